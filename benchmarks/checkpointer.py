"""Checkpointer: how long a save stalls training, async against sync, next to the floor.

Two models trained at D=2 (spawned gloo ranks, bf16 parameters, AdamW): the demo TinyGPT,
and one with about 1 GB of fp32 master + Adam state (83M parameters, the model of
checkpoint_io.py). On every rank, in one run:

* floor: a plain copy of the rank's state into already allocated host buffers (what an
  async save must at least do before training may go on);
* async stall: the time ``Checkpointer.save`` blocks the loop (previous save finished);
* sync save: the time a synchronous ``save`` takes (copy, CRC, write, fsync, commit);
* step time of the steps that start while a save is being written, against steps with
  none in flight;
* host memory: the snapshot buffer and the peak RSS added while async saves run, against
  the rank's state (fp32 masters + optimizer state, and on rank 0 the model it writes).

Medians over the saves; the table shows the slower rank.

    .venv/bin/python benchmarks/checkpointer.py [--skip-large] [--saves 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.snapshot import HostSnapshot
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn
from zeroshard.models import TinyGPT

STEPS_AFTER_SAVE = 4  # steps run after each async save (same count on every rank)


class WideModel(nn.Module):
    """About 83M parameters in 9 layers of (hidden x hidden) and (hidden x 8 hidden)."""

    def __init__(self, hidden: int = 1024, layers: int = 9) -> None:
        super().__init__()
        self.attn = nn.ParameterList(nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5) for _ in range(layers))
        self.mlp = nn.ParameterList(nn.Parameter(torch.randn(hidden, 8 * hidden) / hidden**0.5) for _ in range(layers))
        self.norm = nn.ParameterList(nn.Parameter(torch.ones(hidden)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, mlp, norm in zip(self.attn, self.mlp, self.norm):
            x = x + (x @ attn) * norm
            x = x + F.gelu(x @ mlp) @ mlp.t() / 8
        return x.float().pow(2).mean()


def _build(kind: str, device: str = "cpu"):
    torch.manual_seed(0)
    if kind == "demo":
        model = TinyGPT().to(device)
        idx = torch.randint(0, model.config.vocab_size, (4, model.config.block_size)).to(device)

        def loss():
            return model(idx[:, :-1], idx[:, 1:])

    else:
        model = WideModel().to(device)
        x = torch.randn(4, 1024).to(device)

        def loss():
            return model(x.to(torch.bfloat16))

    engine = ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_dtype=torch.bfloat16, lr=1e-4)
    return engine, loss


def _step(engine: ZeroOptimizer, loss) -> float:
    start = time.perf_counter()
    engine.backward(loss())
    engine.step()
    engine.zero_grad()
    if engine.device.type == "cuda":  # the step's kernels, not only their launch
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples this process's RSS every 5 ms while active."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _state_bytes(engine: ZeroOptimizer) -> int:
    views = engine.state_views()
    tensors = list(views.fp32_partitions)
    tensors += [t for group in views.optimizer_states + views.optimizer_scalars for t in group.values()]
    if engine.rank == 0:
        tensors += list({t.data_ptr(): t for t in views.model_state.values()}.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(rank: int, world: int, kind: str, root: str, saves: int, device: str = "cpu") -> dict[str, float]:
    """Rounds of: a floor copy, a sync save, an async save followed by steps. Interleaved,
    so that each ratio compares figures taken moments apart (the load of a shared machine
    swings by several times within minutes); medians of the per-round ratios. The model
    lives on ``device`` (benchmarks/gpu_check.py runs it on a GPU at D=1)."""
    engine, loss = _build(kind, device)
    for _ in range(2):  # optimizer state exists from the first step on
        _step(engine, loss)
    floor = HostSnapshot(pin_memory=engine.device.type == "cuda")
    rows = []
    idle, busy = [], []
    sync = Checkpointer(engine, Path(root) / "sync", keep_last=1, async_save=False)
    ckpt = Checkpointer(engine, Path(root) / "async", keep_last=1)
    floor.take(engine.state_views(), with_model=rank == 0)  # allocated before the idle peak
    idle_sampler = _PeakRss()
    idle += [_step(engine, loss) for _ in range(2)]
    idle_peak = idle_sampler.stop()
    async_peak = 0
    for i in range(saves + 1):  # round 0 allocates the buffers
        start = time.perf_counter()
        floor.take(engine.state_views(), with_model=rank == 0)
        floor_s = time.perf_counter() - start
        sync_s = sync.save(i).stall_s
        sampler = _PeakRss()
        stats = ckpt.save(i)
        for _ in range(STEPS_AFTER_SAVE):
            in_flight = ckpt.in_flight
            (busy if in_flight else idle).append(_step(engine, loss))
        ckpt.wait()
        peak = sampler.stop()
        if i > 0:
            rows.append((floor_s, sync_s, stats.stall_s, stats.snapshot_s, stats.write_s))
            async_peak = max(async_peak, peak)
    result = {"state_bytes": _state_bytes(engine), "snapshot_bytes": ckpt.snapshot_bytes}
    ckpt.close()
    sync.close()
    median = lambda column: statistics.median(row[column] for row in rows)  # noqa: E731
    result.update(floor_s=median(0), sync_s=median(1), stall_s=median(2), snapshot_s=median(3), write_s=median(4))
    result["stall_per_floor"] = statistics.median(row[2] / row[0] for row in rows)
    result["stall_per_sync"] = statistics.median(row[2] / row[1] for row in rows)
    # The floor's buffer is held throughout: the peak while async saves are written and
    # steps run, against the peak of steps alone (both with it), is what async save adds.
    result["rss_added"] = async_peak - idle_peak
    result["idle_step_s"] = statistics.median(idle)
    result["busy_step_s"] = statistics.median(busy) if busy else float("nan")
    result["busy_steps"] = len(busy)
    return result


def report(kind: str, saves: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="zs-ckpt-bench-"))
    try:
        ranks = spawn(measure, 2, (kind, str(root), saves), timeout_s=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worst = {key: max(r[key] for r in ranks) for key in ranks[0]}
    ms = lambda seconds: f"{1e3 * seconds:,.1f} ms"  # noqa: E731
    load = os.getloadavg()[0]
    print(f"\n{kind} model at D=2: {worst['state_bytes'] / 1e6:,.1f} MB of state on the larger rank"
          f" ({os.cpu_count()} cores, load average {load:.1f})")
    print(f"  floor: copy of the rank's state into the host buffer   {ms(worst['floor_s'])}")
    print(f"  async save: training stall                            {ms(worst['stall_s'])}"
          f"  = {worst['stall_per_floor']:.2f}x the floor, {worst['stall_per_sync']:.3f}x the sync save (per-round ratios)")
    print(f"    of which the snapshot copy                          {ms(worst['snapshot_s'])}")
    print(f"  async save: written in the background in              {ms(worst['write_s'])}")
    print(f"  sync save                                             {ms(worst['sync_s'])}")
    print(f"  step time, no save in flight / save being written     {ms(worst['idle_step_s'])} / {ms(worst['busy_step_s'])}"
          f"  = {worst['busy_step_s'] / worst['idle_step_s']:.2f}x ({int(min(r['busy_steps'] for r in ranks))} steps)")
    for rank, r in enumerate(ranks):
        print(f"  rank {rank}: snapshot buffer {r['snapshot_bytes'] / 1e6:,.1f} MB, peak RSS added {r['rss_added'] / 1e6:,.1f} MB"
              f" = {r['rss_added'] / r['state_bytes']:.2f}x its state ({r['state_bytes'] / 1e6:,.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the demo model")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (medians)")
    args = parser.parse_args()
    report("demo", args.saves)
    if not args.skip_large:
        report("large", args.saves)


if __name__ == "__main__":
    main()
