"""Synthetic ShardedStates with values known from (parameter name, element index).

Tests and benchmarks build every rank's state straight from a layout, at any world size,
without an engine or processes, then check loaded values against :func:`expected_partition`
bit for bit. Each tensor kind ("fp32", "exp_avg", ...) has its own pattern; every parameter
element is a nonzero integer below 2**23 (exact in float32), padding is zero.
"""

from __future__ import annotations

import functools
import zlib

import torch

from ..layout import Layout
from ..state import ParamGroupState, ShardedState
from .io.dtypes import torch_dtype

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
    """``rank``'s partition of ``group`` filled with the ``kind`` pattern (only ``params``, if given)."""
    layout_group = layout.groups[group]
    partition = torch.zeros(layout_group.partition_numel, dtype=torch.float32)
    for fragment in layout_group.fragments(rank):
        if params is not None and fragment.name not in params:
            continue
        values = pattern(fragment.name, kind, layout_group.params[fragment.param_index].numel)
        end = fragment.param_start + fragment.length
        partition[fragment.partition_start : fragment.partition_start + fragment.length] = values[
            fragment.param_start : end
        ]
    return partition


def synthetic_model_state(layout: Layout, *, tied_alias: str | None = "tied.alias") -> dict[str, torch.Tensor]:
    """Weights from the "fp32" pattern in each group's dtype, a frozen weight, a buffer, a tied name."""
    state: dict[str, torch.Tensor] = {}
    for group in layout.groups:
        for slot in group.params:
            state[slot.name] = (
                pattern(slot.name, "fp32", slot.numel).to(torch_dtype(group.dtype)).reshape(slot.spec.shape)
            )
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
