"""Write planned tensors into size-bounded safetensors shards, one tensor in memory at a time.

Converters describe their output as :class:`OutputTensor` entries (key, dtype, shape and a
function producing the values); :func:`plan_shards` cuts the list into shards from the
sizes alone, and :func:`write_shards` produces, writes and drops each tensor in order.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .checksum import FileRecord
from .digest import RunningDigest
from .safetensors_io import PlannedTensor, SafetensorsWriter


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of a conversion's output; ``produce`` returns its values (any shape, same numel)."""

    planned: PlannedTensor
    produce: Callable[[], np.ndarray]


def plan_shards(sizes: Sequence[int], max_shard_size: int | None) -> list[range]:
    """Consecutive runs of tensor indices with at most ``max_shard_size`` bytes each.

    A tensor bigger than the limit gets a shard of its own; None means one shard.
    """
    if max_shard_size is not None and max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    shards: list[range] = []
    start, filled = 0, 0
    for index, size in enumerate(sizes):
        if max_shard_size is not None and index > start and filled + size > max_shard_size:
            shards.append(range(start, index))
            start, filled = index, 0
        filled += size
    shards.append(range(start, len(sizes)))
    return shards


def write_shards(
    directory: Path,
    tensors: Sequence[OutputTensor],
    shards: Sequence[range],
    file_names: Sequence[str],
    *,
    block_size: int,
    metadata: dict[str, str] | None = None,
    progress: bool | None = None,
    description: str = "writing",
    digests: dict[str, int] | None = None,
    page_aligned: bool = False,
) -> dict[str, FileRecord]:
    """Write each shard's tensors to ``directory / file_names[i]``; their records by file name.
    ``digests``, if given, receives the digest (``zlib.crc32``) of each tensor's bytes as
    written, by key, computed while they are in the CPU cache. ``page_aligned``: each shard's
    first tensor starts on a page of its file (see :func:`.safetensors_io.write_safetensors`).

    Tensors are produced on this thread and written (hashed, written, fsynced) on another,
    so reading the next tensor overlaps writing the last; at most two are alive at a time.
    Consecutive entries with the same ``produce`` function object (one tensor saved under
    several names) are produced once. ValueError before anything is written when two
    entries have one key (each file's header refuses that alone; this is across files).
    """
    planned: set[str] = set()
    for tensor in tensors:
        if tensor.planned.key in planned:
            raise ValueError(f"{directory}: tensor {tensor.planned.key!r} is planned twice; an output holds each name once")
        planned.add(tensor.planned.key)
    records: dict[str, FileRecord] = {}
    total = sum(t.planned.nbytes for t in tensors)
    opened: list[dict[str, SafetensorsWriter]] = []
    try:
        with progress_bar(total, description, progress) as bar, _WriterThread() as background:
            last_producer: Any = None
            values: np.ndarray | None = None
            for shard, file_name in zip(shards, file_names):
                plan = [tensors[i].planned for i in shard]
                opened.append({})
                aligned = plan[0].key if page_aligned and plan else None
                background.submit(functools.partial(_open, opened[-1], directory / file_name, plan, block_size, metadata, aligned))
                for index in shard:
                    entry = tensors[index]
                    background.reserve()
                    if entry.produce is not last_producer:
                        values = None  # drop our reference before making the next one
                        values = entry.produce()
                        last_producer = entry.produce
                    write = functools.partial(_write, opened[-1], entry.planned, values, bar, digests)
                    background.submit(write, reserved=True)
                background.submit(functools.partial(_close, opened[-1], records, file_name))
    finally:
        for state in opened:
            if "writer" in state:
                state.pop("writer").abort()
    return records


def _open(
    state: dict, path: Path, plan: list[PlannedTensor], block_size: int, metadata: dict[str, str] | None, page_aligned: str | None
) -> None:
    state["writer"] = SafetensorsWriter(path, plan, block_size, metadata, page_aligned)


def _write(state: dict, planned: PlannedTensor, values: np.ndarray, bar: Any, digests: dict[str, int] | None) -> None:
    running = RunningDigest() if digests is not None else None
    state["writer"].write(planned.key, values, running)
    if running is not None:
        digests[planned.key] = running.value
    bar.update(planned.nbytes)


def _close(state: dict, records: dict[str, FileRecord], file_name: str) -> None:
    records[file_name] = state.pop("writer").close()


class _WriterThread:
    """Runs submitted actions in order on one thread. Every action holds one of ``depth``
    slots from before it is made (a write: before its tensor is produced) until it is done,
    so at most ``depth`` tensors are alive. The first error stops the rest and is raised on
    the submitting thread."""

    def __init__(self, depth: int = 2) -> None:
        self._actions: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zeroshard-writer", daemon=True)

    def reserve(self) -> None:
        """Take a slot for the next ``submit(..., reserved=True)``."""
        self._raise_if_failed()
        self._slots.acquire()
        self._raise_if_failed()

    def submit(self, action: Callable[[], None], *, reserved: bool = False) -> None:
        if not reserved:
            self.reserve()
        self._actions.put(action)

    def _run(self) -> None:
        while True:
            action = self._actions.get()
            if action is None:
                return
            try:
                if self._error is None:
                    action()
            except BaseException as err:  # noqa: BLE001 - handed to the submitting thread
                self._error = err
            finally:
                self._slots.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def __enter__(self) -> _WriterThread:
        self._thread.start()
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if error is not None and self._error is None:
            self._error = RuntimeError("stopped")  # the submitting side failed: skip what is queued
        self._actions.put(None)
        self._thread.join()
        if error is None:
            self._raise_if_failed()


class _NoProgress:
    def update(self, count: int) -> None:
        pass

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(total_bytes: int, description: str, enabled: bool | None) -> Any:
    """A tqdm bar over bytes on stderr; None shows it only when stderr is a terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
