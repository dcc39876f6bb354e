"""Names a checkpoint holds stay inside it: plain file names, regular files, no links.

Each hostile checkpoint is refused by every reader: load, ``inspect --verify``, to-universal
and to-fp32, with one line naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from universal_helpers import save_synthetic

from zeroshard.checkpoint import load_sharded, open_checkpoint, verify_checkpoint
from zeroshard.io.members import member_path, name_problem
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.universal import load_universal, open_universal, to_universal
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

SPECS = [
    [ParamSpec.of("embed", (13, 7), "bf16"), ParamSpec.of("proj", (7, 5), "bf16")],
    [ParamSpec.of("norm", (5,), "bf16")],
]
LAYOUT = build_layout(SPECS, 2)
RANK1 = "rank-00001-of-00002.safetensors"
LINK_MESSAGE = "a symbolic link; files of a checkpoint must be regular files in its directory"


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_converters_refuse(checkpoint: Path, tmp_path: Path, message: str, *, universal: bool = False) -> None:
    commands = ["to-fp32"] if universal else ["to-universal", "to-fp32"]
    for command in commands:
        out = tmp_path / f"out-{command}"
        code, _, err = cli(command, checkpoint, out, "--no-progress")
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not out.exists()


@pytest.fixture
def native(tmp_path) -> Path:
    return save_synthetic(tmp_path / "ck", LAYOUT, block_size=64)


@pytest.fixture
def universal(native, tmp_path) -> Path:
    return to_universal(native, tmp_path / "u", max_shard_size=400, progress=False)


def rename_shard(universal: Path, new_name: str) -> None:
    """Rename the manifest's first shard to ``new_name`` (moving the file there), as a
    tampered manifest would: the bytes are intact, only the name leaves the directory."""
    path = universal / "universal.json"
    data = json.loads(path.read_text())
    old = sorted(data["shards"])[0]
    shutil.move(universal / old, universal / new_name)
    data["shards"] = {(new_name if name == old else name): record for name, record in data["shards"].items()}
    data["weight_map"] = {key: (new_name if shard == old else shard) for key, shard in data["weight_map"].items()}
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_universal_shard_named_outside_is_refused(universal, tmp_path, where):
    outside = tmp_path / "elsewhere.safetensors"
    name = "../elsewhere.safetensors" if where == "parent" else str(outside)
    rename_shard(universal, name)
    assert outside.is_file()
    problem = "a path leaving the checkpoint's directory" if where == "parent" else "an absolute path"
    for attempt in (lambda: open_universal(universal), lambda: load_universal(universal, build_layout(SPECS, 3), 1)):
        with pytest.raises(ValueError) as info:
            attempt()
        message = str(info.value)
        assert f"names file {name!r}" in message and problem in message and "\n" not in message, message
    assert_converters_refuse(universal, tmp_path, problem, universal=True)


def test_universal_shard_replaced_by_a_link_is_refused(universal, tmp_path):
    shard = sorted(universal.glob("universal-*.safetensors"))[-1]
    outside = tmp_path / "copy.safetensors"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(ValueError, match=f"{shard.name}: {LINK_MESSAGE}"):
        load_universal(universal, LAYOUT, 0)
    assert_converters_refuse(universal, tmp_path, f"{shard.name}: {LINK_MESSAGE}", universal=True)


def replace_with_link(path: Path, target: Path) -> None:
    shutil.copy(path, target)
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_native_rank_file_replaced_by_a_link_is_refused(native, tmp_path, target):
    """Policy: a link is refused wherever it points, even at a file inside the checkpoint."""
    copy = (tmp_path / "stolen.safetensors") if target == "outside" else (native / "spare.bin")
    replace_with_link(native / RANK1, copy)
    expected = f"{native / RANK1}: {LINK_MESSAGE}"
    for rank in range(2):  # every rank checks every file, so all fail the same way
        with pytest.raises(ValueError) as info:
            load_sharded(native.parent, LAYOUT, rank)
        assert str(info.value) == expected
    problems = verify_checkpoint(open_checkpoint_unchecked(native))
    assert problems == [expected]
    code, out, _ = cli("inspect", "--verify", native.parent)
    assert code == 1 and out.strip() == expected
    assert_converters_refuse(native.parent, tmp_path, expected)


def open_checkpoint_unchecked(directory: Path):
    from zeroshard.checkpoint.native.handle import Checkpoint
    from zeroshard.checkpoint.native.manifest import read_manifest

    return Checkpoint(directory, read_manifest(directory))


def test_model_file_and_manifest_links_are_refused(native, tmp_path):
    replace_with_link(native / "model.safetensors", tmp_path / "model.copy")
    with pytest.raises(ValueError, match=f"model.safetensors: {LINK_MESSAGE}"):
        open_checkpoint(native)
    replace_with_link(native / "manifest.json", tmp_path / "manifest.copy")
    with pytest.raises(ValueError, match=f"manifest.json: {LINK_MESSAGE}"):
        open_checkpoint(native)


def test_a_file_swapped_for_a_link_after_opening_is_refused_when_read(native, tmp_path):
    """The open-time check is not the only guard: every read opens with O_NOFOLLOW."""
    source = NativeSource(native)
    replace_with_link(native / RANK1, tmp_path / "stolen.safetensors")
    with pytest.raises(ValueError, match=f"{RANK1}: {LINK_MESSAGE}"):
        source.read(1, 0, "fp32", 0, 4)


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(native):
    (native / RANK1).unlink()
    os.mkfifo(native / RANK1)
    with pytest.raises(ValueError, match=f"{RANK1}: not a regular file"):
        open_checkpoint(native)
    assert verify_checkpoint(open_checkpoint_unchecked(native)) == [f"{native / RANK1}: not a regular file"]


def test_latest_naming_a_linked_tag_is_refused(native, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.move(native, moved)
    native.symlink_to(moved, target_is_directory=True)
    with pytest.raises(ValueError, match="names tag 't', a symbolic link"):
        load_sharded(native.parent, LAYOUT, 0)


@pytest.mark.parametrize(
    "name, problem",
    [
        ("../x.safetensors", "a path leaving the checkpoint's directory"),
        ("a/../../x", "a path leaving the checkpoint's directory"),
        ("/etc/passwd", "an absolute path"),
        ("sub/x.safetensors", "a path, not a plain file name"),
        ("sub\\x.safetensors", "a path, not a plain file name"),
        ("..", "a directory, not a file name"),
        (".", "a directory, not a file name"),
        ("", "not a file name"),
        ("x\0.safetensors", "holds a NUL character"),
    ],
)
def test_name_problems(tmp_path, name, problem):
    assert name_problem(name).startswith(problem)
    with pytest.raises(ValueError, match="refused"):
        member_path(tmp_path, name)


def test_plain_names_pass(tmp_path):
    (tmp_path / "..x.safetensors").write_bytes(b"")
    assert name_problem("..x.safetensors") is None
    assert member_path(tmp_path, "..x.safetensors") == tmp_path / "..x.safetensors"
