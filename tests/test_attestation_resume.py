"""Retention and resume trust only what verifies: keep_last counts only checkpoints that open,
never deletes the newest that does for a damaged one (nor a damaged one among the kept), and Checkpointer.load(fallback=True)
resumes from the newest older checkpoint that loads and attests, saying so."""

from __future__ import annotations

import logging
import shutil

import checkpoint_workers
import pytest
import torch
from universal_helpers import save_synthetic

from zeroshard.checkpoint import Checkpointer, list_tags, open_checkpoint, verify_checkpoint
from zeroshard.checkpoint.format import MANIFEST_FILE
from zeroshard.io.damage import CheckpointDamagedError
from zeroshard.checkpoint.retention import apply_retention, step_tag, tags_to_delete
from zeroshard.layout import ParamSpec, build_layout


def _steps(*steps: int) -> dict[str, int]:
    return {step_tag(s): s for s in steps}


def test_damaged_checkpoints_are_neither_counted_nor_deleted():
    steps = _steps(0, 10, 20, 30, 40)
    damaged = {step_tag(30)}

    def verifies(tag):
        return tag not in damaged

    # 40 and 20 are the two newest that verify; 30 is kept for inspection, 0 and 10 go
    assert tags_to_delete(steps, step_tag(40), 2, None, verifies=verifies) == [step_tag(0), step_tag(10)]
    # the committed one itself does not verify: the newest older one that does stays
    damaged.add(step_tag(40))
    assert tags_to_delete(steps, step_tag(40), 1, None, verifies=verifies) == [step_tag(0), step_tag(10)]
    asked = []
    tags_to_delete(_steps(*range(0, 100, 10)), step_tag(90), 2, None, verifies=lambda tag: asked.append(tag) or True)
    assert asked == [step_tag(90), step_tag(80)]  # only until the kept ones are found


def test_retention_on_disk_keeps_a_damaged_tag_and_the_newest_that_opens(tmp_path, caplog):
    layout = build_layout([[ParamSpec.of("w", (6, 5), "float32")]], 1)
    for step in (10, 20, 30):
        save_synthetic(tmp_path, layout, tag=step_tag(step))
    (tmp_path / step_tag(20) / "rank-00000-of-00001.safetensors").unlink()  # damaged
    with caplog.at_level(logging.WARNING):
        assert apply_retention(tmp_path, step_tag(30), keep_last=2, keep_every=None) == []
    assert list_tags(tmp_path) == [step_tag(10), step_tag(20), step_tag(30)]
    assert "step-00000020 does not verify, so it is not counted (nor deleted)" in caplog.text
    # past the kept ones a damaged tag goes with the rest
    assert apply_retention(tmp_path, step_tag(30), keep_last=1, keep_every=None) == [step_tag(10), step_tag(20)]


def _corrupt(tag_dir):
    """Flip a byte in the middle of the rank file: a checksum block no longer matches."""
    path = next(tag_dir.glob("rank-*.safetensors"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def two_saves(tmp_path):
    """A single-process run saved after steps 1 and 2 (sync), its masters at step 1."""
    model, engine = checkpoint_workers.build(seed=0, stage=2)
    with Checkpointer(engine, tmp_path, keep_last=None, async_save=False) as ckpt:
        checkpoint_workers.train(model, engine, 0, 2)
        ckpt.save(1)
        at_first = checkpoint_workers.full_state(engine)
        checkpoint_workers.train(model, engine, 2, 1)
        ckpt.save(2)
    return tmp_path, at_first


def test_a_resume_falls_back_to_the_newest_older_checkpoint_that_verifies(two_saves, caplog):
    root, at_first = two_saves
    _corrupt(root / step_tag(2))
    model, engine = checkpoint_workers.build(seed=9, stage=2)
    with Checkpointer(engine, root, async_save=False) as ckpt:
        with pytest.raises(CheckpointDamagedError, match="checksum mismatch"):
            ckpt.load()  # the default: a damaged latest is an error
    with Checkpointer(engine, root, async_save=False, fallback=True) as ckpt, caplog.at_level(logging.WARNING):
        assert ckpt.load() == 2  # resumes after step 1
        assert ckpt.resumed_from == ckpt.root / step_tag(1) and ckpt.attestation.ok
    assert f"{root / step_tag(2)} does not verify, resuming from the older {step_tag(1)}: " in caplog.text
    loaded = checkpoint_workers.full_state(engine)
    assert all(torch.equal(loaded[k], v) for k, v in at_first.items())


def test_a_fallback_with_nothing_older_that_verifies_raises_the_damage(two_saves):
    root, _ = two_saves
    shutil.rmtree(root / step_tag(1))
    _corrupt(root / step_tag(2))
    _, engine = checkpoint_workers.build(seed=9, stage=2)
    with Checkpointer(engine, root, async_save=False, fallback=True) as ckpt:
        with pytest.raises(CheckpointDamagedError, match=f"{step_tag(2)}.*checksum mismatch"):
            ckpt.load()


def test_retention_never_counts_the_checkpoint_the_fallback_found_damaged(two_saves, caplog):
    """Before (issue 28, M5): retention counted the damaged step 2 (its files have their sizes)
    and deleted step 1, the one the run had just resumed from: keep_last=2 left one checkpoint
    that loads. The fallback now sets step 2 aside, out of the step-* tags retention manages."""
    root, _ = two_saves
    _corrupt(root / step_tag(2))
    model, engine = checkpoint_workers.build(seed=9, stage=2)
    with Checkpointer(engine, root, keep_last=2, async_save=False, fallback=True) as ckpt:
        assert ckpt.load() == 2
        checkpoint_workers.train(model, engine, 2, 2)
        assert ckpt.save(3).deleted == ()
    assert list_tags(root) == [step_tag(1), f"{step_tag(2)}.damaged", step_tag(3)]
    for tag in (step_tag(1), step_tag(3)):
        assert verify_checkpoint(open_checkpoint(root / tag)) == [], tag


def test_after_a_fallback_the_resumed_run_saves_the_damaged_step_again(two_saves):
    """A save never replaces a checkpoint; the damaged one the fallback passed over is set
    aside, so the resumed run's save of its step goes through, and it is kept."""
    root, _ = two_saves
    _corrupt(root / step_tag(2))
    damaged = (root / step_tag(2) / MANIFEST_FILE).read_bytes()
    model, engine = checkpoint_workers.build(seed=9, stage=2)
    with Checkpointer(engine, root, async_save=False, fallback=True) as ckpt:
        assert ckpt.load() == 2
        checkpoint_workers.train(model, engine, 2, 1)
        ckpt.save(2)
    assert verify_checkpoint(open_checkpoint(root)) == [] and open_checkpoint(root).directory == root / step_tag(2)
    assert (root / f"{step_tag(2)}.damaged" / MANIFEST_FILE).read_bytes() == damaged
