import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from concurrent import futures

import grpc
import numpy as np
import pytest
from PIL import Image

from clients import ScoremapClient
from clients.batch.files import read_records
from clients.batch.score_cli import EXIT_FAILURES, EXIT_OK, EXIT_REFUSED, main
from protos import scoring_pb2, scoring_pb2_grpc
from server.memory.huge_pages import HUGE, glibc
from tests.signal_threads import TGKILL, signal_another_thread
from tests.processes import with_umask_022, without_tunables

REPO = Path(__file__).resolve().parents[3]


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not glibc(), reason="glibc's tunables: not a glibc system")
def test_local_scoring_runs_under_glibc_huge_pages_as_the_server_does(tiny_model, photos, tmp_path):
    """`--local` decodes in this process: the command starts itself again once with glibc's huge-page tunable (the
    probe says GLIBC_TUNABLES at each start), and still scores every photo."""
    probe = ("import os, sys\n"
             "print('TUNABLES', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
             "from clients.batch.score_cli import main\n"
             f"sys.argv = ['scoremap-score', {str(photos)!r}, '--out', {str(tmp_path / 'out')!r}, "
             f"'--local', {tiny_model!r}]\n"
             "sys.exit(main())\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env=without_tunables())
    assert result.returncode == EXIT_OK, result.stderr
    said = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("TUNABLES")]
    assert said == ["None", HUGE]
    assert len(read_records(tmp_path / "out" / "results.jsonl")) == 6


def test_server_and_local_give_the_same_results(server, tiny_model, photos, tmp_path):
    common = [str(photos), "--stride", "16", "--maps", "--no-progress", "--concurrency", "2"]
    assert main([*common, "--out", str(tmp_path / "remote"), "--server", server]) == EXIT_OK
    assert main([*common, "--out", str(tmp_path / "local"), "--local", tiny_model]) == EXIT_OK
    remote, local = read_records(tmp_path / "remote" / "results.jsonl"), read_records(tmp_path / "local" / "results.jsonl")
    assert len(remote) == 6 and remote.keys() == local.keys()  # notes.txt skipped by content
    for key, record in remote.items():
        other = local[key]
        assert record["status"] == other["status"] == "OK"
        assert [p["index"] for p in record["top_k"]] == [p["index"] for p in other["top_k"]]
        np.testing.assert_allclose([p["probability"] for p in record["top_k"]],
                                   [p["probability"] for p in other["top_k"]], rtol=1e-6)
        assert record["maps"] == other["maps"] and record["shift"] == "SHIFT_GRID"
        with np.load(tmp_path / "remote" / record["maps_file"]) as a, np.load(tmp_path / "local" / other["maps_file"]) as b:
            assert sorted(a.files) == sorted(b.files)
            for name in a.files:
                np.testing.assert_allclose(a[name], b[name], atol=1e-6)


def test_heic_avif_and_gif_photos_are_found_and_scored(server, photos, tmp_path):
    import pillow_heif

    pillow_heif.register_heif_opener()
    phone = tmp_path / "phone"
    phone.mkdir()
    pixels = Image.open(sorted(photos.glob("*.jpg"))[0]).convert("RGB")
    for suffix, fmt in ((".heic", "HEIF"), (".HEIF", "HEIF"), (".avif", "AVIF"), (".gif", "GIF")):
        pixels.save(phone / f"photo{suffix}", format=fmt)
    pixels.save(phone / "no-suffix", format="AVIF")  # found by its first bytes
    out = tmp_path / "out"
    assert main([str(phone), "--out", str(out), "--server", server, "--no-progress"]) == EXIT_OK
    records = read_records(out / "results.jsonl")
    assert sorted(Path(r["path"]).name for r in records.values()) == [
        "no-suffix", "photo.HEIF", "photo.avif", "photo.gif", "photo.heic"]
    assert {r["status"] for r in records.values()} == {"OK"}


