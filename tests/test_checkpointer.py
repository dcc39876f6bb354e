"""The Checkpointer: async saves equal sync ones byte for byte, errors surface on every rank,
crashes during an async save keep the previous checkpoint, retention, resume at another D."""

from __future__ import annotations

import threading
from pathlib import Path

import checkpoint_workers
import checkpointer_workers as workers
import pytest
import torch

from zeroshard.checkpoint import CheckpointSaveError, Checkpointer, list_tags, open_checkpoint, verify_checkpoint
from zeroshard.checkpoint.directory import read_latest
from zeroshard.checkpoint.format import AUDIT_FILE
from zeroshard.checkpoint.retention import step_tag, tag_step, tags_to_delete
from zeroshard.checkpoint.snapshot import HostSnapshot
from zeroshard.launch import spawn

# ---- retention (pure) -----------------------------------------------------------------------


def _steps(*steps: int) -> dict[str, int]:
    return {step_tag(s): s for s in steps}


def test_retention_keeps_the_last_k_up_to_the_committed_one():
    steps = _steps(0, 10, 20, 30, 40)
    assert tags_to_delete(steps, step_tag(30), keep_last=2, keep_every=None) == [step_tag(0), step_tag(10)]
    assert tags_to_delete(steps, step_tag(40), keep_last=1, keep_every=None) == [step_tag(s) for s in (0, 10, 20, 30)]
    # 40 is newer than the committed 30 (a run restarted from an older checkpoint): never touched
    assert step_tag(40) not in tags_to_delete(steps, step_tag(30), keep_last=1, keep_every=None)
    assert tags_to_delete(steps, step_tag(40), keep_last=None, keep_every=None) == []
    assert tags_to_delete(steps, step_tag(40), keep_last=10, keep_every=None) == []


def test_retention_keeps_protected_and_every_nth():
    steps = _steps(0, 10, 20, 30, 40, 50)
    assert tags_to_delete(steps, step_tag(50), keep_last=2, keep_every=20) == [step_tag(10), step_tag(30)]
    assert tags_to_delete(steps, step_tag(50), keep_last=1, keep_every=None, protected={step_tag(10)}) == [
        step_tag(s) for s in (0, 20, 30, 40)
    ]


def test_step_tags_round_trip_and_other_tags_are_not_managed():
    assert step_tag(100) == "step-00000100" and tag_step("step-00000100") == 100
    assert tag_step(step_tag(123456789012)) == 123456789012
    assert tag_step("best") is None and tag_step("step-100") is None and tag_step("step-000000100") is None
    with pytest.raises(ValueError, match="non-negative integer"):
        step_tag(-1)


# ---- host snapshot ----------------------------------------------------------------------------


def test_host_snapshot_reuses_its_buffers_keeps_ties_and_is_a_copy():
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import ParamSpec, build_layout

    layout = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2)
    live = synthesize_state(layout, 1, step=3)
    shared = torch.arange(6.0)
    live.model_state = {"embed": shared, "head": shared, "bias": torch.ones(2)}
    snapshot = HostSnapshot()
    first = snapshot.take(live, with_model=True)
    pointers = [t.data_ptr() for t in first.fp32_partitions]
    assert first.model_state["embed"] is first.model_state["head"]
    assert torch.equal(first.fp32_partitions[0], live.fp32_partitions[0])
    live.fp32_partitions[0].add_(1)
    shared.add_(1)
    assert not torch.equal(first.fp32_partitions[0], live.fp32_partitions[0])
    assert first.model_state["embed"][0].item() == 0.0
    second = snapshot.take(live, with_model=False)
    assert [t.data_ptr() for t in second.fp32_partitions] == pointers  # reused, not reallocated
    assert torch.equal(second.fp32_partitions[0], live.fp32_partitions[0]) and second.model_state == {}
    live.optimizer_states[0]["momentum"] = torch.zeros_like(live.fp32_partitions[0])  # the signature changes
    third = snapshot.take(live, with_model=False)
    assert "momentum" in third.optimizer_states[0]
    assert snapshot.nbytes == sum(t.numel() * t.element_size() for t in snapshot._buffers.values())


# ---- one process --------------------------------------------------------------------------------


