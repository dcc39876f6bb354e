"""Every way the newest checkpoint of a Checkpointer root can be damaged: without ``fallback``
the resume refuses in one line naming what is wrong (a CheckpointDamagedError); with it, it
resumes from the older checkpoint and says which and why, and sets the damaged one aside so
that the resumed run's save of that step does not meet it.

Before (issue 28, N5 / M3): 9 kinds of damage stopped the fallback with a plain ValueError
(the tag's directory gone, its manifest missing, a link or otherwise unreadable, a layout
number edited, a flipped bit misreported as "an integer of more than 4,300 digits"), and a
tag that is a symbolic link was followed (M4).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import checkpoint_workers
import pytest

from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.engine_io import load_checkpoint
from zeroshard.checkpoint.format import MANIFEST_FILE, MODEL_FILE
from zeroshard.io.damage import CheckpointDamagedError
from zeroshard.checkpoint.retention import step_tag

OLDER, NEWEST = step_tag(1), step_tag(2)
RANK_FILE = "rank-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A world-size-1 root saved after steps 1 and 2 (sync); copied for each case."""
    root = tmp_path_factory.mktemp("damage") / "template"
    model, engine = checkpoint_workers.build(seed=0, stage=2)
    with Checkpointer(engine, root, keep_last=None, async_save=False) as ckpt:
        checkpoint_workers.train(model, engine, 0, 2)
        ckpt.save(1)
        checkpoint_workers.train(model, engine, 2, 1)
        ckpt.save(2)
    return root


@pytest.fixture(scope="module")
def engine():
    """One engine for every load: a load replaces all of its state, a refused one none."""
    return checkpoint_workers.build(seed=9, stage=2)[1]


@pytest.fixture
def root(saved, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


# ---- the damage: each takes the newest tag's directory and returns the path the error must name ----


def flip(name: str, where: Callable[[bytes], int], bit: int = 0x80) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        path = tag / name
        data = bytearray(path.read_bytes())
        data[where(bytes(data))] ^= bit
        path.write_bytes(bytes(data))
        return path

    return damage


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def cut(name: str, keep: Callable[[int], int], then: bytes = b"") -> Callable[[Path], Path]:
    """``name`` cut to its first ``keep(size)`` bytes, ``then`` written after them."""

    def damage(tag: Path) -> Path:
        path = tag / name
        data = path.read_bytes()
        path.write_bytes(data[: keep(len(data))] + then)
        return path

    return damage


def extend(name: str) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        with open(tag / name, "ab") as handle:
            handle.write(b"\0" * 64)
        return tag / name

    return damage


def edit(change: Callable[[dict], None], shows_in: str = MANIFEST_FILE) -> Callable[[Path], Path]:
    """The manifest edited; the damage shows in the file ``shows_in`` ("": the checkpoint)."""

    def damage(tag: Path) -> Path:
        path = tag / MANIFEST_FILE
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data, indent=1))
        return tag / shows_in if shows_in else tag

    return damage


def removed(name: str) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        (tag / name).unlink()
        return tag / name if name != MANIFEST_FILE else tag

    return damage


def linked(name: str) -> Callable[[Path], Path]:
    """``name`` moved out of the tag and a symbolic link to it left in its place."""

    def damage(tag: Path) -> Path:
        elsewhere = tag.parent.parent / f"moved-{name}"
        os.replace(tag / name, elsewhere)
        os.symlink(elsewhere, tag / name)
        return tag / name

    return damage


def replaced(name: str, make: Callable[[Path], None]) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        (tag / name).unlink()
        make(tag / name)
        return tag if name == MANIFEST_FILE else tag / name

    return damage


def tag_gone(tag: Path) -> Path:
    shutil.rmtree(tag)
    return tag


def tag_linked(tag: Path) -> Path:
    """The tag moved out of the root (another run's checkpoint, say) and linked back."""
    elsewhere = tag.parent.parent / "another-run" / tag.name
    elsewhere.parent.mkdir()
    os.replace(tag, elsewhere)
    os.symlink(elsewhere, tag)
    return tag


def tag_is(make: Callable[[Path], None]) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        shutil.rmtree(tag)
        make(tag)
        return tag

    return damage


def from_older(name: str) -> Callable[[Path], Path]:
    def damage(tag: Path) -> Path:
        shutil.copyfile(tag.parent / OLDER / name, tag / name)
        return tag / name

    return damage


def _crc(data: dict) -> None:
    data["files"][RANK_FILE]["crc32"][0] ^= 1


def _digest(data: dict) -> None:
    data["digests"]["params"]["wte.weight"]["fp32"] ^= 1