def test_a_corrupt_image_is_recorded_and_the_rest_scored(server, photos, tmp_path, capsys):
    (photos / "broken.jpg").write_bytes((photos / "photo000.jpg").read_bytes()[:300])  # a torn JPEG
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", server, "--no-progress"]) == EXIT_FAILURES
    records = read_records(out / "results.jsonl")
    broken = [r for r in records.values() if r["path"].endswith("broken.jpg")]
    assert len(broken) == 1 and broken[0]["status"] == "INVALID_ARGUMENT" and broken[0]["error"]
    assert sum(r["status"] == "OK" for r in records.values()) == 6
    summary = capsys.readouterr().out
    assert re.search(r"failed\s+1\n\s+INVALID_ARGUMENT\s+1\n", summary), summary
    # A re-run skips everything recorded, failures included, unless asked to retry them; the
    # recorded failure still counts in its exit status.
    assert main([str(photos), "--out", str(out), "--server", server, "--no-progress"]) == EXIT_FAILURES
    assert re.search(r"failed, all runs\s+1\n", capsys.readouterr().out)
    assert len(lines(out)) == 7
    (photos / "broken.jpg").write_bytes((photos / "photo000.jpg").read_bytes())  # repaired
    assert main([str(photos), "--out", str(out), "--server", server, "--no-progress", "--retry-failed"]) == EXIT_OK
    assert len(lines(out)) == 8 and all(r["status"] == "OK" for r in read_records(out / "results.jsonl").values())


def test_heatmaps_are_pngs_of_the_photo_size(server, photos, tmp_path):
    from clients.api.heatmap import canvas_scale
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", server, "--heatmaps", "--stride", "16",
                 "--no-progress"]) == EXIT_OK
    for record in lines(out):
        with Image.open(record["path"]) as photo, Image.open(out / record["heatmap_file"]) as heatmap:
            factor = canvas_scale(*photo.size)  # these photos are small: enlarged for a readable legend
            assert heatmap.format == "PNG" and heatmap.size == (photo.width * factor, photo.height * factor)
            assert record["image_size"] == [photo.height, photo.width]
            assert np.asarray(heatmap.convert("RGB")).std() > 0


def test_sigkill_mid_run_then_rerun_records_every_image_once(tiny_model, make_photos, tmp_path):
    photos = tmp_path / "many"
    paths = make_photos(photos, 60, seed=1)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "clients.batch.score_cli", str(photos), "--out", str(out), "--local", tiny_model,
               "--maps", "--heatmaps", "--concurrency", "2", "--no-progress"]
    run = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and run.poll() is None:
        if results.exists() and results.read_text().count("\n") >= 10:
            break
        time.sleep(0.01)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, run.stderr.read().decode()
    killed_at = results.read_text().count("\n")
    assert 10 <= killed_at < 60
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == EXIT_OK, rerun.stderr
    keys = [record["key"] for record in lines(out)]
    assert sorted(keys) == sorted(os.path.realpath(p) for p in paths)  # every image exactly once
    assert not list(out.rglob("*.partial"))
    for record in lines(out):
        with np.load(out / record["maps_file"]) as maps:
            assert maps["scores_64"].shape[0] == 10
        with Image.open(out / record["heatmap_file"]) as heatmap:
            heatmap.load()


def test_a_server_restart_mid_run_is_ridden_out(start_server, make_photos, tmp_path):
    photos = tmp_path / "many"
    make_photos(photos, 40, seed=2)
    first, port = start_server()
    out = tmp_path / "out"
    outcome = {}
    run = threading.Thread(target=lambda: outcome.update(code=main([
        str(photos), "--out", str(out), "--server", f"127.0.0.1:{port}", "--concurrency", "1",
        "--retry-for", "30", "--no-progress", "--scales", "256"])))
    run.start()
    results = out / "results.jsonl"
    while run.is_alive() and not (results.exists() and results.read_text().count("\n") >= 5):
        time.sleep(0.005)
    first.stop(1.0).wait(10)  # drains: in-flight calls finish, new ones get UNAVAILABLE
    time.sleep(1.0)
    start_server(address=f"127.0.0.1:{port}")
    run.join(120)
    records = lines(out)
    assert outcome["code"] == EXIT_OK, [r for r in records if r["status"] != "OK"]
    assert len(records) == 40 and all(r["status"] == "OK" for r in records)


