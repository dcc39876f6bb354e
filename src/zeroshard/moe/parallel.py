"""Expert parallelism for a model whose experts modules follow the contract, in one call.

:func:`expert_parallel` keeps, in every experts module, only the experts this rank's EP rank
holds (``expert_map[ep_rank]``; contiguous by default): each stack becomes a parameter of the
same name and shape ``[E / EP, ...]``. A transformers v5 experts module also gets an
expert-parallel forward: the (token, choice) rows are sorted by the slot of their expert
(EP rank, then local index; :func:`~zeroshard.layout.expert_slots`), travel to their EP rank
by all-to-all (:mod:`.dispatch`), run through the module's own experts implementation
(transformers' ``grouped_mm`` path, so the expert matmuls are grouped GEMMs on the local
stacks, which ZeroOptimizer makes aligned views of its flat buffer) and come back to be
weighted by the router's top-k weights and summed, as the unmodified module does. Each rank
trains on its own data; at EP = 1 nothing is sent. A module of a user's own that declared
its stacks (:func:`~.contract.declare_experts`) has its stacks cut the same way and keeps
its forward (its dispatch is its own).
"""

from __future__ import annotations

import types
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..layout import check_expert_map, contiguous_expert_map, expert_slots
from .contract import ExpertModule, declare_experts, expert_modules, is_transformers_experts
from .dispatch import combine, dispatch
from .experts import GroupedExperts
from .groups import ExpertGroups


def expert_parallel(
    model: nn.Module,
    groups: ExpertGroups | None,
    *,
    expert_map: Sequence[Sequence[int]] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, ExpertModule]:
    """Make ``model`` expert-parallel over ``groups.ep`` (None: one process, EP = 1); returns
    the experts modules' new contracts by module name. Not collective itself: every rank
    calls it with the same ``expert_map`` (None: contiguous), and keeps its own experts. The
    forward it gives a transformers experts module is collective over ``groups.ep`` at
    EP > 1: every rank of the EP group runs forward and backward together.

    A stack on the meta device (a model built under ``torch.device("meta")``) is allocated,
    uninitialised, on ``device`` (default CPU) with only this rank's experts; load weights
    with :func:`~.pretrained.load_pretrained`.

    Raises:
        ValueError: the model has no experts modules, its modules hold different expert
            counts, it holds a module already made parallel or built with an EP group
            (MoEGPT), or the placement does not fit the experts and the EP group.
    """
    ep_size = groups.mesh.ep_size if groups is not None else 1
    ep_rank = groups.ep_rank if groups is not None else 0
    found = expert_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no experts module zeroshard recognises or that declared its stacks")
    modules = dict(model.named_modules())
    counts = {contract.num_experts for contract in found.values()}
    if len(counts) != 1:
        raise ValueError(f"the model's experts modules hold different expert counts {sorted(counts)}")
    num_experts = counts.pop()
    placement = contiguous_expert_map(num_experts, ep_size) if expert_map is None else check_expert_map(expert_map)
    if len(placement) != ep_size or sum(map(len, placement)) != num_experts:
        raise ValueError(
            f"the expert map places {sum(map(len, placement))} experts on {len(placement)} EP ranks; "
            f"the model has {num_experts} experts and the EP group {ep_size} ranks"
        )
    made = {}
    for name, contract in found.items():
        module = modules[name]
        if isinstance(module, GroupedExperts) or contract.ep_size != 1:
            raise ValueError(f"experts module {name!r} is already expert-parallel (EP = {contract.ep_size})")
        for leaf in contract.stacks:
            _keep_experts(module, leaf, placement[ep_rank], device)
        made[name] = declare_experts(module, contract.stacks, expert_map=placement, ep_rank=ep_rank)
        if is_transformers_experts(module):
            _install_forward(module, placement, groups.ep if groups is not None else None)
    return made


def _keep_experts(module: nn.Module, leaf: str, expert_ids: tuple[int, ...], device) -> None:
    """Replace stack ``leaf`` by a parameter of the same name holding only ``expert_ids``."""
    full = getattr(module, leaf)
    if full.is_meta:
        local = torch.empty((len(expert_ids), *full.shape[1:]), dtype=full.dtype, device=device or "cpu")
    else:
        local = full.detach()[torch.tensor(expert_ids, device=full.device)].clone()
    setattr(module, leaf, nn.Parameter(local, requires_grad=full.requires_grad))


def _install_forward(module: nn.Module, placement: tuple[tuple[int, ...], ...], group: dist.ProcessGroup | None) -> None:
    """The module's forward becomes the expert-parallel one; its experts implementation (the
    class's forward, which dispatches on ``config._experts_implementation``) runs the local experts."""
    module._zeroshard_slots = torch.tensor(expert_slots(placement))
    module._zeroshard_ep_group = group if len(placement) > 1 else None
    module.num_experts = len(placement[0])  # what the experts implementation sizes its groups by
    module.forward = types.MethodType(_expert_parallel_forward, module)


def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts signature: ``hidden_states`` [T, H], the router's top-k global
    expert ids and weights [T, k]. Returns [T, H]."""
    local_forward = type(self).forward
    slots = self._zeroshard_slots.to(top_k_index.device)[top_k_index]
    group = self._zeroshard_ep_group
    if group is None:  # EP = 1: every expert is here, in slot order
        if self._zeroshard_slots.numel() != self.num_experts:
            raise RuntimeError("this experts module holds some of the experts but has no EP group to reach the others")
        return local_forward(self, hidden_states, slots, top_k_weights)
    tokens, top_k = top_k_index.shape
    choices = slots.reshape(-1)
    order = choices.argsort(stable=True)
    counts = torch.bincount(choices, minlength=self._zeroshard_slots.numel())
    received, local_counts, route = dispatch(hidden_states[order // top_k], counts, group)
    local_ids = torch.repeat_interleave(torch.arange(local_counts.numel(), device=received.device), local_counts)
    ones = torch.ones((received.shape[0], 1), dtype=top_k_weights.dtype, device=received.device)
    outputs = combine(local_forward(self, received, local_ids.unsqueeze(1), ones), route, group)
    outputs = outputs[order.argsort()].view(tokens, top_k, -1)
    # As transformers weighs and sums the experts' outputs (proj_out * weight, then the sum over k).
    return (outputs * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)
