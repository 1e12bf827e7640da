"""A resumable, loss-free batch run: score image files, record each one in results.jsonl.

Outputs (.npz maps, heatmap PNGs) are written atomically before the file's line is appended, so
a line means its files are complete; a re-run skips files that already have a line. Failures of
one file are recorded with their status and never stop the run; failures of the service itself
(unreachable beyond the retry budget, credentials refused, unknown model) stop it, recording
nothing for unscored files, so the next run resumes exactly there. Retries are the scorer's
(clients/api/retry.py); an interrupted run records nothing for the files it was scoring.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import grpc
import numpy as np

from clients.api.errors import ScoremapError
from clients.api.heatmap import heatmap_png
from clients.api.images import open_photo
from clients.api.options import ScoreOptions, build_request
from clients.api.results import result_from_response
from clients.api.interrupts import first_done
from clients.api.retry import Interrupted
from clients.batch.files import ImageFile, ResultsLog, atomic_write, keep_records, read_records, remove_partials
from clients.batch.run_options import run_options, settle_options
from protos import scoring_pb2

__all__ = ["Scorer", "BatchSummary", "ErrorKind", "RunAborted", "run_batch", "files_to_score", "RUN_LEVEL_CODES",
           "RESULTS_NAME"]

log = logging.getLogger(__name__)

RESULTS_NAME = "results.jsonl"
# Statuses that say the service (not the file) is the problem: the run stops, the file stays unrecorded.
RUN_LEVEL_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
})
# Files read ahead of the workers: enough to keep them busy, bounded so memory stays flat.
READ_AHEAD_PER_WORKER = 2


class Scorer(Protocol):
    """What a batch run scores with: ScoremapClient (gRPC) or LocalScorer (in-process)."""

    def score_request(self, request: scoring_pb2.ScoreRequest, *, timeout: float | None = None) -> scoring_pb2.ScoreResponse: ...

    def models(self) -> list[scoring_pb2.ModelSummary]: ...

    def interrupt(self) -> None: ...


class RunAborted(Exception):
    """The service failed in a way no retry of this run will fix; carries the ScoremapError."""

    def __init__(self, error: ScoremapError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class ErrorKind:
    """Records sharing one status and message pattern: how many, and the first one's path and words."""

    status: str
    count: int
    example_path: str
    example: str


def _pattern(status: str, message: str, path: str) -> tuple[str, str]:
    """What makes two messages "the same error": the file's own name and the numbers taken out."""
    return status, re.sub(r"\d+(\.\d+)?", "#", message.replace(path, "<file>").replace(Path(path).name, "<file>"))


@dataclass
class BatchSummary:
    """Counts of a run: what was scored, failed (by status) and skipped as already recorded.

    `still_failed` counts found files whose latest record, of this run or an earlier one, is a
    failure: the run succeeded only if it is zero. `errors` and `warnings` group this run's
    failures and warnings by kind, with an example each; `not_images` counts files found in the
    folders and skipped because they are not images.
    """

    found: int = 0
    still_failed: int = 0
    skipped: int = 0
    scored: int = 0
    not_images: int = 0
    failures: Counter = field(default_factory=Counter)
    errors: dict[tuple[str, str], ErrorKind] = field(default_factory=dict)
    warnings: dict[tuple[str, str], ErrorKind] = field(default_factory=dict)
    aborted: ScoremapError | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def warned(self) -> int:
        return sum(kind.count for kind in self.warnings.values())

    @property
    def remaining(self) -> int:
        return self.found - self.skipped - self.scored - self.failed

    def add(self, record: dict[str, Any]) -> None:
        """Count one record written by this run."""
        path = record.get("path", "")
        if record["status"] == "OK":
            self.scored += 1
        else:
            self.failures[record["status"]] += 1
            _tally(self.errors, record["status"], record.get("error", ""), path)
        for warning in record.get("warnings", ()):
            _tally(self.warnings, "warning", warning, path)

    def to_dict(self) -> dict[str, Any]:
        """The summary for programs (--summary-json)."""
        def kinds(table: dict[tuple[str, str], ErrorKind]) -> list[dict[str, Any]]:
            return [dataclasses.asdict(k) for k in sorted(table.values(), key=lambda k: -k.count)]
        return {"found": self.found, "skipped_recorded": self.skipped, "scored": self.scored,
                "failed": self.failed, "failed_all_runs": self.still_failed, "not_images": self.not_images,
                "not_scored": self.remaining if self.aborted is not None else 0,
                "failures_by_status": dict(sorted(self.failures.items())), "errors": kinds(self.errors),
                "warned": self.warned, "warnings": kinds(self.warnings),
                "stopped_by": str(self.aborted) if self.aborted is not None else None,
                "seconds": round(self.seconds, 3)}