def test_exit_codes_for_an_unreachable_server_and_bad_arguments(photos, tmp_path, caplog):
    from clients.batch.score_cli import EXIT_UNAVAILABLE
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", "127.0.0.1:1", "--retry-for", "0.2",
                 "--no-progress"]) == EXIT_UNAVAILABLE
    assert not out.exists()  # never reached: nothing started, nothing recorded
    assert "cannot reach 127.0.0.1:1" in caplog.text
    with pytest.raises(SystemExit) as usage:
        main([str(tmp_path / "missing"), "--out", str(out), "--server", "127.0.0.1:1"])
    assert usage.value.code == 2


def test_same_file_names_in_two_folders_keep_their_own_maps(server, make_photos, tmp_path):
    make_photos(tmp_path / "a", 1, seed=3)
    make_photos(tmp_path / "b", 1, seed=4)  # another photo, also named photo000.jpg
    out = tmp_path / "out"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--server", server, "--maps",
                 "--heatmaps", "--no-progress"]) == EXIT_OK
    records = {Path(r["path"]).parent.name: r for r in lines(out)}
    assert records["a"]["maps_file"] != records["b"]["maps_file"]
    assert records["a"]["heatmap_file"] != records["b"]["heatmap_file"]
    with ScoremapClient(server) as client:
        for record in records.values():
            expected = client.score(record["path"]).maps[0]
            with np.load(out / record["maps_file"]) as maps:
                np.testing.assert_allclose(maps[f"scores_{expected.scale}"], expected.scores, atol=1e-6)


def test_two_files_with_one_output_name_are_refused(server, make_photos, tmp_path):
    from clients.batch.score_cli import EXIT_REFUSED
    one, other = make_photos(tmp_path / "a", 1)[0], make_photos(tmp_path / "b", 1, seed=5)[0]
    out = tmp_path / "out"
    assert main([str(one), str(other), "--out", str(out), "--server", server, "--maps", "--no-progress"]) == EXIT_REFUSED
    assert not (out / "results.jsonl").read_text() and not (out / "maps").exists()


def test_a_full_queue_is_waited_out_but_a_request_too_large_is_recorded(start_server, make_photos, tmp_path):
    photos = tmp_path / "many"
    make_photos(photos, 16, seed=6)
    _, port = start_server(queue_depth=1, max_batch=1)
    out = tmp_path / "busy"
    assert main([str(photos), "--out", str(out), "--server", f"127.0.0.1:{port}", "--concurrency", "8",
                 "--scales", "512", "--no-progress"]) == EXIT_OK
    assert len(lines(out)) == 16 and all(r["status"] == "OK" for r in lines(out))
    _, port = start_server(memory_budget_bytes=1)  # no pass fits: the server refuses each for good
    out = tmp_path / "small"
    assert main([str(photos / "photo000.jpg"), "--out", str(out), "--server", f"127.0.0.1:{port}",
                 "--no-progress"]) == EXIT_FAILURES
    [record] = lines(out)
    assert record["status"] == "RESOURCE_EXHAUSTED" and "memory budget" in record["error"]
    assert record["elapsed_ms"] < 1000  # recorded at once, not sent again


class UnavailableScorer(scoring_pb2_grpc.DenseScoringServicer):
    """A server that lists its model, then answers every Score with UNAVAILABLE: a run that reached
    its server and now waits for it to come back, deterministically."""

    def ListModels(self, request, context):
        return scoring_pb2.ListModelsResponse(models=[scoring_pb2.ModelSummary(name="tiny", classes=10)])

    def Score(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "stopping")


