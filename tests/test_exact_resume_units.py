"""Exact resume (issue 31) in one process: random states as plain data, resume files in the
format (version 4, verified, damage falls back, old checkpoints load), the audit record
(missing, damaged, strict), load()'s value and the step convention."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from zeroshard.checkpoint import CheckpointDamagedError, CheckpointSaveError, Checkpointer, open_checkpoint
from zeroshard.checkpoint import verify_checkpoint
from zeroshard.checkpoint.audit import ResumeAuditError, ResumeAuditWarning, relative_bound
from zeroshard.checkpoint.engine_io import save_checkpoint
from zeroshard.checkpoint.exact_resume import ResumePoint
from zeroshard.checkpoint.format import AUDIT_FILE, MANIFEST_FILE, resume_file_name
from zeroshard.checkpoint.rng import capture_rng, derived_rng, restore_derived, restore_rng
from zeroshard.cli.inspect_report import describe_native
from zeroshard.engine import ZeroOptimizer


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_random_state_round_trips_and_a_bad_one_changes_nothing():
    saved = capture_rng()
    expected = _draws()
    restore_rng(saved, "here")
    assert _draws() == expected
    bad = {**saved, "numpy": {**saved["numpy"], "key": saved["numpy"]["key"][:10]}}
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"^here: NumPy's random state is uint32 \[10\], expected uint32 \[624\]$"):
        restore_rng(bad, "here")
    assert torch.equal(torch.get_rng_state(), before), "no stream set before every field was checked"


def test_derived_streams_are_reproducible_and_distinct_per_rank():
    saved = capture_rng()
    draws = {}
    for rank in (2, 3, 2):
        restore_derived(derived_rng(saved, rank, "here"))
        draws.setdefault(rank, []).append(_draws())
    assert draws[2][0] == draws[2][1] and draws[2][0] != draws[3][0]
    restore_rng(saved, "here")
    assert _draws() not in (draws[2][0], draws[3][0])


def test_the_bound_at_another_layout():
    u = 2.0**-24
    assert relative_bound(12, u) == pytest.approx(2 * 11 * u / (1 - 11 * u))
    assert relative_bound(None, u) is None and relative_bound(2**25, u) is None  # n u >= 1: says nothing


def test_resume_point_is_the_next_step_named_so():
    point = ResumePoint(10, 9, None)
    assert point == 10 and point.next_step == 10 and point.saved_step == 9 and list(range(point, 12)) == [10, 11]
    assert f"{point}" == "10" and repr(point) == "ResumePoint(next_step=10, saved_step=9, path=None)"


class Counter:
    """A training script's own state (a data position)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "seen": torch.arange(self.position)}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        assert torch.equal(state["seen"], torch.arange(self.position))


def _engine() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)


def _step(model, engine, ckpt=None) -> float:
    loss = model(torch.randn(5, 4)).square().mean()  # draws from torch's generator, as dropout does
    engine.backward(loss)
    if ckpt is not None:
        ckpt.report_loss(loss, terms=5)
    engine.step()
    engine.zero_grad()
    return loss.item()


def _saved_run(root, steps: int = 3, **options) -> tuple[list[float], Counter]:
    """A run that saves after each step; the losses of a step after the last save."""
    model, engine = _engine()
    counter = Counter()
    with Checkpointer(engine, root, async_save=False, state={"data": counter}, **options) as ckpt:
        ckpt.load()
        for step in range(steps):
            _step(model, engine, ckpt)
            counter.position += 1
            ckpt.save(step)
        after = [_step(model, engine, ckpt) for _ in range(2)]
    return after, counter


