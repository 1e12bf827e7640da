"""`scoremap-score --engine ray`: a folder of millions of images over a Ray cluster's actors.

Ray Data streams the files still to score to an actor pool (one actor per GPU, else per core);
each actor holds the same in-process pipeline as `--local` (clients/batch/local.py) and scores each file
with the batch run's own per-file step (clients/batch/run.py): it reads the image and writes its maps
and heatmap atomically into OUT. Only the driver appends to results.jsonl, a line per record it
receives, so a file is recorded once even when an actor dies and Ray retries its batch on another
(the outputs of the lost attempt are rewritten whole, by rename). The run is resumable as the
single-machine one: what results.jsonl holds is skipped, partial files are removed.

Inputs may be local paths or pyarrow filesystem URIs (s3://, gs://, hdfs://, file://): a URI is
listed on the driver and each file read by the actors through the same pyarrow filesystem; its
record's key and path are the file's URI, so a re-run with the same URI skips what is recorded.

On a cluster the workers need scoremap installed and see the model file and OUT at the same path
(a shared filesystem), as a batch job's nodes usually do; images given by URI need not be there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

import grpc

from clients.api.errors import ScoremapError
from clients.api.options import ScoreOptions
from clients.api.settings import ClientSettings
from clients.batch.files import ImageFile, ResultsLog, find_images, is_image_file, unique_label
from clients.batch.run import RESULTS_NAME, BatchSummary, RunAborted, files_to_score, open_run, score_one

__all__ = ["run_ray_batch", "connect", "pool_size", "find_inputs", "UriImage", "FILES_PER_BATCH"]

log = logging.getLogger(__name__)

# Files one actor call scores: small enough that a lost actor costs little, large enough that
# Ray's per-call overhead (milliseconds) stays far below the scoring time of the batch.
FILES_PER_BATCH = 16
# Ray otherwise sends its internal traffic over the primary interface; and a local
# Ray's control store gets 120 s to start rather than 30, which a loaded 2-core machine overran.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_gcs_server_port_wait_time_s": "120"}
# Ray's own logging, down to what matters to a user of scoremap-score (left alone, ~30 lines for two images):
# its Python loggers to errors, Ray Data's progress off (the command has its own), and its C++ core to fatal,
# whose one error on every run ("constructor arguments in the object store and max_restarts > 0") is moot
# here, since Ray Data holds those arguments for the whole run. A value set in the environment is kept.
QUIET_ENV = {"RAY_BACKEND_LOG_LEVEL": "fatal"}
RAY_LOG_LEVEL = logging.ERROR
LOG = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
STARTS = 2  # tries of a local cluster's start (start_local_cluster)
# Ray's words when its node does not register in its 30 s, or its GCS server does not write its port in its 30 s
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
ABORTED = "aborted"  # the record field an actor sets when the service, not the file, failed
# An input naming a pyarrow filesystem (scheme://...) rather than a local path.
URI_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
LOCAL = -1  # a row's filesystem index when the actor reads a local path


@dataclass(frozen=True)
class UriImage(ImageFile):
    """An image behind a pyarrow filesystem: `path` is its URI (its key and recorded path),
    `location` its path within `filesystem`, through which it is read."""

    path: str  # type: ignore[assignment]  # a URI is no local Path ("s3://b" would become "s3:/b")
    location: str = ""
    filesystem: Any = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return self.path

    def content(self) -> bytes:
        with self.filesystem.open_input_file(self.location) as handle:
            return handle.readall()


def _pyarrow_fs():
    try:
        from pyarrow import fs
    except ModuleNotFoundError as missing:
        raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, f"URI inputs need pyarrow ({missing}): "
                            "pip install 'scoremap[ray]'") from missing
    return fs


def _uri_images(uri: str, labels: set[str] | None,
                on_skip: Callable[[str], None] | None) -> Iterator[UriImage]:
    """The images under `uri` (a folder: recursively, sorted, hidden entries and non-images skipped,
    as find_images does) or the file it names. With `labels` (several inputs), a folder's files are
    named under its last name, made unique among `labels`."""
    fs = _pyarrow_fs()
    try:
        filesystem, root = fs.FileSystem.from_uri(uri)
        info = filesystem.get_file_info(root)
        found = (filesystem.get_file_info(fs.FileSelector(root, recursive=True))
                 if info.type == fs.FileType.Directory else [])
    except (ValueError, OSError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"cannot list {uri!r} ({error}); expected a local path or a URI pyarrow.fs opens "
                            "(s3://bucket/folder, gs://, hdfs://, file:///absolute/folder) with its "
                            "credentials in the environment") from error
    base = uri.rstrip("/")
    if info.type == fs.FileType.File:
        yield UriImage(base, Path(info.base_name), location=root, filesystem=filesystem)
        return
    if info.type != fs.FileType.Directory:
        raise FileNotFoundError(f"no such file or folder: {uri!r}")
    prefix = Path(unique_label(PurePosixPath(root).name or "root", labels)) if labels is not None else Path()
    inside = len(root.rstrip("/")) + 1
    for entry in sorted(found, key=lambda entry: entry.path):
        relative = entry.path[inside:]
        if entry.type != fs.FileType.File or any(part.startswith(".") for part in relative.split("/")):
            continue
        if is_image_file(entry.base_name, partial(_read_head, filesystem, entry.path)):
            yield UriImage(f"{base}/{relative}", prefix / relative, location=entry.path, filesystem=filesystem)
        elif on_skip:
            on_skip(f"{base}/{relative}")


def _read_head(filesystem, location: str, size: int) -> bytes:
    with filesystem.open_input_file(location) as handle:
        return handle.read(size)


def find_inputs(paths: Iterable[str | os.PathLike], *,
                on_skip: Callable[[Any], None] | None = None) -> Iterator[ImageFile]:
    """clients.batch.files.find_images, with pyarrow filesystem URIs among the paths.

    Without a URI, exactly find_images. With several paths, each folder's files are named under
    its last name (made unique), as find_images names them.
    """
    given = [str(path) for path in paths]
    if not any(URI_PATTERN.match(path) for path in given):
        yield from find_images(given, on_skip=on_skip)
        return
    labels: set[str] | None = set() if len(given) > 1 else None
    for path in given:
        if URI_PATTERN.match(path):
            yield from _uri_images(path, labels, on_skip)
        elif labels is not None and Path(path).is_dir():
            prefix = Path(unique_label(os.path.basename(os.path.realpath(path)) or "root", labels))
            for image in find_images([path], on_skip=on_skip):
                yield dataclasses.replace(image, relative=prefix / image.relative)
        else:
            yield from find_images([path], on_skip=on_skip)


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one on loopback; True when this call started Ray."""
    for name, value in {**LOCAL_CLUSTER_ENV, **QUIET_ENV}.items():
        os.environ.setdefault(name, value)
    try:
        import ray
        import ray.data
    except ModuleNotFoundError as missing:
        raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT, f"--engine ray needs Ray ({missing}): "
                            "pip install 'scoremap[ray]'") from missing

    for name in ("ray", "ray.data"):  # Ray Data sets its own logger's level on import
        logging.getLogger(name).setLevel(RAY_LOG_LEVEL)
    ray.data.DataContext.get_current().enable_progress_bars = False
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=RAY_LOG_LEVEL)
    else:
        start_local_cluster(logging_level=RAY_LOG_LEVEL)
    return True


