"""MoEGPT under ZeRO stage 2 with expert parallelism at W = 4, EP = 1, 2, 4 (gloo, CPU).

One spawn of 4 ranks builds one engine per EP (bf16 parameters, fp32 masters and fp32
reduction, AdamW) and trains them interleaved, step by step in a rotating order so load on
the machine hits every EP alike. Per EP it prints:

* per-rank memory (``engine.memory_report()``: bf16 parameters, fp32 masters, AdamW's two
  states, fp32 gradient partitions) against the formula without padding:
  ``2 (P_d + P_e E/EP) + 16 (P_d / W + P_e E/W)`` bytes, P_d the dense parameters, P_e one
  expert's, E the experts: a rank holds E/EP experts' bf16 weights, and their fp32 state is
  sharded over the W/EP ranks of its expert-DP group;
* bytes per step and rank by collective: the all-to-all payload of the MoE layers (token rows
  sent to other EP ranks, forward and backward; the per-expert counts; the rows a rank keeps
  are not sent), against the minimum, the rows whose expert lives on another EP rank, each
  sent four times (dispatch, combine, and their gradients), as the mean over ranks (a rank
  sends back what others dispatched to it, so single ranks differ); the
  reduce-scatter and all-gather payloads (dense over all W ranks plus expert over the expert-DP
  group) against the minimum, the fp32 gradient and bf16 parameters of what the rank holds
  (P_d + P_e E/EP), padding excluded;
* the median step time (forward, backward, step), and its ratio to EP = 1;
* checkpoint bytes each rank writes (``save_checkpoint`` after the steps): its rank file's
  dense and expert tensors (fp32 master and AdamW's two states, 12 bytes an element) against
  ``12 P_d / W`` and ``12 P_e E / W`` (an expert's state is sharded over the W/EP ranks of
  its expert-DP group, which hold E/EP experts), and the expert bytes of all ranks together
  against ``12 P_e E``: every expert written once. Rank 0 also writes the model file (dense
  bf16 weights and buffers; expert weights are the masters cast, left out) and the manifest.

    .venv/bin/python benchmarks/moe_step.py [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.checkpoint.engine_io import save_checkpoint
from zeroshard.checkpoint.format import MANIFEST_FILE, MODEL_FILE, rank_file_name
from zeroshard.io.safetensors_io import read_header
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn
from zeroshard.moe import MoEConfig, MoEGPT, moe_param_groups, new_expert_groups, per_expert_state_dict

moe_dispatch = importlib.import_module("zeroshard.moe.dispatch")  # the module (zeroshard.moe.dispatch is also its function)

WORLD_SIZE = 4
EP_SIZES = (1, 2, 4)
CONFIG = MoEConfig(
    vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, num_experts=8, top_k=2, expert_hidden=128
)
BATCH_SIZE = 8  # sequences of block_size tokens per rank

_all_to_all = dist.all_to_all_single
_sent = Counter()  # bytes sent to other ranks by the MoE layers' all-to-alls, per label


def _counting_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
    """Counts what leaves this rank: the rows (or equal chunks) for the other ranks."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    row_bytes = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
    splits = input_split_sizes or [input.shape[0] // size] * size
    label = "counts" if input.dtype == torch.int64 else "rows"
    _sent[label] += sum(rows for peer, rows in enumerate(splits) if peer != rank) * row_bytes
    return _all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)


class _CountingDist:
    """torch.distributed as the MoE token dispatch sees it, its all-to-alls counted. Only the
    dispatch's: the engine's gloo all-gather of two ranks is an all-to-all too (comm.py), and
    counting it here would add the expert-DP gather to the token traffic."""

    all_to_all_single = staticmethod(_counting_all_to_all)

    def __getattr__(self, name: str):
        return getattr(dist, name)


@contextlib.contextmanager
def counting_dispatch():
    """Count the bytes the MoE layers' token dispatch sends (into ``_sent``) while inside."""
    real = moe_dispatch.dist
    moe_dispatch.dist = _CountingDist()
    try:
        yield
    finally:
        moe_dispatch.dist = real


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 101 + rank)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH_SIZE, CONFIG.block_size), generator=generator)
    return idx, (idx * 3 + 1) % CONFIG.vocab_size


