"""Bytes a load reads per rank and over the job, and its time, against the read floor and DeepSpeed (issue 33).

One ``torchrun`` at D ranks (gloo, CPU) per model and D: zeroshard's stage-2 engine (and,
unless ``--no-deepspeed``, DeepSpeed 0.19.8's ZeRO-2 engine) on the same model, bf16
parameters with fp32 masters and AdamW, one step, each saves its own checkpoint. Then, in
rounds whose order rotates every round, every rank times:

* ``floor-cache``: ``os.preadv`` of exactly the bytes the rank's share of the load needs (its
  rank file's partitions, and the buffers and frozen parameters it is given to read) into one
  buffer touched before the rounds, a megabyte per call, no checksum: reading the job's bytes
  once, and nothing else (the load also pays the first-touch faults of the new memory it
  builds the state in, so that a failed load changes nothing);
* ``floor-dio``: the same bytes (page-rounded) read past the page cache (``O_DIRECT``,
  8 MiB a call), as the load reads big cold ranges, where the file system allows;
* ``floor``: per round, the faster of the two: the read floor every ratio is taken to;
* ``zeroshard``: ``load_checkpoint`` into the running engine (each rank reads its own
  partitions; the weights are rebuilt from the masters and all-gathered; the shared tensors
  read by one rank each and broadcast), which then frees the state it held on a thread
  (waited for after the step, untimed, so that the next step does not pay for it; the
  line ``freed after`` gives that wait);
* ``resume``: the same load into the engine as a resumed run's is (masters, and no
  optimizer state yet: it is dropped before the timing), which has less memory to free;
* ``universal``: ``load_checkpoint`` of the same state converted to a universal checkpoint
  (rank 0 converts it once, before the rounds), whose bytes per partition are the native
  ones less the padding, so it is held to the same floor;
* ``before``: the load as it was before issue 33 (every rank reads its partitions and all of
  model.safetensors, then the same import), for the bytes and the time it took;
* ``deepspeed``: DeepSpeed's ``engine.load_checkpoint`` of its own checkpoint;
* ``from-ds``: zeroshard's ``load_checkpoint`` of that DeepSpeed checkpoint (a migration);
  its bytes are held to the native floor, though a rank that reads any of a zip record
  reads all of it to check its CRC-32;
* ``gather``: the engine's masters cast and its parameter buffers all-gathered alone
  (``sync_params_from_masters``), which the ``zeroshard`` load does once it has read: the
  work that replaces reading the weights, shown apart from the floor (row ``floor+gather``:
  the two per round).

Bytes come from ``ReadStats`` (tensor data; what opening files cost is shown apart), and
the job's total is compared with what the job needs: every partition's masters and states
once, the shared tensors once. Column ``disk x``: what the kernel read from storage for the
job's ranks (``/proc/self/io``: direct reads, page-cache reads and the read-ahead they set
off) over what the job needs, with cold reads the check that nothing is read twice below
the loader's own counts. Per round the slower rank's time counts; the table gives
medians over rounds and the median per-round ratio to the floor and to DeepSpeed, wall and
CPU time (user + system of the rank's process).

Models, each with a frozen Linear(1024, 1024) and a buffer besides: ``45m`` (43 x
[Linear(1024, 1024), LayerNorm(1024)]: 45.2 M trained bf16 parameters, 0.54 GB of fp32
master + Adam state) and ``1gb`` (9 x [Linear(1024, 1024), Linear(1024, 4096),
Linear(4096, 1024)]: 84.9 M, 1.02 GB of state).

With ``--cold`` every timed step starts with the checkpoints dropped from the page cache
(:func:`read_floor.evict`), so floor and loads read from the disk; without it, from memory.
``--read-bps B`` (root; implies ``--cold``) limits the job's disk reads to B bytes a second
in all (:func:`read_floor.throttled_reads`): storage of steady bandwidth shared by the ranks.

    .venv/bin/python benchmarks/load_bytes.py [--models 45m 1gb] [--worlds 2 4] [--rounds 3] [--no-deepspeed] [--cold] [--read-bps 1e9]
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
from contextlib import nullcontext
from pathlib import Path

from deepspeed_adamw import zero2_bf16_adamw
from read_floor import direct_floor_buffer, direct_read_floor, evict, needed_extents, read_floor, throttled_reads
from torchrun_job import per_round, round_ratio, run_for_json, write_gathered

LR, BETAS = 3e-4, (0.9, 0.95)
MODELS = {"45m": (1024, 43, 1), "1gb": (1024, 9, 4)}  # hidden, layers, MLP width (x hidden; 1: a LayerNorm instead)


# ---- worker (one rank under torchrun) ----------------------------------------------------------


def _model(name: str):
    import torch
    from torch import nn

    hidden, layers, wide = MODELS[name]
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        if wide == 1:
            modules += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden)]
        else:
            modules += [nn.Linear(hidden, hidden), nn.Linear(hidden, wide * hidden), nn.Linear(wide * hidden, hidden)]
    frozen = nn.Linear(hidden, hidden)
    frozen.requires_grad_(False)
    model = nn.Sequential(*modules, frozen)
    model.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))
    return model


def _param_groups(model) -> list[dict]:
    trained = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]


def _inputs(hidden: int, rank: int):
    import torch

    return torch.randn(4, hidden, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)


def _deepspeed_engine(name: str, rank: int, save_dir: Path):
    model = _model(name)
    engine = zero2_bf16_adamw(model, _param_groups(model), LR, BETAS)
    engine.backward(engine(_inputs(MODELS[name][0], rank)).float().square().mean())
    engine.step()
    engine.save_checkpoint(str(save_dir), tag="t")
    return engine


def _zeroshard_engine(name: str, rank: int, root: Path):
    import torch

    from zeroshard.checkpoint.engine_io import save_checkpoint
    from zeroshard.engine import ZeroOptimizer

    model = _model(name)
    model[-1].to(torch.bfloat16)  # the frozen layer runs in the parameters' dtype
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, _param_groups(model), stage=2, param_dtype=torch.bfloat16, lr=LR, betas=BETAS
    )
    engine.backward(model(_inputs(MODELS[name][0], rank)).float().square().mean())
    engine.step()
    save_checkpoint(engine, root, "t")
    return engine


def _drop_optimizer_state(engine) -> None:
    """The engine as a resumed run's is before its load: masters, no optimizer state yet
    (torch's optimizers make theirs at the first step)."""
    engine.optimizer.state.clear()
    engine.matrices.clear()


def _needed_extents(checkpoint_dir: Path, engine) -> list[tuple[Path, int, int]]:
    """The byte ranges this rank's share of a load needs: its partitions (masters and states)
    of every rank file it draws from, and the shared tensors it is given to read."""
    from zeroshard.checkpoint.formats import open_source
    from zeroshard.checkpoint.shared_module import share_checkpoint

    with open_source(checkpoint_dir) as source:
        mine = share_checkpoint(source.info.model_entries, engine.layout, engine.rank).mine
    return needed_extents(checkpoint_dir, engine.layout, engine.rank, mine)


def _load_before(engine, path: Path, stats):
    """The engine load before issue 33: every rank reads its partitions and the whole module
    file (``load_state`` without a share), then imports the weights it read."""
    from zeroshard.checkpoint.attest.attested import load_attested
    from zeroshard.checkpoint.engine_io import _coordinator
    from zeroshard.checkpoint.formats import open_source

    state, _ = load_attested(
        lambda: open_source(path), str(path), engine.layout, engine.rank, _coordinator(engine),
        module_state=engine.model.state_dict(), stats=stats,
    )  # fmt: skip
    engine.import_state(state, take=True)


def _measure(run, cold: Path | None) -> dict[str, float]:
    """Time ``run`` on every rank from a common start; with ``cold``, the files under it are
    dropped from the page cache first. A ``(prepare, run)`` pair has ``prepare`` run before,
    untimed."""
    import torch.distributed as dist

    if isinstance(run, tuple):
        prepare, run = run
        prepare()
    gc.collect()
    if cold is not None and dist.get_rank() == 0:
        evict(cold)
    dist.barrier()
    disk_start, cpu_start, start = _disk_bytes(), time.process_time(), time.perf_counter()
    run()
    record = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu_start}
    if disk_start is not None:
        record["disk"] = _disk_bytes() - disk_start
    # A load frees the state it replaced on a thread; the next step must not pay for it.
    from zeroshard.io.host_memory import wait_released

    released = time.perf_counter()
    wait_released()
    record["release"] = time.perf_counter() - released
    return record


