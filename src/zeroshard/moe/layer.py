"""A mixture-of-experts feed-forward layer: top-k router, experts spread over an EP group.

Each token goes to its ``top_k`` most probable experts (softmax over the router's logits in
fp32, the top-k probabilities renormalised to sum to one, as Mixtral does) and comes back as
their outputs weighted by those probabilities. With an expert-parallel group of EP ranks,
each rank holds E / EP experts and the tokens travel to them and back by all-to-all
(:mod:`.dispatch`); without one (or at EP = 1) every expert is local and nothing is sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..layout import contiguous_expert_map
from .dispatch import combine, dispatch
from .experts import GroupedExperts


class MoEFeedForward(nn.Module):
    """Router (``gate``, no bias) and SwiGLU experts (``experts``), Mixtral's names.

    With ``ep_group`` (EP > 1) this rank holds its E / EP experts (the contiguous map), and
    forward and backward are collective over ``ep_group``.

    Raises:
        ValueError: at construction, ``top_k`` is not between 1 and ``num_experts``, this
            rank is not in ``ep_group``, or EP does not divide ``num_experts``.
    """

    def __init__(
        self, dim: int, hidden: int, num_experts: int, top_k: int = 2, ep_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
        self.top_k = top_k
        self.ep_group = ep_group
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if ep_rank < 0:
            raise ValueError(f"rank {dist.get_rank()} is not in the expert-parallel group it was given")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, contiguous_expert_map(num_experts, ep_size)[ep_rank], num_experts)

    @property
    def num_experts(self) -> int:
        """E: the layer's experts on all EP ranks."""
        return self.experts.num_experts

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's renormalised expert weights [T, k] (fp32) and its ``top_k`` experts [T, k]."""
        probabilities = F.softmax(self.gate(tokens).float(), dim=-1)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., dim] -> the same shape: each token's top-k experts' outputs, weighted.

        Collective over ``ep_group`` when EP > 1 (all-to-alls of the counts and the rows, and
        backward's of their gradients): every rank of it runs forward and backward together,
        each with its own tokens.
        """
        tokens = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(tokens)
        # One row per (token, choice), sorted by expert; order.argsort() undoes the sort.
        choices = experts.flatten()
        order = choices.argsort(stable=True)
        counts = torch.bincount(choices, minlength=self.num_experts)
        outputs = self._run_experts(tokens[order // self.top_k], counts)
        outputs = outputs[order.argsort()].view(tokens.shape[0], self.top_k, tokens.shape[1])
        mixed = (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(dim=1)
        return mixed.view_as(x)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of ``rows`` sorted by global expert (``counts`` per expert)."""
        if self.ep_group is None or dist.get_world_size(self.ep_group) == 1:
            return self.experts(rows, counts)
        received, local_counts, route = dispatch(rows, counts, self.ep_group)
        return combine(self.experts(received, local_counts), route, self.ep_group)
