"""Exact resume (issue 31): what the random state, the data position and the audit cost.

At D=2 (spawned gloo ranks) on checkpointer.py's two models (the demo TinyGPT, and the 83M
parameters with about 1 GB of fp32 master + Adam state), in alternating rounds, two
asynchronous Checkpointers on the same engine: "plain" saves what every save saved before
(``rng=False``, no states, no audit), "exact" adds every rank's random state, a torchdata
StatefulDataLoader's position and the audit (the defaults plus ``state={"data": loader}``).

* the training stall of each save (median, and the median of the per-round ratio; the two
  save in turn first), and the resume state's capture alone (the random state, and the
  loader's ``state_dict()`` encoded: what the stall adds);
* the bytes of a checkpoint: the resume files and the audit record against all its files;
* the audited step (the first after the exact save) against the step after it: time, and
  the bytes of each collective (one all-reduce of ten float64 is all the audit adds);
* the resumed check's extra work: the digest pass over the rank's state its first step
  makes, against a step.

    .venv/bin/python benchmarks/exact_resume.py [--skip-large] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from checkpointer import _build, _step  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from zeroshard.checkpoint import Checkpointer, open_checkpoint  # noqa: E402
from zeroshard.checkpoint.audit import Expectation, read_record  # noqa: E402
from zeroshard.checkpoint.audit_step import expected_state, live_state  # noqa: E402
from zeroshard.checkpoint.format import AUDIT_FILE  # noqa: E402
from zeroshard.launch import spawn  # noqa: E402

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13


def _loader(rank: int, world: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(100_000))
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=3)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    return loader, batches


def _tag_bytes(tag: Path) -> tuple[int, int]:
    """(all files, resume files and audit record) of a checkpoint directory, in bytes."""
    sizes = {entry.name: entry.stat().st_size for entry in tag.iterdir()}
    extra = sum(size for name, size in sizes.items() if name.startswith("resume-") or name == AUDIT_FILE)
    return sum(sizes.values()), extra


def _moved(engine, action) -> dict[str, int]:
    before = dict(engine.comm.bytes_moved)
    action()
    return {key: value - before.get(key, 0) for key, value in engine.comm.bytes_moved.items()}


def measure(rank: int, world: int, kind: str, root: str, rounds: int) -> dict:
    engine, loss = _build(kind)
    for _ in range(2):  # optimizer state exists from the first step on
        _step(engine, loss)
    loader, batches = _loader(rank, world)
    plain = Checkpointer(engine, Path(root) / "plain", keep_last=1, rng=False, audit=False)
    exact = Checkpointer(engine, Path(root) / "exact", keep_last=1, state={"data": loader})
    rows = []
    for i in range(rounds + 1):  # round 0 allocates the snapshot buffers
        stalls = {}
        for checkpointer in (plain, exact) if i % 2 else (exact, plain):  # either first, in turn
            stalls[checkpointer] = checkpointer.save(i).stall_s
            checkpointer.wait()
        plain_stall, exact_stall = stalls[plain], stalls[exact]
        start = time.perf_counter()
        exact._exact.capture()  # the capture alone, as save() takes it
        capture = time.perf_counter() - start
        next(batches)
        audited_time = time.perf_counter()
        audited_bytes = _moved(engine, lambda: _step(engine, loss))
        audited_time = time.perf_counter() - audited_time
        exact.wait()  # the audit record is written after the save, by the writer thread
        next(batches)
        plain_time = time.perf_counter()
        plain_bytes = _moved(engine, lambda: _step(engine, loss))
        plain_time = time.perf_counter() - plain_time
        if i > 0:
            rows.append((plain_stall, exact_stall, capture, audited_time, plain_time))
    tag = Path(root) / "exact" / f"step-{rounds:08d}"
    total, extra = _tag_bytes(tag) if rank == 0 else (0, 0)
    manifest = open_checkpoint(tag).manifest
    kinds, terms, scalars = expected_state(manifest)
    expectation = Expectation(str(tag), read_record(tag)[0], kinds, terms, scalars, True)
    digest_pass = []
    for _ in range(3):
        start = time.perf_counter()
        live_state(engine, expectation)
        digest_pass.append(time.perf_counter() - start)
    exact.close()
    plain.close()
    median = lambda column: statistics.median(row[column] for row in rows)  # noqa: E731
    return {
        "plain_stall_s": median(0),
        "exact_stall_s": median(1),
        "stall_ratio": statistics.median(row[1] / row[0] for row in rows),
        "capture_s": median(2),
        "audited_step_s": median(3),
        "step_s": median(4),
        "audited_bytes": audited_bytes,
        "step_bytes": plain_bytes,
        "digest_pass_s": statistics.median(digest_pass),
        "checkpoint_bytes": total,
        "resume_bytes": extra,
    }


def report(kind: str, rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="zs-exact-bench-"))
    try:
        ranks = spawn(measure, 2, (kind, str(root), rounds), timeout_s=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = lambda seconds: f"{1e3 * seconds:,.2f} ms"  # noqa: E731
    worst = {key: max(r[key] for r in ranks) for key in ranks[0] if not key.endswith("_bytes")}
    first = ranks[0]
    print(f"\n{kind} model at D=2 ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}), {rounds} rounds:")
    print(f"  save stall, plain / exact                 {ms(worst['plain_stall_s'])} / {ms(worst['exact_stall_s'])}"
          f"  (per-round ratio {worst['stall_ratio']:.3f}x)")
    print(f"  of which the resume state's capture       {ms(worst['capture_s'])}"
          f"  = {100 * worst['capture_s'] / worst['exact_stall_s']:.2f}% of the exact stall")
    print(f"  checkpoint bytes, resume files + audit    {first['resume_bytes']:,} of {first['checkpoint_bytes']:,}"
          f"  = {100 * first['resume_bytes'] / first['checkpoint_bytes']:.3f}%")
    print(f"  audited step / next step                  {ms(worst['audited_step_s'])} / {ms(worst['step_s'])}")
    for rank, r in enumerate(ranks):
        extra = {k: r["audited_bytes"][k] - r["step_bytes"].get(k, 0) for k in r["audited_bytes"]}
        print(f"  rank {rank}: bytes the audited step moved beyond the next step's, per collective: {extra}")
    print(f"  resumed check's digest pass               {ms(worst['digest_pass_s'])}"
          f"  = {worst['digest_pass_s'] / worst['step_s']:.2f}x a step (once per resume)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the demo model")
    parser.add_argument("--rounds", type=int, default=5, help="saves per mode (medians)")
    args = parser.parse_args()
    report("demo", args.rounds)
    if not args.skip_large:
        report("large", args.rounds)


if __name__ == "__main__":
    main()
