"""utils.files: the atomic writer. Oracle: the file system itself (what a reader finds afterwards)."""

import json
import os
import pickle

import pytest
import torch

from utils import files


def test_text_bytes_json_and_torch_round_trip(tmp_path):
    files.atomic_write(tmp_path / "a" / "b.txt", "héllo\r\nworld")  # folders are made
    assert (tmp_path / "a" / "b.txt").read_bytes() == "héllo\r\nworld".encode()  # newlines kept as given
    files.atomic_write(tmp_path / "c.bin", b"\x00\x01")
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\x01"
    files.atomic_write_json(tmp_path / "d.json", {"x": 1, "p": tmp_path})
    assert json.loads((tmp_path / "d.json").read_text()) == {"x": 1, "p": str(tmp_path)}
    files.atomic_save({"w": torch.arange(3)}, tmp_path / "e.pt")
    assert torch.equal(torch.load(tmp_path / "e.pt")["w"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c.bin", "d.json", "e.pt"]  # no temporaries


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    files.atomic_write_json(target, {"v": 1})

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_an_unserialisable_object_never_touches_the_target(tmp_path):
    target = tmp_path / "model.pt"
    files.atomic_save({"ok": 1}, target)
    with pytest.raises((pickle.PicklingError, AttributeError)):  # which one depends on where the lambda lives
        files.atomic_save({"bad": lambda: 0}, target)  # pickling fails before any byte is written
    assert torch.load(target) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_a_streaming_writer_that_fails_midway_leaves_the_old_file(tmp_path):
    target = tmp_path / "archive.tar"
    files.atomic_write(target, b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with files.atomic_open(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("the writer failed midway")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["archive.tar"]
    with files.atomic_open(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new"


def test_shm_free_bytes_is_what_the_file_system_reports(tmp_path):
    import shutil

    before = shutil.disk_usage(tmp_path).free  # the oracle: the standard library's reading of the same folder
    got = files.shm_free_bytes(str(tmp_path))
    after = shutil.disk_usage(tmp_path).free
    slack = 2**20  # other programs write to the same disk meanwhile
    assert min(before, after) - slack <= got <= max(before, after) + slack
    assert files.shm_free_bytes(str(tmp_path / "missing")) is None, "no such folder: nothing to check"
