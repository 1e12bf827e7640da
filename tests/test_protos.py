"""The committed generated code matches the .proto files (regenerate with `make protos`)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_protos_are_current(tmp_path):
    for proto, grpc in [("protos/model_card.proto", False), ("protos/scoring.proto", True)]:
        args = [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}", proto]
        if grpc:
            args.append(f"--grpc_python_out={tmp_path}")
        subprocess.run(args, cwd=ROOT, check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py"))
    assert generated, "protoc generated nothing"
    for path in generated:
        assert (ROOT / path).read_text() == (tmp_path / path).read_text(), f"{path} is stale: run `make protos`"