def _tally(table: dict[tuple[str, str], ErrorKind], status: str, message: str, path: str) -> None:
    key = _pattern(status, message, path)
    if key in table:
        table[key].count += 1
    else:
        table[key] = ErrorKind(status, 1, path, message)


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def output_name(relative: Path, extension: str) -> Path:
    """An output's path for the image at `relative`: its suffix joins the name (`coffee.jpg` -> `coffee_jpg.png`),
    so outputs carry one extension (never `coffee.png.png`) and `x.jpg` and `x.png` still get two names."""
    name = f"{relative.stem}_{relative.suffix[1:]}" if relative.suffix else relative.name
    return relative.with_name(name + extension)


def _output_files(image: ImageFile, *, maps: bool, heatmaps: bool) -> dict[str, str]:
    """The record fields naming `image`'s outputs, relative to the output folder."""
    outputs = {}
    if maps:
        outputs["maps_file"] = str(Path("maps") / output_name(image.relative, ".npz"))
    if heatmaps:
        outputs["heatmap_file"] = str(Path("heatmaps") / output_name(image.relative, ".png"))
    return outputs


def refuse_shared_outputs(todo: Sequence[ImageFile], recorded: dict[str, dict[str, Any]], out: Path, *,
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


def files_to_score(images: Sequence[ImageFile], recorded: dict[str, dict[str, Any]], out: Path, *,
                   options_id: str, retry_failed: bool, maps: bool, heatmaps: bool
                   ) -> tuple[list[ImageFile], list[ImageFile]]:
    """(the distinct files, those still to score): not recorded, recorded under other options, or
    failed when `retry_failed`. Refuses a selection whose outputs would share a name."""
    unique = list({image.key: image for image in images}.values())
    todo = [image for image in unique
            if image.key not in recorded or recorded[image.key].get("options", options_id) != options_id
            or (retry_failed and recorded[image.key].get("status") != "OK")]
    refuse_shared_outputs(todo, recorded, out, maps=maps, heatmaps=heatmaps)
    return unique, todo


def score_one(image: ImageFile, scorer: Scorer, options: ScoreOptions, out_dir: Path, *,
               maps: bool, heatmaps: bool, timeout: float | None, options_id: str) -> dict[str, Any]:
    """Score one file, write its outputs atomically; its results.jsonl record."""
    started = time.perf_counter()
    record: dict[str, Any] = {"key": image.key, "path": str(image.path), "options": options_id}
    try:
        content = image.content()
        request = build_request(content, options)
        result = result_from_response(scorer.score_request(request, timeout=timeout))
        record.update(result.to_record())
        outputs = _output_files(image, maps=maps, heatmaps=heatmaps)
        # Every output is made before any is written, and a failed write takes back the others: a file
        # recorded as failed has no outputs (a failed heatmap leaves no .npz behind).
        made = {}
        if maps:
            made[outputs["maps_file"]] = _npz_bytes(result.map_arrays())
        if heatmaps:
            made[outputs["heatmap_file"]] = heatmap_png(open_photo(content), result)
        _write_all(out_dir, made)
        record.update(outputs)
        record["status"] = "OK"
    except Interrupted:
        raise  # nothing is known about this file: left unrecorded, so a re-run scores it
    except ScoremapError as error:
        if error.code in RUN_LEVEL_CODES:
            raise RunAborted(error) from error
        record.update(status=error.code.name, error=error.message)
    except (OSError, ValueError) as error:  # unreadable file, undrawable heatmap, bad tensor
        record.update(status=type(error).__name__, error=str(error))
    record["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return record


def _write_all(out: Path, outputs: dict[str, bytes]) -> None:
    """Write every output (name relative to `out`) atomically, or, when one write fails, none of them."""
    written = []
    try:
        for name, data in outputs.items():
            atomic_write(out / name, data)
            written.append(name)
    except BaseException:
        for name in written:
            _remove_output(out, name)
        raise


def _named_outputs(record: dict[str, Any]) -> list[str]:
    return [record[field] for field in ("maps_file", "heatmap_file") if record.get(field)]


def _remove_output(out: Path, name: str) -> None:
    """Delete the output `name` (relative to `out`, as records name them), and folders it leaves empty."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        return  # not a name this program writes
    path = out / relative
    path.unlink(missing_ok=True)
    for folder in path.parents:
        if folder == out:
            break
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone)
            break


def forget_other_options(out: Path, options_id: str) -> None:
    """Remove the records of other options than `options_id`, and the outputs they name (only those: other
    files in the folder are the user's), so after --force-new-options only the new options' results stay.
    Outputs go first, so a run killed in between leaves records naming nothing, which the next run
    removes (it gets here with the new options stored, forced or not)."""
    results = out / RESULTS_NAME
    records = list(read_records(results).values())

    def current(record: dict[str, Any]) -> bool:
        return record.get("options", options_id) == options_id

    kept = {name for record in records if current(record) for name in _named_outputs(record)}
    for record in records:
        if not current(record):
            for name in _named_outputs(record):
                if name not in kept:
                    _remove_output(out, name)
    keep_records(results, current)


def open_run(out: Path, options: ScoreOptions, *, maps: bool, heatmaps: bool,
             force_new_options: bool) -> tuple[ScoreOptions, str]:
    """Ready the output folder for a run (every engine's): partial files of a killed run removed, the options
    settled (clients/batch/run_options.py); (the options to score with, their fingerprint)."""
    out.mkdir(parents=True, exist_ok=True)
    if (removed := remove_partials(out)):
        log.info("removed %d partial files left by an interrupted run", removed)
    if maps or heatmaps:
        options = dataclasses.replace(options, return_maps=True)
    options_id = settle_options(out, run_options(options, maps=maps, heatmaps=heatmaps), force=force_new_options)
    forget_other_options(out, options_id)  # their files are scored again: they go now, not beside the new ones
    return options, options_id


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
    force_new_options: bool = False,
    timeout: float | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> BatchSummary:
    """Score `images` not yet recorded in OUT_DIR/results.jsonl, `concurrency` at a time.

    The options are checked against those stored in OUT_DIR (clients/batch/run_options.py: OptionsChanged
    when they differ, unless `force_new_options`, which scores again the files recorded under
    other options). `on_start(n)` is told how many files will be scored, `on_progress(record)`
    each record written. On any exception (KeyboardInterrupt included) the scorer is interrupted,
    so the run ends at once.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency} must be at least 1")
    out = Path(out_dir)
    options, options_id = open_run(out, options, maps=maps, heatmaps=heatmaps, force_new_options=force_new_options)
    summary = BatchSummary()
    started = time.perf_counter()
    with ResultsLog(out / RESULTS_NAME) as results:
        recorded = results.records()
        unique, todo = files_to_score(images, recorded, out, options_id=options_id, retry_failed=retry_failed,
                                      maps=maps, heatmaps=heatmaps)
        summary.found, summary.skipped = len(unique), len(unique) - len(todo)
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
                    in_flight.add(pool.submit(score_one, image, scorer, options, out, maps=maps,
                                              heatmaps=heatmaps, timeout=timeout, options_id=options_id))
            try:
                refill()
                while in_flight:
                    for future in first_done(in_flight):
                        in_flight.discard(future)
                        if future.cancelled():
                            continue
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
                        summary.add(record)
                        if on_progress:
                            on_progress(record)
                    in_flight = {f for f in in_flight if not f.cancelled()}
                    refill()
            except BaseException:
                for future in in_flight:
                    future.cancel()
                scorer.interrupt()  # running calls and retry pauses end now, not after --retry-for
                raise
    summary.still_failed = sum(recorded.get(image.key, {}).get("status", "OK") != "OK" for image in unique)
    summary.seconds = time.perf_counter() - started
    return summary
