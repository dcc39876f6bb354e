"""Digests of a run's logical state: what a checkpoint records and what every load recomputes.

A *digest key* names one logical tensor: ``(parameter, expert, kind)``, where ``kind`` is
"fp32" (the master) or an optimizer state name, and ``expert`` is the global expert id of
one expert of a stacked expert weight (None for a dense parameter). Its digest is
``zlib.crc32`` of its padding-free values in logical order, as stored (see :mod:`...io.digest`):
a dense parameter's elements, an expert's slice ``[in, out]`` of the stacked weight. The
same key has the same digest at any world size, EP, policy or bucket size, so every rank
digests the pieces it holds and the XOR of everyone's terms gives it.

:class:`StateDigests` is what a manifest records (JSON); :class:`Terms` is one rank's
partial digests; :func:`held_pieces` lists what one rank holds of a group, from the layout's
fragments and the expert map alone (not through the resharding's ``rank_runs``, so a bug
there cannot hide itself); :func:`partition_terms` digests a partition, and
:class:`PartitionDigester` the same bytes as the writer streams them.

Torch-free.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from ...layout import GroupLayout, Layout
from ...layout.coordinates import ep_rank, expert_numel, expert_pieces, shard_rank
from ...io.digest import ALGORITHM, digest, finish, piece_term, raw_crc, zeros_crc

Key = tuple[str, "int | None", str]  # (parameter, global expert or None, kind)
_MAX_DIGEST = 1 << 32


def describe_key(key: Key) -> str:
    """``'blocks.0.moe.experts.w1' expert 5 exp_avg`` for a key, for one-line errors."""
    name, expert, kind = key
    return f"{name!r}{'' if expert is None else f' expert {expert}'} {kind}"


@dataclass(frozen=True)
class StateDigests:
    """The digests of a saved run: every parameter's (every global expert's) master and
    optimizer states, the optimizer scalars and the module tensors of the model file."""

    params: dict[str, dict[str, int | tuple[int, ...]]]  # param -> kind -> digest (per global expert: a tuple)
    scalars: list[dict[str, int]]  # per layout group (native) or param group (universal): name -> digest
    model: dict[str, int] = field(default_factory=dict)  # stored module tensor -> digest
    algorithm: str = ALGORITHM

    def get(self, key: Key) -> int | None:
        """The recorded digest of ``key``, or None when none is recorded."""
        name, expert, kind = key
        value = self.params.get(name, {}).get(kind)
        if value is None:
            return None
        if isinstance(value, tuple):
            return value[expert] if expert is not None and 0 <= expert < len(value) else None
        return value if expert is None else None

    def keys(self) -> list[Key]:
        """Every recorded parameter key, one per global expert for a stacked expert weight."""
        found: list[Key] = []
        for name, kinds in self.params.items():
            for kind, value in kinds.items():
                if isinstance(value, tuple):
                    found += [(name, expert, kind) for expert in range(len(value))]
                else:
                    found.append((name, None, kind))
        return found

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a manifest records (per-expert tuples as lists); :meth:`from_dict` reads it."""
        return {
            "algorithm": self.algorithm,
            "params": {
                name: {kind: list(v) if isinstance(v, tuple) else v for kind, v in kinds.items()}
                for name, kinds in self.params.items()
            },
            "scalars": [dict(group) for group in self.scalars],
            "model": dict(self.model),
        }

    @classmethod
    def from_dict(cls, data: Any) -> StateDigests:
        """Parse; ValueError (or KeyError, TypeError) on a malformed value."""
        if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM:
            found = data.get("algorithm") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"digests use algorithm {repr(found)[:40]}, this zeroshard computes {ALGORITHM!r}")
        params = {
            str(name): {str(kind): _digest_value(value, f"{name} {kind}") for kind, value in _mapping(kinds).items()}
            for name, kinds in _mapping(data["params"]).items()
        }
        scalars = [{str(n): _one_digest(v, n) for n, v in _mapping(group).items()} for group in data["scalars"]]
        model = {str(name): _one_digest(value, name) for name, value in _mapping(data["model"]).items()}
        return cls(params, scalars, model)


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _one_digest(value: Any, what: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_DIGEST:
        raise ValueError(f"digest of {str(what)[:80]} is {repr(value)[:40]}, not a 32-bit unsigned integer")
    return value


def _digest_value(value: Any, what: str) -> int | tuple[int, ...]:
    if isinstance(value, list):
        return tuple(_one_digest(v, what) for v in value)
    return _one_digest(value, what)


@dataclass
class Terms:
    """Partial digests: per key, the XOR of the terms of the pieces digested and the bytes
    they cover. Plain data, so ranks can exchange it; :meth:`merge` combines two ranks'."""

    values: dict[Key, tuple[int, int]] = field(default_factory=dict)

    def add(self, key: Key, term: int, nbytes: int) -> None:
        """XOR ``term`` into ``key``'s partial digest and count the ``nbytes`` it covers."""
        xor, covered = self.values.get(key, (0, 0))
        self.values[key] = (xor ^ term, covered + nbytes)

    def merge(self, other: Terms) -> Terms:
        """Add every term of ``other`` into this one; returns this one."""
        for key, (term, nbytes) in other.values.items():
            self.add(key, term, nbytes)
        return self


@dataclass(frozen=True)
class HeldPiece:
    """A run of one logical tensor (a dense parameter, or one expert of a stacked weight)
    inside one rank's partition."""

    name: str
    expert: int | None
    partition_start: int
    position: int  # first element inside the logical tensor
    length: int
    tensor_numel: int  # elements of the whole logical tensor


def held_pieces(group: GroupLayout, rank: int, params: Iterable[str] | None = None) -> list[HeldPiece]:
    """What global rank ``rank`` holds of ``group``'s logical tensors, in partition order
    (only of ``params``, if given). An expert group's fragments are cut where experts change,
    each named by its global id from the expert map."""
    wanted = None if params is None else set(params)
    experts = group.expert_map[ep_rank(group, rank)] if group.is_expert_group else ()
    found: list[HeldPiece] = []
    for fragment in group.fragments(shard_rank(group, rank)):
        if wanted is not None and fragment.name not in wanted:
            continue
        slot = group.params[fragment.param_index]
        if not group.is_expert_group:
            start, position = fragment.partition_start, fragment.param_start
            found.append(HeldPiece(slot.name, None, start, position, fragment.length, slot.numel))
            continue
        per_expert = expert_numel(slot)
        for piece in expert_pieces(fragment, per_expert):
            expert, start = experts[piece.local_expert], piece.partition_start
            found.append(HeldPiece(slot.name, expert, start, piece.within_expert, piece.length, per_expert))
    return found


def partition_terms(
    pieces: Iterable[HeldPiece], kind: str, values: np.ndarray, terms: Terms, offset: int = 0
) -> None:
    """Add to ``terms`` the terms of ``pieces`` (of one rank's partition of ``kind``) within
    ``values``, which holds partition elements ``[offset, offset + values.size)``; pieces
    reaching outside it count only their part inside."""
    data = np.ascontiguousarray(values).reshape(-1)
    itemsize = data.dtype.itemsize
    raw = memoryview(data.view(np.uint8)) if data.size else memoryview(b"")
    end = offset + data.size
    for piece in pieces:
        lo, hi = max(piece.partition_start, offset), min(piece.partition_start + piece.length, end)
        if lo >= hi:
            continue
        crc = raw_crc(raw[(lo - offset) * itemsize : (hi - offset) * itemsize])
        position = piece.position + lo - piece.partition_start
        trailing = (piece.tensor_numel - position - (hi - lo)) * itemsize
        terms.add((piece.name, piece.expert, kind), piece_term(crc, trailing), (hi - lo) * itemsize)


def range_term(values: np.ndarray, position: int, tensor_numel: int) -> tuple[int, int]:
    """(term, bytes) of ``values``: elements ``[position, position + values.size)`` of a
    logical tensor of ``tensor_numel`` elements."""
    data = np.ascontiguousarray(values).reshape(-1)
    itemsize = data.dtype.itemsize
    crc = raw_crc(memoryview(data.view(np.uint8)) if data.size else b"")
    return piece_term(crc, (tensor_numel - position - data.size) * itemsize), data.size * itemsize


class PartitionDigester:
    """:func:`partition_terms` of one partition tensor as a writer streams it or a reader
    fills it, without a pass of its own: given the CRC of each *segment* the writer or reader
    computes anyway for its checksum blocks, cut where :meth:`cuts` asks (no segment crosses
    a piece boundary), in any order (:meth:`segment`); or, where CRCs cannot be combined (no
    zlib-ng), fed consecutive chunks of the bytes from the start (``__call__``), while they
    are in the CPU cache. Offsets are bytes of the partition from ``base`` (the partition
    byte at offset 0 of what is streamed). No bytes are kept."""

    def __init__(self, pieces: list[HeldPiece], kind: str, itemsize: int, terms: Terms, base: int = 0) -> None:
        self._pieces = pieces
        self._kind = kind
        self._itemsize = itemsize
        self._terms = terms
        self._base = base
        self._starts = [p.partition_start * itemsize for p in pieces]
        ends = [(p.partition_start * itemsize, (p.partition_start + p.length) * itemsize) for p in pieces]
        self._bounds = sorted({bound for pair in ends for bound in pair})
        self._next = 0  # __call__: the piece being digested
        self._running: int | None = None  # __call__: its raw CRC so far

    def at(self, base: int) -> PartitionDigester:
        """The same digester, for a stream that starts at partition byte ``base``."""
        shifted = PartitionDigester.__new__(PartitionDigester)
        shifted.__dict__.update(self.__dict__)
        shifted._base = base
        return shifted

    def after(self, nbytes: int) -> PartitionDigester:
        """The same digester, for a stream that starts ``nbytes`` further into the partition
        than this one's (a part of what this one was asked to observe)."""
        return self.at(self._base + nbytes)

    def cuts(self, begin: int, end: int) -> list[int]:
        """Where pieces start or end strictly inside the streamed bytes (begin, end)."""
        found = self._bounds[bisect.bisect_right(self._bounds, begin + self._base) : bisect.bisect_left(self._bounds, end + self._base)]
        return [bound - self._base for bound in found]

    def segment(self, offset: int, length: int, crc: int) -> None:
        """Streamed bytes [offset, offset + length), which no piece boundary cuts, have
        ``zlib.crc32`` value ``crc``: the term of that run of its piece (none for padding).
        ValueError for a run that crosses the end of its piece (not cut where :meth:`cuts`
        asks)."""
        offset += self._base
        index = bisect.bisect_right(self._starts, offset) - 1
        if index < 0 or length == 0:
            return
        piece, begin = self._pieces[index], self._starts[index]
        piece_end = begin + piece.length * self._itemsize
        if offset >= piece_end:
            return  # padding after the piece
        if offset + length > piece_end:  # its term would be wrong (and a shift by a negative count never ends)
            raise ValueError(
                f"a segment crossing the end of {piece.name!r}'s piece at byte {piece_end}: cut it where cuts() asks"
            )
        position = piece.position * self._itemsize + offset - begin
        trailing = piece.tensor_numel * self._itemsize - position - length
        self._terms.add((piece.name, piece.expert, self._kind), piece_term(crc ^ zeros_crc(length), trailing), length)

    def __call__(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        while self._next < len(self._pieces):
            piece = self._pieces[self._next]
            begin = piece.partition_start * self._itemsize
            stop = begin + piece.length * self._itemsize
            lo, hi = max(begin, offset), min(stop, end)
            if lo >= end:
                return
            if lo < hi:
                self._running = raw_crc(chunk[lo - offset : hi - offset], self._running)
            if hi < stop:
                return  # the piece goes on in the next chunk
            crc = raw_crc(b"") if self._running is None else self._running
            trailing = (piece.tensor_numel - piece.position - piece.length) * self._itemsize
            key = (piece.name, piece.expert, self._kind)
            self._terms.add(key, piece_term(crc, trailing), piece.length * self._itemsize)
            self._next, self._running = self._next + 1, None


class JointDigester:
    """Several :class:`PartitionDigester` fed by one pass over the same bytes: segments are
    cut wherever any of them asks, and each segment's CRC goes to all (a segment that no
    boundary of one digester cuts is still within one of its pieces). A load from a source
    without digests uses it to digest what it reads both where the bytes land and where
    they lay in the source, from the CRCs of the source's own checks."""

    def __init__(self, *digesters: PartitionDigester) -> None:
        self._digesters = digesters

    def after(self, nbytes: int) -> JointDigester:
        """Each digester's :meth:`PartitionDigester.after`."""
        return JointDigester(*(digester.after(nbytes) for digester in self._digesters))

    def cuts(self, begin: int, end: int) -> list[int]:
        """Where any digester's pieces start or end strictly inside (begin, end)."""
        return sorted({cut for digester in self._digesters for cut in digester.cuts(begin, end)})

    def segment(self, offset: int, length: int, crc: int) -> None:
        """The CRC of streamed bytes [offset, offset + length), to every digester."""
        for digester in self._digesters:
            digester.segment(offset, length, crc)


def tensors_digester(tensors: Mapping[str, tuple[int, int]], terms: Terms) -> PartitionDigester:
    """A digester of whole tensors lying in one buffer (``name -> (begin, end)`` bytes), as
    pieces of kind "module": :func:`finished` of ``(name, None, "module")`` over ``end -
    begin`` bytes is each one's digest."""
    pieces = [HeldPiece(name, None, begin, 0, end - begin, end - begin) for name, (begin, end) in sorted(tensors.items(), key=lambda t: t[1])]
    return PartitionDigester(pieces, "module", 1, terms)


def logical_keys(
    layout: Layout, kinds_of: Mapping[int, Iterable[str]], params: Iterable[str] | None = None
) -> dict[Key, int]:
    """Every digest key of ``layout`` (of ``params`` only, if given) with its element count:
    each parameter (each global expert) in each kind ``kinds_of[group index]`` lists."""
    wanted = None if params is None else set(params)
    found: dict[Key, int] = {}
    for group in layout.groups:
        for slot in group.params:
            if wanted is not None and slot.name not in wanted:
                continue
            for kind in kinds_of[group.index]:
                if group.is_expert_group:
                    experts = sorted(e for ids in group.expert_map for e in ids)
                    found.update({(slot.name, e, kind): expert_numel(slot) for e in experts})
                else:
                    found[(slot.name, None, kind)] = slot.numel
    return found


def finished(terms: Terms, key: Key, total_bytes: int) -> int | None:
    """The digest of ``key`` from merged ``terms``, or None when they do not cover exactly
    its ``total_bytes`` (a piece missing or counted twice)."""
    xor, covered = terms.values.get(key, (0, 0))
    return finish(xor, total_bytes) if covered == total_bytes else None


def array_digest(array: np.ndarray) -> int:
    """The digest of a whole array's bytes (C order)."""
    data = np.ascontiguousarray(array).reshape(-1)
    return digest(memoryview(data.view(np.uint8)) if data.size else b"")


def scalar_digest(value: Any) -> int:
    """The digest of an optimizer scalar as the engine holds it: an array's bytes; a plain
    Python number as the 0-d tensor ``torch.tensor`` makes of it (int64, float32, bool)."""
    if isinstance(value, np.ndarray):
        return array_digest(value)
    if isinstance(value, bool):
        return array_digest(np.array(value, dtype=np.bool_))
    if isinstance(value, int):
        return array_digest(np.array(value, dtype=np.int64))
    if isinstance(value, float):
        return array_digest(np.array(value, dtype=np.float32))
    from ...io.dtypes import as_array  # a torch tensor

    return array_digest(as_array(value))


def digests_from_terms(
    layout: Layout, terms: Terms, kinds_of: Mapping[int, Iterable[str]], itemsize_of: Mapping[tuple[int, str], int]
) -> tuple[dict[str, dict[str, int | tuple[int, ...]]], list[str]]:
    """The ``params`` of a :class:`StateDigests` from every rank's merged ``terms``, and one
    line per key they do not cover exactly (empty when all are whole). ``itemsize_of`` maps
    (group index, kind) to the stored element size."""
    params: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for (name, expert, kind), numel in logical_keys(layout, kinds_of).items():
        group = layout.param(name)[0]
        total = numel * itemsize_of[(group.index, kind)]
        value = finished(terms, (name, expert, kind), total)
        if value is None:
            covered = terms.values.get((name, expert, kind), (0, 0))[1]
            problems.append(f"{describe_key((name, expert, kind))}: the ranks hold {covered} of its {total} bytes")
            value = 0
        kinds = params.setdefault(name, {})
        if expert is None:
            kinds[kind] = value
        else:
            kinds.setdefault(kind, {})[expert] = value
    for kinds in params.values():
        for kind, value in kinds.items():
            if isinstance(value, dict):
                kinds[kind] = tuple(value[e] for e in sorted(value))
    return params, problems
