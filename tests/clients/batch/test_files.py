import json
import os

import pytest

from clients.batch.files import ResultsLog, atomic_write, find_images, read_records, remove_partials


def test_folders_are_walked_for_images_by_content_or_image_suffix(photos, tmp_path):
    (photos / "disguised.txt").write_bytes((photos / "photo001.png").read_bytes())  # an image by content
    (photos / "fake.jpg").write_text("text, not a JPEG")  # kept: it fails when scored, and is recorded
    (photos / "notes.txt").write_text("not an image, not named like one")
    found = list(find_images([photos]))
    names = [str(image.relative) for image in found]
    assert "disguised.txt" in names and "fake.jpg" in names and "notes.txt" not in names
    assert "nested/photo002.jpg" in names
    explicit = list(find_images([photos / "fake.jpg"]))  # named on purpose: kept, fails when scored
    assert [str(image.relative) for image in explicit] == ["fake.jpg"]
    with pytest.raises(FileNotFoundError, match="missing"):
        list(find_images([tmp_path / "missing"]))


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "deep" / "out.bin"
    atomic_write(target, b"first")
    atomic_write(target, b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["out.bin"]
    (target.parent / ".out.bin.abc123.partial").write_bytes(b"half")  # what a SIGKILL leaves
    assert remove_partials(tmp_path) == 1 and os.listdir(target.parent) == ["out.bin"]


def test_results_log_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultsLog(path) as log:
        log.append({"key": "/a", "status": "OK"})
        log.append({"key": "/b", "status": "INVALID_ARGUMENT"})
    with open(path, "ab") as handle:
        handle.write(b'{"key": "/c", "sta')  # killed mid-write
    assert set(read_records(path)) == {"/a", "/b"}
    with ResultsLog(path) as log:  # reopening cuts the torn line, so the next append is whole
        log.append({"key": "/c", "status": "OK"})
        log.append({"key": "/b", "status": "OK"})  # a retried failure supersedes its old line
        records = log.records()
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == ["/a", "/b", "/c", "/b"]
    assert records["/b"]["status"] == "OK" and len(records) == 3


def test_several_roots_name_their_files_apart(make_photos, tmp_path):
    for folder in ("a", "b", "c/a"):
        make_photos(tmp_path / folder, 1)  # photo000.jpg in each
    found = list(find_images([tmp_path / "a", tmp_path / "b", tmp_path / "c" / "a"]))
    assert [str(image.relative) for image in found] == ["a/photo000.jpg", "b/photo000.jpg", "a-2/photo000.jpg"]
    assert [str(image.relative) for image in find_images([tmp_path / "a"])] == ["photo000.jpg"]
