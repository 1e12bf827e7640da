"""--engine ray on a local Ray instance: the records and files of --local, each file once, an actor killed mid-run,
a folder given as a pyarrow filesystem URI (file://) scored as the folder itself."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image, ImageOps

from clients.api.errors import ScoremapError
from clients.api.options import ScoreOptions
from clients.batch.files import find_images
from clients.batch.local import LocalScorer
from clients.batch.ray_engine import LOCAL_CLUSTER_ENV
from clients.batch.run import RESULTS_NAME, run_batch
from clients.batch.score_cli import main
from server.settings import Settings
from tests.processes import pids_named
from tests.tiny_models import patch_net

for name, value in LOCAL_CLUSTER_ENV.items():  # before ray is imported, as the product sets them
    os.environ.setdefault(name, value)
ray = pytest.importorskip("ray", reason="--engine ray needs the `ray` extra: pip install -e '.[ray]'")
from clients.batch.ray_engine import (FILES_PER_BATCH, find_inputs, run_ray_batch,  # noqa: E402
                                      start_local_cluster)

SAMPLES = Path(__file__).resolve().parents[3] / "samples"
PHOTOS = 240
HEATMAP_PHOTOS = 6  # heatmaps take ~50 ms each here: a few show they are the same
URI_PHOTOS = 9  # a few files read through pyarrow show the route is the local one
TIMING_FIELDS = {"elapsed_ms", "timings_ms"}
OPTIONS = ScoreOptions(scales=(64, 96), top_k=3)
assert PHOTOS // FILES_PER_BATCH >= 8  # many batches per actor, so the kill below lands mid-run


def write_folder(folder: Path, photos: int = PHOTOS) -> None:
    """The samples, shrunk, rotated, mirrored, cropped and re-encoded into `photos` files, plus one corrupt file."""
    sources = [Image.open(path).convert("RGB") for path in sorted(SAMPLES.glob("*.jpg"))]
    for n in range(photos):
        photo = sources[n % len(sources)]
        photo = photo.resize((64 + n % 7 * 16, 64 + n % 5 * 16)).rotate(n % 4 * 90, expand=True)
        if n % 3 == 0:
            photo = ImageOps.mirror(photo)
        photo = photo.crop((n % 9, 0, photo.width, photo.height))
        sub = folder / f"part{n % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        photo.save(sub / f"p{n:03d}.{'png' if n % 2 else 'jpg'}")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")


def comparable(out: Path) -> dict:
    records = [json.loads(line) for line in (out / RESULTS_NAME).read_text().splitlines()]
    keys = [record["key"] for record in records]
    assert len(keys) == len(set(keys)), "a file was recorded twice"
    return {record["key"]: {k: v for k, v in record.items() if k not in TIMING_FIELDS} for record in records}


def same_file(tmp_path: Path, name: str) -> bool:
    return (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def map_workers() -> list[int]:
    """Process ids of the running FileScorer actors (their process title names the class)."""
    return pids_named(b"FileScorer")


@pytest.fixture(scope="module")
def local_ray():
    start_local_cluster(num_cpus=2)
    yield
    ray.shutdown()


def score_both_ways(tmp_path: Path, images, ray_images=None, **outputs):
    """--local's run of `images` into tmp_path/local; the local summary and the Ray run (of `ray_images`,
    default the same) into tmp_path/ray."""
    model = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=10), model)
    with LocalScorer([str(model)], settings=Settings(intra_op_threads=1)) as scorer:
        local = run_batch(images, scorer, tmp_path / "local", options=OPTIONS, **outputs)
    return local, lambda **more: run_ray_batch(images if ray_images is None else ray_images, str(model),
                                               tmp_path / "ray", options=OPTIONS, **outputs, **more)


def test_ray_scores_as_local_once_per_file_even_when_an_actor_dies(tmp_path, local_ray):
    write_folder(tmp_path / "photos")
    images = list(find_images([tmp_path / "photos"]))
    local, run_ray = score_both_ways(tmp_path, images, maps=True)
    killed = []

    def kill_an_actor(record: dict) -> None:
        if not killed:
            killed.extend(map_workers()[:1])
            os.kill(killed[0], signal.SIGKILL)

    summary = run_ray(on_progress=kill_an_actor)
    assert killed and summary.scored + summary.failed == local.found == PHOTOS + 1
    assert summary.failed == local.failed == 1 and summary.aborted is None
    expected, got = comparable(tmp_path / "local"), comparable(tmp_path / "ray")
    assert got == expected
    for record in expected.values():
        if "maps_file" in record:
            assert same_file(tmp_path, record["maps_file"])
    maps_file = next(record["maps_file"] for record in got.values() if "maps_file" in record)
    with np.load(tmp_path / "ray" / maps_file) as arrays:
        assert {"scores_64", "scores_96"} <= set(arrays.files)

    again = run_ray()
    assert (again.skipped, again.scored) == (PHOTOS + 1, 0)
    assert comparable(tmp_path / "ray") == got


def test_ray_writes_the_same_heatmaps(tmp_path, local_ray):
    write_folder(tmp_path / "photos")
    images = list(find_images([tmp_path / "photos" / "part0"]))[:HEATMAP_PHOTOS]
    local, run_ray = score_both_ways(tmp_path, images, heatmaps=True)
    assert run_ray().scored == local.scored == HEATMAP_PHOTOS
    expected = comparable(tmp_path / "local")
    assert comparable(tmp_path / "ray") == expected
    for record in expected.values():
        assert same_file(tmp_path, record["heatmap_file"])


def test_the_command_line_runs_the_ray_engine(tmp_path, local_ray, capsys):
    model = tmp_path / "tiny.onnx"
    onnx.save(patch_net(classes=10), model)
    write_folder(tmp_path / "photos", URI_PHOTOS)
    uri, folder = (tmp_path / "photos" / "part1").as_uri(), tmp_path / "photos" / "part2"
    argv = [uri, str(folder), "--out", str(tmp_path / "out"), "--local", str(model), "--scales", "64", "--no-progress"]
    assert main([*argv, "--engine", "ray"]) == 0
    paths = sorted(json.loads(line)["path"] for line in (tmp_path / "out" / RESULTS_NAME).read_text().splitlines())
    assert paths == sorted([f"{uri}/{file.name}" for file in (tmp_path / "photos" / "part1").iterdir()]
                           + [str(file) for file in folder.iterdir()])
    assert "found" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--ray-address", "127.0.0.1:6379"])  # an address without --engine ray is a usage error


def test_a_file_uri_is_read_through_pyarrow_as_its_local_folder(tmp_path, local_ray):
    folder = tmp_path.resolve() / "photos"
    write_folder(folder, URI_PHOTOS)
    (folder / "notes.txt").write_text("not an image")
    (folder / ".hidden.png").write_bytes(b"")
    skipped = []
    images, uris = list(find_images([folder])), list(find_inputs([folder.as_uri()], on_skip=skipped.append))
    assert [image.relative for image in uris] == [image.relative for image in images]
    assert skipped == [f"{folder.as_uri()}/notes.txt"]
    local, run_ray = score_both_ways(tmp_path, images, uris, maps=True, heatmaps=True)
    assert run_ray().scored == local.scored == URI_PHOTOS

    def as_uri(record: dict) -> dict:
        return {**record, "key": Path(record["key"]).as_uri(), "path": Path(record["path"]).as_uri()}
    expected = {Path(key).as_uri(): as_uri(record) for key, record in comparable(tmp_path / "local").items()}
    assert comparable(tmp_path / "ray") == expected
    for record in expected.values():
        if record["status"] == "OK":
            assert same_file(tmp_path, record["maps_file"]) and same_file(tmp_path, record["heatmap_file"])
    again = run_ray()
    assert (again.skipped, again.scored) == (URI_PHOTOS + 1, 0)


def test_uris_and_local_folders_together_are_named_by_their_folders(tmp_path):
    for name in ("a", "b"):
        write_folder(tmp_path / name, 2)
    found = [str(image.relative) for image in find_inputs([(tmp_path / "a").as_uri(), tmp_path / "b",
                                                           f"{(tmp_path / 'b').as_uri()}/"])]
    assert found == [f"{label}/{name}" for label in ("a", "b", "b-2")
                     for name in ("broken.jpg", "part0/p000.jpg", "part1/p001.png")]
    with pytest.raises(FileNotFoundError, match="missing"):
        list(find_inputs([(tmp_path / "missing").as_uri()]))
    with pytest.raises(ScoremapError, match="cannot list 'nosuch://x'.*s3://bucket/folder"):
        list(find_inputs(["nosuch://x"]))


def test_ray_keeps_its_own_logging_to_itself(tmp_path):
    """Ray's own logging stays out of the way (left alone, ~30 lines for two images, an `E ... core_worker.cc` line
    among them). In a
    process of its own, so the Ray it starts is configured by scoremap, and its C++ output is on the real stderr."""
    import subprocess
    import sys

    model, photos = tmp_path / "tiny.onnx", tmp_path / "photos"
    onnx.save(patch_net(classes=10), model)
    photos.mkdir()
    for path in sorted(SAMPLES.glob("*.jpg"))[:2]:
        Image.open(path).convert("RGB").resize((96, 64)).save(photos / path.name)
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RAY_BACKEND")}
    environment["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    done = subprocess.run([sys.executable, "-m", "clients.batch.score_cli", str(photos), "--out", str(tmp_path / "out"),
                           "--local", str(model), "--engine", "ray", "--no-progress"],
                          env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ray_lines = [line for line in done.stderr.splitlines()
                 if not line.startswith("scoremap-score:") and "Set ray log level from environment" not in line]
    assert ray_lines == [], "\n".join(ray_lines)
    assert (tmp_path / "out" / RESULTS_NAME).read_text().count("\n") == 2


def test_a_local_cluster_that_does_not_start_in_time_is_started_once_more(monkeypatch):
    """Ray waits a fixed 30 s for its GCS server's port and for its node: a loaded machine can outlast either once;
    any other failure, or a second timeout, is raised as it is."""
    tries, shutdowns, timeouts, gcs_timeouts = [], [], [1], [5]  # which tries (1-based) time out, and how

    def init(**options):
        tries.append(options)
        if len(tries) in timeouts:
            raise Exception("The current node timed out during startup.")
        if len(tries) in gcs_timeouts:
            raise RuntimeError("Timed out waiting for file /tmp/ray/session_1/gcs_server_port_0a1b")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(len(tries)))
    start_local_cluster(num_cpus=2)
    assert len(tries) == 2 and shutdowns == [1]
    assert tries[1]["num_cpus"] == 2 and tries[1]["_node_ip_address"] == "127.0.0.1"
    timeouts[:] = [3, 4]  # both tries of the next start time out: the second timeout is raised
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_cluster()
    assert len(tries) == 4
    start_local_cluster()  # the GCS server's port not written in time: started again too
    assert len(tries) == 6 and shutdowns == [1, 3, 5]
    monkeypatch.setattr(ray, "init", lambda **options: (_ for _ in ()).throw(RuntimeError("no such address")))
    with pytest.raises(RuntimeError, match="no such address"):
        start_local_cluster()
    assert shutdowns == [1, 3, 5]  # never after another failure
