"""Native load against the read floor and DeepSpeed's own load: time and peak RSS, same D and resharded.

One ``torchrun`` at D = 2 runs DeepSpeed 0.19.8's ZeRO-2 engine and zeroshard's stage 2 on the
same model (43 x [Linear(1024, 1024), LayerNorm(1024)], 45.2 M bf16 parameters, fp32 masters,
AdamW; ``--hidden``/``--layers`` change it), trains each one step and saves each its own
checkpoint. Then, in rounds whose order rotates every round, every rank times:

* ``floor``: ``os.preadv`` of the bytes the rank's load needs (its rank file's partitions and all
  of model.safetensors; for a resharded load the ranges of the old rank files it draws from)
  into one fresh ``np.empty`` buffer, a megabyte per call: reading those bytes once into new
  memory (as much as the load returns, so the same first-touch page faults), no checksum;
* ``load_sharded``: zeroshard's load of the rank's state (checks, CRCs, tensors) for the same D,
  and for D = 3 and D = 1 (resharded: rank ``r % D`` of the new layout);
* ``zeroshard engine``: ``engine_io.load_checkpoint`` (the load above, then the import into the
  running engine: weights, masters, optimizer state);
* ``deepspeed engine``: DeepSpeed's ``engine.load_checkpoint`` of its own checkpoint.

The page cache is warm (one untimed round first). Per round the slower rank's time counts;
the table gives medians over rounds and the median of the per-round ratios, of wall time and
of CPU time (user + system of the rank's process, all threads: on a machine shared with
other jobs the steadier figure), and the largest peak RSS a step added above the process's
RSS before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), against the
rank's state under the layout loaded (its fp32 partitions and optimizer state plus the bf16
model weights: the bytes the floor reads).

    .venv/bin/python benchmarks/load_vs_deepspeed.py [--rounds 7] [--hidden 1024] [--layers 43] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from deepspeed_adamw import zero2_bf16_adamw
from read_floor import needed_extents, read_floor
from torchrun_job import per_round, round_ratio, run_for_json, write_gathered

LR, BETAS = 3e-4, (0.9, 0.95)
RESHARD_WORLDS = (3, 1)


# ---- worker (one rank under torchrun) ----------------------------------------------------------


def _model(hidden: int, layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = [(nn.Linear(hidden, hidden), nn.LayerNorm(hidden)) for _ in range(layers)]
    return nn.Sequential(*[module for pair in layer for module in pair])


def _param_groups(model) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _inputs(hidden: int, rank: int):
    import torch

    return torch.randn(4, hidden, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)


def _deepspeed_engine(hidden: int, layers: int, rank: int, save_dir: Path):
    model = _model(hidden, layers)
    engine = zero2_bf16_adamw(model, _param_groups(model), LR, BETAS)
    loss = engine(_inputs(hidden, rank)).float().square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(save_dir), tag="t")
    return engine


def _zeroshard_engine(hidden: int, layers: int, rank: int, root: Path):
    import torch

    from zeroshard.checkpoint.engine_io import save_checkpoint
    from zeroshard.engine import ZeroOptimizer

    model = _model(hidden, layers)
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, _param_groups(model), stage=2, param_dtype=torch.bfloat16, lr=LR, betas=BETAS
    )
    loss = model(_inputs(hidden, rank)).float().square().mean()
    engine.backward(loss)
    engine.step()
    save_checkpoint(engine, root, "t")
    return engine


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _measure(run) -> dict[str, float]:
    """Wall and CPU seconds of ``run()`` and the peak RSS it added (bytes) above the RSS before it."""
    import torch.distributed as dist

    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before = _memory_kb("VmRSS")
    dist.barrier()
    cpu_start, start = time.process_time(), time.perf_counter()
    result = run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _memory_kb("VmHWM")
    del result
    gc.collect()
    return {"seconds": seconds, "cpu": cpu, "peak_added": 1024 * (peak - before)}


def worker(out_path: Path, work: Path, rounds: int, hidden: int, layers: int) -> None:
    import importlib

    import deepspeed
    import torch
    import torch.distributed as dist

    from zeroshard.checkpoint import load_sharded
    from zeroshard.checkpoint.engine_io import load_checkpoint

    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ds_engine = _deepspeed_engine(hidden, layers, rank, work / "deepspeed")
    zs_engine = _zeroshard_engine(hidden, layers, rank, work / "zeroshard")
    native = work / "zeroshard" / "t"
    layouts = {world_size: zs_engine.layout}
    layouts.update({world: zs_engine.layout.with_world_size(world) for world in RESHARD_WORLDS})
    extents = {world: needed_extents(native, layout, rank % world) for world, layout in layouts.items()}
    steps = {"deepspeed engine": lambda: ds_engine.load_checkpoint(str(work / "deepspeed"), tag="t")}
    steps["zeroshard engine"] = lambda: load_checkpoint(zs_engine, native)
    for world, layout in layouts.items():
        steps[f"floor D={world}"] = lambda extents=extents[world]: read_floor(extents)
        steps[f"load_sharded D={world}"] = lambda layout=layout, world=world: load_sharded(native, layout, rank % world)
    names = list(steps)
    records: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(rounds + 1):  # the first round warms the page cache and is not kept
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            record = _measure(steps[name])
            if round_index:
                records[name].append(record)
    state = zs_engine.export_state()
    state_bytes = sum(t.nbytes for t in state.fp32_partitions)
    state_bytes += sum(t.nbytes for group in state.optimizer_states for t in group.values())
    state_bytes += sum(t.nbytes for t in zs_engine.model.state_dict().values())
    floor_bytes = {world: sum(end - begin for _, begin, end in found) for world, found in extents.items()}
    mine = {"records": records, "state_bytes": state_bytes, "floor_bytes": floor_bytes}
    params = sum(p.numel() for p in zs_engine.model.parameters())
    kinds = ("deepspeed", "zeroshard")
    sizes = {kind: sum(f.stat().st_size for f in (work / kind).rglob("*") if f.is_file()) for kind in kinds}
    write_gathered(out_path, mine, params=params, disk=sizes)
    deepspeed.comm.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tests/deepspeed_fixtures.py: skip gloo's interpreter teardown


# ---- launcher and report --------------------------------------------------------------------------


def launch(rounds: int, hidden: int, layers: int, directory: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="zs-load-", dir=directory))
    try:
        out = work / "result.json"
        args = ["--worker", str(out), "--work", str(work), "--rounds", str(rounds)]
        args += ["--hidden", str(hidden), "--layers", str(layers)]
        return run_for_json(__file__, 2, args, out, timeout=3600, DS_ACCELERATOR="cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict) -> None:
    world = result["world_size"]
    state_bytes = max(r["state_bytes"] for r in result["ranks"])
    disk = result["disk"]
    rounds = len(result["ranks"][0]["records"]["floor D=2"])
    print(
        f"{result['params']:,} parameters at D={world}; checkpoints: zeroshard {disk['zeroshard'] / 1e6:.0f} MB, "
        f"DeepSpeed {disk['deepspeed'] / 1e6:.0f} MB; one rank's state {state_bytes / 1e6:.0f} MB; "
        f"{rounds} rounds; load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        f"{'step':<22}{'MB read':>8}{'wall s':>8}{'vs floor':>9}{'vs DS':>7}"
        f"{'cpu s':>8}{'vs floor':>9}{'vs DS':>7}{'peak +MB':>9}{'/ state':>8}"
    )
    print(header)
    print("-" * len(header))
    ds = "deepspeed engine"
    for name in result["ranks"][0]["records"]:
        target = name.split("D=")[-1] if "D=" in name else str(world)
        floor = f"floor D={target}"
        read = max(r["floor_bytes"][target] for r in result["ranks"]) / 1e6 if name == floor else None
        row = f"{name:<22}" + (f"{read:>8.0f}" if read is not None else f"{'':>8}")
        for key in ("seconds", "cpu"):
            median = statistics.median(per_round(result, name, key))
            vs_ds = f"{round_ratio(result, name, ds, key):>7.2f}" if "engine" in name else f"{'':>7}"
            row += f"{median:>8.3f}{round_ratio(result, name, floor, key):>9.2f}{vs_ds}"
        peak = max(per_round(result, name, "peak_added"))
        state = max(r["floor_bytes"][target] for r in result["ranks"])  # the rank's state under that layout
        print(row + f"{peak / 1e6:>9.0f}{peak / state:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-round, per-rank records here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.work, args.rounds, args.hidden, args.layers)
        return
    result = launch(args.rounds, args.hidden, args.layers, args.dir)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    report(result)


if __name__ == "__main__":
    main()
