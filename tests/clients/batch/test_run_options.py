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
    # The old options' records went; results.jsonl holds one line per image, not both runs'.
    assert (out / "results.jsonl").read_text().count("\n") == len(first)


def test_naming_the_defaults_is_the_same_run(server, photos, tmp_path):
    out = tmp_path / "out"
    common = [str(photos), "--out", str(out), "--server", server, "--no-progress"]
    assert main(common) == EXIT_OK
    assert main([*common, "--model", "tiny"]) == EXIT_OK  # the one model, named: not "other options"


def _files(folder) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def test_forced_new_options_remove_the_outputs_of_the_old(server, photos, tmp_path):
    """Maps and heatmaps of the old options go, never to stay beside the new results. Only the files
    the old records name go: a file of the user's own in the output folder stays."""
    out = tmp_path / "out"
    common = [str(photos), "--out", str(out), "--server", server, "--no-progress"]
    assert main([*common, "--stride", "16", "--maps", "--heatmaps"]) == EXIT_OK
    old = read_records(out / "results.jsonl")
    named = sorted(r[field] for r in old.values() for field in ("maps_file", "heatmap_file"))
    assert len(named) == 12 and _files(out / "maps") + _files(out / "heatmaps")
    (out / "maps" / "mine.npz").write_bytes(b"the user's own")

    assert main([*common, "--stride", "32", "--force-new-options"]) == EXIT_OK
    assert not any((out / name).exists() for name in named)
    assert _files(out / "maps") == ["mine.npz"] and _files(out / "heatmaps") == []

    assert main([*common, "--stride", "32", "--maps", "--force-new-options"]) == EXIT_OK
    new = read_records(out / "results.jsonl")
    assert sorted(r["maps_file"] for r in new.values()) == sorted(f for f in named if f.startswith("maps/"))
    assert all((out / r["maps_file"]).exists() for r in new.values())
