"""`scoremap-score --engine ray`: a folder of millions of images over a Ray cluster's actors.

Ray Data streams the files still to score to an actor pool (one actor per GPU, else per core);
each actor holds the same in-process pipeline as `--local` (clients/local.py) and scores each file
with the batch run's own per-file step (clients/batch.py): it reads the image and writes its maps
and heatmap atomically into OUT. Only the driver appends to results.jsonl, a line per record it
receives, so a file is recorded once even when an actor dies and Ray retries its batch on another
(the outputs of the lost attempt are rewritten whole, by rename). The run is resumable as the
single-machine one: what results.jsonl holds is skipped, partial files are removed.

On a cluster the workers need scoremap installed and see the model file and OUT at the same path
(a shared filesystem), as a batch job's nodes usually do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from clients.batch import (RESULTS_NAME, BatchSummary, RunAborted, refuse_shared_outputs,
                           score_one)
from clients.errors import ScoremapError
from clients.files import ImageFile, ResultsLog, remove_partials
from clients.options import ScoreOptions
from clients.run_options import run_options, settle_options
from clients.settings import ClientSettings

__all__ = ["run_ray_batch", "connect", "FILES_PER_BATCH"]

log = logging.getLogger(__name__)

# Files one actor call scores: small enough that a lost actor costs little, large enough that
# Ray's per-call overhead (milliseconds) stays far below the scoring time of the batch.
FILES_PER_BATCH = 16
# Ray otherwise sends its internal traffic over the primary interface (issue 11, item 3).
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK = "127.0.0.1"
ABORTED = "aborted"  # the record field an actor sets when the service, not the file, failed


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one on loopback; True when this call started Ray."""
    for name, value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)
    try:
        import ray
    except ModuleNotFoundError as missing:
        raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, f"--engine ray needs Ray ({missing}): "
                            "pip install 'scoremap[ray]'") from missing

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, _node_ip_address=LOOPBACK, log_to_driver=False)
    return True


class FileScorer:
    """A Ray actor: the --local pipeline, scoring each file of a batch with the batch run's per-file step."""

    def __init__(self, model_path: str, *, options: ScoreOptions, out_dir: str, maps: bool, heatmaps: bool,
                 timeout: float | None, options_id: str, concurrency: int, intra_op_threads: int,
                 client_settings: ClientSettings) -> None:
        from clients.local import LocalScorer  # imports the server package: only in the actors
        from server.settings import Settings

        self._scorer = LocalScorer([model_path], settings=Settings(intra_op_threads=intra_op_threads),
                                   client_settings=client_settings)
        self._step = dict(options=options, out_dir=Path(out_dir), maps=maps, heatmaps=heatmaps, timeout=timeout,
                          options_id=options_id)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="scoremap-ray")

    def _one(self, path: str, relative: str) -> str:
        image = ImageFile(Path(path), Path(relative))
        try:
            record = score_one(image, self._scorer, **self._step)
        except RunAborted as aborted:
            record = {"key": image.key, ABORTED: aborted.error.code.name, "error": aborted.error.message}
        return json.dumps(record)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        return {"record": list(self._pool.map(self._one, batch["path"], batch["relative"]))}


def _pool_size(ray_module) -> tuple[int, float, int]:
    """(actors, GPUs per actor, CPU threads per actor): one actor per GPU, else one per core."""
    resources = ray_module.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return gpus, 1.0, 1
    return max(1, int(resources.get("CPU", 1))), 0.0, 1


def run_ray_batch(
    images: Sequence[ImageFile],
    model_path: str,
    out_dir: str | Path,
    *,
    options: ScoreOptions,
    concurrency: int = 1,
    maps: bool = False,
    heatmaps: bool = False,
    retry_failed: bool = False,
    force_new_options: bool = False,
    timeout: float | None = None,
    address: str | None = None,
    actors: int = 0,
    client_settings: ClientSettings | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> BatchSummary:
    """As clients.batch.run_batch, with the files scored by Ray actors running `model_path`'s pipeline.

    `concurrency` is the files each actor scores at once (so its pipeline can batch them on a
    GPU); `actors` 0 means one per GPU of the cluster, else one per CPU.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (removed := remove_partials(out)):
        log.info("removed %d partial files left by an interrupted run", removed)
    if maps or heatmaps:
        options = dataclasses.replace(options, return_maps=True)
    options_id = settle_options(out, run_options(options, maps=maps, heatmaps=heatmaps), force=force_new_options)
    summary = BatchSummary()
    started = time.perf_counter()
    started_ray = connect(address)
    import ray

    try:
        with ResultsLog(out / RESULTS_NAME) as results:
            recorded = results.records()
            unique = list({image.key: image for image in images}.values())
            summary.found = len(unique)
            todo = [image for image in unique
                    if image.key not in recorded or recorded[image.key].get("options", options_id) != options_id
                    or (retry_failed and recorded[image.key].get("status") != "OK")]
            summary.skipped = summary.found - len(todo)
            refuse_shared_outputs(todo, recorded, out, maps=maps, heatmaps=heatmaps)
            if on_start:
                on_start(len(todo))
            if todo:
                _score_on_ray(ray, todo, model_path, out, results, recorded, summary, options=options, maps=maps,
                              heatmaps=heatmaps, timeout=timeout, options_id=options_id, concurrency=concurrency,
                              actors=actors, client_settings=client_settings or ClientSettings(),
                              on_progress=on_progress)
    finally:
        if started_ray:
            ray.shutdown()
    summary.still_failed = sum(recorded.get(image.key, {}).get("status", "OK") != "OK" for image in unique)
    summary.seconds = time.perf_counter() - started
    return summary


def _score_on_ray(ray, todo: list[ImageFile], model_path: str, out: Path, results: ResultsLog,
                  recorded: dict[str, dict[str, Any]], summary: BatchSummary, *, options: ScoreOptions, maps: bool,
                  heatmaps: bool, timeout: float | None, options_id: str, concurrency: int, actors: int,
                  client_settings: ClientSettings, on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    """Stream `todo` through the actor pool; append each record once, as it comes back."""
    size, gpus, threads = _pool_size(ray)
    files = ray.data.from_items([{"path": str(image.path), "relative": str(image.relative)} for image in todo])
    scored = files.map_batches(
        FileScorer, batch_size=FILES_PER_BATCH, compute=ray.data.ActorPoolStrategy(size=actors or size),
        num_gpus=gpus, num_cpus=threads,
        fn_constructor_args=(str(Path(model_path).resolve()),),
        fn_constructor_kwargs=dict(options=options, out_dir=str(out), maps=maps, heatmaps=heatmaps, timeout=timeout,
                                   options_id=options_id, concurrency=max(1, concurrency), intra_op_threads=threads,
                                   client_settings=client_settings),
    )
    written: set[str] = set()  # Ray emits a retried batch's rows once; this makes "once" ours to keep
    for row in scored.iter_rows():
        record = json.loads(row["record"])
        if ABORTED in record:
            summary.aborted = ScoremapError(grpc.StatusCode[record[ABORTED]], record["error"])
            break
        if record["key"] in written:
            continue
        written.add(record["key"])
        results.append(record)
        recorded[record["key"]] = record
        summary.add(record)
        if on_progress:
            on_progress(record)
