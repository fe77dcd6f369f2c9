"""Symbolic links in checkpoint folders: real paths recorded, links leaving the folder reported, loops exit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from h3gate.checkpoint import INDEX_NAME, WEIGHTS_NAME, open_checkpoint
from h3gate.errors import InputError
from h3gate.paths import display


@pytest.fixture(scope="module")
def single(tiny_checkpoint) -> Path:
    return tiny_checkpoint("links", "single", 3)


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint) -> Path:
    return tiny_checkpoint("links", "sharded", 3, shard_size=1_000_000)


def _fingerprint(run_cli, tmp_path: Path, folder: Path) -> tuple[int, dict | None, str]:
    ev = tmp_path / "ev"
    code, _, err = run_cli("fingerprint", "--out", ev, "--checkpoint", folder)
    doc = json.loads((ev / "fingerprint.json").read_text()) if (ev / "fingerprint.json").exists() else None
    return code, doc, err


def test_plain_folder_records_real_paths_and_no_warning(run_cli, tmp_path, single):
    code, doc, err = _fingerprint(run_cli, tmp_path, single)
    assert (code, err) == (0, "")
    report = doc["checkpoint"]
    assert report["path"] == str(single) and report["real_path"] == str(single.resolve())
    assert report["outside_folder"] == []
    assert report["shards"][0]["real_path"] == str((single / WEIGHTS_NAME).resolve())
    assert report["shards"][0]["outside_folder"] is False


def test_link_inside_the_folder_is_recorded_without_warning(run_cli, tmp_path, single):
    folder = tmp_path / "ck"
    shutil.copytree(single, folder)
    (folder / "blobs").mkdir()
    (folder / WEIGHTS_NAME).rename(folder / "blobs" / "w")
    (folder / WEIGHTS_NAME).symlink_to(Path("blobs") / "w")
    code, doc, err = _fingerprint(run_cli, tmp_path, folder)
    assert (code, err) == (0, "")
    shard = doc["checkpoint"]["shards"][0]
    assert shard["file"] == WEIGHTS_NAME and shard["real_path"] == str((folder / "blobs" / "w").resolve())
    assert shard["outside_folder"] is False and doc["checkpoint"]["outside_folder"] == []


def test_link_leaving_the_folder_is_reported(run_cli, tmp_path, single):
    folder, store = tmp_path / "ck", tmp_path / "store"
    shutil.copytree(single, folder)
    store.mkdir()
    (folder / WEIGHTS_NAME).rename(store / "blob")
    (folder / WEIGHTS_NAME).symlink_to(store / "blob")
    code, doc, err = _fingerprint(run_cli, tmp_path, folder)
    assert code == 0  # read anyway: the same bytes, now reported
    real = str((store / "blob").resolve())
    assert err == (
        f"h3gate: warning: {display(folder)}: 1 weight file resolves outside the checkpoint folder "
        f"({WEIGHTS_NAME} -> {real}); read anyway, recorded as outside_folder in fingerprint evidence\n"
    )
    report = doc["checkpoint"]
    assert report["outside_folder"] == [WEIGHTS_NAME]
    assert report["shards"][0] == {**report["shards"][0], "real_path": real, "outside_folder": True}


def test_sharded_links_leaving_the_folder_warn_once(tmp_path, sharded, capsys):
    folder, store = tmp_path / "ck", tmp_path / "store"
    shutil.copytree(sharded, folder)
    store.mkdir()
    shards = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
    assert len(shards) >= 2
    for name in shards[:2]:
        (folder / name).rename(store / name)
        (folder / name).symlink_to(store / name)
    ckpt = open_checkpoint(folder)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"h3gate: warning: {display(folder)}: 2 weight files resolve")
    assert ckpt.outside == shards[:2]
    assert [s["outside_folder"] for s in ckpt.shards()] == [n in shards[:2] for n in shards]


def test_checkpoint_folder_that_is_a_link_is_resolved(tmp_path, single, capsys):
    link = tmp_path / "alias"
    link.symlink_to(single)
    ckpt = open_checkpoint(link)
    assert ckpt.real_path == single.resolve() and ckpt.outside == []
    assert capsys.readouterr().err == ""


def test_symlink_loop_checkpoint_exits_2(run_cli, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    assert display(loop) == str(loop)  # the display no longer raises
    code, doc, err = _fingerprint(run_cli, tmp_path, loop)
    assert (code, doc, err) == (2, None, f"h3gate: error: {loop}: symbolic link loop\n")


@pytest.mark.parametrize(("target", "message"), [("self", "symbolic link loop"), ("gone", "dangling symbolic link")])
def test_weight_file_loop_or_dangling_exits_2(run_cli, tmp_path, single, target, message):
    folder = tmp_path / "ck"
    shutil.copytree(single, folder)
    (folder / WEIGHTS_NAME).unlink()
    (folder / WEIGHTS_NAME).symlink_to(folder / WEIGHTS_NAME if target == "self" else tmp_path / "gone")
    with pytest.raises(InputError, match=message):
        open_checkpoint(folder)
    code, doc, err = _fingerprint(run_cli, tmp_path, folder)
    assert (code, doc) == (2, None) and err == f"h3gate: error: {folder / WEIGHTS_NAME}: {message}" + (
        " (its target does not exist)\n" if target == "gone" else "\n"
    )


def test_run_ws1_block_on_a_loop_is_one_line(run_cli, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    code, _, err = run_cli("run", "ws1-block", "--device", "cpu", "--checkpoint", loop, "--out", tmp_path / "ev")
    assert code == 2 and err.count("\n") == 1 and "symbolic link loop" in err
    assert os.path.islink(loop)
