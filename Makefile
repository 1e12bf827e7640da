# scoremap: `make setup demo` on a fresh machine, `make test` for the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL := models/default.onnx
CHROMIUM := /usr/bin/chromium
# A machine with the NVIDIA driver (nvidia-smi, or the kernel module's /proc/driver/nvidia/version) also gets the
# `gpu` extra: the CUDA 13 runtime and cuDNN 9 as wheels, which the engine preloads (README: "On a GPU machine").
# `make setup GPU=0` leaves them out; `GPU=1` installs them without a driver (an image built for GPU machines).
GPU ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 || test -r /proc/driver/nvidia/version; then echo 1; else echo 0; fi)
comma := ,
EXTRAS := dev,triton,ray$(if $(filter 1,$(GPU)),$(comma)gpu)

.PHONY: setup protos test demo docs bench bench-gpu clean FORCE

setup: $(BIN)/scoremap-convert $(CHROMIUM)

# The viewer's browser test (tests/server/edges/http/test_viewer.py) drives Debian's Chromium: Playwright never
# downloads a browser. Installed when missing (as root, as CI runs on Debian).
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The extras last installed: a change (GPU=1 after a driver was installed, or GPU=0) installs again.
$(VENV)/extras: FORCE
	@mkdir -p $(VENV)
	@echo '$(EXTRAS)' | cmp -s - $@ || echo '$(EXTRAS)' > $@

$(BIN)/scoremap-convert: pyproject.toml $(VENV)/extras
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	# nvidia-pytriton pins numpy<2 for its Python-backend stub only: the stub gets its own small
	# environment of this interpreter with numpy<2 (tests/server/edges/test_triton_binding.py, docs/scale-out.md).
	$(BIN)/pip install --quiet --no-deps nvidia-pytriton==0.7.0
	$(BIN)/python -m venv --without-pip $(VENV)/triton-stub
	$(BIN)/pip install --quiet --no-deps --target "$$($(VENV)/triton-stub/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" numpy==1.26.4 pyzmq==27.3.0
	touch $@

# Regenerates the committed protos/*_pb2*.py; tests/test_protos.py fails when they are stale.
protos:
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. protos/model_card.proto
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/scoring.proto

test: setup
	$(BIN)/python -m pytest -q

# clients.batch.demo converts the default model to $(MODEL) when it is missing.
demo: setup
	$(BIN)/python -m clients.batch.demo --model $(MODEL) --out out/demo samples

# The documentation site, browsable offline (site/index.html). The reference page is made from the commands'
# definitions first; tests/test_docs.py checks the committed page and builds the site with --strict.
docs: setup
	$(BIN)/python -m docs.reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: setup
	$(BIN)/python -m bench

# Needs onnxruntime's CUDA provider really loading; elsewhere it says why and exits 0.
# `$(BIN)/python -m bench.bench_gpu --dry-run` checks it on the CPU in seconds; `--quick` measures less, within 200 s.
bench-gpu: setup
	$(BIN)/python -m bench.bench_gpu

clean:
	rm -rf $(VENV) models out site *.egg-info

FORCE:
