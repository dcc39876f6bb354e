"""zeroshard.deepspeed.lr_schedules against DeepSpeed's own schedulers, value for value, and the
DeepSpeedLossScaler against DeepSpeed's DynamicLossScaler, step for step.

Each case runs DeepSpeed's class (deepspeed/runtime/lr_schedules.py, fp16/loss_scaler.py of
the installed 0.19.8) and ours side by side on two identical torch optimizers and compares the
lr (and the betas OneCycle sets) of every param group after construction and after every step,
with ``==``: the same formula in the same order of operations gives the same float.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.runtime import lr_schedules as ds_schedules  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler  # noqa: E402

from zeroshard.deepspeed import lr_schedules  # noqa: E402
from zeroshard.engine import DeepSpeedLossScaler, MinimumLossScaleError  # noqa: E402

STEPS = 40  # past the end of every schedule below

CASES = [
    ("WarmupLR", {"warmup_num_steps": 5}),
    (
        "WarmupLR",
        {"warmup_min_lr": 1e-5, "warmup_max_lr": [1e-3, 3e-3], "warmup_num_steps": 7, "warmup_type": "linear"},
    ),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": 1e-2, "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 1e-5, "warmup_num_steps": 3, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_max_lr": [1e-3, 2e-3], "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 2, "warmup_min_ratio": 0.1}),  # the fixtures'
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 4, "cos_min_ratio": 0.01, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 5}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5}),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 6,
            "cycle_first_stair_count": 2,
            "cycle_second_stair_count": 3,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": [0.95, 0.9],
        },
    ),  # fmt: skip
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 3,
            "decay_step_size": 4,
            "decay_lr_rate": 0.2,
        },
    ),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    (
        "LRRangeTest",
        {"lr_range_test_min_lr": [1e-4, 1e-3], "lr_range_test_step_size": 4, "lr_range_test_staircase": True},
    ),
]


def case_id(case) -> str:
    name, params = case
    return f"{name}-{'-'.join(sorted(params))}"


def make_optimizer(kind: str = "adamw") -> torch.optim.Optimizer:
    torch.manual_seed(0)
    groups = [
        {"params": [torch.nn.Parameter(torch.randn(3))], "lr": 1e-3},
        {"params": [torch.nn.Parameter(torch.randn(2))], "lr": 2e-3},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-3)
    return torch.optim.AdamW(groups, betas=(0.9, 0.95))


def values(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [(group["lr"], tuple(group["betas"]) if "betas" in group else None) for group in optimizer.param_groups]


def step_both(*pairs) -> None:
    """An optimizer step (no gradients: nothing changes) then the scheduler's, as in training."""
    for optimizer, schedule in pairs:
        optimizer.step()
        schedule.step()


def both(name: str, params: dict, kind: str = "adamw", **extra):
    theirs, ours = make_optimizer(kind), make_optimizer(kind)
    return (
        theirs,
        getattr(ds_schedules, name)(theirs, **params, **extra),
        ours,
        lr_schedules.SCHEDULES[name](ours, **params, **extra),
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_step_sets_deepspeeds_lr_exactly(case):
    name, params = case
    theirs, their_schedule, ours, our_schedule = both(name, params)
    assert values(ours) == values(theirs), "at construction (iteration -1)"
    for step in range(STEPS):
        step_both((theirs, their_schedule), (ours, our_schedule))
        assert values(ours) == values(theirs), f"after step {step}"
        assert our_schedule.last_batch_iteration == their_schedule.last_batch_iteration == step
    assert our_schedule.get_last_lr() == [lr for lr, _ in values(theirs)]
    json.dumps(our_schedule.state_dict())  # a Checkpointer stores it as JSON


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_resuming_carries_on_as_deepspeed_does(case):
    """Built with last_batch_iteration (the lrs left alone until the next step), and loaded
    from the state dict a DeepSpeed checkpoint holds."""
    name, params = case
    theirs, their_schedule, ours, our_schedule = both(name, params, last_batch_iteration=6)
    assert values(ours) == values(theirs), "the lrs are left as they were"
    for _ in range(5):
        step_both((theirs, their_schedule), (ours, our_schedule))
        assert values(ours) == values(theirs)

    theirs, their_schedule, ours, our_schedule = both(name, params)
    for _ in range(9):
        step_both((theirs, their_schedule))
    our_schedule.load_state_dict(their_schedule.state_dict())  # {"last_batch_iteration": 8}
    for group, (lr, betas) in zip(ours.param_groups, values(theirs)):  # the optimizer state carries these
        group["lr"] = lr
        if betas is not None:
            group["betas"] = betas
    for _ in range(STEPS - 9):
        step_both((theirs, their_schedule), (ours, our_schedule))
        assert values(ours) == values(theirs)


def test_our_own_state_dict_round_trips():
    _, _, ours, schedule = both("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 2})
    for _ in range(5):
        step_both((ours, schedule))
    saved = json.loads(json.dumps(schedule.state_dict()))
    again = lr_schedules.WarmupCosineLR(make_optimizer(), total_num_steps=20, warmup_num_steps=2)
    again.load_state_dict(saved)
    assert again.last_batch_iteration == 4
    step_both((ours, schedule), (again.optimizer, again))
    assert again.get_last_lr() == schedule.get_last_lr()


def test_one_cycle_without_betas_cycles_no_momentum_as_deepspeed():
    theirs, their_schedule, ours, our_schedule = both("OneCycle", CASES[9][1], kind="sgd")
    for _ in range(12):
        step_both((theirs, their_schedule), (ours, our_schedule))
        assert values(ours) == values(theirs)
    assert our_schedule.notes and "no momentum" in our_schedule.notes[0]


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("WarmupLR", {"warmup_type": "cubic"}, "warmup_type must be one of log, linear"),
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps must be a positive integer"),
        ("WarmupLR", {"warmup_max_lr": [1e-3]}, "warmup_max_lr: 1 values given, the optimizer has 2 param groups"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size must be a positive integer"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
            "cycle_first_step_size must be positive",
        ),
    ],
)
def test_bad_arguments_raise_one_line(name, params, message):
    with pytest.raises(ValueError, match=message):
        lr_schedules.SCHEDULES[name](make_optimizer(), **params)