def start_local_cluster(**options) -> None:
    """`ray.init` of a cluster on loopback, tried twice: Ray waits a fixed 30 s for its GCS server's port and for
    its node to register, which a loaded machine can outlast, and a second start finds it warm."""
    import ray

    for attempt in range(STARTS):
        try:
            ray.init(include_dashboard=False, _node_ip_address=LOOPBACK, log_to_driver=False, **options)
            return
        except Exception as error:  # Ray raises a bare Exception for this
            if attempt == STARTS - 1 or not any(words in str(error) for words in STARTUP_TIMEOUTS):
                raise
            LOG.warning("Ray's cluster did not start in time (%s); starting it again", error)
            ray.shutdown()


class FileScorer:
    """A Ray actor: the --local pipeline, scoring each file of a batch with the batch run's per-file step."""

    def __init__(self, model_path: str, *, options: ScoreOptions, out_dir: str, maps: bool, heatmaps: bool,
                 timeout: float | None, options_id: str, concurrency: int, intra_op_threads: int,
                 client_settings: ClientSettings, filesystems: Sequence[Any] = ()) -> None:
        from clients.batch.local import LocalScorer  # imports the server package: only in the actors
        from server.settings import Settings

        self._scorer = LocalScorer([model_path], settings=Settings(intra_op_threads=intra_op_threads),
                                   client_settings=client_settings)
        self._step = dict(options=options, out_dir=Path(out_dir), maps=maps, heatmaps=heatmaps, timeout=timeout,
                          options_id=options_id)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="scoremap-ray")
        self._filesystems = list(filesystems)  # the pyarrow filesystems of the URI inputs, by row index

    def _one(self, path: str, relative: str, location: str, filesystem: int) -> str:
        image = (ImageFile(Path(path), Path(relative)) if filesystem == LOCAL else
                 UriImage(path, Path(relative), location=location, filesystem=self._filesystems[filesystem]))
        try:
            record = score_one(image, self._scorer, **self._step)
        except RunAborted as aborted:
            record = {"key": image.key, ABORTED: aborted.error.code.name, "error": aborted.error.message}
        return json.dumps(record)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        return {"record": list(self._pool.map(self._one, batch["path"], batch["relative"], batch["location"],
                                              batch["filesystem"]))}