def _engine():
    return checkpoint_workers.build(seed=0, stage=2)


def test_single_process_save_load_and_errors(tmp_path):
    model, engine = _engine()
    with Checkpointer(engine, tmp_path, keep_last=2) as ckpt:
        assert ckpt.load() == 0 and not tmp_path.joinpath("latest").exists()
        for step in range(3):
            checkpoint_workers.train(model, engine, step, 1)
            stats = ckpt.save(step, extra={"step": step})
            assert stats.stall_s >= stats.snapshot_s > 0
        done = ckpt.wait()
        assert done.path == tmp_path / "step-00000002" and done.write_s > 0
        assert list_tags(tmp_path) == ["step-00000001", "step-00000002"]
        ckpt.save(3, extra={"bad": object()})  # not JSON-able: fails in the background
        with pytest.raises(CheckpointSaveError, match="step-00000003 not saved.*extra"):
            ckpt.wait()
        assert read_latest(tmp_path) == "step-00000002" and ckpt.wait() is None  # raised once
    assert not [t for t in threading.enumerate() if t.name == workers.WRITER_THREAD]
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(4)
    ckpt.close()  # idempotent

    model, engine = _engine()
    with Checkpointer(engine, tmp_path, async_save=False) as ckpt:
        assert ckpt.load() == 3 and ckpt.extra == {"step": 2}
        with pytest.raises(CheckpointSaveError, match="extra"):
            ckpt.save(5, extra={"x": object()})
    assert read_latest(tmp_path) == "step-00000002"


def test_a_failed_retention_is_logged_and_the_next_save_goes_on(tmp_path, monkeypatch, caplog):
    """Retention runs on rank 0 only, after the commit: its failure must not become an error
    that rank 0 alone raises at the next save (the others would wait for it)."""
    from zeroshard.checkpoint import checkpointer as checkpointer_module

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "step-00000000"))

    monkeypatch.setattr(checkpointer_module, "apply_retention", refuse)
    model, engine = _engine()
    with Checkpointer(engine, tmp_path, keep_last=1) as ckpt:
        for step in range(2):
            checkpoint_workers.train(model, engine, step, 1)
            ckpt.save(step)
        assert ckpt.wait().deleted == ()
    assert list_tags(tmp_path) == ["step-00000000", "step-00000001"] and read_latest(tmp_path) == "step-00000001"
    assert "retention after step-00000001 failed, old tags kept" in caplog.text


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_never_replaces_a_checkpoint(tmp_path, async_save):
    """Before (issue 28, N1): a save whose tag existed replaced it (a run restarted from
    scratch beside a root's tags saved over them)."""
    model, engine = _engine()
    tag = tmp_path / step_tag(1)
    with Checkpointer(engine, tmp_path, async_save=async_save) as ckpt:
        checkpoint_workers.train(model, engine, 0, 1)
        ckpt.save(1)
        ckpt.wait()
        saved = _files(tag)
        checkpoint_workers.train(model, engine, 1, 1)  # the step after the save writes its audit record
        with pytest.raises(CheckpointSaveError) as refused:
            ckpt.save(1)
            ckpt.wait()
    assert str(refused.value) == (
        f"checkpoint {tag} not saved: {tag}: exists, and this save never replaces a checkpoint: "
        f"move it out of {tmp_path} to save {step_tag(1)!r} again"
    )
    assert set(_files(tag)) == {*saved, AUDIT_FILE}
    assert _committed(tag) == saved
    assert read_latest(tmp_path) == step_tag(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_tag(1)], "nothing written"


def test_bad_arguments():
    _, engine = _engine()
    for kwargs in ({"keep_last": 0}, {"keep_every": -1}, {"keep_last": 1.5}):
        with pytest.raises(ValueError, match="positive integer"):
            Checkpointer(engine, "unused", **kwargs)


# ---- two ranks --------------------------------------------------------------------------------


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _committed(directory: Path) -> dict[str, bytes]:
    """The files a save commits (the audit record comes later, from the step after it)."""
    return {name: data for name, data in _files(directory).items() if name != AUDIT_FILE}


