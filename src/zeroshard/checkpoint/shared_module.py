"""Module tensors a job reads once: each buffer and frozen parameter by one rank, then broadcast.

Under ZeRO 1/2 every rank holds the whole module. Its trained parameters need no reading:
the engine rebuilds them from the fp32 master partitions each rank reads anyway (cast, then
all-gathered, as after a step). What no master gives (buffers, frozen parameters, and the
names tied to them) is read by one rank each and broadcast to the others, a few MiB at a
time. Who reads what (:func:`share_module`) is worked out from what every rank already
knows, the checkpoint's list of module tensors and the world size, so deciding it costs no
collective; the load's agreement compares every rank's :meth:`ModuleShare.fingerprint`
before anything is broadcast (:func:`broadcast_module`).
"""

from __future__ import annotations

import heapq
import math
import zlib
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch

from ..comm import Collectives
from ..io.dtypes import itemsize_of, torch_dtype
from ..layout import Layout
from .source import ModelEntry

BATCH_BYTES = 4 << 20  # what one broadcast carries at most (a bigger tensor goes alone)
_ALIGN = 64  # each tensor's offset in a batch: any dtype can view its bytes in place


@dataclass(frozen=True)
class SharedTensor:
    """A module tensor of the checkpoint and the rank that reads it."""

    name: str  # as stored (an alias of it is the same tensor)
    shape: tuple[int, ...]
    dtype: str
    reader: int

    @property
    def nbytes(self) -> int:
        """Bytes of its values."""
        return math.prod(self.shape) * itemsize_of(self.dtype)


@dataclass(frozen=True)
class ModuleShare:
    """Which rank of a job reads each module tensor, and the order they are broadcast in."""

    rank: int
    world_size: int
    tensors: tuple[SharedTensor, ...]  # by reader, then in the checkpoint's order

    @property
    def mine(self) -> list[str]:
        """The tensors this rank reads."""
        return [tensor.name for tensor in self.tensors if tensor.reader == self.rank]

    def batches(self) -> list[list[SharedTensor]]:
        """The broadcasts: consecutive tensors of one reader, at most BATCH_BYTES together
        unless one alone is bigger."""
        found: list[list[SharedTensor]] = []
        size = 0
        for tensor in self.tensors:
            if found and found[-1][0].reader == tensor.reader and size + _aligned(tensor.nbytes) <= BATCH_BYTES:
                found[-1].append(tensor)
                size += _aligned(tensor.nbytes)
            else:
                found.append([tensor])
                size = _aligned(tensor.nbytes)
        return found

    def fingerprint(self) -> int:
        """The same on every rank that decided alike (the load's agreement compares it)."""
        decided = [(t.name, t.shape, t.dtype, t.reader) for t in self.tensors]
        return zlib.crc32(repr((self.world_size, decided)).encode())


def share_module(entries: Sequence[ModelEntry], world_size: int, rank: int) -> ModuleShare:
    """Spread ``entries`` (the checkpoint's buffers and frozen parameters) over ``world_size``
    ranks by bytes: largest first, each to the rank with the fewest bytes so far (the lowest
    such rank). The same on every rank given the same entries."""
    readers = [(0, rank) for rank in range(min(world_size, len(entries)))]  # (bytes so far, rank): a heap
    reader_of: dict[str, int] = {}
    order = {entry.name: index for index, entry in enumerate(entries)}
    by_size = sorted(entries, key=lambda e: (-math.prod(e.shape) * itemsize_of(e.dtype), order[e.name]))
    for entry in by_size:
        loaded, reader = readers[0]
        reader_of[entry.name] = reader
        heapq.heapreplace(readers, (loaded + math.prod(entry.shape) * itemsize_of(entry.dtype), reader))
    tensors = [SharedTensor(e.name, tuple(e.shape), e.dtype, reader_of[e.name]) for e in entries]
    tensors.sort(key=lambda t: (t.reader, order[t.name]))
    return ModuleShare(rank, world_size, tuple(tensors))


def share_checkpoint(
    entries: Sequence[ModelEntry], layout: Layout, rank: int, keep_only: Collection[str] | None = None
) -> ModuleShare:
    """:func:`share_module` of a checkpoint's module tensors (``entries``) for a job of
    ``layout``'s ranks: those no trained parameter of ``layout`` gives (a checkpoint's entry
    the run trains, an empty parameter DeepSpeed leaves out of its buffers, is rebuilt with
    the others), and of those only ``keep_only``'s names when given (a load with
    ``strict=False`` reads no tensor the run lacks)."""
    trained = set(layout.param_names)
    wanted = [e for e in entries if e.name not in trained and (keep_only is None or e.name in keep_only)]
    return share_module(wanted, layout.world_size, rank)


def broadcast_module(
    comm: Collectives, share: ModuleShare, mine: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Collective over ``comm``'s ranks, which must be ``share``'s: every shared tensor, from
    the rank that read it (``mine``: what this rank read, by stored name) to all, one
    broadcast per batch. Call it only after the ranks agreed the load (and ``share``): a
    rank that failed to read must not get here, or the others wait for its bytes."""
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else torch.device("cpu")
    found: dict[str, torch.Tensor] = {}
    started = []
    for batch in share.batches():  # all started, then waited for: back to back, not a round trip each
        reader = batch[0].reader
        offsets = _offsets(batch)
        buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
        if reader == comm.rank:
            for tensor, begin in zip(batch, offsets):
                buffer[begin : begin + tensor.nbytes].copy_(_bytes_of(mine[tensor.name]))
        started.append((batch, offsets, buffer, comm.start_broadcast(buffer, reader)))
    for batch, offsets, buffer, handle in started:
        handle.wait()
        reader = batch[0].reader
        for tensor, begin in zip(batch, offsets):
            if reader == comm.rank:
                found[tensor.name] = mine[tensor.name]
            else:
                piece = buffer[begin : begin + tensor.nbytes]
                found[tensor.name] = piece.view(torch_dtype(tensor.dtype)).reshape(tensor.shape)
    return found


def _offsets(batch: list[SharedTensor]) -> list[int]:
    """Where each tensor of a batch starts in its buffer, then the buffer's size."""
    offsets = [0]
    for tensor in batch:
        offsets.append(offsets[-1] + _aligned(tensor.nbytes))
    return offsets


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
