"""Consecutive `torchrun ... zeroshard demo` runs: how many exit cleanly.

Each run is ``torchrun --standalone --nproc_per_node D zeroshard demo --steps S --out DIR``
in a fresh DIR (the training phase and its checkpoint, then the exit of every rank). A run
is clean when torchrun exits 0 and its output holds no abort ("terminate called", SIGABRT,
"Signal 6"); a failed run's last lines are printed. The figure is clean / total.

With ``--jobs J`` up to J runs go at once (on a busy machine, for throughput; the load
they add to each other only makes an exit race likelier).

    .venv/bin/python benchmarks/torchrun_stress.py [--runs 50] [--jobs 1] [--nproc 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BIN = Path(sys.executable).parent
ABORT_MARKERS = ("terminate called", "SIGABRT", "Signal 6", "Aborted", "core dumped")


def run_once(nproc: int, steps: int, timeout_s: float) -> tuple[bool, float, str]:
    """One torchrun of the demo's training phase: (clean, seconds, output tail)."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-stress-") as out:
        command = [
            str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc),
            str(BIN / "zeroshard"), "demo", "--steps", str(steps), "--out", out,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as err:
            return False, time.perf_counter() - start, f"timed out after {timeout_s:.0f} s\n{err.stderr or ''}"
        seconds = time.perf_counter() - start
        output = result.stdout + result.stderr
        clean = result.returncode == 0 and not any(marker in output for marker in ABORT_MARKERS)
        return clean, seconds, output[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args()
    clean = failed = 0
    times = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = pool.map(lambda _: run_once(args.nproc, args.steps, args.timeout), range(args.runs))
        for index, (ok, seconds, tail) in enumerate(runs):
            times.append(seconds)
            clean += ok
            failed += not ok
            print(f"run {index + 1:3d}/{args.runs}: {'clean' if ok else 'FAILED'} in {seconds:5.1f} s", flush=True)
            if not ok:
                print("  " + tail.replace("\n", "\n  "), flush=True)
    print(f"\n{clean} clean, {failed} failed of {args.runs} consecutive runs "
          f"(torchrun --nproc_per_node {args.nproc} zeroshard demo --steps {args.steps}; "
          f"median {sorted(times)[len(times) // 2]:.1f} s per run)")  # fmt: skip
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
