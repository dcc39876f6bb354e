"""What digests cost at save and attestation at load, against the save and load they are part of.

Goal (issue 21): at most 3% of a save and 5% of a load. Two cases, ranks on threads of this
process with synthesised states (the testing pattern), as benchmarks/checkpoint_io.py:

* the model of about 1 GB of fp32 state (83M bf16 parameters, fp32 master + Adam) saved at
  D=2, loaded at D=2 (same layout) and resharded to D=3 (compact policy);
* the D=4096 conversion case of benchmarks/convert.py (the seeds' DeepSpeed-policy model,
  4096 rank files of ~80 KB): the save that writes it, and to-universal of it, whose reads
  are checked against the digests.

Each is run once untimed (the page cache warm), then timed ``--repeats`` times with digests
and attestation on and with them switched off (monkeypatched to no-ops: the save writes a
version 1 manifest then), alternating which goes first, and the medians compared, of wall
time and of this process's CPU time (all threads), which other processes disturb less. The machine is shared, so the spread (min-max) of each is printed too;
and the time spent inside the digest code itself is measured in the same runs (a timer
around every digest call, summed per rank; the ratio uses the slowest rank's), which
contention disturbs less than a difference of two wall times.

    .venv/bin/python benchmarks/attestation.py [--repeats 5] [--skip-large] [--skip-4096]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_io import large_specs  # noqa: E402
from convert import seeds_layout  # noqa: E402

from zeroshard.checkpoint import run_ranks, save_sharded  # noqa: E402
from zeroshard.checkpoint.attest import attestation, digests, read_digests  # noqa: E402
from zeroshard.checkpoint.native import model_file, save as native_save  # noqa: E402
from zeroshard.checkpoint.native.load import load_sharded  # noqa: E402
from zeroshard.checkpoint.testing import pattern, synthesize_state  # noqa: E402
from zeroshard.checkpoint.universal import to_universal  # noqa: E402
from zeroshard.layout import LayoutPolicy, build_layout  # noqa: E402


class DigestClock:
    """Seconds spent inside the digest code, per thread (thread ranks)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[threading.current_thread().name] += time.perf_counter() - start

        return wrapper

    def slowest(self) -> float:
        return max(self.seconds.values(), default=0.0)

    def total(self) -> float:
        return sum(self.seconds.values())


@contextlib.contextmanager
def patched(*replacements):
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class _NoDigest:
    value = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, offset, chunk) -> None:
        pass


_EVIDENCE_INIT = attestation.Evidence.__init__


def _disabled_evidence(self, enabled: bool = True) -> None:
    _EVIDENCE_INIT(self, False)


def digests_off():
    """The save without digests (it writes a version 1 manifest), the load without attestation."""
    no_verdict = lambda *args, **kwargs: attestation.Attestation("", "", 0, 0, 0)  # noqa: E731
    return patched(
        (native_save, "PartitionDigester", _NoDigest),
        (native_save, "_combined_digests", lambda *args: None),
        (model_file, "RunningDigest", _NoDigest),
        (attestation.Evidence, "__init__", _disabled_evidence),
        (attestation, "judge", no_verdict),
        (read_digests.ReadChecker, "param", lambda self, *args: None),
        (read_digests.ReadChecker, "model_tensor", lambda self, *args: None),
        (read_digests.ReadChecker, "digests", lambda self, *args: None),
    )


def digests_timed(clock: DigestClock):
    """Digests and attestation on, every digest call timed."""
    digester = digests.PartitionDigester
    return patched(
        (digester, "__call__", clock.timed(digester.__call__)),  # where a second CRC pass digests
        (digester, "segment", clock.timed(digester.segment)),  # where the writer's one pass feeds it
        (digester, "cuts", clock.timed(digester.cuts)),
        (attestation, "partition_terms", clock.timed(attestation.partition_terms)),
        (attestation, "judge", clock.timed(attestation.judge)),
        (attestation.Evidence, "model_tensor", clock.timed(attestation.Evidence.model_tensor)),
        (attestation.Evidence, "master", clock.timed(attestation.Evidence.master)),
        (native_save, "_combined_digests", clock.timed(native_save._combined_digests)),
        (read_digests.ReadChecker, "param", clock.timed(read_digests.ReadChecker.param)),
        (read_digests.ReadChecker, "model_tensor", clock.timed(read_digests.ReadChecker.model_tensor)),
    )


