"""A rank's experts as stacked 3-D weights, run by one grouped GEMM per weight.

Each expert is Mixtral's SwiGLU feed-forward, ``w2(silu(w1 x) * w3 x)``. The weights of the
rank's local experts are stacked, ``w1``/``w3`` [local, dim, hidden] and ``w2`` [local,
hidden, dim], so under a flat buffer each is one zero-copy view that ``torch._grouped_mm``
reads directly. On CUDA that kernel needs 16-byte aligned operands (base pointer and row
stride); the native layout's 16-byte parameter starts provide the first, and dims that are
multiples of 8 (16 bytes of bf16) the second. torch 2.13's CPU kernel runs fp32, bf16 and
fp16, forward and backward, and does not check alignment.

Checkpoints name experts by global id, one tensor per expert and weight in ``nn.Linear``
orientation, as Hugging Face MoE checkpoints do (Mixtral: ``experts.{i}.w1.weight``):
:func:`per_expert_state_dict` writes that form, and ``load_state_dict`` accepts it as well as
the stacked one, taking the rank's own experts from a dict that may hold all of them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..layout import LEGACY_STACK, contiguous_expert_map
from .contract import declare_experts

WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: Mixtral's names


class GroupedExperts(nn.Module):
    """The SwiGLU experts with global ids ``expert_ids`` (of ``num_experts``), stacked.

    ``expert_map`` is the placement they belong to (default: the contiguous one, of which
    ``expert_ids`` must be one EP rank's block). ValueError at construction when
    ``expert_ids`` are not one EP rank's experts of the placement."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        expert_ids: Sequence[int],
        num_experts: int,
        expert_map: Sequence[Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        self.expert_ids = tuple(expert_ids)
        self.num_experts = num_experts
        local = len(self.expert_ids)
        self.w1 = nn.Parameter(torch.empty(local, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(local, dim, hidden))
        for weight in (self.w1, self.w2, self.w3):
            nn.init.normal_(weight, mean=0.0, std=0.02)
        self.register_load_state_dict_pre_hook(_stack_per_expert_weights)
        # The contract: [local, in, out] stacks exported per expert (LEGACY_STACK).
        placement = expert_map if expert_map is not None else _contiguous_placement(self.expert_ids, num_experts)
        held = [tuple(experts) for experts in placement]
        if self.expert_ids not in held:
            raise ValueError(f"experts {list(self.expert_ids)} are not one expert-parallel rank's in {held}")
        declare_experts(self, {w: LEGACY_STACK for w in WEIGHTS}, expert_map=held, ep_rank=held.index(self.expert_ids))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` [N, dim] grouped by local expert, ``counts`` [local] rows per expert."""
        offsets = counts.cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(tokens, self.w1, offs=offsets)
        up = torch._grouped_mm(tokens, self.w3, offs=offsets)
        return torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offsets)

    def extra_repr(self) -> str:
        """The experts it holds and w1's shape, for ``repr``."""
        return f"experts={list(self.expert_ids)} of {self.num_experts}, w1={tuple(self.w1.shape)}"


def _contiguous_placement(expert_ids: tuple[int, ...], num_experts: int) -> tuple[tuple[int, ...], ...]:
    local = len(expert_ids)
    if not local or num_experts % local:
        raise ValueError(f"{local} local experts do not split {num_experts} experts evenly; give the expert_map")
    return contiguous_expert_map(num_experts, num_experts // local)


def per_expert_name(prefix: str, expert_id: int, weight: str) -> str:
    """The checkpoint name of one expert's weight: ``{prefix}{expert_id}.{weight}.weight``."""
    return f"{prefix}{expert_id}.{weight}.weight"


def per_expert_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every stacked expert weight split into per-expert
    tensors named by global expert id, each ``[out, in]`` like an ``nn.Linear`` weight."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        prefix = f"{prefix}." if prefix else ""
        for weight in WEIGHTS:
            stacked = state.pop(prefix + weight)
            for local, expert_id in enumerate(module.expert_ids):
                state[per_expert_name(prefix, expert_id, weight)] = stacked[local].t().contiguous()
    return state


def _stack_per_expert_weights(
    module: GroupedExperts,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Turn per-expert entries into the stacked ones this module holds (before it loads).

    Entries of experts another rank holds are consumed too; any missing local expert leaves
    the stacked entry out, so load_state_dict reports it missing."""
    for weight in WEIGHTS:
        stacked_name = prefix + weight
        names = {expert_id: per_expert_name(prefix, expert_id, weight) for expert_id in range(module.num_experts)}
        if stacked_name in state_dict or not any(name in state_dict for name in names.values()):
            continue
        found = {expert_id: state_dict.pop(name) for expert_id, name in names.items() if name in state_dict}
        local = [found[i] for i in module.expert_ids if i in found]
        expected = tuple(getattr(module, weight).shape[:0:-1])  # one expert's [out, in]
        wrong = next((i for i in module.expert_ids if i in found and tuple(found[i].shape) != expected), None)
        if wrong is not None:
            error_msgs.append(
                f"size mismatch for {names[wrong]}: expected shape {list(expected)}, got {list(found[wrong].shape)}"
            )
        elif len(local) == len(module.expert_ids):
            state_dict[stacked_name] = torch.stack([tensor.t() for tensor in local])
