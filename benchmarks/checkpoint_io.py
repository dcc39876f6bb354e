"""Checkpoint save and load: time and bytes read per rank, resharded and not.

Two models: the demo TinyGPT (bf16, AdamW), and one of about 1 GB of fp32 state (fp32
master + exp_avg + exp_avg_sq = 12 bytes per parameter: 83M bf16 parameters). Ranks run as
threads of this process (file I/O releases the GIL), with synthesised states, at D = 2
and 4, loading at the same layout and resharded to another world size and to the compact
policy. The share column is what a rank must read at least: its partition of the fp32
master and the two Adam states. Every rank also reads model.safetensors whole.

    .venv/bin/python benchmarks/checkpoint_io.py [--skip-large]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from zeroshard.checkpoint import ReadStats, load_sharded, open_checkpoint, run_ranks, save_sharded
from zeroshard.checkpoint.format import MODEL_FILE
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout
from zeroshard.models import TinyGPT, gpt_param_groups, param_specs


def demo_specs() -> list[list[ParamSpec]]:
    with torch.device("meta"):
        model = TinyGPT()
    specs = {spec.name: spec for spec in param_specs(model, "bfloat16")}
    return [[specs[n] for n in names if n in specs] for names in gpt_param_groups(model)]


def large_specs(hidden: int = 1024, layers: int = 9) -> list[list[ParamSpec]]:
    """About 83M parameters: 1 GB of fp32 master + Adam state."""
    widths = {"attn": hidden, "mlp": 8 * hidden}
    weights = [ParamSpec(f"l{i}.{kind}", (hidden, widths[kind]), "bfloat16") for i in range(layers) for kind in widths]
    norms = [ParamSpec(f"l{i}.norm", (hidden,), "bfloat16") for i in range(layers)]
    return [weights, norms]


def save(specs, world: int, root: Path) -> tuple[float, int]:
    layout = build_layout(specs, world)
    states = [synthesize_state(layout, rank) for rank in range(world)]
    start = time.perf_counter()
    run_ranks(world, lambda coord: save_sharded(root, "ckpt", states[coord.rank], coordinator=coord), timeout=600)
    seconds = time.perf_counter() - start
    total = sum(f.stat().st_size for f in (root / "ckpt").iterdir())
    return seconds, total


def load(specs, root: Path, world: int, policy: LayoutPolicy) -> tuple[float, list[int], list[int]]:
    """Load at ``world`` ranks; (seconds, rank-file bytes read per rank, share per rank)."""
    layout = build_layout(specs, world, policy)
    ckpt = open_checkpoint(root / "ckpt")
    stats = [ReadStats() for _ in range(world)]
    start = time.perf_counter()
    run_ranks(world, lambda coord: load_sharded(ckpt, layout, coord.rank, stats=stats[coord.rank]), timeout=600)
    seconds = time.perf_counter() - start
    read = [s.total - s.bytes_by_file.get(MODEL_FILE, 0) for s in stats]
    share = [3 * 4 * sum(g.partition_numel for g in layout.groups)] * world
    return seconds, read, share


def report(name: str, specs) -> None:
    params = sum(s.numel for group in specs for s in group)
    print(f"\n{name}: {params:,} parameters, {12 * params / 1e6:,.1f} MB of fp32 master + Adam state")
    print(f"  {'case':<34} {'time s':>8} {'read/rank MB':>14} {'share/rank MB':>14} {'read/share':>10}")
    for world in (2, 4):
        root = Path(tempfile.mkdtemp(prefix="zs-bench-"))
        try:
            seconds, total = save(specs, world, root)
            print(f"  {f'save D={world}':<34} {seconds:>8.2f} {'':>14} {'':>14} {'':>10}   ({total / 1e6:,.1f} MB on disk)")
            targets = [(world, LayoutPolicy.native(), "same layout"), (6 - world, LayoutPolicy.native(compact=True), "resharded, compact")]
            for new_world, policy, label in targets:
                seconds, read, share = load(specs, root, new_world, policy)
                ratio = max(r / s for r, s in zip(read, share))
                case = f"load D={world}->{new_world} {label}"
                print(f"  {case:<34} {seconds:>8.2f} {max(read) / 1e6:>14.1f} {share[0] / 1e6:>14.1f} {ratio:>10.3f}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the demo model")
    args = parser.parse_args()
    report("demo TinyGPT", demo_specs())
    if not args.skip_large:
        report("large model", large_specs())


if __name__ == "__main__":
    main()
