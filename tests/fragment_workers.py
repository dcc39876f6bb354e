"""Worker for the fragment API test: parameters that span ranks and sit next to padding."""

from __future__ import annotations

import torch

from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy
from zeroshard.models import OddSizedModel

# Small buckets and 64-byte alignment: parameters span ranks, and padding sits between them.
POLICY = LayoutPolicy.native(alignment_bytes=64, bucket_numel=300)


def _assembled(engine: ZeroOptimizer, name: str, partitions: list[torch.Tensor]) -> torch.Tensor:
    """A parameter gathered by hand from every rank's partitions and the layout's pieces."""
    group, slot = engine.layout.param(name)
    gathered = [torch.empty_like(partitions[group.index]) for _ in range(engine.world_size)]
    torch.distributed.all_gather(gathered, partitions[group.index].contiguous())
    full = torch.empty(slot.numel)
    for piece in group.pieces(slot.index):
        full[piece.param_start : piece.param_start + piece.length] = gathered[piece.rank][
            piece.partition_start : piece.partition_start + piece.length
        ]
    return full.view(slot.spec.shape)


def _owners(engine: ZeroOptimizer, name: str) -> set[int]:
    group, slot = engine.layout.param(name)
    return {piece.rank for piece in group.pieces(slot.index)}


def check_fragments(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = OddSizedModel()
    engine = ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_dtype=torch.bfloat16, policy=POLICY, lr=1e-2)
    spanning = [name for name in engine.layout.param_names if len(_owners(engine, name)) > 1]
    tokens = torch.randint(0, 13, (4, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(model(tokens, tokens))
    results = {"spanning": spanning, "checks": {}}
    masters = [m.detach() for m in engine.masters]
    grads = engine.reducer.partition_grads
    for name in engine.layout.param_names:
        group, slot = engine.layout.param(name)
        checks = {}
        checks["get_fp32"] = torch.equal(engine.get_full_fp32_param(name), _assembled(engine, name, masters))
        checks["get_grad"] = torch.equal(engine.get_full_grad(name), _assembled(engine, name, grads))
        new_value = torch.arange(slot.numel, dtype=torch.float32).view(slot.spec.shape) / 7  # the same on every rank
        engine.set_full_fp32_param(name, new_value)
        param = dict(model.named_parameters())[name]
        checks["set_fp32"] = torch.equal(engine.get_full_fp32_param(name), new_value)
        checks["set_updates_model"] = torch.equal(param.detach(), new_value.to(param.dtype))
        new_grad = torch.full(slot.spec.shape, 0.25)
        engine.set_full_grad(name, new_grad)
        checks["set_grad"] = torch.equal(engine.get_full_grad(name), new_grad)
        local = engine.get_local_fp32_param(name)
        if local is not None:
            flat = new_value.reshape(-1)
            checks["local_get"] = torch.equal(local.values, flat[local.param_start : local.param_start + local.values.numel()])
            engine.set_local_fp32_param(name, local.values * 2)
        gathered_after_local = engine.get_full_fp32_param(name)
        checks["local_set"] = torch.equal(gathered_after_local, new_value * 2)
        results["checks"][name] = checks
    engine.step()
    for name in engine.layout.param_names:
        state = engine.get_full_optimizer_state(name, "exp_avg")
        # The step used the gradients set above: exp_avg = (1 - beta1) * 0.25 everywhere.
        expected = torch.full_like(state, (1 - 0.9) * 0.25)
        results["checks"][name]["optimizer_state"] = torch.allclose(state, expected, rtol=0, atol=1e-7)
        engine.set_full_optimizer_state(name, "exp_avg", torch.zeros_like(state))
        results["checks"][name]["set_optimizer_state"] = torch.equal(
            engine.get_full_optimizer_state(name, "exp_avg"), torch.zeros_like(state)
        )
    results["padding_zero"] = all(
        bool((m.detach()[start:end] == 0).all())
        for m, group in zip(engine.masters, engine.layout.groups)
        for start, end in group.padding_ranges(rank)
    )
    return results
