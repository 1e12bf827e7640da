"""A resumable, loss-free batch run: score image files, record each one in results.jsonl.

Outputs (.npz maps, heatmap PNGs) are written atomically before the file's line is appended, so
a line means its files are complete; a re-run skips files that already have a line. Failures of
one file are recorded with their status and never stop the run; failures of the service itself
(unreachable beyond the retry budget, credentials refused, unknown model) stop it, recording
nothing for unscored files, so the next run resumes exactly there.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import grpc
import numpy as np

from clients.errors import ScoremapError
from clients.files import ImageFile, ResultsLog, atomic_write, remove_partials
from clients.heatmap import heatmap_png
from clients.images import open_photo
from clients.options import ScoreOptions, build_request
from clients.results import result_from_response
from protos import scoring_pb2

__all__ = ["Scorer", "BatchSummary", "RunAborted", "run_batch", "RUN_LEVEL_CODES", "RESULTS_NAME"]

log = logging.getLogger(__name__)

RESULTS_NAME = "results.jsonl"
# Statuses that say the service (not the file) is the problem: the run stops, the file stays unrecorded.
RUN_LEVEL_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
})
# Answers that say "not now" rather than "not this file": the file is sent again, with a doubling
# pause, this many times before it is recorded as failed. A batch run never cancels its own calls,
# so CANCELLED means the server dropped the call while shutting down (gRPC core cancels calls caught
# mid-stop); RESOURCE_EXHAUSTED whose message starts with QUEUE_FULL_PREFIX (server/batcher.py) means
# the server's queue was full for a moment. RESOURCE_EXHAUSTED from memory admission (the request
# can never fit) is recorded at once. UNAVAILABLE is retried inside ScoremapClient.
TRANSIENT_RESENDS = 6
TRANSIENT_PAUSE_S = 0.5
TRANSIENT_PAUSE_MAX_S = 4.0
QUEUE_FULL_PREFIX = "queue full"
# Files read ahead of the workers: enough to keep them busy, bounded so memory stays flat.
READ_AHEAD_PER_WORKER = 2


class Scorer(Protocol):
    """What a batch run scores with: ScoremapClient (gRPC) or LocalScorer (in-process)."""

    def score_request(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> scoring_pb2.ScoreResponse: ...


class RunAborted(Exception):
    """The service failed in a way no retry of this run will fix; carries the ScoremapError."""

    def __init__(self, error: ScoremapError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class BatchSummary:
    """Counts of a run: what was scored, failed (by status) and skipped as already recorded.

    `still_failed` counts found files whose latest record, of this run or an earlier one, is a
    failure: the run succeeded only if it is zero.
    """

    found: int = 0
    still_failed: int = 0
    skipped: int = 0
    scored: int = 0
    failures: Counter = field(default_factory=Counter)
    aborted: ScoremapError | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def remaining(self) -> int:
        return self.found - self.skipped - self.scored - self.failed


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def _is_transient(error: ScoremapError) -> bool:
    """Whether the same request may well succeed if sent again shortly."""
    return error.code == grpc.StatusCode.CANCELLED or (
        error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.message.startswith(QUEUE_FULL_PREFIX))


def _output_files(image: ImageFile, *, maps: bool, heatmaps: bool) -> dict[str, str]:
    """The record fields naming `image`'s outputs, relative to the output folder."""
    outputs = {}
    if maps:
        outputs["maps_file"] = str(Path("maps") / image.relative.with_name(image.relative.name + ".npz"))
    if heatmaps:
        outputs["heatmap_file"] = str(Path("heatmaps") / image.relative.with_name(image.relative.name + ".png"))
    return outputs


def _refuse_shared_outputs(todo: Sequence[ImageFile], recorded: dict[str, dict[str, Any]], out: Path, *,
                           maps: bool, heatmaps: bool) -> None:
    """Refuse a run that would write two files' outputs to one name (the second would overwrite the first)."""
    owners: dict[str, tuple[str, str]] = {}  # output name -> (key, path) of the file it belongs to
    for key, record in recorded.items():
        for name in (record.get("maps_file"), record.get("heatmap_file")):
            if name:
                owners[name] = (key, record.get("path", key))
    for image in todo:
        for name in _output_files(image, maps=maps, heatmaps=heatmaps).values():
            key, path = owners.setdefault(name, (image.key, str(image.path)))
            if key != image.key:
                raise ScoremapError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{str(image.path)!r} and {path!r} would both be written to "
                                    f"{str(out / name)!r}; score them into different --out folders, "
                                    "or pass their folders rather than the files themselves")


