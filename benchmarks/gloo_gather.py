"""The parameter all-gather on gloo: torch's all-gather against ``Collectives.all_gather_into``.

One ``torchrun`` per world size (gloo, CPU, one thread a rank). Each rank holds its part of
a bf16 buffer the size of the 45m model of ``load_bytes.py`` (45.2 M elements, 90 MB), as the
engine's parameter buffer is after a step or a load; in rounds whose order alternates, every
rank times:

* ``torch``: ``all_gather_into_tensor`` of its part into the buffer, which gloo runs by
  receiving into a new flat tensor and copying that into the buffer;
* ``zeroshard``: ``Collectives.all_gather_into`` of the same, which moves the same bytes in
  place (two ranks: one all-to-all that sends nothing to itself; more: a broadcast of each
  rank's part into its place).

Per round the slower rank's wall time counts; the table gives medians over rounds of wall
time, CPU time (user + system of the rank's process, gloo's threads included) and minor page
faults per rank, and zeroshard's over torch's, with the largest difference between the two
results (0: the same bytes).

    .venv/bin/python benchmarks/gloo_gather.py [--world-sizes 2 4 8] [--rounds 7] [--numel 45221888]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

from torchrun_job import exit_worker, per_round, run_for_json, write_gathered

NUMEL = 45_221_888  # the 45m model's trained parameters and frozen layer, rounded up


def _timed(gather) -> dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, start = time.process_time(), time.perf_counter()
    gather()
    return {
        "seconds": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
        "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }


def worker(out: Path, numel: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from zeroshard.comm import Collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = numel // world
    buffers = {name: torch.zeros(per_rank * world, dtype=torch.bfloat16) for name in ("torch", "zeroshard")}
    part = torch.arange(per_rank, dtype=torch.float32).mul_(rank + 1).to(torch.bfloat16)
    comm = Collectives()
    gathers = {
        "torch": lambda: dist.all_gather_into_tensor(buffers["torch"], part),
        "zeroshard": lambda: comm.all_gather_into(buffers["zeroshard"], part).wait(),
    }
    records: dict[str, list[dict]] = {name: [] for name in gathers}
    for round_index in range(rounds + 1):  # the first round is not kept
        order = list(gathers) if round_index % 2 else list(gathers)[::-1]
        for name in order:
            record = _timed(gathers[name])
            if round_index:
                records[name].append(record)
    difference = (buffers["torch"].float() - buffers["zeroshard"].float()).abs().max().item()
    write_gathered(out, {"records": records, "difference": difference}, numel=per_rank * world)
    exit_worker()


def launch(world: int, numel: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        args = ["--worker", str(out), "--numel", str(numel), "--rounds", str(rounds)]
        return run_for_json(__file__, world, args, out, timeout=1800)


def _median_over_ranks(result: dict, name: str, key: str) -> float:
    """The median of ``key`` over every rank's rounds of gather ``name``."""
    return statistics.median(record[key] for rank in result["ranks"] for record in rank["records"][name])


def report(result: dict) -> None:
    rounds = len(per_round(result, "torch", "seconds"))
    print(f"\nD={result['world_size']}: {result['numel'] * 2 / 1e6:.1f} MB of bf16, {rounds} rounds")
    print(f"{'gather':10s} {'wall s':>8s} {'/torch':>7s} {'cpu s':>7s} {'/torch':>7s} {'faults':>8s}")
    wall = {name: statistics.median(per_round(result, name, "seconds")) for name in ("torch", "zeroshard")}
    cpu = {name: _median_over_ranks(result, name, "cpu") for name in wall}
    for name in wall:
        faults = _median_over_ranks(result, name, "faults")
        print(
            f"{name:10s} {wall[name]:8.3f} {wall[name] / wall['torch']:7.2f} {cpu[name]:7.3f} "
            f"{cpu[name] / cpu['torch']:7.2f} {faults:8.0f}"
        )
    print(f"largest difference between the results: {max(rank['difference'] for rank in result['ranks'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--numel", type=int, default=NUMEL)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.numel, args.rounds)
        return
    for world in args.world_sizes:
        report(launch(world, args.numel, args.rounds))


if __name__ == "__main__":
    main()
