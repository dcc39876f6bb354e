"""Worker code for the Checkpointer tests (module level, so spawned ranks can import it).

The model, data and training loop are those of checkpoint_workers: every world size trains
on the same global batches.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_workers import SAVE_POLICY, build, dump, full_state, train

from zeroshard.checkpoint import CheckpointSaveError, Checkpointer, list_tags
from zeroshard.checkpoint.native import save as save_module
from zeroshard.checkpoint.directory import read_latest
from zeroshard.layout import LayoutPolicy

WRITER_THREAD = "zeroshard-checkpoint-writer"


def schedule(engine) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(engine, lambda step: 1.0 / (1.0 + step))


class _DiskFull:
    """Replaces the rank-file writer on one rank: the write fails as on a full disk."""

    def __init__(self, rank: int, failing_rank: int) -> None:
        self.active = rank == failing_rank
        self.original = save_module.write_safetensors

    def __enter__(self) -> None:
        if self.active:

            def full(path, *args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            save_module.write_safetensors = full

    def __exit__(self, *exc: object) -> None:
        save_module.write_safetensors = self.original


def _error_of(action) -> str | None:
    try:
        action()
    except CheckpointSaveError as err:
        return str(err)
    return None


def async_sync_errors_retention(rank: int, world: int, out: str) -> dict[str, Any]:
    """One D=2 run: async and sync Checkpointers save the same states (the test compares
    their bytes); retention; a writer error on rank 1 surfaces on every rank at the next
    wait, save and close; a save of a step already saved is refused on every rank; nothing
    of the Checkpointer outlives close()."""
    out_dir = Path(out)
    groups_before = len(dist.distributed_c10d._world.pg_map)
    model, engine = build(seed=0, stage=2, policy=SAVE_POLICY)
    sched = schedule(engine)
    result: dict[str, Any] = {}
    ckpt = Checkpointer(engine, out_dir / "async", keep_last=2, keep_every=4, lr_scheduler=sched)
    sync = Checkpointer(engine, out_dir / "sync", keep_last=None, async_save=False, lr_scheduler=sched)
    result["fresh_start"] = ckpt.load()
    result["writer_alive_while_saving"] = False
    for step in range(6):
        train(model, engine, step, 1)
        sched.step()
        ckpt.save(step, extra={"note": step})
        result["writer_alive_while_saving"] |= any(t.name == WRITER_THREAD for t in threading.enumerate())
        sync.save(step, extra={"note": step})
    ckpt.wait()
    result["async_tags"] = list_tags(out_dir / "async")
    result["sync_tags"] = list_tags(out_dir / "sync")
    sync.close()

    with _DiskFull(rank, failing_rank=1):
        ckpt.save(6)
        train(model, engine, 6, 1)  # training collectives run while the failing save is in flight
        result["wait_error"] = _error_of(ckpt.wait)
    result["latest_after_error"] = read_latest(out_dir / "async")
    with _DiskFull(rank, failing_rank=1):
        ckpt.save(7)
        result["save_error"] = _error_of(lambda: ckpt.save(8))  # raises step 7's error
    if rank == 1:  # this rank cannot take its snapshot: every rank's save fails, none hangs
        engine.state_views = lambda: (_ for _ in ()).throw(MemoryError("no host memory"))
    ckpt.save(8)
    result["snapshot_error"] = _error_of(ckpt.wait)
    if rank == 1:
        del engine.state_views  # back to the method
    ckpt.save(8, extra={"note": 8})
    ckpt.wait()
    dump(engine, out_dir / "state-at-8.safetensors")
    result["latest_after_recovery"] = read_latest(out_dir / "async")
    result["hidden_after_recovery"] = sorted(p.name for p in (out_dir / "async").iterdir() if p.name.startswith("."))
    ckpt.save(8)  # its tag exists: refused on every rank, nothing written
    result["save_over_error"] = _error_of(ckpt.wait)
    with _DiskFull(rank, failing_rank=1):
        ckpt.save(9)
        result["close_error"] = _error_of(ckpt.close)
    result["final_tags"] = list_tags(out_dir / "async")
    result["threads_after_close"] = sorted(t.name for t in threading.enumerate() if t.name == WRITER_THREAD)
    result["groups_leaked"] = len(dist.distributed_c10d._world.pg_map) - groups_before
    try:
        ckpt.save(10)
        result["save_after_close"] = None
    except RuntimeError as err:
        result["save_after_close"] = str(err)
    return result


def resume_elsewhere(rank: int, world: int, out: str) -> dict[str, Any]:
    """Resume the D=2 run through load() at this world size, stage 1 on a compact layout."""
    out_dir = Path(out)
    model, engine = build(seed=5, stage=1, policy=LayoutPolicy.native(compact=True))
    sched = schedule(engine)
    with Checkpointer(engine, out_dir / "async", lr_scheduler=sched) as ckpt:
        start = ckpt.load()
        loaded = full_state(engine)
        saved = _read(out_dir / "state-at-8.safetensors")
        worst = max((loaded[k] - saved[k]).abs().max().item() for k in saved)
        losses = train(model, engine, start, 1)
        ckpt.save(start)
    return {
        "start": start,
        "extra": ckpt.extra,
        "scheduler_epoch": sched.last_epoch,
        "same_keys": set(loaded) == set(saved),
        "max_abs_diff": worst,
        "losses": losses,
        "tags": list_tags(out_dir / "async"),
    }


def crash_during_async_save(rank: int, world: int, out: str, point: str, victim: int) -> None:
    """Save step 1, then die (os._exit, no cleanup) on ``victim`` at ``point`` of the
    background save of step 2, while the training loop goes on."""

    def fault(at: str, fault_rank: int) -> None:
        if at == point and fault_rank == victim and saving[0] == 2:
            os._exit(17)

    saving = [0]
    model, engine = build(seed=0, stage=2, policy=SAVE_POLICY)
    ckpt = Checkpointer(engine, Path(out), keep_last=1, fault=fault)
    for step in range(3):
        train(model, engine, step, 1)
        if step in (1, 2):
            ckpt.wait()  # so that the fault below cannot fire in step 1's save
            saving[0] = step
            ckpt.save(step)
    train(model, engine, 3, 1)
    ckpt.close()


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def unencodable_extra_on_rank_0(rank: int, world: int, root: str) -> dict:
    """Rank 0's extra contains itself (RecursionError when encoded): every rank's save must
    fail at once, and the group stay usable."""
    from zeroshard.engine import ZeroOptimizer

    engine = ZeroOptimizer(torch.nn.Linear(4, 3), torch.optim.AdamW, lr=1e-3)
    extra: dict = {"note": rank}
    if rank == 0:
        extra["self"] = extra  # a dict that contains itself: RecursionError when encoded
    result: dict = {}
    with Checkpointer(engine, root, async_save=False, timeout_s=20) as ckpt:
        started = time.perf_counter()
        try:
            ckpt.save(0, extra=extra)
        except CheckpointSaveError as err:
            result["error"] = str(err)
        result["seconds"] = time.perf_counter() - started
        ckpt.save(1, extra={"note": rank})  # the group is still usable
    return result
