"""Where a zeroshard stage-2 step goes, phase by phase, on the model of engine_vs_deepspeed.py.

Same medium TinyGPT, data, bf16 parameters, AdamW and clipping as ``engine_vs_deepspeed.py``
(bf16 reduction unless ``--reduce-dtype float32``),
on gloo at D = 2 and 4 under torchrun. The engine's methods are wrapped (in this process
only) so that every phase is timed exclusively of the phases nested in it: forward,
autograd's backward, the hooks' copies into buckets, each collective's launch and wait,
the widening sum, the fold into the partition, the norm and its all-reduce, torch's AdamW,
the master -> bf16 cast, the parameter all-gather's launch and wait, zero_grad. Per phase:
wall time, the main thread's CPU time, and minor page faults (the whole process's). The
step's process CPU time (all threads: gloo's included) and its idle time (wall - process
CPU) are printed too, next to the floor (the bare model's forward and backward plus AdamW
on the partition), as in engine_vs_deepspeed.py.

    .venv/bin/python benchmarks/engine_phases.py [--world-sizes 2 4] [--steps 15] [--bucket-numel N]
        [--reduce-dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_vs_deepspeed as bench
from torchrun_job import run_for_json, write_gathered


class PhaseClock:
    """Exclusive wall, thread-CPU time and minor faults per phase, with nesting."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        self.stack: list[str] = []
        self.mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, int, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), time.thread_time(), usage.ru_minflt, time.process_time()

    def _charge(self) -> None:
        now = self._now()
        name = self.stack[-1] if self.stack else "outside"
        for i in range(4):
            self.totals[name][i] += now[i] - self.mark[i]
        self.mark = now

    def enter(self, name: str) -> None:
        self._charge()
        self.stack.append(name)

    def leave(self) -> None:
        self._charge()
        self.stack.pop()

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, attribute, timed)

    def take(self) -> dict[str, list[float]]:
        taken = {name: list(values) for name, values in self.totals.items()}
        self.totals.clear()
        return taken


def _instrument(engine, clock: PhaseClock) -> None:
    from zeroshard import comm as comm_module

    reducer = engine.reducer
    clock.wrap(reducer, "_on_grad", "bwd: hooks (copy into buckets)")
    clock.wrap(reducer, "_zero_unwritten", "bwd: zero unwritten")
    clock.wrap(reducer, "_bucket_staging", "bwd: staging buffer")
    clock.wrap(reducer, "_launch_ready", "bwd: launch checks")
    clock.wrap(reducer, "_reduce_bucket", "bwd: reduction launch")
    clock.wrap(reducer, "_accumulate", "bwd: fold into partition")
    clock.wrap(reducer, "finish_backward", "bwd: end-of-backward callback")
    clock.wrap(reducer, "_retire_in_flight", "bwd: reduction wait")
    original_wait = comm_module._Widening.wait

    def widening_wait(handle):
        if getattr(handle, "_parts", getattr(handle, "_partials", None)) is None:  # _partials: older trees
            return True
        clock.enter("bwd: reduction wait")
        try:
            handle._work.wait()
        finally:
            clock.leave()
        clock.enter("bwd: widening sum")
        try:
            handle._work = _Done()
            return original_wait(handle)
        finally:
            clock.leave()

    class _Done:
        def wait(self) -> bool:
            return True

    comm_module._Widening.wait = widening_wait
    clock.wrap(engine, "_clip", "step: norm + clip")
    clock.wrap(engine.comm, "all_reduce_", "step: norm all-reduce")
    clock.wrap(engine.optimizer, "step", "step: torch AdamW")
    clock.wrap(engine, "zero_grad", "zero_grad")

    def write_back_and_gather() -> None:
        handles = []
        for buffer, master, comm in zip(engine.buffers, engine.masters, engine.group_comms):
            for bucket in buffer.group.buckets:
                clock.enter("step: master -> bf16 cast")
                own = buffer.rank_slice(bucket.index, comm.rank)
                own.copy_(master.detach()[bucket.partition_start : bucket.partition_start + bucket.partition_numel])
                clock.leave()
                clock.enter("step: all-gather launch")
                handles.append(comm.all_gather_into(buffer.bucket_view(bucket.index), own, async_op=True))
                clock.leave()
        clock.enter("step: all-gather wait")
        for handle in handles:
            handle.wait()
        clock.leave()

    if hasattr(engine, "_write_back_and_gather") and not getattr(engine, "_gathers_in_place", False):
        engine._write_back_and_gather = write_back_and_gather