def _disk_bytes() -> int | None:
    """Bytes this process (all its threads) has had read from storage: direct reads, reads
    through the page cache and the kernel's read-ahead they caused (``/proc/self/io``
    ``read_bytes``); None where the kernel does not say."""
    try:
        with open("/proc/self/io") as counters:
            fields = dict(line.split(": ") for line in counters.read().splitlines())
        return int(fields["read_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def worker(out_path: Path, work: Path, name: str, rounds: int, with_deepspeed: bool, cold: bool) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from zeroshard.checkpoint.engine_io import load_checkpoint
    from zeroshard.io.read_stats import ReadStats

    torch.set_num_threads(1)
    if with_deepspeed:
        import importlib

        import deepspeed

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
        deepspeed.init_distributed(dist_backend="gloo")
        ds_engine = _deepspeed_engine(name, dist.get_rank(), work / "deepspeed")
    else:
        dist.init_process_group("gloo")
    zs_engine = _zeroshard_engine(name, dist.get_rank(), work / "zeroshard")
    native = work / "zeroshard" / "t"
    universal = work / "universal"
    if dist.get_rank() == 0:
        from zeroshard.checkpoint.universal import to_universal

        to_universal(native, universal, progress=False)
    dist.barrier()
    extents = _needed_extents(native, zs_engine)
    # Touched once, before any round: the floor is the reads alone, not the first-touch page
    # faults of new memory, which vary more than the reads on this VM (and which the load pays).
    floor_buffer = np.ones(sum(end - begin for _, begin, end in extents), dtype=np.uint8)
    direct_buffer = direct_floor_buffer(extents)
    counted: dict[str, ReadStats] = {}

    def counting(key: str, load):
        def run():
            stats = counted[key] = ReadStats()
            load(stats)

        return run

    steps = {
        "floor-cache": lambda: read_floor(extents, into=floor_buffer),
        **({"floor-dio": lambda: direct_read_floor(extents, direct_buffer)} if direct_buffer is not None else {}),
        "zeroshard": counting("zeroshard", lambda stats: load_checkpoint(zs_engine, native, stats=stats)),
        "resume": (
            lambda: _drop_optimizer_state(zs_engine),
            counting("resume", lambda stats: load_checkpoint(zs_engine, native, stats=stats)),
        ),
        "universal": counting("universal", lambda stats: load_checkpoint(zs_engine, universal, stats=stats)),
        "before": counting("before", lambda stats: _load_before(zs_engine, native, stats)),
        "gather": zs_engine.sync_params_from_masters,  # the cast and all-gather inside the load
    }
    if with_deepspeed:
        steps["deepspeed"] = lambda: ds_engine.load_checkpoint(str(work / "deepspeed"), tag="t")
        steps["from-ds"] = counting("from-ds", lambda stats: load_checkpoint(zs_engine, work / "deepspeed" / "t", stats=stats))
    names = list(steps)
    records: dict[str, list[dict]] = {step: [] for step in names}
    for round_index in range(rounds + 1):  # the first round (warming the page cache) is not kept
        shift = round_index % len(names)
        for step in names[shift:] + names[:shift]:
            record = _measure(steps[step], work if cold else None)
            if round_index:
                records[step].append(record)
    floors = [records[step] for step in ("floor-cache", "floor-dio") if step in records]
    records = {"floor": [min(pair, key=lambda record: record["seconds"]) for pair in zip(*floors)], **records}
    reads = {key: {"data": stats.data, "opening": stats.opening, "files": stats.bytes_by_file} for key, stats in counted.items()}
    needed = sum(end - begin for _, begin, end in extents)
    state = sum(t.numel() * 4 for t in zs_engine.masters) * 3  # this rank's masters and two Adam states
    mine = {"records": records, "reads": reads, "needed": needed, "state": state}
    params = sum(p.numel() for p in zs_engine.model.parameters() if p.requires_grad)
    kinds = ("deepspeed", "zeroshard") if with_deepspeed else ("zeroshard",)
    sizes = {kind: sum(f.stat().st_size for f in (work / kind).rglob("*") if f.is_file()) for kind in (*kinds, "universal")}
    write_gathered(out_path, mine, params=params, disk=sizes, model=name, cold=cold)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's interpreter teardown (as load_vs_deepspeed.py)


# ---- launcher and report --------------------------------------------------------------------------


def launch(name: str, world: int, rounds: int, with_deepspeed: bool, directory: Path | None, cold: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="zs-load-bytes-", dir=directory))
    try:
        out = work / "result.json"
        args = ["--worker", str(out), "--work", str(work), "--models", name, "--rounds", str(rounds)]
        args += [] if with_deepspeed else ["--no-deepspeed"]
        args += ["--cold"] if cold else []
        return run_for_json(__file__, world, args, out, timeout=7200, DS_ACCELERATOR="cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict) -> None:
    world, ranks = result["world_size"], result["ranks"]
    needed = [r["needed"] for r in ranks]
    disk = ", ".join(f"{kind} {size / 1e6:.0f} MB" for kind, size in result["disk"].items())
    print(
        f"\n{result['model']}: {result['params']:,} trained parameters at D={world}; checkpoints: {disk}; "
        f"the job needs {sum(needed) / 1e6:.1f} MB (per rank {', '.join(f'{n / 1e6:.1f}' for n in needed)}); "
        f"{len(ranks[0]['records']['floor'])} rounds, {_reads_from(result)}; load average {os.getloadavg()[0]:.1f}"
    )
    header = f"{'step':<11}{'MB/rank (max)':>14}{'MB job':>9}{'x needed':>9}{'open MB':>8}{'disk x':>7}{'wall s':>8}{'/floor':>7}{'/DS':>6}{'cpu s':>7}{'/floor':>7}{'/DS':>6}"
    print(header)
    print("-" * len(header))
    for step in ranks[0]["records"]:
        reads = [r["reads"].get(step) for r in ranks]
        if reads[0] is not None:
            data = [read["data"] for read in reads]
            row = f"{step:<11}{max(data) / 1e6:>14.1f}{sum(data) / 1e6:>9.1f}{sum(data) / sum(needed):>9.3f}"
            row += f"{max(read['opening'] for read in reads) / 1e6:>8.2f}"
        elif step.startswith("floor"):
            row = f"{step:<11}{max(needed) / 1e6:>14.1f}{sum(needed) / 1e6:>9.1f}{1:>9.3f}{'':>8}"
        else:
            row = f"{step:<11}{'':>14}{'':>9}{'':>9}{'':>8}"
        row += _disk_ratio(ranks, step, sum(needed))
        for key in ("seconds", "cpu"):
            median = statistics.median(per_round(result, step, key))
            vs_ds = f"{round_ratio(result, step, 'deepspeed', key):>6.2f}" if "deepspeed" in ranks[0]["records"] else f"{'':>6}"
            row += f"{median:>8.3f}{round_ratio(result, step, 'floor', key):>7.2f}{vs_ds}"
        print(row)
    both = [a + b for a, b in zip(per_round(result, "floor", "seconds"), per_round(result, "gather", "seconds"))]
    load = per_round(result, "zeroshard", "seconds")
    ratio = statistics.median(a / b for a, b in zip(load, both))
    print(f"{'floor+gather':<11}{'':>14}{'':>9}{'':>9}{'':>8}{statistics.median(both):>8.3f}   zeroshard / (floor+gather): {ratio:.2f}")
    freed = per_round(result, "zeroshard", "release")
    print(f"{'freed after':<11}{'':>14}{'':>9}{'':>9}{'':>8}{statistics.median(freed):>8.3f}   (the replaced state, on a thread once zeroshard returned)")


def _disk_ratio(ranks: list[dict], step: str, needed: int) -> str:
    """The job's bytes read from storage by ``step`` over what it needs, median over rounds
    (with cold reads; from the page cache, about 0)."""
    records = [rank["records"][step] for rank in ranks]
    if any("disk" not in record for rank_records in records for record in rank_records):
        return f"{'':>7}"
    job = [sum(rank_records[i]["disk"] for rank_records in records) for i in range(len(records[0]))]
    return f"{statistics.median(job) / needed:>7.3f}"


def _reads_from(result: dict) -> str:
    if result.get("read_bps"):
        return f"cold, the job's reads limited to {result['read_bps'] / 1e9:g} GB/s"
    return "cold (files evicted before each)" if result.get("cold") else "page cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["45m", "1gb"], choices=sorted(MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoints from the page cache before every timed step")
    parser.add_argument("--read-bps", type=float, default=None, help="limit the job's disk reads to this many bytes a second (root; implies --cold)")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's records here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.work, args.models[0], args.rounds, not args.no_deepspeed, args.cold)
        return
    cold = args.cold or args.read_bps is not None
    throttle = nullcontext()
    if args.read_bps is not None:
        throttle = throttled_reads(args.dir or Path(tempfile.gettempdir()), int(args.read_bps))
    results = []
    with throttle:
        for name in args.models:
            for world in args.worlds:
                result = launch(name, world, args.rounds, not args.no_deepspeed, args.dir, cold)
                result["read_bps"] = args.read_bps
                results.append(result)
                report(result)
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
