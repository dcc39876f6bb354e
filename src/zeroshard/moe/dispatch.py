"""Token dispatch and combine across an expert-parallel group by all-to-all.

Tokens arrive sorted by expert slot (EP rank, then local expert; with the contiguous placement
that is the global expert id, and for any other placement ``zeroshard.layout.expert_slots``
gives the slots) with a count per slot. The counts are exchanged
first (one all-to-all of E integers), so every rank knows how many rows it sends to and
receives from each EP rank; then the rows travel by ``all_to_all_single`` with those split
sizes, are regrouped by local expert for the grouped GEMM, and travel back the same way.
The autograd of the exchange is the exchange with the split sizes swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Route:
    """What combine needs to send the experts' outputs back where the tokens came from."""

    send_splits: list[int]  # rows to each EP rank
    recv_splits: list[int]  # rows from each EP rank
    by_local_expert: torch.Tensor  # received row order grouped by local expert


def dispatch(
    tokens: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """Send each token to the EP rank holding its expert.

    ``tokens`` [N, dim] are sorted by expert slot, ``counts`` [E] (int64) counts them per
    slot; slots ``r * E / EP ...`` are EP rank ``r``'s experts, in its local order (with the
    contiguous placement, slot = global expert id). Returns the received rows grouped by
    local expert, the row count of each local expert, and the route back. Collective over
    ``group`` (an all-to-all of the counts, one of the rows; backward sends the rows' gradient
    back by another).
    """
    ep_size = dist.get_world_size(group)
    local_experts = counts.numel() // ep_size
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
    received_counts = received_counts.view(ep_size, local_experts)
    send_splits = counts.view(ep_size, local_experts).sum(1).tolist()
    recv_splits = received_counts.sum(1).tolist()
    received = _AllToAll.apply(tokens, recv_splits, send_splits, group)
    expert_of_row = torch.arange(local_experts, device=counts.device).repeat(ep_size)
    expert_of_row = expert_of_row.repeat_interleave(received_counts.flatten())
    by_local_expert = expert_of_row.argsort(stable=True)
    route = Route(send_splits, recv_splits, by_local_expert)
    return received[by_local_expert], received_counts.sum(0), route


def combine(outputs: torch.Tensor, route: Route, group: dist.ProcessGroup) -> torch.Tensor:
    """Send the experts' outputs (rows in ``dispatch``'s order) back to the tokens' ranks,
    in the order the tokens were dispatched. Collective over ``group`` (an all-to-all; its
    backward another)."""
    in_received_order = outputs[route.by_local_expert.argsort()]
    return _AllToAll.apply(in_received_order, route.send_splits, route.recv_splits, group)


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    output = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(output, rows.contiguous(), output_splits, input_splits, group=group)
    return output


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None
