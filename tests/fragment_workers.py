"""Worker for the fragment API test: parameters that span ranks and sit next to padding."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
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
        # The step used the gradients set above: exp_avg = (1 - beta1) * 0.25 everywhere, in
        # fp32 two roundings (of 1 - beta1 and of the product) from the exact value.
        expected = torch.full_like(state, (1 - 0.9) * 0.25)
        results["checks"][name]["optimizer_state"] = torch.allclose(state, expected, rtol=2 * 2.0**-24, atol=0)
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


# ---- collectives called badly: every rank must raise the same error, none may block --------------


def _outcome(engine: ZeroOptimizer, call, probe: str, expected_probe: torch.Tensor) -> dict:
    """Run ``call``; report its error and whether the group still works (and nothing changed)."""
    start = time.perf_counter()
    try:
        call()
        error = None
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = err
    seconds = time.perf_counter() - start
    ranks_sum = engine.comm.all_reduce_(torch.tensor([float(engine.rank + 1)]), op="sum").item()
    unchanged = torch.equal(engine.get_full_fp32_param(probe), expected_probe)
    return {
        "type": None if error is None else type(error).__name__,
        "message": None if error is None else str(error.args[0] if len(error.args) == 1 else error),
        "seconds": seconds,
        "group_usable": ranks_sum == engine.world_size * (engine.world_size + 1) / 2,
        "unchanged": unchanged,
    }


def check_bad_calls(rank: int, world: int, root: str) -> dict:
    """At D=2, each public collective called so that it fails, on one rank or on both."""
    torch.manual_seed(0)
    model = OddSizedModel()
    engine = ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_dtype=torch.bfloat16, policy=POLICY, lr=1e-2)
    only_rank0 = next(name for name in engine.layout.param_names if _owners(engine, name) == {0})
    other = next(name for name in engine.layout.param_names if name != only_rank0)
    value = engine.get_full_fp32_param(only_rank0)
    slot = engine.layout.param(only_rank0)[1]
    checkpoint = save_checkpoint(engine, Path(root), tag="good")
    mine = engine.export_state()
    if rank == 1:
        mine.rank = 0  # rank 1 alone passes another rank's state
    calls = {
        "state_before_first_step": lambda: engine.get_full_optimizer_state(only_rank0, "exp_avg"),
        "set_state_before_first_step": lambda: engine.set_full_optimizer_state(only_rank0, "exp_avg", torch.zeros(slot.spec.shape)),
        "unknown_parameter": lambda: engine.get_full_fp32_param("no.such.parameter"),
        "unknown_parameter_grad": lambda: engine.get_full_grad("no.such.parameter"),
        "ranks_ask_for_different_parameters": lambda: engine.get_full_fp32_param(only_rank0 if rank == 0 else other),
        "wrong_size_on_one_rank": lambda: engine.set_full_fp32_param(
            only_rank0, torch.ones(slot.spec.shape) if rank == 0 else torch.ones(slot.numel + 1)
        ),
        "not_a_tensor_on_one_rank": lambda: engine.set_full_grad(only_rank0, torch.ones(slot.spec.shape) if rank == 0 else 1.0),
        "import_another_ranks_state_on_one_rank": lambda: engine.import_state(mine),
        "load_options_differ": lambda: load_checkpoint(engine, checkpoint, strict=rank == 0),
        "load_missing_on_one_rank": lambda: load_checkpoint(engine, checkpoint if rank == 0 else Path(root) / "missing"),
        "save_tags_differ": lambda: save_checkpoint(engine, Path(root), tag=f"tag-of-rank-{rank}"),
    }
    outcomes = {label: _outcome(engine, call, only_rank0, value) for label, call in calls.items()}
    outcomes["published_tags"] = sorted(p.name for p in Path(root).iterdir() if not p.name.startswith("."))
    return outcomes
