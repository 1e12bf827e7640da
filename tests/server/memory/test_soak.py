"""Host memory comes back: a real server's idle RSS after a burst of large requests."""

import onnx

from bench.bench_memory import soak
from tests.tiny_models import patch_net

MiB = 2**20


def test_idle_memory_returns_after_a_burst_of_large_requests(tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=10), path)
    # Eight decoding threads, so that the burst holds its requests' memory at once: with one per core (two here)
    # it holds 37-51 MiB over idle, the plans sharing one arena.
    result = soak(str(path), seconds=1.0, clients=8, shapes=((1536, 2048), (2432, 640)), scales=(384, 512),
                  idle_seconds=1.0, server_args=("--no-warm-up", "--decode-threads", "8"))
    assert result.requests >= 8 and not result.errors, result
    # The burst really held memory: the requests' own (decoded images, canvases, maps); the plans' activations
    # are already held before it, by the shared arena.
    assert result.peak_bytes - result.before_bytes > 50 * MiB, result
    assert result.after_bytes <= 1.5 * result.before_bytes, result
