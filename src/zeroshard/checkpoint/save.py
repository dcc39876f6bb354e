"""Collective save: every rank writes its own file, rank 0 commits the directory.

Steps, with the fault-injection points a test can crash at:

1. every rank checks its ShardedState; the ranks agree on the outcome, so all fail or none;
2. rank 0 takes the root's writer lock (WriterLockedError on every rank if another save
   holds it), removes leftovers of interrupted saves and creates ``<root>/.<tag>.tmp-<id>``;
3. every rank writes ``rank-RRRRR-of-DDDDD.safetensors`` (rank 0 also ``model.safetensors``),
   hashing while writing, then fsyncs it; ``after_rank_file``;
4. the block checksums are gathered on rank 0 (this is also the barrier);
5. rank 0: ``before_manifest``; writes manifest.json and fsyncs; ``before_rename``; renames
   the directory to ``<root>/<tag>`` (``mid_replace`` when a tag is overwritten);
   ``before_latest``; replaces ``latest``;
6. rank 0 broadcasts the outcome, so every rank returns, or raises, together, and
   releases the lock.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Collection

import torch

from ..state import ShardedState
from . import jsonvalue
from .checksum import FileRecord
from .coordinator import Coordinator, default_coordinator
from .directory import fsync_dir, prepare_staging, publish, root_lock, write_file_durably
from .format import (
    DEFAULT_BLOCK_SIZE,
    FORMAT_NAME,
    MANIFEST_FILE,
    MODEL_FILE,
    check_tag,
    fp32_key,
    rank_file_name,
    scalar_key,
    state_key,
)
from .manifest import GroupRecord, Manifest, ModelTensorRecord, dtype_name
from .model_file import save_model_state
from .safetensors_io import write_safetensors
from .writer_lock import WriterLockedError

FaultHook = Callable[[str, int], None]
"""Called as ``fault(point, rank)`` at each point of FAULT_POINTS; raising there simulates a crash."""

FAULT_POINTS = ("after_rank_file", "before_manifest", "before_rename", "mid_replace", "before_latest")


def save_sharded(
    root: str | os.PathLike[str],
    tag: str,
    state: ShardedState,
    *,
    coordinator: Coordinator | None = None,
    fault: FaultHook | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    buffer_names: Collection[str] | None = None,
) -> Path:
    """Save this rank's share of a run as checkpoint ``<root>/<tag>``; collective over all ranks.

    ``model_state`` and ``extra`` are taken from rank 0. ``buffer_names`` marks which
    non-trainable state_dict entries are buffers (the rest are frozen parameters). Returns
    the published directory on every rank. ValueError (or OSError) on every rank when any
    rank's state is unusable or a write fails; nothing is published then. WriterLockedError
    (an OSError naming the holder) on every rank when another process is saving into
    ``root``: one writer per root at a time.
    """
    root = Path(root)
    check_tag(tag)
    coord = coordinator or default_coordinator()

    def fire(point: str) -> None:
        if fault is not None:
            fault(point, coord.rank)

    group_records = _agree_on_state(state, coord)
    with ExitStack() as held:  # rank 0 holds the root's writer lock from cleanup to publication

        def begin() -> str:
            lock = held.enter_context(root_lock(root, tag))
            return str(prepare_staging(root, tag, clean=lock.held))

        staging = Path(_on_rank0_then_broadcast(coord, begin))
        outcome = _write_own_files(staging, state, block_size, buffer_names)
        fire("after_rank_file")
        outcomes = coord.all_gather_object(outcome)
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            if coord.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise OSError(f"checkpoint {root / tag} not saved: {failures[0]}")

        def commit() -> str:
            fire("before_manifest")
            manifest = _manifest(tag, state, group_records, outcomes)
            write_file_durably(staging / MANIFEST_FILE, manifest.to_json())
            fsync_dir(staging)
            return str(publish(root, tag, staging, fire))

        return Path(_on_rank0_then_broadcast(coord, commit))


def _on_rank0_then_broadcast(coord: Coordinator, action: Callable[[], Any]) -> Any:
    """Run ``action`` on rank 0 and hand its result, or its error, to every rank."""
    outcome: tuple[str, Any] | None = None
    if coord.rank == 0:
        try:
            outcome = ("ok", action())
        except WriterLockedError as err:
            outcome = ("locked", str(err))
        except (OSError, ValueError) as err:
            outcome = ("error", f"{type(err).__name__}: {err}")
    kind, value = coord.broadcast_object(outcome)
    if kind == "locked":
        raise WriterLockedError(f"checkpoint save refused: {value}")
    if kind == "error":
        raise OSError(f"checkpoint save failed on rank 0: {value}")
    return value


def _agree_on_state(state: ShardedState, coord: Coordinator) -> list[GroupRecord]:
    problem = _problem_with(state, coord)
    records = None if problem else _group_records(state)
    digest = hashlib.sha256(state.layout.to_json().encode()).hexdigest()
    summary = (problem, digest, [r.to_dict() for r in records] if records else None)
    everyone = coord.all_gather_object(summary)
    for rank, (their_problem, their_digest, their_records) in enumerate(everyone):
        if their_problem:
            raise ValueError(f"cannot save: rank {rank}: {their_problem}")
        if their_digest != everyone[0][1]:
            raise ValueError(f"cannot save: rank {rank}'s layout differs from rank 0's")
        if their_records != everyone[0][2]:
            raise ValueError(f"cannot save: rank {rank}'s optimizer state names or dtypes differ from rank 0's")
    return records  # type: ignore[return-value]


def _problem_with(state: ShardedState, coord: Coordinator) -> str | None:
    layout = state.layout
    if state.rank != coord.rank or layout.world_size != coord.world_size:
        return f"state is rank {state.rank} of {layout.world_size} but the coordinator is rank {coord.rank} of {coord.world_size}"
    groups = len(layout.groups)
    for field_name in ("fp32_partitions", "optimizer_states", "optimizer_scalars"):
        if len(getattr(state, field_name)) != groups:
            return f"{field_name} has {len(getattr(state, field_name))} entries for {groups} layout groups"
    for group in layout.groups:
        expected = (group.partition_numel,)
        tensors = {fp32_key(group.index): state.fp32_partitions[group.index]}
        tensors.update({state_key(group.index, n): t for n, t in state.optimizer_states[group.index].items()})
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                return f"{key} has shape {shape}, expected the partition shape {list(expected)}"
        if not state.fp32_partitions[group.index].is_floating_point():
            return f"{fp32_key(group.index)} is {state.fp32_partitions[group.index].dtype}, not a floating point type"
        for name in list(state.optimizer_states[group.index]) + list(state.optimizer_scalars[group.index]):
            if not name or "/" in name:
                return f"group {group.index}: optimizer state name {name!r} cannot be stored"
    if coord.rank == 0:
        try:
            jsonvalue.encode(state.extra, "extra")
            for index, group in enumerate(state.param_groups):
                jsonvalue.encode(group.hyperparameters, f"param_groups[{index}]")
        except ValueError as err:
            return str(err)
    return None


def _group_records(state: ShardedState) -> list[GroupRecord]:
    return [
        GroupRecord(
            fp32_dtype=dtype_name(state.fp32_partitions[g].dtype),
            states={name: dtype_name(t.dtype) for name, t in sorted(state.optimizer_states[g].items())},
            scalars={
                name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in sorted(state.optimizer_scalars[g].items())
            },
        )
        for g in range(len(state.layout.groups))
    ]


def _write_own_files(
    staging: Path, state: ShardedState, block_size: int, buffer_names: Collection[str] | None
) -> dict[str, Any] | str:
    """This rank's file records (and rank 0's model description), or a one-line error."""
    world = state.layout.world_size
    name = rank_file_name(state.rank, world)
    try:
        written: dict[str, Any] = {"files": {name: _write_rank_file(staging / name, state, block_size).to_dict()}}
        if state.rank == 0:
            trainable = set(state.layout.param_names)
            model = save_model_state(staging / MODEL_FILE, state.model_state, trainable, buffer_names, block_size)
            written["files"][MODEL_FILE] = model.record.to_dict()
            written["model"] = ({k: (list(t.shape), t.dtype, t.kind) for k, t in model.tensors.items()}, model.aliases)
        return written
    except (OSError, ValueError) as err:
        return f"rank {state.rank}: writing {name}: {type(err).__name__}: {err}"


def _write_rank_file(path: Path, state: ShardedState, block_size: int) -> FileRecord:
    # Scalars first: they sit in the first checksum block with the header, cheap to read alone.
    scalars, partitions = [], []
    for g in range(len(state.layout.groups)):
        scalars += [(scalar_key(g, n), t) for n, t in sorted(state.optimizer_scalars[g].items())]
        partitions.append((fp32_key(g), state.fp32_partitions[g]))
        partitions += [(state_key(g, n), t) for n, t in sorted(state.optimizer_states[g].items())]
    metadata = {"format": FORMAT_NAME, "rank": str(state.rank), "world_size": str(state.layout.world_size)}
    data_bytes = sum(t.numel() * t.element_size() for _, t in scalars + partitions)
    return write_safetensors(path, scalars + partitions, _block_size_for(data_bytes, block_size), metadata)


def _block_size_for(data_bytes: int, block_size: int) -> int:
    """At least 16 checksum blocks per rank file (down to 4 KiB blocks), so a reader of a
    slice of a small file (large D) does not read and check the whole file for it."""
    smaller = block_size
    while smaller > 4096 and smaller * 16 > data_bytes:
        smaller //= 2
    return smaller


def _manifest(tag: str, state: ShardedState, records: list[GroupRecord], outcomes: list[Any]) -> Manifest:
    files: dict[str, FileRecord] = {}
    for outcome in outcomes:
        files.update({name: FileRecord.from_dict(record) for name, record in outcome["files"].items()})
    tensors, aliases = outcomes[0]["model"]
    return Manifest(
        tag=tag,
        layout=state.layout,
        optimizer_class=state.optimizer_class,
        param_groups=list(state.param_groups),
        groups=tuple(records),
        model_tensors={
            name: ModelTensorRecord(tuple(shape), dtype, kind) for name, (shape, dtype, kind) in tensors.items()
        },
        aliases=aliases,
        extra=state.extra,
        files=files,
    )
