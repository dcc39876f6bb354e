"""zeroshard's ZeRO stage 2 against DeepSpeed's, same model and data, in the same run.

The medium TinyGPT of issue 13 (vocab 8192, d_model 256, 4 layers, 4 heads, sequences of 64
tokens, 16 per rank) trains with bf16 parameters, fp32 masters, AdamW (torch's), clipping
at 1.0, on gloo with one thread per rank, at D = 2 and 4. Variants, in one process group:

* DeepSpeed 0.19.8 ZeRO stage 2 as configured by a user (bf16; it reduces in bf16);
* zeroshard stage 2, reducing in fp32 (the default) and in bf16 (``reduce_dtype``), with
  the default buckets (one per group at this size, reduced when backward ends, as
  DeepSpeed's default) and with 1M-element buckets, reduced while backward goes on;
* the floor under any ZeRO-2 engine with torch's AdamW: the bare bf16 model's forward and
  backward (gradients dropped, nothing reduced), then torch's AdamW on one flat fp32 tensor
  of this rank's partition size (numel / D), as both engines update their partition.

Each round every variant runs ``--steps`` steps, in an order that rotates every round, so
load on the machine hits all alike; the figures are medians over rounds and ranks of the
per-step times (forward, backward, step, total), and of the CPU time the rank's process
used per step (all its threads: a figure that contention on a busy machine disturbs less
than wall time; "cpu fwd+bwd" up to the end of backward), and of the idle time (wall - CPU:
waiting on a collective, on another rank or for a core). Bytes per step per rank are what the
process wrote in that step (``wchar`` of /proc/self/io: gloo's socket writes; nothing else
writes during a step), and for zeroshard also the payloads its ``comm.bytes_moved`` records.

    .venv/bin/python benchmarks/engine_vs_deepspeed.py [--world-sizes 2 4] [--rounds 7] [--steps 3]

The launcher starts ``torchrun`` per world size with this file as the worker.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from torchrun_job import add_round_arguments, exit_worker, run_rounds, write_gathered

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 8192, 256, 4, 4, 64, 16
LR, WEIGHT_DECAY, BETAS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1.0
OVERLAP_BUCKET_NUMEL = 1 << 20  # 2 MiB of bf16 gradient: several buckets, reduced while backward goes on
VARIANTS = (
    "deepspeed stage 2",
    "zeroshard stage 2",
    "zeroshard stage 2 bf16-reduce",
    "zeroshard bf16-reduce 1M buckets",
    "floor: model + AdamW",
)


# ---- worker (one rank under torchrun) ----------------------------------------------------------


def _model(config=None, device: str = "cpu"):
    """The medium TinyGPT (or ``config``'s), seeded, on ``device``."""
    import torch

    from zeroshard.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    config = config or GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=D_MODEL)
    return TinyGPT(config).to(device)


def _param_groups(model) -> list[dict]:
    from zeroshard.models import gpt_param_groups

    params = dict(model.named_parameters())
    decay, no_decay = gpt_param_groups(model)
    return [
        {"params": [params[n] for n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]


def _batch(step: int, rank: int):
    import torch

    generator = torch.Generator().manual_seed(step * 1009 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _written() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


class DeepSpeedVariant:
    def __init__(self, world_size: int, model_config=None, batch: int = BATCH, device: str = "cpu") -> None:
        import deepspeed

        model = _model(model_config, device)
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "torch_adam": True}},
            "bf16": {"enabled": True},
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_param_groups(model), config=config)
        self.moved = None

    def forward(self, idx, targets):
        return self.engine(idx, targets)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


class ZeroshardVariant:
    def __init__(self, reduce_dtype, bucket_numel: int | None = None, model_config=None, device: str = "cpu") -> None:
        import torch

        from zeroshard.engine import ZeroOptimizer
        from zeroshard.layout import LayoutPolicy

        self.model = _model(model_config, device)
        self.engine = ZeroOptimizer(
            self.model,
            torch.optim.AdamW,
            _param_groups(self.model),
            stage=2,
            param_dtype=torch.bfloat16,
            reduce_dtype=reduce_dtype,
            policy=LayoutPolicy.native(bucket_numel=bucket_numel) if bucket_numel else None,
            max_grad_norm=CLIP,
            lr=LR,
            betas=BETAS,
        )
        self.moved = self.engine.comm.bytes_moved

    def forward(self, idx, targets):
        return self.model(idx, targets)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()
        self.engine.zero_grad()