def _score_one(image: ImageFile, scorer: Scorer, options: ScoreOptions, out_dir: Path, *,
               maps: bool, heatmaps: bool, timeout: float | None) -> dict[str, Any]:
    """Score one file, write its outputs atomically; its results.jsonl record."""
    started = time.perf_counter()
    record: dict[str, Any] = {"key": image.key, "path": str(image.path)}
    try:
        request = build_request(image.path, options)
        pause = TRANSIENT_PAUSE_S
        for resend in range(TRANSIENT_RESENDS + 1):
            try:
                response = scorer.score_request(request, timeout=timeout)
                break
            except ScoremapError as error:
                if not _is_transient(error) or resend == TRANSIENT_RESENDS:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, TRANSIENT_PAUSE_MAX_S)
        result = result_from_response(response)
        record.update(result.to_record())
        outputs = _output_files(image, maps=maps, heatmaps=heatmaps)
        if maps:
            atomic_write(out_dir / outputs["maps_file"], _npz_bytes(result.map_arrays()))
        if heatmaps:
            atomic_write(out_dir / outputs["heatmap_file"], heatmap_png(open_photo(image.path), result))
        record.update(outputs)
        record["status"] = "OK"
    except ScoremapError as error:
        if error.code in RUN_LEVEL_CODES:
            raise RunAborted(error) from error
        record.update(status=error.code.name, error=error.message)
    except (OSError, ValueError) as error:  # unreadable file, undrawable heatmap, bad tensor
        record.update(status=type(error).__name__, error=str(error))
    record["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return record


def run_batch(
    images: Sequence[ImageFile],
    scorer: Scorer,
    out_dir: str | Path,
    *,
    options: ScoreOptions,
    concurrency: int = 4,
    maps: bool = False,
    heatmaps: bool = False,
    retry_failed: bool = False,
    timeout: float | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> BatchSummary:
    """Score `images` not yet recorded in OUT_DIR/results.jsonl, `concurrency` at a time.

    `on_start(n)` is told how many files will be scored, `on_progress(record)` each record written.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency} must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (removed := remove_partials(out)):
        log.info("removed %d partial files left by an interrupted run", removed)
    if maps or heatmaps:
        options = dataclasses.replace(options, return_maps=True)
    summary = BatchSummary()
    started = time.perf_counter()
    with ResultsLog(out / RESULTS_NAME) as results:
        recorded = results.records()
        unique = list({image.key: image for image in images}.values())
        summary.found = len(unique)
        todo = [image for image in unique
                if image.key not in recorded or (retry_failed and recorded[image.key].get("status") != "OK")]
        summary.skipped = summary.found - len(todo)
        _refuse_shared_outputs(todo, recorded, out, maps=maps, heatmaps=heatmaps)
        if on_start:
            on_start(len(todo))
        queue = iter(todo)
        in_flight: set[Future] = set()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="scoremap-score") as pool:
            def refill() -> None:
                while summary.aborted is None and len(in_flight) < concurrency * READ_AHEAD_PER_WORKER:
                    image = next(queue, None)
                    if image is None:
                        return
                    in_flight.add(pool.submit(_score_one, image, scorer, options, out, maps=maps,
                                              heatmaps=heatmaps, timeout=timeout))
            try:
                refill()
                while in_flight:
                    done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for future in done:
                        in_flight.discard(future)
                        try:
                            record = future.result()
                        except RunAborted as aborted:
                            if summary.aborted is None:
                                summary.aborted = aborted.error
                                for other in in_flight:
                                    other.cancel()
                            continue
                        results.append(record)
                        recorded[record["key"]] = record
                        if record["status"] == "OK":
                            summary.scored += 1
                        else:
                            summary.failures[record["status"]] += 1
                        if on_progress:
                            on_progress(record)
                    in_flight = {f for f in in_flight if not f.cancelled()}
                    refill()
            except BaseException:
                for future in in_flight:
                    future.cancel()
                raise
    summary.still_failed = sum(recorded.get(image.key, {}).get("status", "OK") != "OK" for image in unique)
    summary.seconds = time.perf_counter() - started
    return summary