def test_a_resume_restores_random_state_and_states_and_the_audit_confirms(tmp_path, caplog):
    after, _ = _saved_run(tmp_path)
    manifest = open_checkpoint(tmp_path / "step-00000002").manifest
    assert manifest.format_version == 4 and manifest.resume.to_dict() == {"rng": True, "states": {"data": "rank"}}
    assert verify_checkpoint(open_checkpoint(tmp_path / "step-00000002")) == []
    report = "\n".join(describe_native(open_checkpoint(tmp_path / "step-00000002")))
    assert "resume: every rank's random state (torch CPU and CUDA, Python, NumPy); states: 'data' (per rank)" in report
    assert "audit: the first step after the save (world size 1): gradient norm" in report and "over 5 terms" in report

    model, engine = _engine()
    counter = Counter()
    caplog.set_level(logging.INFO, logger="zeroshard.checkpoint.checkpointer")
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": counter}) as ckpt:
        point = ckpt.load()
        assert (point.next_step, point.saved_step, counter.position) == (3, 2, 3)
        assert [_step(model, engine, ckpt) for _ in range(2)] == after
        assert ckpt.audit_verdict.causes == [] and ckpt.audit_verdict.exact
    assert "restored the random state and 'data': each rank its own, as saved" in caplog.text
    assert "matches the run that saved it bit for bit (lr, optimizer state, RNG and data position as saved" in (
        caplog.text
    )


def _flip_byte(path, offset: int = 40) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_resume_file_is_found_by_verify_and_the_fallback_takes_the_older_checkpoint(tmp_path):
    _saved_run(tmp_path)
    damaged = tmp_path / "step-00000002" / resume_file_name(0, 1)
    _flip_byte(damaged)
    problems = verify_checkpoint(open_checkpoint(tmp_path / "step-00000002"))
    size = damaged.stat().st_size
    assert problems == [f"{damaged}: checksum mismatch in block 0 (bytes 0-{size}): the file is corrupted"]
    model, engine = _engine()
    refused = pytest.raises(CheckpointDamagedError, match=f"^{damaged}: checksum mismatch in block 0")
    with Checkpointer(engine, tmp_path, async_save=False) as ckpt, refused:
        ckpt.load()
    with Checkpointer(engine, tmp_path, async_save=False, fallback=True) as ckpt:
        assert ckpt.load().saved_step == 1
    assert (tmp_path / "step-00000002.damaged").is_dir()


def test_a_resume_file_of_another_rank_is_damage(tmp_path):
    """Its bytes match a manifest rewritten for them, but it says it is rank 1 of 2."""
    _saved_run(tmp_path, steps=1)
    tag = tmp_path / "step-00000000"
    path = tag / resume_file_name(0, 1)
    document = json.loads(path.read_bytes())
    path.write_bytes(json.dumps({**document, "rank": 1, "world_size": 2}).encode())
    manifest = json.loads((tag / MANIFEST_FILE).read_text())
    from zeroshard.checkpoint.run_state import file_record

    manifest["files"][path.name] = file_record(path.read_bytes(), manifest["files"][path.name]["block_size"]).to_dict()
    (tag / MANIFEST_FILE).write_text(json.dumps(manifest))
    problems = verify_checkpoint(open_checkpoint(tag))
    assert problems == [f"{path}: holds rank 1 of 2, but the manifest puts rank 0 of 1 here"]


def test_a_version_3_manifest_may_not_list_resume_files(tmp_path):
    _saved_run(tmp_path, steps=1)
    manifest_path = tmp_path / "step-00000000" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "version": 3}))
    with pytest.raises(CheckpointDamagedError, match="version 3, but it lists resume files, which version 4 added"):
        open_checkpoint(tmp_path / "step-00000000")


def test_an_old_checkpoint_without_random_state_loads_and_says_so_once(tmp_path, caplog):
    model, engine = _engine()
    _step(model, engine)
    save_checkpoint(engine, tmp_path, tag="step-00000000")  # the lower-level save: no resume files
    assert open_checkpoint(tmp_path / "step-00000000").manifest.format_version == 2
    model, engine = _engine()
    caplog.set_level(logging.WARNING)
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": Counter()}) as ckpt:
        assert ckpt.load() == 1
    said = [r.getMessage() for r in caplog.records if "holds no random state or data position" in r.getMessage()]
    assert len(said) == 1


def test_a_missing_audit_record_is_said_in_the_resume_line_and_strict_refuses(tmp_path, caplog):
    _saved_run(tmp_path, steps=1)
    (tmp_path / "step-00000000" / AUDIT_FILE).unlink()
    model, engine = _engine()
    caplog.set_level(logging.INFO, logger="zeroshard.checkpoint.checkpointer")
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": Counter()}) as ckpt:
        ckpt.load()
    assert "the first step is not audited: " in caplog.text and "has no audit record" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    strict = Checkpointer(engine, tmp_path, async_save=False, state={"data": Counter()}, audit="strict")
    with strict, pytest.raises(ResumeAuditError, match="has no audit record .*audit='strict'"):
        strict.load()