@pytest.mark.parametrize("to", ["the process", "another thread"])
def test_ctrl_c_while_waiting_for_the_server_stops_at_once(photos, tmp_path, to):
    """A run waiting for its server stops at once on Ctrl-C, whichever of its threads the kernel hands SIGINT to:
    Python runs the handler in the main thread, which must not sit in a wait that only a finished photo ends."""
    if to == "another thread" and TGKILL is None:
        pytest.skip(f"tgkill's syscall number on {platform.machine()} is not known here")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scoring_pb2_grpc.add_DenseScoringServicer_to_server(UnavailableScorer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # A client started as a terminal starts it: SIGINT caught, not ignored. A suite run in the background (`&`)
        # ignores SIGINT, and a child inherits an ignored signal through exec (a caught one comes back as default).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            run = subprocess.Popen([sys.executable, "-m", "clients.batch.score_cli", str(photos), "--out",
                                    str(tmp_path / "out"), "--server", f"127.0.0.1:{port}", "--retry-for", "120",
                                    "--no-progress"], cwd=REPO, stderr=subprocess.PIPE, text=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        said: list[str] = []
        waiting = threading.Event()

        def read() -> None:
            for line in run.stderr:
                said.append(line)
                if "waiting for" in line:
                    waiting.set()
        reader = threading.Thread(target=read)
        reader.start()
        assert waiting.wait(60), said
        signals = pathlib.Path(f"/proc/{run.pid}/status").read_text()
        if to == "the process":
            run.send_signal(signal.SIGINT)
        else:
            signal_another_thread(run.pid, signal.SIGINT)
        interrupted = time.monotonic()
        try:
            code = run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
            raise AssertionError(f"no exit 30 s after SIGINT; its signal masks: "
                                 f"{[line for line in signals.splitlines() if line.startswith('Sig')]}; said: {said}")
        stopped_after = time.monotonic() - interrupted
        reader.join(10)
    finally:
        server.stop(0)
    text = "".join(said)
    assert code == 130, text
    # At once, not after --retry-for's 120 s; the bound leaves room for a loaded machine (2 s failed there)
    assert stopped_after < 15.0, text
    assert f"waiting for 127.0.0.1:{port}, retrying for " in text and "s more" in text
    assert "re-run the same command to resume" in text and "Traceback" not in text
    assert not read_records(tmp_path / "out" / "results.jsonl")  # nothing recorded for the files in flight


def test_summary_lists_distinct_errors_with_examples_and_skipped_files(server, photos, tmp_path, capsys):
    for name in ("torn1.jpg", "torn2.jpg"):
        (photos / name).write_bytes((photos / "photo000.jpg").read_bytes()[:300])
    (photos / "paper.pdf").write_bytes(b"%PDF-1.7\n" + bytes(40))  # not an image we score: skipped, counted
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    assert main([str(photos), "--out", str(out), "--server", server, "--no-progress",
                 "--summary-json", str(summary)]) == EXIT_FAILURES
    printed = capsys.readouterr().out
    assert re.search(r"not images \(skipped\)\s+2\n", printed), printed  # notes.txt and paper.pdf
    assert re.search(r"errors \(1 distinct\):\n\s+2 x INVALID_ARGUMENT: .+\n\s+e\.g\. .+torn\d\.jpg", printed), printed
    report = json.loads(summary.read_text())
    assert (report["found"], report["scored"], report["failed"], report["not_images"]) == (8, 6, 2, 2)
    [kind] = report["errors"]
    assert kind["status"] == "INVALID_ARGUMENT" and kind["count"] == 2 and "torn" in kind["example_path"]


def test_a_folder_without_images_is_an_error(server, tmp_path, caplog):
    from clients.batch.score_cli import EXIT_USAGE
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no photos here")
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--server", server]) == EXIT_USAGE
    assert "no images" in caplog.text and "readme.txt" in caplog.text