def off_rank_rows(model: MoEGPT, idx: torch.Tensor, ep_size: int, ep_rank: int) -> int:
    """Routed rows of this rank's tokens whose expert lives on another EP rank (all layers)."""
    rows, local = 0, CONFIG.num_experts // ep_size
    hooks = []
    for block in model.blocks:

        def count(module, inputs, _output):
            nonlocal rows
            _, experts = module.route(inputs[0].reshape(-1, inputs[0].shape[-1]))
            rows += int((experts // local != ep_rank).sum())

        hooks.append(block.moe.register_forward_hook(count))
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    return rows


def build(ep_size: int, state: dict[str, torch.Tensor]):
    groups = new_expert_groups(ep_size)
    model = MoEGPT(CONFIG, ep_group=groups.ep)
    model.load_state_dict(state, strict=True)
    engine = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        moe_param_groups(model),
        stage=2,
        param_dtype=torch.bfloat16,
        expert_process_group=groups.expert_dp,
        max_grad_norm=1.0,
        lr=3e-3,
        weight_decay=0.1,
    )
    return groups, model, engine


def state_bytes(report) -> int:
    """The report's training state: its total less stage 2's reusable bucket buffers."""
    return report.total_bytes - report.bucket_pool_bytes


def checkpoint_bytes(engine: ZeroOptimizer, root: Path) -> dict:
    """Save; the bytes of this rank's file by kind of group (tensor payload), its size, and
    on rank 0 the model file and manifest."""
    directory = save_checkpoint(engine, root)
    path = directory / rank_file_name(engine.rank, engine.world_size)
    payload = Counter()
    for name, entry in read_header(path, path.stat().st_size).items():
        group = engine.layout.groups[int(name.split(".")[0].removeprefix("group"))]
        payload["expert" if group.is_expert_group else "dense"] += entry.end - entry.begin
    shared = {"model": (directory / MODEL_FILE).stat().st_size, "manifest": (directory / MANIFEST_FILE).stat().st_size}
    return {**payload, "file": path.stat().st_size, **(shared if engine.rank == 0 else {})}


def step_figures(
    engine: ZeroOptimizer, ep: int, steps: int, start_bytes: dict, sent: Counter, minimum_rows: int, times: list, row_bytes: int
) -> dict:
    """One EP's figures per step on this rank (see the module docstring), from the bytes its
    Collectives moved since ``start_bytes``, the dispatch bytes ``sent``, the routed rows of
    other EP ranks' experts and the step times; ``row_bytes``: one token row's."""
    moved = Counter()
    for name, comm in engine.comms.items():
        moved += Counter({k: v - start_bytes[name][k] for k, v in comm.bytes_moved.items()})
    dense = sum(g.param_numel for g in engine.layout.groups if not g.is_expert_group)
    expert = sum(g.param_numel for g in engine.layout.groups if g.is_expert_group)  # E/EP experts
    world_size = engine.world_size
    return {
        "memory": state_bytes(engine.memory_report()),
        "formula": 2 * (dense + expert) + 16 * dense / world_size + 16 * expert * ep / world_size,
        "all_to_all": (sent["rows"] + sent["counts"]) / steps,
        "all_to_all_min": 4 * minimum_rows * row_bytes / steps,  # dispatch, combine, both backward
        "reduce_scatter": moved["reduce_scatter"] / steps,
        "reduce_scatter_min": 4 * (dense + expert),
        "all_gather": moved["all_gather"] / steps,
        "all_gather_min": 2 * (dense + expert),
        "step_s": statistics.median(times),
        "dense_numel": dense,
        "expert_numel_all": expert * ep,  # every expert of the model
    }


def print_step_table(per_rank: list[dict], ep_sizes: tuple[int, ...]) -> None:
    """The per-EP table of :func:`step_figures` (rank 0's; all-to-all: mean over ranks; step
    time: max over ranks of the median), step time against EP = 1."""
    print("figures of rank 0, all-to-all: mean over ranks, step time: max over ranks of the median")
    base = max(result[1]["step_s"] for result in per_rank)
    print(
        "EP | memory/rank | vs formula | all-to-all/step | vs min | reduce-scatter/step | vs min"
        " | all-gather/step | vs min | step | vs EP=1"
    )
    for ep in ep_sizes:
        r = per_rank[0][ep]
        step = max(result[ep]["step_s"] for result in per_rank)
        a2a = statistics.mean(result[ep]["all_to_all"] for result in per_rank)
        a2a_min = statistics.mean(result[ep]["all_to_all_min"] for result in per_rank)
        a2a_ratio = f"{a2a / a2a_min:.3f}x" if a2a_min else "-"
        print(
            f"{ep} | {r['memory'] / 1e6:.3f} MB | {r['memory'] / r['formula']:.3f}x | "
            f"{a2a / 1e3:.1f} kB | {a2a_ratio} | "
            f"{r['reduce_scatter'] / 1e3:.1f} kB | {r['reduce_scatter'] / r['reduce_scatter_min']:.3f}x | "
            f"{r['all_gather'] / 1e3:.1f} kB | {r['all_gather'] / r['all_gather_min']:.3f}x | "
            f"{step * 1e3:.1f} ms | {step / base:.2f}x"
        )


def interleaved_steps(runs: dict, steps: int, row_bytes: int, train_step, off_rank) -> dict:
    """Train every EP's (groups, model, engine) in ``runs`` ``steps`` steps, interleaved in a
    rotating order; per EP, :func:`step_figures`. ``train_step(ep, step)`` runs one forward
    and backward; ``off_rank(ep, step)`` counts that step's routed rows of other EP ranks."""
    ep_sizes = tuple(runs)
    times = {ep: [] for ep in ep_sizes}
    sent = {ep: Counter() for ep in ep_sizes}
    minimum_rows = {ep: 0 for ep in ep_sizes}
    start_bytes = {ep: {k: Counter(c.bytes_moved) for k, c in runs[ep][2].comms.items()} for ep in ep_sizes}
    for step in range(steps):
        for ep in ep_sizes[step % len(ep_sizes) :] + ep_sizes[: step % len(ep_sizes)]:
            engine = runs[ep][2]
            minimum_rows[ep] += off_rank(ep, step) if ep > 1 else 0
            _sent.clear()
            dist.barrier()
            begin = time.perf_counter()
            with counting_dispatch():
                train_step(ep, step)
            engine.step()
            engine.zero_grad()
            times[ep].append(time.perf_counter() - begin)
            sent[ep] += _sent
    return {
        ep: step_figures(runs[ep][2], ep, steps, start_bytes[ep], sent[ep], minimum_rows[ep], times[ep], row_bytes)
        for ep in ep_sizes
    }


def worker(rank: int, world_size: int, steps: int, checkpoint_root: str) -> dict:
    torch.manual_seed(0)
    state = per_expert_state_dict(MoEGPT(CONFIG))
    runs = {ep: build(ep, state) for ep in EP_SIZES}

    def train_step(ep: int, step: int) -> None:
        _, model, engine = runs[ep]
        engine.backward(model(*batch(step, rank)))

    def off_rank(ep: int, step: int) -> int:
        groups, model, _ = runs[ep]
        return off_rank_rows(model, batch(step, rank)[0], ep, groups.ep_rank)

    results = interleaved_steps(runs, steps, CONFIG.n_embd * 2, train_step, off_rank)  # bf16 rows
    for ep in EP_SIZES:
        results[ep]["checkpoint"] = checkpoint_bytes(runs[ep][2], Path(checkpoint_root) / f"ep{ep}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-step-") as root:
        per_rank = spawn(worker, WORLD_SIZE, (args.steps, root), backend="gloo", timeout_s=1800)
    print(f"MoEGPT {CONFIG}, W={WORLD_SIZE}, stage 2, bf16, {args.steps} steps")
    print_step_table(per_rank, EP_SIZES)
    print_checkpoint_bytes(per_rank)


def print_checkpoint_bytes(per_rank: list[dict]) -> None:
    print()
    print("checkpoint bytes written per rank (tensor payload of its rank file; fp32 master + 2 AdamW states)")
    print(
        "EP | dense/rank | vs 12 P_d/W | expert/rank | vs 12 P_e E/W | expert, all ranks | vs 12 P_e E"
        " | rank file | model file (rank 0) | manifest"
    )
    for ep in EP_SIZES:
        first = per_rank[0][ep]
        dense_formula = 12 * first["dense_numel"] / WORLD_SIZE
        expert_formula = 12 * first["expert_numel_all"] / WORLD_SIZE
        dense = [result[ep]["checkpoint"]["dense"] for result in per_rank]
        expert = [result[ep]["checkpoint"]["expert"] for result in per_rank]
        files = [result[ep]["checkpoint"]["file"] for result in per_rank]
        print(
            f"{ep} | {max(dense) / 1e3:.1f} kB | {min(dense) / dense_formula:.3f}-{max(dense) / dense_formula:.3f}x | "
            f"{max(expert) / 1e3:.1f} kB | {min(expert) / expert_formula:.3f}-{max(expert) / expert_formula:.3f}x | "
            f"{sum(expert) / 1e3:.1f} kB | {sum(expert) / (12 * first['expert_numel_all']):.3f}x | "
            f"{max(files) / 1e3:.1f} kB | {first['checkpoint']['model'] / 1e3:.1f} kB | "
            f"{first['checkpoint']['manifest'] / 1e3:.1f} kB"
        )


if __name__ == "__main__":
    main()