def test_a_damaged_audit_record_is_a_warning_not_a_failed_resume(tmp_path, caplog):
    _saved_run(tmp_path, steps=1)
    record = tmp_path / "step-00000000" / AUDIT_FILE
    record.write_text(record.read_text().replace('"stepped": true', '"stepped": false'))
    model, engine = _engine()
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": Counter()}) as ckpt:
        assert ckpt.load() == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    damaged = "damaged (its checksum does not match: the file is corrupted); the first resumed step is not audited"
    assert warned == [f"resume audit: {record}: {damaged}"]


def test_states_are_checked_when_registered_and_their_scope_when_loaded(tmp_path):
    _, engine = _engine()
    with pytest.raises(ValueError, match=r"^state\['data'\]: a list has no state_dict\(\) and load_state_dict\(\)$"):
        Checkpointer(engine, tmp_path, state={"data": []})
    with pytest.raises(ValueError, match="state and global_state both name 'data'"):
        Checkpointer(engine, tmp_path, state={"data": Counter()}, global_state={"data": Counter()})
    _saved_run(tmp_path, steps=1)
    _, engine = _engine()
    refused = pytest.raises(ValueError, match="saved state 'data' per rank \\(state=\\), this run registers it global")
    with Checkpointer(engine, tmp_path, global_state={"data": Counter()}) as ckpt, refused:
        ckpt.load()


def test_a_state_that_needs_pickle_fails_the_save_naming_it(tmp_path):
    class Opaque(Counter):
        def state_dict(self) -> dict:
            return {"generator": torch.Generator()}

    model, engine = _engine()
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": Opaque()}) as ckpt:
        _step(model, engine)
        named = r"state\['data'\]\.state_dict\(\)\['generator'\]: cannot store a Generator"
        with pytest.raises(CheckpointSaveError, match=named):
            ckpt.save(0)


def test_a_save_of_step_plus_one_is_told_once(tmp_path, caplog):
    """Before: load() returned the step after the one passed to save(), and a loop that saved
    step + 1 resumed one step late without a word."""
    model, engine = _engine()
    with Checkpointer(engine, tmp_path, async_save=False) as ckpt:
        start = ckpt.load()
        for step in range(start, 4):
            _step(model, engine)
            ckpt.save(step + 1)  # the number of steps done: one more than the step just completed
    warned = [r.getMessage() for r in caplog.records if "Checkpointer.save" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "Checkpointer.save(1): the engine stepped 1 time(s) since load() returned step 0 (nothing to resume), so the "
        "step just completed is 0:"
    )


def test_a_state_that_fails_at_the_audited_step_leaves_it_unaudited_and_training_goes_on(tmp_path, caplog):
    """Whatever fails in one rank's part of the audit still reaches the all-reduce (no rank is
    left waiting): the step is not recorded, or not judged, and a warning says so."""

    class Flaky(Counter):
        failing = False

        def state_dict(self) -> dict:
            if self.failing:
                raise OSError("the shard index is gone")
            return super().state_dict()

    model, engine = _engine()
    flaky = Flaky()
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": flaky}) as ckpt:
        ckpt.load()
        for step in range(2):
            _step(model, engine)
            ckpt.save(step)
            flaky.failing = step == 1
            _step(model, engine, ckpt)  # records step 0's first step; fails to record step 1's
    assert (tmp_path / "step-00000000" / AUDIT_FILE).exists()
    assert not (tmp_path / "step-00000001" / AUDIT_FILE).exists(), "no record of a step not measured"
    assert "resume audit: this rank cannot audit the step: OSError: the shard index is gone" in caplog.text

    (tmp_path / "latest").write_text("step-00000000\n")
    (tmp_path / "step-00000001").rename(tmp_path / "elsewhere")
    model, engine = _engine()
    flaky = Flaky()
    with Checkpointer(engine, tmp_path, async_save=False, state={"data": flaky}) as ckpt:
        ckpt.load()
        flaky.failing = True
        with pytest.warns(ResumeAuditWarning, match="is not audited: 1 rank\\(s\\) could not take their fingerprints"):
            _step(model, engine, ckpt)
        assert ckpt.audit_verdict.failed and ckpt.audit_verdict.causes == []