DAMAGE: dict[str, Callable[[Path], Path]] = {
    "tag deleted": tag_gone,
    "tag a symbolic link": tag_linked,
    "tag a file": tag_is(lambda path: path.write_text("x")),
    "tag empty": tag_is(lambda path: path.mkdir()),
    "manifest missing": removed(MANIFEST_FILE),
    "manifest a symbolic link": linked(MANIFEST_FILE),
    "manifest a directory": replaced(MANIFEST_FILE, lambda path: path.mkdir()),
    "manifest a FIFO": replaced(MANIFEST_FILE, lambda path: os.mkfifo(path)),
    "manifest empty": cut(MANIFEST_FILE, lambda size: 0),
    "manifest truncated": cut(MANIFEST_FILE, lambda size: size // 2),
    "manifest bit flipped (0x20 to 0xa0)": flip(MANIFEST_FILE, lambda data: data.index(b" ")),
    "manifest an empty object": edit(lambda data: data.clear()),
    "manifest not an object": cut(MANIFEST_FILE, lambda size: 0, b"[1, 2]"),
    "manifest format name": edit(lambda data: data.update(format="zeroshard.checkpoinT")),
    "manifest version not a number": edit(lambda data: data.update(version="2")),
    "manifest field missing": edit(lambda data: data.pop("groups")),
    "manifest layout not an object": edit(lambda data: data.update(layout=[])),
    "manifest layout number": edit(lambda data: data["layout"]["groups"][0].update(partition_numel=8584)),
    "manifest world size": edit(lambda data: data.update(world_size=2)),
    "manifest state dtype": edit(lambda data: data["groups"][0]["states"].update(exp_avg="float16"), RANK_FILE),
    "manifest file size": edit(lambda data: data["files"][RANK_FILE].update(size=1)),
    "manifest block checksum": edit(_crc, RANK_FILE),
    "manifest digest": edit(_digest, ""),
    "rank file missing": removed(RANK_FILE),
    "rank file a symbolic link": linked(RANK_FILE),
    "rank file truncated": cut(RANK_FILE, lambda size: size - 100),
    "rank file extended": extend(RANK_FILE),
    "rank file bit flipped in its data": flip(RANK_FILE, lambda data: len(data) // 2),
    "rank file bit flipped in its header": flip(RANK_FILE, lambda data: data.index(b'"dtype"') + 2, 0x20),
    "rank file header length": flip(RANK_FILE, lambda data: 2, 0x01),
    "rank file from the older checkpoint": from_older(RANK_FILE),
    "model file missing": removed(MODEL_FILE),
    "model file truncated": cut(MODEL_FILE, lambda size: size - 64),
    "model file bit flipped in its data": flip(MODEL_FILE, lambda data: header_end(data) + 40),
    "model file bit flipped in its header": flip(MODEL_FILE, lambda data: data.index(b'"shape"') + 3, 0x20),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_is_damage_in_one_line_naming_the_file(root, engine, kind):
    """load_checkpoint through ``latest``: damage of every kind is a CheckpointDamagedError,
    which the Checkpointer's fallback takes (a plain ValueError says the run differs)."""
    named = DAMAGE[kind](root / NEWEST)
    with pytest.raises(CheckpointDamagedError) as refused:
        load_checkpoint(engine, root)
    message = str(refused.value)
    if named == root / NEWEST and kind == "manifest digest":  # the attestation names the path given
        named = root
    assert "\n" not in message and str(named) in message, message


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_the_checkpointer_refuses_damage_or_falls_back_to_the_older_checkpoint(root, engine, kind, caplog):
    named = DAMAGE[kind](root / NEWEST)
    with Checkpointer(engine, root, async_save=False) as ckpt:
        with pytest.raises(CheckpointDamagedError) as refused:
            ckpt.load()
        assert ckpt.resumed_from is None
    message = str(refused.value)
    assert "\n" not in message and str(named) in message, message
    if kind.startswith("tag"):
        assert f"{root / 'latest'} names it" in message, "says where the tag comes from"

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeroshard.checkpoint"):
        with Checkpointer(engine, root, async_save=False, fallback=True) as ckpt:
            assert ckpt.load() == 2, "resumed after step 1"
            assert ckpt.resumed_from == root / OLDER and ckpt.attestation.ok
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(named) in line and f"resuming from the older {OLDER}" in line for line in warnings), warnings
    assert not os.path.lexists(root / NEWEST), "set aside: the resumed run saves this step again"
    if kind != "tag deleted":
        assert os.path.lexists(root / f"{NEWEST}.damaged"), "kept for inspection"
        assert any(f"set aside the damaged {NEWEST} as {NEWEST}.damaged, for" in line for line in warnings), warnings
