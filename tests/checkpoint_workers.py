"""Worker code for the engine checkpoint tests (module level, so spawned ranks can import it).

Data is defined per global batch: every step draws GLOBAL_BATCH sequences from a seed, and
rank r of D trains on its contiguous 1/D of them. Runs at different world sizes therefore
see the same global batches, and a resharded resume continues the same optimisation.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.demos.data import markov_chain, sample_batch
from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy
from zeroshard.models import GPTConfig, TinyGPT, gpt_param_groups

CONFIG = GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=3, n_embd=24)
GLOBAL_BATCH = 12  # divisible by every world size tested: 1, 2, 3, 4
SAVE_POLICY = LayoutPolicy.native(bucket_numel=3000)  # several buckets, 16-byte aligned


def build(seed: int, stage: int, policy: LayoutPolicy | None = None, lr: float = 3e-3) -> tuple[TinyGPT, ZeroOptimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    decay, no_decay = gpt_param_groups(model)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": 0.1},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0, "lr": lr / 3},
    ]
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, groups, stage=stage, param_dtype=torch.bfloat16, policy=policy,
        max_grad_norm=1.0, lr=lr, betas=(0.9, 0.95),
    )
    return model, engine


def train(model: TinyGPT, engine: ZeroOptimizer, first_step: int, steps: int) -> list[float]:
    """Steps ``first_step`` .. on the global batches; the global mean loss of each."""
    chain = markov_chain(CONFIG.vocab_size)
    share = GLOBAL_BATCH // engine.world_size
    losses = []
    for step in range(first_step, first_step + steps):
        inputs, targets = sample_batch(chain, GLOBAL_BATCH, CONFIG.block_size, seed=step)
        mine = slice(engine.rank * share, (engine.rank + 1) * share)
        loss = model(inputs[mine], targets[mine])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = engine.comm.all_reduce_(loss.detach().float().reshape(1), op="sum")
        losses.append(total.item() / engine.world_size)
    return losses


def full_state(engine: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Every parameter's master and Adam states, gathered (collective)."""
    tensors = {}
    for name in engine.layout.param_names:
        tensors[f"{name}/fp32"] = engine.get_full_fp32_param(name).contiguous()
        if engine.optimizer.state:
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{name}/{key}"] = engine.get_full_optimizer_state(name, key).contiguous()
    return tensors


def dump(engine: ZeroOptimizer, path: Path) -> None:
    tensors = full_state(engine)
    if engine.rank == 0:
        save_file(tensors, str(path))


def save_run(rank: int, world: int, out: str, stage: int, policy: LayoutPolicy | None) -> dict:
    """Train 3 steps, save, dump the state; train 3 more (the uninterrupted run); then resume
    from the checkpoint in a fresh engine at the same world size and train the same 3 steps."""
    out_dir = Path(out)
    model, engine = build(seed=0, stage=stage, policy=policy)
    first = train(model, engine, 0, 3)
    save_checkpoint(engine, out_dir / "ckpt")
    dump(engine, out_dir / "at_save.safetensors")
    uninterrupted = train(model, engine, 3, 3)
    dump(engine, out_dir / "uninterrupted_end.safetensors")

    model, resumed = build(seed=1, stage=stage, policy=policy)
    load_checkpoint(resumed, out_dir / "ckpt")
    after_load = full_state(resumed)
    resumed_losses = train(model, resumed, 3, 3)
    end = full_state(resumed)
    reference_end = full_state(engine)
    return {
        "first": first,
        "uninterrupted": uninterrupted,
        "resumed": resumed_losses,
        "load_exact": all(torch.equal(after_load[k], v) for k, v in _read(out_dir / "at_save.safetensors").items()),
        "end_exact": all(torch.equal(end[k], reference_end[k]) for k in end),
    }


def resume_run(rank: int, world: int, out: str, stage: int, policy: LayoutPolicy | None) -> dict:
    """Load the D=2 checkpoint at this world size and policy; compare, then train 3 steps."""
    out_dir = Path(out)
    model, engine = build(seed=7, stage=stage, policy=policy)
    load_checkpoint(engine, out_dir / "ckpt")
    after_load = full_state(engine)
    saved = _read(out_dir / "at_save.safetensors")
    exact = all(torch.equal(after_load[k], v) for k, v in saved.items()) and set(after_load) == set(saved)
    losses = train(model, engine, 3, 3)
    end = full_state(engine)
    reference = _read(out_dir / "uninterrupted_end.safetensors")
    masters = [k for k in reference if k.endswith("/fp32")]
    worst = max((end[k] - reference[k]).abs().max().item() for k in masters)
    # The difference relative to how far the uninterrupted run moved in those 3 steps.
    moved = torch.cat([(reference[k] - saved[k]).reshape(-1) for k in masters]).norm()
    differ = torch.cat([(end[k] - reference[k]).reshape(-1) for k in masters]).norm()
    return {
        "load_exact": exact,
        "losses": losses,
        "max_master_diff": worst,
        "relative_update_diff": (differ / moved).item(),
        "steps": engine.global_steps,
    }


def save_run_then_failed_load(rank: int, world: int, out: str, copy: str, stage: int, policy: LayoutPolicy | None) -> dict:
    """:func:`save_run`, then :func:`failed_load_changes_nothing` on a copy of its checkpoint
    (made by rank 0), in the same process group: one spawn for both."""
    saved = save_run(rank, world, out, stage, policy)
    if rank == 0:
        shutil.copytree(Path(out) / "ckpt", Path(copy) / "ckpt")
    dist.barrier()
    return {"save": saved, "failed_load": failed_load_changes_nothing(rank, world, copy)}


def failed_load_changes_nothing(rank: int, world: int, out: str) -> dict:
    """Corrupt one rank file that only rank 1 reads; the load fails on every rank, and
    every rank's engine is as before."""
    out_dir = Path(out)
    model, engine = build(seed=3, stage=2, policy=SAVE_POLICY)  # same layout: each rank reads its own file
    train(model, engine, 0, 1)
    before = full_state(engine)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    target = out_dir / "ckpt" / "step-00000003" / "rank-00001-of-00002.safetensors"
    if rank == 0:
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    engine.comm.barrier()
    try:
        load_checkpoint(engine, out_dir / "ckpt")
        message = None
    except ValueError as err:
        message = str(err)
    after = full_state(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and all(
        torch.equal(params_before[n], p) for n, p in model.named_parameters()
    )
    return {"message": message, "unchanged": unchanged}


def crash_during_save(rank: int, world: int, out: str, point: str, victim: int) -> None:
    """Save tag "good", then die (os._exit, no cleanup) on ``victim`` at ``point`` of saving "bad"."""
    model, engine = build(seed=0, stage=2)
    train(model, engine, 0, 1)
    save_checkpoint(engine, Path(out), "good")

    def fault(at: str, fault_rank: int) -> None:
        if at == point and fault_rank == victim:
            os._exit(17)

    train(model, engine, 1, 1)
    save_checkpoint(engine, Path(out), "bad", fault=fault)


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