def pool_size(ray_module) -> tuple[int, float, int]:
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
    """As clients.batch.run.run_batch, with the files scored by Ray actors running `model_path`'s pipeline.

    `concurrency` is the files each actor scores at once (so its pipeline can batch them on a
    GPU); `actors` 0 means one per GPU of the cluster, else one per CPU.
    """
    out = Path(out_dir).resolve()
    options, options_id = open_run(out, options, maps=maps, heatmaps=heatmaps, force_new_options=force_new_options)
    summary = BatchSummary()
    started = time.perf_counter()
    started_ray = connect(address)
    import ray

    try:
        with ResultsLog(out / RESULTS_NAME) as results:
            recorded = results.records()
            unique, todo = files_to_score(images, recorded, out, options_id=options_id, retry_failed=retry_failed,
                                          maps=maps, heatmaps=heatmaps)
            summary.found, summary.skipped = len(unique), len(unique) - len(todo)
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
    size, gpus, threads = pool_size(ray)
    filesystems: list[Any] = []  # the URI inputs' pyarrow filesystems, sent once to each actor; rows name theirs
    index_of: dict[int, int] = {}

    def as_row(image: ImageFile) -> dict[str, Any]:
        if not isinstance(image, UriImage):
            return {"path": str(image.path), "relative": str(image.relative), "location": "", "filesystem": LOCAL}
        index = index_of.setdefault(id(image.filesystem), len(filesystems))
        if index == len(filesystems):
            filesystems.append(image.filesystem)
        return {"path": image.path, "relative": str(image.relative), "location": image.location, "filesystem": index}

    files = ray.data.from_items([as_row(image) for image in todo])
    scored = files.map_batches(
        FileScorer, batch_size=FILES_PER_BATCH, compute=ray.data.ActorPoolStrategy(size=actors or size),
        num_gpus=gpus, num_cpus=threads,
        fn_constructor_args=(str(Path(model_path).resolve()),),
        fn_constructor_kwargs=dict(options=options, out_dir=str(out), maps=maps, heatmaps=heatmaps, timeout=timeout,
                                   options_id=options_id, concurrency=max(1, concurrency), intra_op_threads=threads,
                                   client_settings=client_settings, filesystems=filesystems),
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
