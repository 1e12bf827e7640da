import json

from clients.batch.files import read_records
from clients.batch.score_cli import EXIT_OK, EXIT_USAGE, main


def test_a_rerun_with_other_options_is_refused_unless_forced(server, photos, tmp_path, caplog):
    out = tmp_path / "out"
    common = [str(photos), "--out", str(out), "--server", server, "--no-progress"]
    assert main([*common, "--stride", "16", "--scales", "96"]) == EXIT_OK
    first = read_records(out / "results.jsonl")
    stored = json.loads((out / "options.json").read_text())
    assert stored["stride"] == 16 and stored["scales"] == [96]

    assert main([*common, "--stride", "32", "--scales", "64"]) == EXIT_USAGE
    assert "--stride: 16 before, 32 now" in caplog.text and "--scales: [96] before, [64] now" in caplog.text
    assert "--force-new-options" in caplog.text
    assert read_records(out / "results.jsonl") == first  # nothing scored, nothing changed

    assert main([*common, "--stride", "16", "--scales", "96"]) == EXIT_OK  # the same options: all skipped
    assert (out / "results.jsonl").read_text().count("\n") == len(first)

    assert main([*common, "--stride", "32", "--scales", "64", "--force-new-options"]) == EXIT_OK
    records = read_records(out / "results.jsonl")
    assert records.keys() == first.keys()
    assert all(r["output_stride"] == 32 and r["scales"] == [64] for r in records.values())
    assert json.loads((out / "options.json").read_text())["stride"] == 32
    # Issue 24: the old options' records went; results.jsonl holds one line per image, not both runs'.
    assert (out / "results.jsonl").read_text().count("\n") == len(first)


def test_naming_the_defaults_is_the_same_run(server, photos, tmp_path):
    out = tmp_path / "out"
    common = [str(photos), "--out", str(out), "--server", server, "--no-progress"]
    assert main(common) == EXIT_OK
    assert main([*common, "--model", "tiny"]) == EXIT_OK  # the one model, named: not "other options"
