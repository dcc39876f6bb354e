"""Checkpoint bytes per rank of an MoE run, and load time across (W, EP).

The state of MoEGPT (8 experts, top-2, d_model 64, 2 layers; fp32 masters and AdamW's two
states) is synthesised for every rank at each (W, EP) and saved by thread ranks. Printed:

* bytes of tensor data each rank file holds, against the minimum (the rank's 1/W share of
  all real elements: every rank holds 1/W of the dense state and, over its W / EP expert-DP
  ranks, 1/W of the experts), and the expert bytes of all rank files together against the
  experts' own bytes (1.000x: no expert written twice, none lost);
* the time to load rank 0's state at (2, 1) and at (4, 4) from the (4, 2) checkpoint,
  against loading it at (4, 2) (each rank reads its own file whole).

Run: ``python benchmarks/moe_checkpoint.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from zeroshard.checkpoint import load_sharded, run_ranks, save_sharded
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.layout import ExpertMesh, ParamSpec, build_layout, global_shape
from zeroshard.moe import MoEConfig, MoEGPT, expert_param_names

CONFIG = MoEConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64, num_experts=8, top_k=2, expert_hidden=128)
WORLDS = [(4, 1), (4, 2), (4, 4), (8, 4)]
TENSORS_PER_ELEMENT = 3  # fp32 master, exp_avg, exp_avg_sq


def moe_layout(world_size: int, ep_size: int):
    model = MoEGPT(CONFIG)
    params = dict(model.named_parameters())
    dense, experts = expert_param_names(model)
    local = CONFIG.num_experts // ep_size
    dense_specs = [ParamSpec.of(name, tuple(params[name].shape), "float32") for name in dense]
    expert_specs = [ParamSpec.of(name, (local, *params[name].shape[1:]), "float32") for name in experts]
    mesh = ExpertMesh(world_size, ep_size)
    return build_layout([dense_specs, mesh.expert_group(expert_specs, CONFIG.num_experts)], world_size)


def save(root: Path, layout) -> Path:
    states = [synthesize_state(layout, rank) for rank in range(layout.world_size)]
    return run_ranks(layout.world_size, lambda coord: save_sharded(root, "t", states[coord.rank], coordinator=coord))[0]


def data_bytes(path: Path, group: int | None = None) -> int:
    with safe_open(path, framework="numpy") as handle:
        keys = [k for k in handle.keys() if group is None or k.startswith(f"group{group}.")]  # noqa: SIM118
        return sum(handle.get_tensor(k).nbytes for k in keys if ".scalar." not in k)


def bytes_table(root: Path) -> None:
    print("| W | EP | bytes/rank (max) | vs min | expert bytes, all ranks | vs the experts' |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for world_size, ep_size in WORLDS:
        layout = moe_layout(world_size, ep_size)
        directory = save(root / f"w{world_size}ep{ep_size}", layout)
        files = [directory / f"rank-{r:05d}-of-{world_size:05d}.safetensors" for r in range(world_size)]
        real = sum(math.prod(global_shape(g, s)) for g in layout.groups for s in g.params)
        minimum = real * 4 * TENSORS_PER_ELEMENT / world_size
        experts = layout.groups[1]
        expert_real = sum(math.prod(global_shape(experts, s)) for s in experts.params) * 4 * TENSORS_PER_ELEMENT
        written = sum(data_bytes(f, group=1) for f in files)
        largest = max(data_bytes(f) for f in files)
        print(
            f"| {world_size} | {ep_size} | {largest:,} | {largest / minimum:.3f}x | {written:,} | "
            f"{written / expert_real:.3f}x |"
        )


def load_times(root: Path, rounds: int) -> None:
    directory = save(root / "source", moe_layout(4, 2))
    targets = {"(4, 2) same layout": moe_layout(4, 2), "(2, 1)": moe_layout(2, 1), "(4, 4)": moe_layout(4, 4)}
    times: dict[str, list[float]] = {label: [] for label in targets}
    for _ in range(rounds):
        for label, layout in targets.items():
            start = time.perf_counter()
            load_sharded(directory, layout, 0)
            times[label].append(time.perf_counter() - start)
    baseline = statistics.median(times["(4, 2) same layout"])
    print("\n| load of rank 0 from (4, 2) | median | vs same layout |")
    print("| --- | ---: | ---: |")
    for label, measured in times.items():
        print(f"| {label} | {statistics.median(measured) * 1e3:.1f} ms | {statistics.median(measured) / baseline:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bytes_table(Path(tmp))
        load_times(Path(tmp), args.rounds)


if __name__ == "__main__":
    main()