def test_a_bad_deepspeed_state_is_refused():
    schedule = lr_schedules.WarmupLR(make_optimizer())
    with pytest.raises(ValueError, match="last_batch_iteration must be an integer >= -1"):
        schedule.load_state_dict({"last_batch_iteration": "7"})


# ---- the loss scaler -------------------------------------------------------------------------

SCALER_CASES = [
    # (initial scale power, window, hysteresis, consecutive hysteresis, min scale)
    (16, 1000, 2, False, 1),  # DeepSpeed's defaults
    (12, 3, 1, False, 1),
    (12, 2, 2, False, 1),
    (12, 2, 3, True, 1),
    (8, 5, 2, True, 64),  # reaches the minimum: both raise
    (4, 1, 1, False, 4),
]


@pytest.fixture
def deepspeed_rank_zero(monkeypatch):
    """DeepSpeed's scaler asks deepspeed.comm for the rank to decide whether to log."""
    monkeypatch.setattr(ds_loss_scaler, "dist", type("Comm", (), {"get_rank": staticmethod(lambda: 0)}))


@pytest.mark.parametrize("case", SCALER_CASES, ids=str)
def test_loss_scale_follows_deepspeeds_dynamic_scaler(case, deepspeed_rank_zero):
    power, window, hysteresis, consecutive, min_scale = case
    theirs = ds_loss_scaler.DynamicLossScaler(2.0**power, window, min_scale, hysteresis, consecutive)
    ours = DeepSpeedLossScaler(
        scale=2.0**power,
        growth_interval=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=min_scale,
    )
    flags = random.Random(sum(case)).choices([True, False], weights=[1, 3], k=300)
    flags[:4] = [False, True, True, False]  # hysteresis used up early in every case
    scales = {ours.scale}
    for step, overflow in enumerate(flags):
        try:
            theirs.update_scale(overflow)
        except Exception as err:  # DeepSpeed raises a bare Exception at the minimum scale
            assert "minimum" in str(err)
            with pytest.raises(MinimumLossScaleError, match="minimum loss scale"):
                ours.update(overflow)
            break
        ours.update(overflow)
        assert (ours.scale, ours.hysteresis_left) == (theirs.cur_scale, theirs.cur_hysteresis), f"step {step}"
        scales.add(ours.scale)
    assert len(scales) > 1, "the scale moved"


def test_loss_scaler_loads_deepspeeds_fields(deepspeed_rank_zero):
    theirs = ds_loss_scaler.DynamicLossScaler(2.0**10, 3, 1, 2, False)
    for overflow in (False, True, True, False, False, False, False):
        theirs.update_scale(overflow)
    ours = DeepSpeedLossScaler()
    ours.load_state_dict({k: v for k, v in vars(theirs).items() if isinstance(v, (bool, int, float))})
    for overflow in (False, True, False, False, False, True, True, False):
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert (ours.scale, ours.hysteresis_left, ours.iteration) == (
            theirs.cur_scale,
            theirs.cur_hysteresis,
            theirs.cur_iter,
        )