def timed_save(states, root: Path) -> float:
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    run_ranks(len(states), lambda c: save_sharded(root, "ckpt", states[c.rank], coordinator=c, buffer_names=["positions"]), timeout=1800)
    return time.perf_counter() - start


def timed_load(path: Path, layout) -> float:
    start = time.perf_counter()
    run_ranks(layout.world_size, lambda c: load_sharded(path, layout, c.rank, coordinator=c), timeout=1800)
    return time.perf_counter() - start


def timed_convert(path: Path, out: Path) -> float:
    start = time.perf_counter()
    to_universal(path, out, overwrite=True, progress=False)
    return time.perf_counter() - start


def compare(label: str, run, repeats: int) -> None:
    """Median wall and CPU time with digests on and off (alternating which goes first), and
    the digest code's own time. CPU time (all threads of this process) is what contention
    from other processes disturbs least."""
    wall = {True: [], False: []}
    cpu = {True: [], False: []}
    slowest, total = [], []
    with digests_off():
        run()  # untimed: a save drops what it wrote from the page cache, so the first load reads the disk
    for repeat in range(repeats):
        for digested in (True, False) if repeat % 2 == 0 else (False, True):
            clock = DigestClock()
            with digests_timed(clock) if digested else digests_off():
                started = time.process_time()
                wall[digested].append(run())
                cpu[digested].append(time.process_time() - started)
            if digested:
                slowest.append(clock.slowest())
                total.append(clock.total())
    with_, without = statistics.median(wall[True]), statistics.median(wall[False])
    cpu_with, cpu_without = statistics.median(cpu[True]), statistics.median(cpu[False])
    own, everyone = statistics.median(slowest), statistics.median(total)
    spread = lambda values: f"[{min(values):.2f}-{max(values):.2f}]"  # noqa: E731
    print(
        f"  {label:<36} {with_:>6.2f} s {spread(wall[True]):<13} {without:>6.2f} s {spread(wall[False]):<13}"
        f" {cpu_with:>6.2f} s {cpu_without:>6.2f} s {100 * (cpu_with - cpu_without) / cpu_without:>+6.1f}%"
        f"  {own:>6.3f} s = {100 * own / with_:>4.1f}%  {everyone:>6.3f} s = {100 * everyone / (_CORES * with_):>4.1f}%",
        flush=True,
    )


_CORES = 2  # this machine's; the all-ranks column is the share of their time


def header(title: str) -> None:
    print(f"\n{title}")
    print(
        f"  {'':<36} {'wall: with [range]':<22} {'without [range]':<22} {'CPU: with  without  diff':<26}"
        f" {'digest code: slowest rank':<26} {f'all ranks (of {_CORES} cores)':<22}"
    )


def large_case(work: Path, repeats: int) -> None:
    specs = large_specs()
    params = sum(s.numel for group in specs for s in group)
    header(f"about 1 GB of state: {params:,} parameters, {12 * params / 1e6:,.0f} MB fp32 master + Adam, D=2")
    layout = build_layout(specs, 2)
    states = [synthesize_state(layout, rank) for rank in range(2)]
    pattern.cache_clear()
    root = work / "large"
    compare("save D=2", lambda: timed_save(states, root), repeats)
    timed_save(states, root)  # the checkpoint the loads read, with digests
    del states
    pattern.cache_clear()
    compare("load D=2 -> 2 (same layout)", lambda: timed_load(root / "ckpt", layout), repeats)
    resharded = build_layout(specs, 3, LayoutPolicy.native(compact=True))
    compare("load D=2 -> 3 (resharded, compact)", lambda: timed_load(root / "ckpt", resharded), repeats)
    shutil.rmtree(root, ignore_errors=True)


def conversion_case(work: Path, repeats: int) -> None:
    layout = seeds_layout(4096)
    params = sum(slot.numel for group in layout.groups for slot in group.params)
    header(f"D=4096 conversion case: {params:,} parameters, DeepSpeed policy, 4096 rank files")
    states = [synthesize_state(layout, rank) for rank in range(layout.world_size)]
    pattern.cache_clear()
    root = work / "d4096"
    compare("save D=4096 (4096 thread ranks)", lambda: timed_save(states, root), max(1, repeats // 2))
    timed_save(states, root)  # with digests: what the conversion reads and checks
    del states
    compare("to-universal of D=4096", lambda: timed_convert(root / "ckpt", work / "u4096"), repeats)
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-4096", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zs-attest-", dir=args.dir))
    try:
        if not args.skip_large:
            large_case(work, args.repeats)
        if not args.skip_4096:
            conversion_case(work, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
