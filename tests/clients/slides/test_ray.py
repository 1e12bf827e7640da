"""`--tiled --engine ray` on a local Ray instance: the Zarr map, journal and exit status of `--tiled --local`, an
actor killed mid-run."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import zarr

from clients.batch.local import LocalScorer
from clients.batch.ray_engine import LOCAL_CLUSTER_ENV
from clients.batch.score_cli import main
from clients.slides.run import SlideOptions, score_file
from tests.clients.slides.nets import ON_DEMAND
from tests.clients.slides.test_run import mosaic, write_tiff
from tests.processes import pids_named

for name, value in LOCAL_CLUSTER_ENV.items():  # before ray is imported, as the product sets them
    os.environ.setdefault(name, value)
ray = pytest.importorskip("ray", reason="--engine ray needs the `ray` extra: pip install -e '.[ray]'")
from clients.batch.ray_engine import start_local_cluster  # noqa: E402
from clients.slides.ray_scorer import RayTileScorer  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    start_local_cluster(num_cpus=2)
    yield
    ray.shutdown()


def test_ray_actors_score_the_tiles_into_the_local_map(converted, tmp_path, local_ray, capsys, caplog):
    model = converted(True, False)
    image = write_tiff(tmp_path / "slide.tif", mosaic(600, 700, seed=2))
    common = [str(image), "--local", model, "--tiled", "--canvas", "256", "--stride", "16", "--flip",
              "--zarr-dtype", "float32", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray"]) == 0
    local, on_ray = (zarr.open_group(tmp_path / name / "slide.zarr", mode="r") for name in ("local", "ray"))
    expected, got = np.asarray(local["scores"]), np.asarray(on_ray["scores"])
    rows, columns = local.attrs["scoremap"]["tiles"]
    assert rows * columns > 4 and not np.isnan(expected).any()
    assert got.shape == expected.shape and np.max(np.abs(got - expected)) <= 1e-6
    assert on_ray.attrs["scoremap"] == local.attrs["scoremap"]
    journal = (tmp_path / "ray" / "slide.tiles.jsonl").read_text().splitlines()
    assert len(journal) == len(set(journal)) == rows * columns
    # Run again: every tile is recorded, none goes to the actors.
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray"]) == 0
    assert f"{rows * columns} tiles ({rows * columns} already stored)" in capsys.readouterr().out
    # A refusal on an actor is --local's: the same exit status and message.
    assert main([*common, "--out", str(tmp_path / "other"), "--engine", "ray", "--model", "nosuch"]) == 4
    assert "no model named 'nosuch'" in caplog.text


def tile_scorers() -> list[int]:
    """Process ids of the running TileScorer actors (their process title names the class)."""
    return pids_named(b"TileScorer")


def test_an_actor_killed_mid_run_is_restarted_and_its_tiles_sent_again(converted, tmp_path, local_ray):
    model = converted(True, False)
    image = write_tiff(tmp_path / "slide.tif", mosaic(600, 700, seed=4))
    options = SlideOptions(canvas=256, dtype="float32", concurrency=2)
    with LocalScorer([model], settings=ON_DEMAND) as scorer:
        expected = score_file(image, scorer, tmp_path / "local", options=options)
    killed: list[int] = []

    def kill_an_actor(_tile) -> None:
        if not killed:
            killed.extend(tile_scorers()[:1])
            os.kill(killed[0], signal.SIGKILL)

    scorer = RayTileScorer(model, per_actor=1)
    try:
        summary = score_file(image, scorer, tmp_path / "ray", options=options, on_tile=kill_an_actor)
    finally:
        scorer.close()
    assert killed and summary.scored == summary.tiles == expected.tiles > 4
    np.testing.assert_array_equal(np.asarray(zarr.open_group(summary.map_path, mode="r")["scores"]),
                                  np.asarray(zarr.open_group(expected.map_path, mode="r")["scores"]))