def _step(variant, clock: PhaseClock | None, step: int, rank: int) -> dict:
    import torch.distributed as dist

    idx, targets = bench._batch(step, rank)
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, start = time.process_time(), time.perf_counter()
    if clock is not None:
        clock.mark = clock._now()
        clock.enter("forward")
    loss = variant.forward(idx, targets)
    if clock is not None:
        clock.leave()
        clock.enter("bwd: autograd")
    variant.backward(loss)
    if clock is not None:
        clock.leave()
        clock.enter("step: other")
    variant.step()
    if clock is not None:
        clock.leave()
    record = {
        "wall": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
        "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }
    if clock is not None:
        record["phases"] = clock.take()
    return record


def worker(out_path: Path, steps: int, bucket_numel: int | None, reduce_dtype: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    zeroshard = bench.ZeroshardVariant(getattr(torch, reduce_dtype), bucket_numel)
    floor = bench.FloorVariant(world_size)
    clock = PhaseClock()
    _instrument(zeroshard.engine, clock)
    records = {"zeroshard": [], "floor": []}
    clock.wrap(floor.optimizer, "step", "step: torch AdamW")
    for step in range(steps + 2):
        for name, variant in (("zeroshard", zeroshard), ("floor", floor)):
            record = _step(variant, clock, step, rank)
            if step >= 2:
                records[name].append(record)
    write_gathered(out_path, records)
    dist.destroy_process_group()


def launch(world_size: int, steps: int, bucket_numel: int | None, reduce_dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        args = ["--worker", str(out), "--steps", str(steps), "--reduce-dtype", reduce_dtype]
        args += ["--bucket-numel", str(bucket_numel)] if bucket_numel else []
        return run_for_json(__file__, world_size, args, out, timeout=1800)


def report(result: dict) -> None:
    ranks = result["ranks"]

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for records in ranks for r in records[name])

    print(f"\nD = {result['world_size']}: medians over ranks and steps")
    for name in ("zeroshard", "floor"):
        wall, cpu, faults = median(name, "wall"), median(name, "cpu"), median(name, "faults")
        print(f"  {name:<10} wall {1e3 * wall:7.1f} ms  process CPU {1e3 * cpu:7.1f} ms  "
              f"idle {1e3 * (wall - cpu):6.1f} ms  minor faults {faults:8.0f}")  # fmt: skip
    phases = sorted({p for records in ranks for r in records["zeroshard"] for p in r["phases"]})
    floor_phases = {}
    for phase in ("forward", "bwd: autograd", "step: torch AdamW"):
        floor_phases[phase] = statistics.median(r["phases"][phase][1] for records in ranks for r in records["floor"])
    print("  floor, main thread CPU: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in floor_phases.items()))
    print(
        f"  {'phase (exclusive)':<34}{'wall ms':>9}{'main thread CPU':>17}{'process CPU':>13}{'idle ms':>9}{'faults':>9}"
    )
    for phase in phases:
        values = [r["phases"].get(phase, [0.0, 0.0, 0, 0.0]) for records in ranks for r in records["zeroshard"]]
        wall, thread, faults, cpu = (statistics.median(v[i] for v in values) for i in range(4))
        print(
            f"  {phase:<34}{1e3 * wall:>9.2f}{1e3 * thread:>17.2f}{1e3 * cpu:>13.2f}{1e3 * (wall - cpu):>9.2f}{faults:>9.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--bucket-numel", type=int, default=None, help="stage-2 bucket size (default: the engine's)")
    parser.add_argument("--reduce-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.bucket_numel, args.reduce_dtype)
        return
    for world_size in args.world_sizes:
        report(launch(world_size, args.steps, args.bucket_numel, args.reduce_dtype))


if __name__ == "__main__":
    main()