class FloorVariant:
    """The work any ZeRO-2 engine does at least: the model's forward and backward, and the
    optimizer's update of this rank's fp32 partition."""

    def __init__(self, world_size: int, model_config=None, device: str = "cpu") -> None:
        import torch

        self.model = _model(model_config, device).to(torch.bfloat16)
        numel = sum(p.numel() for p in self.model.parameters())
        partition = torch.nn.Parameter(torch.randn(numel // world_size, device=device) * 0.02)
        partition.grad = torch.randn_like(partition) * 1e-3
        self.optimizer = torch.optim.AdamW([partition], lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        self.moved = None

    def forward(self, idx, targets):
        return self.model(idx, targets)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)


def _timed_step(variant, step: int, rank: int) -> dict[str, float]:
    import torch.distributed as dist

    idx, targets = _batch(step, rank)
    dist.barrier()
    moved_before = dict(variant.moved) if variant.moved is not None else None
    written = _written()
    cpu_start, start = time.process_time(), time.perf_counter()
    loss = variant.forward(idx, targets)
    forward_done = time.perf_counter()
    variant.backward(loss)
    cpu_backward, backward_done = time.process_time(), time.perf_counter()
    variant.step()
    cpu_done, done = time.process_time(), time.perf_counter()
    record = {
        "forward": forward_done - start,
        "backward": backward_done - forward_done,
        "step": done - backward_done,
        "total": done - start,
        "cpu": cpu_done - cpu_start,
        "cpu_backward": cpu_backward - cpu_start,
        "idle": (done - start) - (cpu_done - cpu_start),
        "wire_bytes": _written() - written,
        "loss": float(loss),
    }
    if moved_before is not None:
        record["payload_bytes"] = sum(variant.moved.values()) - sum(moved_before.values())
    return record


def worker(out_path: Path, rounds: int, steps: int, warmup: int) -> None:
    import importlib

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variants = {
        "deepspeed stage 2": DeepSpeedVariant(world_size),
        "zeroshard stage 2": ZeroshardVariant(torch.float32),
        "zeroshard stage 2 bf16-reduce": ZeroshardVariant(torch.bfloat16),
        "zeroshard bf16-reduce 1M buckets": ZeroshardVariant(torch.bfloat16, OVERLAP_BUCKET_NUMEL),
        "floor: model + AdamW": FloorVariant(world_size),
    }
    records: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(warmup + rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            for step in range(steps):
                record = _timed_step(variants[name], round_index * steps + step, rank)
                if round_index >= warmup:
                    records[name].append(record)
    params = sum(p.numel() for p in variants["zeroshard stage 2"].model.parameters())
    write_gathered(out_path, records, params=params)
    exit_worker()


# ---- launcher and report --------------------------------------------------------------------------


def launch(world_size: int, rounds: int, steps: int, warmup: int) -> dict:
    return run_rounds(__file__, world_size, rounds, steps, warmup)


def _median(result: dict, name: str, key: str) -> float:
    return statistics.median(record[key] for records in result["ranks"] for record in records[name])


def report(result: dict) -> None:
    world_size = result["world_size"]
    print(f"\nD = {world_size}: {result['params']:,} parameters; medians over ranks and steps")
    header = (
        f"{'variant':<31}{'total ms':>10}{'fwd ms':>9}{'bwd ms':>9}{'step ms':>9}{'vs DS':>8}"
        f"{'cpu ms':>9}{'cpu fwd+bwd':>13}{'vs DS':>8}{'idle ms':>9}{'wire MB/step':>14}{'vs DS':>8}{'payload MB':>12}"
    )
    print(header)
    print("-" * len(header))
    ds_total = _median(result, VARIANTS[0], "total")
    ds_wire = _median(result, VARIANTS[0], "wire_bytes")
    ds_cpu = _median(result, VARIANTS[0], "cpu")
    for name in VARIANTS:
        total, wire = _median(result, name, "total"), _median(result, name, "wire_bytes")
        payload = _median(result, name, "payload_bytes") / 1e6 if name.startswith("zeroshard") else float("nan")
        print(
            f"{name:<31}{1e3 * total:>10.1f}{1e3 * _median(result, name, 'forward'):>9.1f}"
            f"{1e3 * _median(result, name, 'backward'):>9.1f}{1e3 * _median(result, name, 'step'):>9.1f}"
            f"{total / ds_total:>8.3f}{1e3 * _median(result, name, 'cpu'):>9.1f}"
            f"{1e3 * _median(result, name, 'cpu_backward'):>13.1f}{_median(result, name, 'cpu') / ds_cpu:>8.3f}"
            f"{1e3 * _median(result, name, 'idle'):>9.1f}{wire / 1e6:>14.2f}{wire / ds_wire:>8.3f}{payload:>12.2f}"
        )
    floor_cpu = _median(result, VARIANTS[-1], "cpu")
    print(f"floor / DeepSpeed CPU time: {floor_cpu / ds_cpu:.3f}; engine's own CPU per step (CPU - floor):")
    for name in VARIANTS[:-1]:
        own = _median(result, name, "cpu") - floor_cpu
        print(f"  {name:<33}{1e3 * own:>7.1f} ms = {own / _median(result, name, 'cpu'):.1%} of its step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_arguments(parser)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.rounds, args.steps, args.warmup)
        return
    print(
        f"TinyGPT vocab {VOCAB}, d_model {D_MODEL}, {LAYERS} layers, seq {SEQ}, batch {BATCH} per rank; bf16 params, "
        f"fp32 masters, AdamW, clip {CLIP}; gloo, 1 thread per rank; {args.rounds} rounds x {args.steps} steps"
    )
    start = time.perf_counter()
    for world_size in args.world_sizes:
        report(launch(world_size, args.rounds, args.steps, args.warmup))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
