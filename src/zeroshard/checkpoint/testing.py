"""Synthetic ShardedStates with values known from (parameter name, element index).

Tests and benchmarks build every rank's state straight from a layout, at any world size,
without an engine or processes, then check loaded values against :func:`expected_partition`
bit for bit. Each tensor kind ("fp32", "exp_avg", ...) has its own pattern; every parameter
element is a nonzero integer below 2**23 (exact in float32), padding is zero. Patterns run over
a parameter's global elements (an expert weight's experts stacked by global id), so the same
expert carries the same values at every (W, EP).
"""

from __future__ import annotations

import functools
import math
import zlib

import torch

from ..layout import Layout, global_shape, rank_runs
from ..layout.coordinates import ep_rank, expert_numel
from ..state import ParamGroupState, ShardedState
from ..io.dtypes import torch_dtype

ADAM_STATES = ("exp_avg", "exp_avg_sq")
_PERIOD = (1 << 23) - 1


@functools.lru_cache(maxsize=4096)
def pattern(name: str, kind: str, numel: int) -> torch.Tensor:
    """The values of parameter ``name`` in tensor kind ``kind``, flattened (do not modify)."""
    seed = zlib.crc32(f"{kind}:{name}".encode())
    return ((torch.arange(numel, dtype=torch.int64) + seed) % _PERIOD + 1).to(torch.float32)


def expected_partition(
    layout: Layout, rank: int, group: int, kind: str, params: set[str] | None = None
) -> torch.Tensor:
    """Global rank ``rank``'s partition of ``group`` filled with the ``kind`` pattern (only
    ``params``, if given)."""
    layout_group = layout.groups[group]
    partition = torch.zeros(layout_group.partition_numel, dtype=torch.float32)
    numel = {slot.name: math.prod(global_shape(layout_group, slot)) for slot in layout_group.params}
    for run in rank_runs(layout_group, rank):
        if params is not None and run.name not in params:
            continue
        values = pattern(run.name, kind, numel[run.name])
        partition[run.partition_start : run.partition_start + run.length] = values[run.global_start : run.global_start + run.length]
    return partition


def local_pattern(layout: Layout, rank: int, name: str, kind: str) -> torch.Tensor:
    """Parameter ``name``'s ``kind`` pattern as global rank ``rank`` holds it, in its shape
    (an expert weight: the stacked experts of the rank's EP rank)."""
    group, slot = layout.param(name)
    values = pattern(name, kind, math.prod(global_shape(group, slot)))
    if group.is_expert_group:
        per_expert = expert_numel(slot)
        experts = group.expert_map[ep_rank(group, rank)]
        values = torch.cat([values[g * per_expert : (g + 1) * per_expert] for g in experts])
    return values.reshape(slot.spec.shape)


def synthetic_model_state(
    layout: Layout, *, tied_alias: str | None = "tied.alias", rank: int = 0
) -> dict[str, torch.Tensor]:
    """Weights from the "fp32" pattern in each group's dtype (global rank ``rank``'s experts),
    a frozen weight, a buffer, a tied name."""
    state: dict[str, torch.Tensor] = {}
    for group in layout.groups:
        for slot in group.params:
            state[slot.name] = local_pattern(layout, rank, slot.name, "fp32").to(torch_dtype(group.dtype))
    state["frozen.weight"] = pattern("frozen.weight", "fp32", 6).reshape(2, 3).clone()
    state["positions"] = torch.arange(5, dtype=torch.int64)
    first = layout.groups[0].params[0].name
    if tied_alias:
        state[tied_alias] = state[first]
    return state


def synthesize_state(
    layout: Layout,
    rank: int,
    *,
    states: tuple[str, ...] = ADAM_STATES,
    step: int = 7,
    model_state: dict[str, torch.Tensor] | None = None,
) -> ShardedState:
    """Rank ``rank``'s state as an AdamW run of ``layout`` after ``step`` steps would export it."""
    groups = range(len(layout.groups))
    return ShardedState(
        layout=layout,
        rank=rank,
        fp32_partitions=[expected_partition(layout, rank, g, "fp32") for g in groups],
        optimizer_states=[{name: expected_partition(layout, rank, g, name) for name in states} for g in groups],
        optimizer_scalars=[{"step": torch.tensor(float(step))} for _ in groups],
        param_groups=[
            ParamGroupState({"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1 if g == 0 else 0.0}, [g])
            for g in groups
        ],
        optimizer_class="torch.optim.adamw.AdamW",
        model_state=model_state if model_state is not None else (synthetic_model_state(layout) if rank == 0 else {}),
        extra={
            "global_step": step,
            "loss_scaler": {"scale": 65536.0, "growth_tracker": 3},
            "lr_scheduler": {"last_epoch": step, "_last_lr": [1e-3, 1e-3], "base_lrs": (1e-3, 1e-3)},
        },
    )
