"""The read floor of a native load: the exact byte ranges a rank's load needs, read once.

Shared by load_vs_deepspeed.py and load_bytes.py, which compare a load's time with reading
these ranges (and nothing else), into new memory (the former) or into memory touched before
(the latter: the reads alone, through the page cache and past it, :func:`direct_read_floor`);
and the two ways load_bytes.py reads from the disk: cold (:func:`evict`) and at a steady
bandwidth (:func:`throttled_reads`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

CHUNK = 1 << 20  # bytes per preadv, as the load reads: one call for hundreds of MB runs slower here
DIRECT_CHUNK = 8 << 20  # bytes per direct read, as the load's (zeroshard.io.direct_reads)
PAGE = 4096


def needed_extents(
    checkpoint_dir: Path, layout, rank: int, model_tensors: Iterable[str] | None = None
) -> list[tuple[Path, int, int]]:
    """The byte ranges a load of ``rank`` under ``layout`` needs, adjacent ranges merged: its
    partitions (masters and optimizer states) of every rank file it draws from, and of
    model.safetensors the tensors named in ``model_tensors`` (every tensor when None)."""
    from zeroshard.checkpoint import open_checkpoint, plan_reads
    from zeroshard.checkpoint.format import MODEL_FILE, fp32_key, rank_file_name, state_key
    from zeroshard.io.dtypes import itemsize_of
    from zeroshard.io.safetensors_io import read_header

    checkpoint = open_checkpoint(checkpoint_dir)
    manifest = checkpoint.manifest
    headers = {}

    def header(name: str):
        if name not in headers:
            headers[name] = read_header(checkpoint.path(name), manifest.files[name].size)
        return headers[name]

    ranges = []
    for plan in plan_reads(manifest.layout, layout, rank, set(layout.param_names)):
        for copy in plan.copies:
            record = manifest.groups[copy.source_group]
            keys = {fp32_key(copy.source_group): record.fp32_dtype}
            keys.update({state_key(copy.source_group, name): dtype for name, dtype in record.states.items()})
            file_name = rank_file_name(copy.source_rank, manifest.world_size)
            for key, dtype in keys.items():
                begin = header(file_name)[key].begin + copy.source_start * itemsize_of(dtype)
                ranges.append((file_name, begin, begin + copy.length * itemsize_of(dtype)))
    model = header(MODEL_FILE)
    for name in model if model_tensors is None else model_tensors:
        ranges.append((MODEL_FILE, model[name].begin, model[name].end))
    merged: list[tuple[str, int, int]] = []
    for name, begin, end in sorted(ranges):
        if merged and merged[-1][0] == name and merged[-1][2] == begin:
            merged[-1] = (name, merged[-1][1], end)
        elif end > begin:
            merged.append((name, begin, end))
    return [(checkpoint.path(name), begin, end) for name, begin, end in merged]


def evict(folder: Path) -> None:
    """Drop every file under ``folder`` from the page cache (written back first), so the next
    read comes from the disk: ``posix_fadvise(DONTNEED)`` needs no privileges, unlike
    ``drop_caches``. A hypervisor may still cache the disk underneath."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_floor(extents: list[tuple[Path, int, int]], into: np.ndarray | None = None) -> np.ndarray:
    """Every extent read once, one after another, into one buffer: by default a new one, of
    the size the load returns, so the floor pays the same first-touch page faults at any D
    (buffers of their own would reuse freed heap pages when under glibc's mmap threshold);
    ``into``, a uint8 array of the extents' size touched before, leaves the reads alone."""
    import numpy as np

    size = sum(end - begin for _, begin, end in extents)
    buffer = np.empty(size, dtype=np.uint8) if into is None else into
    if buffer.nbytes != size:
        raise ValueError(f"read_floor: the buffer holds {buffer.nbytes} bytes, the extents {size}")
    view, at = memoryview(buffer), 0
    for path, begin, end in extents:
        fd = os.open(path, os.O_RDONLY)
        try:
            _read(fd, view[at : at + end - begin], begin, CHUNK)
        finally:
            os.close(fd)
        at += end - begin
    return buffer


def direct_floor_buffer(extents: list[tuple[Path, int, int]]) -> np.ndarray | None:
    """Memory touched once for :func:`direct_read_floor` of ``extents`` (page-aligned, a
    page-rounded span per extent), or None where their file system reads nothing direct."""
    import mmap

    import numpy as np

    if not extents or not hasattr(os, "O_DIRECT"):
        return None
    try:
        os.close(os.open(extents[0][0], os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return None
    size = sum(_aligned_end(end) - _aligned_begin(begin) for _, begin, end in extents)
    buffer = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    buffer[:] = 1
    return buffer


def direct_read_floor(extents: list[tuple[Path, int, int]], into: np.ndarray) -> None:
    """Every extent read once past the page cache (``O_DIRECT``, whole pages, a slot of
    8 MiB per call) into ``into`` (:func:`direct_floor_buffer`): the storage's time for the
    bytes, with neither the page cache's nor new memory's costs (a direct load pays the
    second and a copy; a load through the page cache both)."""
    view, at = memoryview(into), 0
    for path, begin, end in extents:
        begin, end = _aligned_begin(begin), _aligned_end(end)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            _read(fd, view[at : at + end - begin], begin, DIRECT_CHUNK)
        finally:
            os.close(fd)
        at += end - begin


def _read(fd: int, view: memoryview, offset: int, chunk: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : min(len(view), done + chunk)]], offset + done)
        if got == 0:
            return  # a direct read's page-rounded end may lie past the file's
        done += got


def _aligned_begin(offset: int) -> int:
    return offset - offset % PAGE


def _aligned_end(offset: int) -> int:
    return -(-offset // PAGE) * PAGE


@contextmanager
def throttled_reads(folder: Path, bytes_per_second: int) -> Iterator[None]:
    """Run this process, and what it starts, in a cgroup whose reads from the disk under
    ``folder`` are limited to ``bytes_per_second`` together: storage of steady bandwidth
    shared by the job's ranks, as a network file system gives, instead of this VM's disk,
    whose cold reads vary twofold from run to run. Needs root and cgroup v1 (``blkio``) or v2
    (``io``); only reads that reach the disk are limited (use it with cold reads)."""
    device = _whole_disk(os.stat(folder).st_dev)
    v1 = Path("/sys/fs/cgroup/blkio")
    parent = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    group = parent / f"zeroshard-bench-{os.getpid()}"
    group.mkdir()
    try:
        if parent == v1:
            (group / "blkio.throttle.read_bps_device").write_text(f"{device} {bytes_per_second}\n")
        else:
            (group / "io.max").write_text(f"{device} rbps={bytes_per_second}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        group.rmdir()


def _whole_disk(st_dev: int) -> str:
    """``major:minor`` of the disk holding a file system (throttling takes disks, not partitions)."""
    number = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    block = Path("/sys/dev/block") / number
    if (block / "partition").is_file():
        return (block.resolve().parent / "dev").read_text().strip()
    return number