def test_outputs_follow_the_umask(server, photos, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(with_umask_022([sys.executable, "-m", "clients.batch.score_cli", str(photos), "--out", str(out),
                                          "--server", server, "--maps", "--heatmaps", "--no-progress"]),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_OK, done.stderr
    written = [out / "results.jsonl", out / "options.json", *out.rglob("*.npz"), *out.rglob("*.png")]
    assert len(written) == 2 + 6 + 6
    assert {oct(path.stat().st_mode & 0o777) for path in written} == {"0o644"}


def test_version_and_help_without_the_heavy_imports():
    from protos import version
    for module in ("clients.batch.score_cli", "clients.loadtest.run"):
        shown = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO, capture_output=True, text=True)
        assert shown.returncode == 0 and version() in shown.stdout
        probe = (f"import sys, runpy; sys.argv = ['x', '--help']\n"
                 f"try:\n    runpy.run_module('{module}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                 "heavy = [m for m in ('torch', 'onnxruntime', 'onnx', 'server') if m in sys.modules]\n"
                 "sys.stderr.write(repr(heavy))")
        helped = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
        assert "usage:" in helped.stdout and helped.stderr.strip() == "[]", helped.stderr


def test_server_warnings_are_recorded_and_counted(server, tmp_path, capsys):
    photos = tmp_path / "tiny"
    photos.mkdir()
    for n in range(2):
        Image.new("RGB", (4 + n, 4), (200, 100, 50)).save(photos / f"speck{n}.png")
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", server, "--no-progress"]) == EXIT_OK
    records = lines(out)
    assert all(r["status"] == "OK" and "far below" in r["warnings"][0] for r in records)
    printed = capsys.readouterr().out
    assert re.search(r"scored with warnings\s+2\n", printed) and "warnings (1 distinct):" in printed, printed


@pytest.mark.parametrize("argv, flag, says", [
    (["--server", "127.0.0.1:70000"], "--server", "port from 0 to 65535"),
    (["--server", "127.0.0.1"], "--server", "expected HOST:PORT"),
    (["--local", "missing.onnx", "--scales", "384,0"], "--scales", ">= 1"),
    (["--local", "missing.onnx", "--stride", "-16"], "--stride", ">= 0"),
    (["--local", "missing.onnx", "--top-k", "-1"], "--top-k", ">= 0"),
    (["--local", "missing.onnx", "--concurrency", "0"], "--concurrency", ">= 1"),
    (["--local", "missing.onnx", "--timeout", "0"], "--timeout", ">= 0.001"),
    (["--local", "missing.onnx", "--retry-for", "-5"], "--retry-for", ">= 0"),
    (["--local", "missing.onnx", "--timeout", "nan"], "--timeout", "got 'nan'"),
    (["--local", "missing.onnx", "--tiled", "--max-slide-pixels", "0"], "--max-slide-pixels", ">= 1"),
])
def test_every_numeric_flag_is_range_checked_before_anything_loads(tmp_path, capsys, argv, flag, says):
    """Exit 2 naming the flag; the model file does not exist, so nothing could have loaded."""
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path), "--out", str(tmp_path / "out"), *argv])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}: " in error and says in error
    assert not (tmp_path / "out").exists()


