# scoremap: `make setup demo` on a fresh machine, `make test` for the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL := models/default.onnx
CHROMIUM := /usr/bin/chromium

.PHONY: setup protos test demo bench bench-gpu clean

setup: $(BIN)/scoremap-convert $(CHROMIUM)

# The viewer's browser test (tests/server/test_viewer.py) drives Debian's Chromium: Playwright never
# downloads a browser. Installed when missing (as root, as CI runs on Debian).
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

$(BIN)/scoremap-convert: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,triton,ray]'
	# nvidia-pytriton pins numpy<2 for its Python-backend stub only: the stub gets its own small
	# environment of this interpreter with numpy<2 (tests/server/test_triton_binding.py, README).
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

bench: setup
	$(BIN)/python -m bench

# Needs onnxruntime's CUDA provider really loading; elsewhere it says why and exits 0.
# `$(BIN)/python -m bench.bench_gpu --dry-run` checks it on the CPU in seconds.
bench-gpu: setup
	$(BIN)/python -m bench.bench_gpu

clean:
	rm -rf $(VENV) models out *.egg-info
