"""Worker code for the multi-process MoE tests (module level, so spawned ranks import it).

Every rank builds the same full MoE layer (all experts, seeded) as the single-process
reference, and an expert-parallel layer that loads its own experts from the full layer's
per-expert state dict. Each rank feeds its own tokens (a different count per rank) through
the EP layer and backpropagates a fixed cotangent; the reference runs every rank's tokens
through the full layer one rank at a time. Workers return max abs differences relative to
the reference's largest magnitude.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroshard.moe import MoEFeedForward, new_expert_groups, per_expert_state_dict

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2


def tokens_of(rank: int, dtype: torch.dtype, empty_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs [n, DIM] (n differs per rank; 0 on ``empty_rank``) and cotangent."""
    count = 0 if rank == empty_rank else 5 + 7 * rank
    generator = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(count, DIM, generator=generator).to(dtype)
    cotangent = torch.randn(count, DIM, generator=generator).to(dtype)
    return inputs, cotangent


def gradients(layer: MoEFeedForward, inputs: torch.Tensor, cotangent: torch.Tensor):
    """Output, input gradient, and the gradients of gate, w1, w2, w3."""
    inputs = inputs.clone().requires_grad_(True)
    output = layer(inputs)
    weights = [layer.gate.weight, layer.experts.w1, layer.experts.w2, layer.experts.w3]
    grads = torch.autograd.grad((output * cotangent).sum(), [inputs, *weights], allow_unused=True)
    return output.detach(), grads[0], [g if g is not None else torch.zeros_like(w) for g, w in zip(grads[1:], weights)]


def relative_diff(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| over max |reference| (0 for empty tensors)."""
    if not reference.numel():
        return 0.0
    scale = reference.float().abs().max().item()
    return (value.float() - reference.float()).abs().max().item() / max(scale, 1e-12)


def compare_with_full_layer(rank: int, world_size: int, ep_size: int, dtype_name: str, empty_rank: int | None) -> dict:
    dtype = getattr(torch, dtype_name)
    groups = new_expert_groups(ep_size)
    torch.manual_seed(0)
    full = MoEFeedForward(DIM, HIDDEN, EXPERTS, TOP_K)
    with torch.no_grad():  # weights of order one, so outputs and gradients are too
        for param in full.parameters():
            param.normal_(0.0, 0.5)
    full = full.to(dtype)
    sharded = MoEFeedForward(DIM, HIDDEN, EXPERTS, TOP_K, ep_group=groups.ep).to(dtype)
    sharded.load_state_dict(per_expert_state_dict(full), strict=True)

    inputs, cotangent = tokens_of(rank, dtype, empty_rank)
    output, input_grad, (gate_grad, *expert_grads) = gradients(sharded, inputs, cotangent)

    # Reference: an expert's gradient sums the tokens of every rank in this EP group.
    expert_ref = [torch.zeros_like(w, dtype=torch.float32) for w in (full.experts.w1, full.experts.w2, full.experts.w3)]
    for other in groups.mesh.ep_group(rank):
        ref_out, ref_input_grad, (ref_gate_grad, *ref_expert) = gradients(full, *tokens_of(other, dtype, empty_rank))
        for total, grad in zip(expert_ref, ref_expert):
            total.add_(grad.float())
        if other == rank:
            mine = (ref_out, ref_input_grad, ref_gate_grad)
    local = list(sharded.experts.expert_ids)
    result = {
        "output": relative_diff(output, mine[0]),
        "input_grad": relative_diff(input_grad, mine[1]),
        "gate_grad": relative_diff(gate_grad, mine[2]),
        "expert_grads": max(relative_diff(g, ref[local]) for g, ref in zip(expert_grads, expert_ref)),
        "output_scale": output.abs().max().item() if output.numel() else 0.0,
        "ep_ranks": dist.get_process_group_ranks(groups.ep),
        "expert_dp_ranks": dist.get_process_group_ranks(groups.expert_dp),
        "local_experts": local,
        "tokens": inputs.shape[0],
    }
    return result


def bad_ep_size_error(world_size: int) -> str:
    """The error every rank gets for an EP that does not divide W (before any group exists)."""
    try:
        new_expert_groups(world_size + 1)
    except ValueError as err:
        return str(err)
    return ""


def run_cases(rank: int, world_size: int, cases: list[tuple[int, str, int | None]]) -> tuple[str, list[dict]]:
    """The bad-EP error, then several (ep_size, dtype, empty_rank) comparisons in one process group."""
    return bad_ep_size_error(world_size), [compare_with_full_layer(rank, world_size, *case) for case in cases]
