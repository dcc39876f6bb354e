"""Engine step time, memory and communication for the demo TinyGPT at D = 1, 2, 4.

One spawn per world size (gloo, one thread per rank) trains, interleaved step by step in a
rotating order so load on the machine hits every variant alike:

* ZeRO stage 1 and stage 2 (bf16 parameters, fp32 masters, AdamW, as ``zeroshard demo``);
* stage 2 on a compact layout (``LayoutPolicy.native(compact=True)``: no padding between
  parameters), for the cost of 16-byte alignment;
* stage 2 with fp32 parameters, to tell the engine's cost from that of bf16 CPU kernels;
* torch DistributedDataParallel with AdamW on fp32 parameters (gradients as bucket views);
* at D = 1 also plain single-process training (fp32, AdamW, no wrapper).

Memory is the sum of the tensor bytes each variant holds per rank (resident-set growth is
too noisy for a 37k-parameter model): parameters, fp32 masters, optimizer state, and
gradients at their peak. For the engine the peak is sampled (``GradientMemoryProbe``) after
each parameter's engine hook, each reduce-scatter call and each step, counting the
reducer's ``held_tensors()`` and the reduce-scatter buffers still alive. Bytes moved are the payloads that
``engine.comm.bytes_moved`` records (the all-reduced buckets for DDP), per step, with one
micro-batch per step.

    .venv/bin/python benchmarks/engine_step.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from zeroshard.engine import ZeroOptimizer
from zeroshard.engine.probe import GradientMemoryProbe
from zeroshard.launch import spawn
from zeroshard.layout import LayoutPolicy
from zeroshard.models import TinyGPT, gpt_param_groups

WORLD_SIZES = (1, 2, 4)
BATCH_SIZE = 8  # sequences of block_size (32) tokens per rank, as the demo
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-3, 0.1, 1.0
ENGINE_VARIANTS = {
    "zero stage 1": dict(stage=1, policy=None),
    "zero stage 2": dict(stage=2, policy=None),
    "stage 2 compact": dict(stage=2, policy=LayoutPolicy.native(compact=True, bucket_numel=1 << 25)),
    "stage 2 fp32": dict(stage=2, policy=None, param_dtype=None),  # separates bf16 CPU kernels from engine cost
}


def build_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def param_groups(model: nn.Module) -> list[dict]:
    params = dict(model.named_parameters())
    decay, no_decay = gpt_param_groups(model)
    return [
        {"params": [params[n] for n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]


def batch(model: TinyGPT, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 64 + rank)
    config = model.config
    tokens = torch.randint(0, config.vocab_size, (BATCH_SIZE, config.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


# ---- variants: each has step(step_index) and memory_bytes() -------------------------------------


class EngineVariant:
    def __init__(self, rank: int, stage: int, policy: LayoutPolicy | None, param_dtype=torch.bfloat16) -> None:
        self.rank = rank
        self.model = build_model()
        self.engine = ZeroOptimizer(
            self.model,
            torch.optim.AdamW,
            param_groups(self.model),
            stage=stage,
            param_dtype=param_dtype,
            policy=policy,
            max_grad_norm=MAX_GRAD_NORM,
            lr=LR,
        )
        self.gradients = GradientMemoryProbe(self.engine, self.model)

    def step(self, index: int) -> None:
        idx, targets = batch(self.model, index, self.rank)
        self.engine.backward(self.model(idx, targets))
        self.gradients.sample()
        self.engine.step()
        self.gradients.sample()
        self.engine.zero_grad()

    def memory_bytes(self) -> int:
        engine = self.engine
        return (
            tensor_bytes(buffer.data for buffer in engine.buffers)
            + tensor_bytes(engine.masters)
            + optimizer_state_bytes(engine.optimizer)
            + self.gradients.peak_bytes
        )

    def gradient_bytes(self) -> int:
        return self.gradients.peak_bytes

    def bytes_moved(self) -> Counter:
        return Counter(self.engine.comm.bytes_moved)

    def expected_stage2_bytes(self) -> tuple[int, int]:
        """One reduce-scatter of the fp32 gradient buffer, one all-gather of the param buffer."""
        groups = self.engine.layout.groups
        gradient_buffer = sum(group.numel * 4 for group in groups)
        param_buffer = tensor_bytes(buffer.data for buffer in self.engine.buffers)
        return gradient_buffer, param_buffer


class TorchVariant:
    """fp32 training with torch.optim.AdamW: wrapped in DDP when distributed."""

    def __init__(self, rank: int, ddp: bool) -> None:
        self.rank = rank
        self.model = build_model()
        self.counter: Counter = Counter()
        self.trainer: nn.Module = self.model
        if ddp:
            self.trainer = nn.parallel.DistributedDataParallel(self.model, gradient_as_bucket_view=True)
            self.trainer.register_comm_hook(self.counter, count_and_all_reduce)
        self.optimizer = torch.optim.AdamW(param_groups(self.model), lr=LR)

    def step(self, index: int) -> None:
        idx, targets = batch(self.model, index, self.rank)
        self.trainer(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # DDP's bucket views stay allocated

    def memory_bytes(self) -> int:
        params = tensor_bytes(self.model.parameters())
        return params + self.gradient_bytes() + optimizer_state_bytes(self.optimizer)

    def gradient_bytes(self) -> int:
        return tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def bytes_moved(self) -> Counter:
        return Counter(self.counter)


def count_and_all_reduce(counter: Counter, bucket):
    counter["all_reduce"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


# ---- one world size -------------------------------------------------------------------------------


def run_world(rank: int, world_size: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    variants = {name: EngineVariant(rank, **options) for name, options in ENGINE_VARIANTS.items()}
    if world_size > 1:
        variants["torch DDP"] = TorchVariant(rank, ddp=True)
    else:
        variants["unsharded"] = TorchVariant(rank, ddp=False)
    times: dict[str, list[float]] = {name: [] for name in variants}
    moved_per_step: dict[str, Counter] = {}
    names = list(variants)
    for index in range(warmup + steps):
        # Interleaved, in an order that rotates every step: load and cache effects hit all alike.
        for name in names[index % len(names) :] + names[: index % len(names)]:
            variant = variants[name]
            if world_size > 1:
                dist.barrier()
            before = variant.bytes_moved()
            start = time.perf_counter()
            variant.step(index)
            elapsed = time.perf_counter() - start
            if index >= warmup:
                times[name].append(elapsed)
            moved_per_step[name] = variant.bytes_moved() - before
    stage2 = variants["zero stage 2"]
    return {
        "median_ms": {name: 1e3 * statistics.median(values) for name, values in times.items()},
        "memory_bytes": {name: variant.memory_bytes() for name, variant in variants.items()},
        "gradient_bytes": {name: variant.gradient_bytes() for name, variant in variants.items()},
        "moved": {name: dict(counter) for name, counter in moved_per_step.items()},
        "stage2_expected": stage2.expected_stage2_bytes(),
    }


# ---- report ---------------------------------------------------------------------------------------


def kib(value: float) -> str:
    return f"{value / 1024:,.1f}"


COLUMNS = [  # (title, width)
    ("variant", 18), ("median step ms", 15), ("max over ranks", 16), ("tensor KiB/rank", 17), ("of it grads", 13),
    ("reduce-scatter KiB", 20), ("all-gather KiB", 16), ("all-reduce KiB", 16),
]


def print_world(world_size: int, ranks: list[dict]) -> None:
    rank0 = ranks[0]
    print(f"\nD = {world_size}" + ("  (4 ranks share 2 cores)" if world_size > 2 else ""))
    header = "".join(f"{title:<{width}}" if i == 0 else f"{title:>{width}}" for i, (title, width) in enumerate(COLUMNS))
    print(header)
    print("-" * len(header))
    for name in rank0["median_ms"]:
        moved = rank0["moved"][name]
        cells = [
            name,
            f"{rank0['median_ms'][name]:.2f}",
            f"{max(r['median_ms'][name] for r in ranks):.2f}",
            kib(max(r["memory_bytes"][name] for r in ranks)),
            kib(max(r["gradient_bytes"][name] for r in ranks)),
            kib(moved.get("reduce_scatter", 0)),
            kib(moved.get("all_gather", 0)),
            kib(moved.get("all_reduce", 0)),
        ]
        print("".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))))
    gradient_buffer, param_buffer = rank0["stage2_expected"]
    moved = rank0["moved"]["zero stage 2"]
    reduce_scatter, all_gather = moved.get("reduce_scatter", 0), moved.get("all_gather", 0)
    print(
        f"stage 2 per step: reduce-scatter {reduce_scatter:,} B vs fp32 gradient buffer {gradient_buffer:,} B "
        f"(ratio {reduce_scatter / gradient_buffer:.3f}); all-gather {all_gather:,} B vs param buffer "
        f"{param_buffer:,} B (ratio {all_gather / param_buffer:.3f}); all-reduce {moved.get('all_reduce', 0):,} B"
    )
    aligned = statistics.median(r["median_ms"]["zero stage 2"] for r in ranks)
    compact = statistics.median(r["median_ms"]["stage 2 compact"] for r in ranks)
    print(
        f"alignment: stage 2 step {aligned:.2f} ms with the 16-byte layout vs {compact:.2f} ms compact "
        f"(ratio {aligned / compact:.3f}, median over ranks)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    model = build_model()
    config = model.config
    print(
        f"TinyGPT {config}: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"batch {BATCH_SIZE}x{config.block_size} tokens per rank; AdamW; engine in bf16 with fp32 masters unless "
        f"marked fp32, DDP and unsharded in fp32; gloo, 1 thread per rank; {args.steps} timed steps"
    )
    print(
        "tensor KiB/rank: sum of tensor bytes held per rank (not resident-set size): parameters + fp32 masters + "
        "optimizer state + peak gradient tensors (engine: held_tensors() and reduce-scatter buffers still alive)"
    )
    start = time.perf_counter()
    for world_size in WORLD_SIZES:
        print_world(world_size, spawn(run_world, world_size, (args.steps, args.warmup), timeout_s=300))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