def test_async_equals_sync_errors_reach_every_rank_retention_and_resume_at_another_d(tmp_path):
    results = spawn(workers.async_sync_errors_retention, 2, (str(tmp_path),), timeout_s=300)
    first = results[0]
    assert first["fresh_start"] == 0 and first["writer_alive_while_saving"]
    # keep_last=2 and keep_every=4 after saving steps 0..5
    assert first["async_tags"] == [step_tag(s) for s in (0, 4, 5)]
    assert first["sync_tags"] == [step_tag(s) for s in range(6)]
    for tag in first["async_tags"]:
        assert _committed(tmp_path / "async" / tag) == _committed(tmp_path / "sync" / tag), tag
    for rank, result in enumerate(results):
        for key, step in (("wait_error", 6), ("save_error", 7), ("close_error", 9)):
            message = result[key]
            assert message is not None, (rank, key)
            assert f"step-0000000{step} not saved" in message and "rank 1" in message, (rank, key, message)
            assert "No space left on device" in message
        assert "rank 1: taking the state failed: MemoryError: no host memory" in result["snapshot_error"]
        assert result["latest_after_error"] == step_tag(5)
        assert result["latest_after_recovery"] == step_tag(8) and result["hidden_after_recovery"] == []
        tag = tmp_path / "async" / step_tag(8)
        assert result["save_over_error"] == (
            f"checkpoint {tag} not saved: {tag}: exists, and this save never replaces a checkpoint: "
            f"move it out of {tag.parent} to save {step_tag(8)!r} again"
        ), rank
        assert result["final_tags"] == [step_tag(s) for s in (0, 4, 5, 8)]  # 6, 7, 9 never appeared
        assert result["threads_after_close"] == [] and result["groups_leaked"] == 0
        assert "closed" in result["save_after_close"]

    (tmp_path / "async" / "latest").unlink()  # the three ranks agree to resume the newest tag
    resumed = spawn(workers.resume_elsewhere, 3, (str(tmp_path),), timeout_s=300)
    for result in resumed:
        assert result["start"] == 9 and result["extra"] == {"note": 8}
        assert result["scheduler_epoch"] == 6  # six sched.step() calls before the save of step 8
        assert result["same_keys"] and result["max_abs_diff"] == 0.0
    assert resumed[0]["tags"] == [step_tag(s) for s in (5, 8, 9)]  # keep_last=3, no keep_every


CRASH_POINTS = [("before_rank_file", 1), ("before_manifest", 0), ("before_rename", 0), ("before_latest", 0)]


@pytest.mark.parametrize("point, victim", CRASH_POINTS, ids=[p for p, _ in CRASH_POINTS])
def test_a_crash_during_an_async_save_keeps_the_previous_checkpoint(tmp_path, point, victim):
    with pytest.raises(RuntimeError, match="exited without a result|failed"):
        spawn(workers.crash_during_async_save, 2, (str(tmp_path), point, victim), timeout_s=300)
    assert read_latest(tmp_path) == step_tag(1)
    assert open_checkpoint(tmp_path).manifest.extra["step"] == 1
    assert verify_checkpoint(open_checkpoint(tmp_path)) == []
    expected = [step_tag(1), step_tag(2)] if point == "before_latest" else [step_tag(1)]
    assert list_tags(tmp_path) == expected  # published complete, but latest not moved yet
    # A rank 0 that died mid-save leaves its lock file behind; the kernel dropped the flock
    # with the process, so the next save takes it (checked below) and removes the file.
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    assert len(hidden) == (0 if point == "before_latest" else 1)

    model, engine = _engine()  # resume at D=1
    if point == "before_latest":  # resuming step 1 would save step 2 over the complete one
        with Checkpointer(engine, tmp_path, keep_last=1) as ckpt:
            newer = rf"latest names {step_tag(1)}, but newer checkpoints are there \({step_tag(2)}\)"
            with pytest.raises(ValueError, match=newer):
                ckpt.load()
        (tmp_path / "latest").write_text(step_tag(2) + "\n")  # what the refusal says to do
    with Checkpointer(engine, tmp_path, keep_last=1) as ckpt:
        start = ckpt.load()
        assert start == (3 if point == "before_latest" else 2)
        ckpt.save(start)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert list_tags(tmp_path) == [step_tag(start)] and read_latest(tmp_path) == step_tag(start)
