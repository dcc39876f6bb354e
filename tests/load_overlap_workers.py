"""Spawn target of test_load_overlap: a load gathers each group's weights while it reads the
optimizer state, and a load that fails puts the run's weights back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from load_bytes_workers import flip_middle_byte, train_and_save, weights_differing_from_file

from zeroshard.checkpoint.engine_io import load_checkpoint
from zeroshard.checkpoint.format import rank_file_name, state_key
from zeroshard.checkpoint.native.source import NativeSource


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save at step 1, train a step more (the run's weights now differ from the saved), then
    load a copy of the checkpoint whose last optimizer state is damaged in the last rank's
    file (every rank's gathers have started by then), then the good one, recording the order
    of the gathers and of the reads of the optimizer state."""
    saved = Path(root) / "native" / "t"
    engine = train_and_save(rank, Path(root) / "native", "t")
    engine.backward(engine.model(torch.randint(0, 97, (4, 7), generator=torch.Generator().manual_seed(7 + rank))))
    engine.step()
    groups = len(engine.layout.groups)
    damaged = _damaged_copy(saved, Path(root) / "damaged", world, groups, rank)

    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    try:
        load_checkpoint(engine, damaged)
        error = None
    except Exception as err:  # noqa: BLE001 - what every rank raised is the result
        error = type(err).__name__
    after = engine.model.state_dict()
    differing = sum(int((before[name] != after[name]).sum()) for name in before)

    events: list[tuple[str, int]] = []
    start = engine.start_params_gather

    def recorded_start(group: int, partition: torch.Tensor | None = None) -> list:
        events.append(("gather", group))
        return start(group, partition)

    read_into = NativeSource.read_into

    def recorded_read(self, source_rank: int, group: int, key: str, *args: Any, **kwargs: Any):
        if key != "fp32":
            events.append(("state", group))
        return read_into(self, source_rank, group, key, *args, **kwargs)

    engine.start_params_gather = recorded_start
    NativeSource.read_into = recorded_read
    try:
        load_checkpoint(engine, saved)
    finally:
        NativeSource.read_into = read_into
        del engine.start_params_gather
    late = [g for g in range(groups) if ("state", g) in events and events.index(("state", g)) < events.index(("gather", g))]
    return {
        "error": error,
        "weights_changed_by_failed_load": differing,
        "groups": groups,
        "gathers": [g for kind, g in events if kind == "gather"],
        "state_reads": sum(1 for kind, _ in events if kind == "state"),
        "state_read_before_its_gather": late,
        "weights_differing_after_load": weights_differing_from_file(saved, engine),
    }


def _damaged_copy(saved: Path, damaged: Path, world: int, groups: int, rank: int) -> Path:
    """A copy of ``saved`` with one byte of the last group's exp_avg_sq flipped in the last
    rank's file (rank 0 writes it; every rank waits)."""
    if rank == 0:
        shutil.copytree(saved, damaged)
        flip_middle_byte(damaged, rank_file_name(world - 1, world), state_key(groups - 1, "exp_avg_sq"))
    dist.barrier()
    return damaged