def test_outputs_carry_one_extension_and_sibling_formats_get_their_own(server, tmp_path):
    """A heatmap of coffee.png is `coffee_png.png`, never `coffee.png.png`; `x.jpg` and `x.png` get two names."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for suffix in ("jpg", "png"):
        Image.new("RGB", (96, 64), (30, 90, 150)).save(photos / f"coffee.{suffix}")
    out = tmp_path / "out"
    assert main([str(photos), "--out", str(out), "--server", server, "--maps", "--heatmaps", "--no-progress"]) == EXIT_OK
    assert sorted(p.name for p in (out / "heatmaps").iterdir()) == ["coffee_jpg.png", "coffee_png.png"]
    assert sorted(p.name for p in (out / "maps").iterdir()) == ["coffee_jpg.npz", "coffee_png.npz"]


def test_a_big_tiff_scores_as_its_png_locally_and_on_a_server(server, tiny_model, tmp_path):
    """BigTIFF files, which the server opens, are scored, not refused by a signature list of the client's own."""
    photos = tmp_path / "photos"
    photos.mkdir()
    pixels = np.asarray(Image.open(REPO / "samples" / "astronaut.jpg").convert("RGB").resize((96, 80)))
    Image.fromarray(pixels).save(photos / "astro.png")
    Image.fromarray(pixels).save(photos / "astro.tif", big_tiff=True)
    for engine, where in (("--server", server), ("--local", tiny_model)):
        out = tmp_path / engine.strip("-")
        assert main([str(photos), "--out", str(out), engine, where, "--no-progress"]) == EXIT_OK
        records = {Path(r["path"]).name: r for r in read_records(out / "results.jsonl").values()}
        assert records["astro.tif"]["status"] == "OK", records["astro.tif"]
        assert records["astro.tif"]["top_k"] == records["astro.png"]["top_k"]


def test_a_file_recorded_as_failed_leaves_no_outputs(server, photos, tmp_path):
    """A file whose heatmap fails is recorded as failed with none of its outputs written, its .npz included."""
    out = tmp_path / "out"
    (out / "heatmaps" / "photo000_jpg.png").mkdir(parents=True)  # its heatmap cannot be written there
    assert main([str(photos), "--out", str(out), "--server", server, "--maps", "--heatmaps", "--no-progress"]) \
        == EXIT_FAILURES
    records = {Path(r["path"]).name: r for r in read_records(out / "results.jsonl").values()}
    assert records["photo000.jpg"]["status"] == "IsADirectoryError" and "maps_file" not in records["photo000.jpg"]
    assert not (out / "maps" / "photo000_jpg.npz").exists()
    assert all((out / r["maps_file"]).exists() for r in records.values() if r["status"] == "OK")


@pytest.mark.parametrize("where", ["/proc/nope", "a-file/out"])
def test_an_out_folder_that_cannot_be_made_is_named_with_the_fix(server, photos, tmp_path, caplog, where):
    """`--out /proc/nope` names the flag and the fix, never a bare `[Errno 2] No such file or directory`."""
    (tmp_path / "a-file").write_text("a file, not a folder")
    out = where if where.startswith("/") else str(tmp_path / where)
    assert main([str(photos), "--out", out, "--server", server, "--no-progress"]) == EXIT_REFUSED
    said = caplog.text
    assert f"--out '{out}'" in said and "give --out a folder you can write to" in said and "Errno" not in said


def test_local_makes_each_plan_when_first_needed_and_runs_at_its_own_priority(tiny_model):
    """--local warms nothing up front and lowers no thread, whatever the settings say: the server's warm-up of
    every scale and the tile canvas would hold a batch job most of a minute before its first photo, and compute at
    nice 19 crawls beside any other work on the machine."""
    from clients.batch.local import LocalScorer
    from server.settings import Settings
    from tests.server.conftest import raw_request

    def tasks() -> set[int]:
        return {int(task.name) for task in Path("/proc/self/task").iterdir()}

    def lowered(since: set[int]) -> list[int]:  # of the threads started since (earlier tests may leave theirs)
        here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return [task for task in tasks() - since if os.getpriority(os.PRIO_PROCESS, task) != here]

    before = tasks()
    with LocalScorer([tiny_model], settings=Settings(warm_up=True, compute_nice=19, intra_op_threads=2)) as scorer:
        model = scorer.models()[0].name
        plans = scorer._pipeline.engine.served(model).plans
        assert plans.made == 0
        assert scorer.score_request(raw_request(np.zeros((64, 64, 3), np.uint8), scales=[64])).top_k
        assert plans.made == 1
        assert not lowered(before)
