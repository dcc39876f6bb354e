"""Engine checkpoints: save, resume (same and other world sizes and policies), stale-buffer
regression, failed loads and crashes during save. Multi-process tests use gloo ranks."""

from __future__ import annotations

import checkpoint_workers as workers
import pytest
import torch

from zeroshard.checkpoint import resolve_checkpoint
from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.launch import spawn
from zeroshard.layout import LayoutPolicy

SAVE_POLICY = workers.SAVE_POLICY
# Tolerances after a resharded resume: the same global batches, but summed in another order
# across ranks (and bf16 forward passes on other batch slices). Adam turns tiny gradient
# differences into up to 2 x lr per element per step where m/sqrt(v) is near +-1, so the
# master check is relative to the update: |resumed - uninterrupted| / |uninterrupted move|.
# The most an element can differ is 2 x lr per step (lr 3e-3, 3 steps; measured 2.6e-3), and
# a step's losses are those of bf16 weights at most one rounding apart: 2^-8 relative. The
# update bound is the one figure not derived: most elements agree to fp32 rounding, the few
# near-zero gradients do not (measured: 0.5% of the movement).
RELATIVE_UPDATE_TOLERANCE = 0.03
MAX_ELEMENT_TOLERANCE = 2 * 3e-3 * 3
LOSS_RELATIVE_TOLERANCE = 2.0**-8


@pytest.fixture(scope="module")
def saved_and_failed_load_at_two(tmp_path_factory):
    """One spawn at D=2: the saved run, then a load of a corrupted copy of its checkpoint."""
    out, copy = tmp_path_factory.mktemp("saved_d2"), tmp_path_factory.mktemp("failed_load_d2")
    args = (str(out), str(copy), 2, SAVE_POLICY)
    return out, spawn(workers.save_run_then_failed_load, 2, args, timeout_s=240)


@pytest.fixture(scope="module")
def saved_at_two(saved_and_failed_load_at_two):
    out, results = saved_and_failed_load_at_two
    return out, results[0]["save"]


def test_save_load_continue_is_bit_exact_at_the_same_world_size(saved_at_two):
    _, result = saved_at_two
    assert result["load_exact"]
    assert result["resumed"] == result["uninterrupted"]
    assert result["end_exact"]


@pytest.mark.parametrize(
    "world, stage, policy",
    [
        (3, 1, LayoutPolicy.native(compact=True)),  # 2 -> 3, aligned+buckets -> compact, stage 2 -> 1
        (4, 2, LayoutPolicy.native(alignment_bytes=64, bucket_numel=700)),  # 2 -> 4, other buckets
    ],
    ids=["2to3-compact-stage1", "2to4-align64-buckets"],
)
def test_resharded_resume_loads_exactly_and_continues(saved_at_two, world, stage, policy):
    out, saved = saved_at_two
    result = spawn(workers.resume_run, world, (str(out), stage, policy), timeout_s=240)[0]
    assert result["load_exact"], "fp32 masters and Adam states must equal the saved ones bit for bit"
    assert result["steps"] == 6
    for resumed, uninterrupted in zip(result["losses"], saved["uninterrupted"]):
        assert resumed == pytest.approx(uninterrupted, rel=LOSS_RELATIVE_TOLERANCE)
    assert result["relative_update_diff"] < RELATIVE_UPDATE_TOLERANCE, result
    assert result["max_master_diff"] < MAX_ELEMENT_TOLERANCE


def test_resharded_resume_at_world_size_one_in_process(saved_at_two):
    out, saved = saved_at_two
    result = workers.resume_run(0, 1, str(out), 2, LayoutPolicy.native())
    assert result["load_exact"]
    for resumed, uninterrupted in zip(result["losses"], saved["uninterrupted"]):
        assert resumed == pytest.approx(uninterrupted, rel=LOSS_RELATIVE_TOLERANCE)
    assert result["relative_update_diff"] < RELATIVE_UPDATE_TOLERANCE, result


def test_failed_load_on_one_rank_fails_everywhere_and_changes_nothing(saved_and_failed_load_at_two):
    _, results = saved_and_failed_load_at_two
    for result in (per_rank["failed_load"] for per_rank in results):
        assert result["unchanged"]
        assert result["message"] is not None
        assert "rank 1:" in result["message"] and "checksum mismatch" in result["message"], result["message"]
        assert "rank-00001-of-00002.safetensors" in result["message"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["module_only", "without_optimizer_states"])
def test_first_step_after_a_weights_load_starts_from_the_loaded_values(tmp_path, stage, kind):
    """The stale-buffer bug: after a module-only load (or one without optimizer state) the
    fp32 master must be rebuilt from the loaded weights, or the first step writes the old
    master back over them."""
    model, engine = workers.build(seed=0, stage=stage)
    workers.train(model, engine, 0, 3)
    path = save_checkpoint(engine, tmp_path / "ckpt")
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}

    other_model, other = workers.build(seed=5, stage=stage, lr=0.0)  # lr 0: a step changes nothing
    workers.train(other_model, other, 0, 2)
    pointers = [p.data_ptr() for p in other_model.parameters()]
    options = {"load_module_only": True} if kind == "module_only" else {"load_optimizer_states": False}
    load_checkpoint(other, path, **options)
    assert all(torch.equal(p, loaded[n]) for n, p in other_model.named_parameters())
    workers.train(other_model, other, 3, 1)  # one step at lr 0
    for name, param in other_model.named_parameters():
        assert torch.equal(param, loaded[name]), f"{name} was overwritten by a stale master"
    assert [p.data_ptr() for p in other_model.parameters()] == pointers
    for buffer in other.buffers:  # the flat buffer is what the params view
        assert all(p.data_ptr() >= buffer.data.data_ptr() for p in buffer.params)


def test_full_load_restores_lr_scheduler_and_counters(tmp_path):
    model, engine = workers.build(seed=0, stage=2)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
    for step in range(3):
        workers.train(model, engine, step, 1)
        scheduler.step()
    path = save_checkpoint(engine, tmp_path / "ckpt", lr_scheduler=scheduler)
    other_model, other = workers.build(seed=1, stage=2)
    other_scheduler = torch.optim.lr_scheduler.StepLR(other.optimizer, step_size=2, gamma=0.5)
    extra = load_checkpoint(other, path, lr_scheduler=other_scheduler)
    assert extra["global_steps"] == 3 and other.global_steps == 3
    assert other_scheduler.state_dict() == scheduler.state_dict()
    assert [g["lr"] for g in other.param_groups] == [g["lr"] for g in engine.param_groups]


@pytest.mark.parametrize("point, victim", [("after_rank_file", 1), ("before_rename", 0), ("before_latest", 0)])
def test_killed_rank_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, point, victim):
    with pytest.raises(RuntimeError):
        spawn(workers.crash_during_save, 2, (str(tmp_path), point, victim), timeout_s=120)
    assert resolve_checkpoint(tmp_path).name == "good"  # "latest" still names the old one
    bad = tmp_path / "bad"
    if point == "before_latest":  # the rename is the commit point: "bad" is complete
        assert (bad / "manifest.json").is_file()
    else:
        assert not bad.exists()
    model, engine = workers.build(seed=9, stage=2)
    load_checkpoint(engine, tmp_path)  # the previous checkpoint, through "latest"
    assert engine.global_steps == 1
