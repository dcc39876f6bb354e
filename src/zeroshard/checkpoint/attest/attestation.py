"""Attestation: every load proves that each rank holds what was saved, or nothing is loaded.

The loader (:func:`~..loader.load_state`) fills an :class:`Evidence` as it reads: after the
load each rank digests what it now holds (:mod:`.digests`): the fragments of its fp32 and
optimizer-state partitions, the optimizer scalars, the module tensors it read, and the fp32
masters it read whole to cast into weights. What it can check alone (whole tensors) it
checks against the checkpoint's digests at once; the partitions' partial digests go to
:func:`judge`, which combines every rank's (one all-gather, the load's own agreement) and
compares each parameter's, each expert's, with the saved digest (:mod:`.attested`). Every rank judges the same
gathered data, so every rank reaches the same verdict; a mismatch refuses the load on every
rank before the engine changes, naming the parameter (and expert) and the checkpoint.

A source without digests (a DeepSpeed checkpoint, a native checkpoint of format version 1)
is digested from the values as read, in the source's own coordinates, and compared with what
the ranks hold after redistribution: that catches a range placed wrongly, not a wrong byte
in the source itself (the files' own checksums catch those). Such a load says so once. A
source that digests its reads hands both sets of digests the CRCs of one pass
(:class:`~.digests.JointDigester`).
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from ...layout import Layout
from .digests import (
    HeldPiece,
    JointDigester,
    PartitionDigester,
    StateDigests,
    Terms,
    array_digest,
    describe_key,
    finished,
    held_pieces,
    logical_keys,
    partition_terms,
    range_term,
    scalar_digest,
)
from ...io.damage import CheckpointDamagedError
from ...io.digest import FUSED, digest
from ...io.dtypes import cast, dtype_info
from ...io.shared_checks import RecordTerms, record_problems

if TYPE_CHECKING:
    from ..source import ShardSource

_SHOWN_PROBLEMS = 3  # of a failed attestation, named in its one line
REBUILT = "weights"  # the digest kind of weights cast from the masters (compared with the model file's)
_CAST_CHUNK = 1 << 20  # elements of masters cast at a time to digest the weights they make


class AttestationError(CheckpointDamagedError):
    """After a load, what the ranks hold is not what the checkpoint saved; nothing was loaded."""


class UnattestedCheckpointWarning(UserWarning):
    """A checkpoint without saved digests (format version 1): checked against the values read only."""


@dataclass
class RankEvidence:
    """What one rank's load digested: plain data, exchanged among the ranks."""

    rank: int
    params: tuple[str, ...]  # the run's parameters the load filled
    itemsizes: dict[int, dict[str, int]]  # new layout group -> kind -> element size (full loads)
    held: Terms = field(default_factory=Terms)  # partial digests of what the rank holds
    read: Terms = field(default_factory=Terms)  # of the values as read (sources without digests)
    scalars: dict[int, dict[str, int]] = field(default_factory=dict)  # new group -> name -> digest
    problems: list[str] = field(default_factory=list)  # mismatches found alone
    checked: int = 0  # digests compared alone
    fingerprint: int = 0  # of the saved digests this rank compares with
    rebuilt: dict[int, int] = field(default_factory=dict)  # new group -> element size of weights cast from masters
    records: RecordTerms = field(default_factory=RecordTerms)  # records (zip, checksum blocks) checked with the other ranks


@dataclass(frozen=True)
class Attestation:
    """The verdict on a load: what was compared, and the mismatches (none: it holds what was saved)."""

    path: str
    basis: str  # what the ranks' state was compared with
    digests: int
    params: int
    experts: int
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No mismatch: the ranks hold what was saved."""
        return not self.problems

    def line(self) -> str:
        """One line for logs: what was attested, or what failed."""
        if self.problems:
            more = f" (and {len(self.problems) - _SHOWN_PROBLEMS} more)" if len(self.problems) > _SHOWN_PROBLEMS else ""
            return f"attestation failed: {'; '.join(self.problems[:_SHOWN_PROBLEMS])}{more}"
        experts = f" ({self.experts} experts)" if self.experts else ""
        return f"attested: {self.digests} digests of {self.params} parameters{experts} match {self.basis} {self.path}"


class Evidence:
    """Filled by :func:`~..loader.load_state` as it loads one rank (see the module docstring).
    One created with ``enabled=False`` ignores every call (a benchmark's baseline)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path, self.kind, self.layout, self.full = "", "", None, False  # set by begin()
        self._expected: StateDigests | None = None
        self._evidence: RankEvidence | None = None
        self._source_layout: Layout | None = None
        self._old_pieces: dict[tuple[int, int], tuple[list[HeldPiece], list[int]]] = {}
        self._new_pieces: dict[int, list[HeldPiece]] = {}  # see _held_pieces
        self._read_digesters: dict[tuple[int, int, str, int], PartitionDigester] = {}  # see observer
        # (new group, kind) -> the terms a source's reads handed over, whether every read did
        self._observed: dict[tuple[int, str], list] = {}

    # ---- called by the loader ---------------------------------------------------------------

    def begin(self, source: ShardSource, layout: Layout, rank: int, params: Iterable[str], full: bool) -> None:
        """Start this rank's evidence for a load from ``source`` into ``layout``: the saved
        digests to compare with (None: digest the reads), the run's parameters the load fills,
        and whether it reads the partitions with optimizer states (``full``) or rebuilds the masters
        from weights."""
        if not self.enabled:
            return
        self._expected = source.info.digests
        self._source_layout = source.info.layout
        self.path, self.kind = str(source.path), getattr(source, "kind", type(source).__name__)
        self.layout, self.full = layout, full
        self._new_pieces.clear()
        fingerprint = 0 if self._expected is None else digest(repr(self._expected.to_dict()).encode())
        self._evidence = RankEvidence(rank, tuple(sorted(params)), {}, fingerprint=fingerprint)

    @property
    def from_reads(self) -> bool:
        """The source has no digests: the values read are digested instead."""
        return self.enabled and self._expected is None

    def read(self, source_rank: int, source_group: int, kind: str, source_start: int, values: np.ndarray) -> None:
        """Values just read from an old rank's partition, from ``source_start`` on."""
        if not self.from_reads:
            return
        pieces, starts = self._pieces_of(source_rank, source_group)
        first = max(0, bisect.bisect_right(starts, source_start) - 1)
        last = bisect.bisect_left(starts, source_start + values.size)
        partition_terms(pieces[first:last], kind, values, self._evidence.read, source_start)

    def read_range(
        self, name: str, expert: int | None, kind: str, position: int, values: np.ndarray, numel: int
    ) -> None:
        """Values just read for elements [position, ...) of one logical tensor of ``numel``."""
        if self.from_reads:
            term, nbytes = range_term(values, position, numel)
            self._evidence.read.add((name, expert, kind), term, nbytes)

    def observer(
        self, group: int, kind: str, dest_start: int, itemsize: int, source: tuple[int, int, int] | None = None
    ) -> PartitionDigester | JointDigester | None:
        """A digester for a read into new group ``group``'s partition of ``kind`` from element
        ``dest_start``: a source that digests its reads hands it the CRCs its checksum pass
        computes, so :meth:`held` need not read the partition again. ``source``: ``(old rank,
        old group, old start)`` the read comes from; where the source has no digests the
        digester also digests the values there (what :meth:`read` would), from the same CRCs.
        None where CRCs cannot be combined (no zlib-ng)."""
        if not (self.enabled and FUSED):
            return None
        entry = self._observed.get((group, kind))
        if entry is None:
            terms = Terms()
            pieces = self._held_pieces(group)
            entry = self._observed[(group, kind)] = [terms, True, PartitionDigester(pieces, kind, itemsize, terms)]
        held = entry[2].at(dest_start * itemsize)
        if not self.from_reads or source is None:
            return held
        source_rank, source_group, source_start = source
        read = self._read_digesters.get((source_rank, source_group, kind, itemsize))
        if read is None:
            pieces, _ = self._pieces_of(source_rank, source_group)
            read = PartitionDigester(pieces, kind, itemsize, self._evidence.read)
            self._read_digesters[(source_rank, source_group, kind, itemsize)] = read
        return JointDigester(held, read.at(source_start * itemsize))

    def observed(self, group: int, kind: str, done: bool) -> None:
        """Whether the source digested the read :meth:`observer` was asked for; one that did
        not means :meth:`held` digests the whole partition of ``kind`` itself (and the
        loader hands the values to :meth:`read`)."""
        entry = self._observed.get((group, kind))
        if entry is not None and not done:
            entry[1] = False

    def master(self, name: str, expert: int | None, values: np.ndarray) -> None:
        """A whole fp32 master read to be cast into a weight (of one expert, for a stack)."""
        if self.enabled and self._expected is not None and not self.full:
            key = (name, expert, "fp32")
            self._compare(describe_key(key), self._expected.get(key), array_digest(values))

    def model_tensor(self, name: str, values: np.ndarray, read: tuple[int, int, int | None] | None = None) -> None:
        """A module tensor read from the checkpoint's model file, under its stored name.
        ``read``: ``(address, nbytes, digest)`` of the bytes the read digested; used only when
        ``values`` are exactly those bytes (else they are digested here)."""
        if self.enabled and self._expected is not None:
            address, nbytes, found = read if read is not None else (0, 0, None)
            if found is None or values.nbytes != nbytes or values.__array_interface__["data"][0] != address:
                found = array_digest(values)
            self._compare(f"module tensor {name!r}", self._expected.model.get(name), found)

    def scalars(self, group: int, source_group: int, scalars: Mapping[str, Any]) -> None:
        """The optimizer scalars new group ``group`` took from old group ``source_group``."""
        if not self.enabled:
            return
        found = {name: scalar_digest(value) for name, value in scalars.items()}
        self._evidence.scalars[group] = found
        if self._expected is None:
            return
        saved = self._expected.scalars[source_group] if source_group < len(self._expected.scalars) else {}
        for name, value in found.items():
            self._compare(f"group {group} scalar {name!r}", saved.get(name), value)

    def held(self, group: int, fp32: np.ndarray, states: Mapping[str, np.ndarray]) -> None:
        """Rank's finished partitions of new group ``group`` (full loads)."""
        if not self.enabled:
            return
        pieces = self._held_pieces(group)
        kinds = {"fp32": fp32, **states}
        self._evidence.itemsizes[group] = {kind: values.dtype.itemsize for kind, values in kinds.items()}
        for kind, values in kinds.items():
            observed = self._observed.get((group, kind))
            if observed is not None and observed[1]:
                self._evidence.held.merge(observed[0])  # digested as it was read
            else:
                partition_terms(pieces, kind, values, self._evidence.held)

    def rebuilt(
        self, group: int, masters: np.ndarray, dtype: str, weights: Sequence[tuple[int, np.ndarray]] | None = None
    ) -> None:
        """The rank's fp32 partition of new group ``group``, whose cast to ``dtype`` (the run's)
        is the weights the engine makes of it. Their pieces, combined over the ranks
        (:func:`judge`), must give the digest of each weight the checkpoint saved (its model
        file's), bit for bit. ``weights``: the weights the engine made, as ``(partition
        offset, values)`` pieces covering the partition, digested as they are (what the run
        holds); without them the masters are cast here a chunk at a time, so the weights are
        never held whole. Expert groups are left out: no model file holds expert weights."""
        if not self.enabled or self.layout.groups[group].is_expert_group:
            return
        pieces = self._held_pieces(group)
        self._evidence.rebuilt[group] = dtype_info(dtype).itemsize
        if weights is not None and all(values.dtype.itemsize == self._evidence.rebuilt[group] for _, values in weights):
            for start, values in weights:
                partition_terms(pieces, REBUILT, values, self._evidence.held, start)
            return
        for start in range(0, masters.size, _CAST_CHUNK):
            chunk = cast(masters[start : start + _CAST_CHUNK], dtype)  # as the engine casts its masters
            partition_terms(pieces, REBUILT, chunk, self._evidence.held, start)

    def record_terms(self) -> RecordTerms:
        """Where a source adds the CRC-32 terms of the record pieces this rank reads, for
        :func:`judge` to combine with every rank's (:mod:`...io.shared_checks`)."""
        return self._evidence.records

    def partial(self) -> RankEvidence | None:
        """This rank's evidence so far, for :func:`judge` (None when disabled or not begun)."""
        return self._evidence

    # ---- internals ----------------------------------------------------------------------------

    def _compare(self, what: str, saved: int | None, found: int) -> None:
        self._evidence.checked += 1
        if saved is None:
            self._evidence.problems.append(f"{what} has no saved digest")
        elif saved != found:
            self._evidence.problems.append(_mismatch(what, found, saved, self._evidence.rank))

    def _held_pieces(self, group: int) -> list[HeldPiece]:
        """What this rank holds of new group ``group`` (asked once per kind read, and again
        by :meth:`held` and :meth:`rebuilt`): listed once per load."""
        found = self._new_pieces.get(group)
        if found is None:
            found = self._new_pieces[group] = held_pieces(self.layout.groups[group], self._evidence.rank, self._evidence.params)
        return found

    def _pieces_of(self, rank: int, group: int) -> tuple[list[HeldPiece], list[int]]:
        found = self._old_pieces.get((rank, group))
        if found is None:
            pieces = held_pieces(self._source_layout.groups[group], rank)
            found = self._old_pieces[(rank, group)] = (pieces, [p.partition_start for p in pieces])
        return found


def _mismatch(what: str, found: int, saved: int, rank: int | None = None) -> str:
    where = "" if rank is None else f" on rank {rank}"
    return f"{what}{where} holds digest {found:08x}, the checkpoint saved {saved:08x}"


def judge(
    evidences: list[RankEvidence],
    layout: Layout,
    expected: StateDigests | None,
    path: str,
    kind: str,
    *,
    complete: bool = True,
    shape: RankEvidence | None = None,
) -> Attestation:
    """The verdict on the ranks' evidence. ``complete``: ``evidences`` holds every rank's,
    so every logical tensor the load filled must be covered; otherwise (one rank, alone) only
    the tensors one rank holds whole are judged. ``shape`` (default: the first evidence)
    gives the parameters the load filled and the partitions' element sizes, the same on
    every rank, so the ranks need not send them."""
    problems = [problem for evidence in evidences for problem in evidence.problems]
    checked = sum(evidence.checked for evidence in evidences)
    if len({evidence.fingerprint for evidence in evidences}) > 1:
        problems.append("the ranks read different digests (was the checkpoint replaced during the load?)")
    held, read = Terms(), Terms()
    for evidence in evidences:
        held.merge(evidence.held)
        read.merge(evidence.read)
    first = shape or evidences[0]
    kinds = {group.index: tuple(first.itemsizes.get(group.index, ())) for group in layout.groups}
    keys = logical_keys(layout, kinds, first.params)
    for key, numel in keys.items():
        total = numel * first.itemsizes[layout.param(key[0])[0].index][key[2]]
        value = finished(held, key, total)
        if value is None:
            if complete:
                covered = held.values.get(key, (0, 0))[1]
                problems.append(f"{describe_key(key)}: the ranks hold {covered} of its {total} bytes")
            continue
        checked += 1
        if expected is not None:
            saved = expected.get(key)
            if saved != value:
                what = describe_key(key)
                problems.append(f"{what} has no saved digest" if saved is None else _mismatch(what, value, saved))
            continue
        as_read = finished(read, key, total)
        if as_read != value:
            what = "was not read whole" if as_read is None else f"was read as {as_read:08x}"
            problems.append(f"{describe_key(key)}: the ranks hold digest {value:08x}, but it {what}")
    if expected is None and complete:
        problems += _scalars_disagree(evidences)
    if complete:
        problems += record_problems(evidence.records for evidence in evidences)
    rebuilt, problems_rebuilt = _judge_rebuilt(held, layout, expected, first, complete)
    checked += rebuilt
    problems += problems_rebuilt
    params = {name for name, _, _ in keys} or set(first.params)
    experts = len({(name, expert) for name, expert, _ in keys if expert is not None})
    return Attestation(path, _basis(kind, expected), checked, len(params), experts, tuple(problems))


def _judge_rebuilt(
    held: Terms, layout: Layout, expected: StateDigests | None, first: RankEvidence, complete: bool
) -> tuple[int, list[str]]:
    """Weights cast from the masters (:meth:`Evidence.rebuilt`) against the weights the
    checkpoint's model file holds: (digests compared, problems). A checkpoint that keeps no
    low-precision weights (universal) or no digests (DeepSpeed) has nothing to compare with:
    there the weights are the masters cast by definition, and the masters are attested."""
    checked, problems = 0, []
    wanted = set(first.params)
    for index, itemsize in first.rebuilt.items():
        for slot in layout.groups[index].params:
            saved = expected.model.get(slot.name) if expected is not None else None
            if slot.name not in wanted or saved is None:
                continue
            value = finished(held, (slot.name, None, REBUILT), slot.numel * itemsize)
            if value is None:
                if complete:
                    covered = held.values.get((slot.name, None, REBUILT), (0, 0))[1]
                    problems.append(f"{slot.name!r} weights: the ranks hold {covered} of its {slot.numel * itemsize} bytes")
                continue
            checked += 1
            if value != saved:
                problems.append(
                    f"{slot.name!r} weights cast from its fp32 master hold digest {value:08x}, the checkpoint's "
                    f"model file saved {saved:08x} (a weight changed outside the optimizer before the save?)"
                )
    return checked, problems


def _scalars_disagree(evidences: list[RankEvidence]) -> list[str]:
    """Without saved digests, every rank must at least hold the same optimizer scalars."""
    first = evidences[0].scalars
    return [
        f"group {group} scalar {name!r}: rank {evidence.rank} holds digest {value:08x}, rank {evidences[0].rank} "
        f"{first.get(group, {}).get(name, 0):08x}"
        for evidence in evidences[1:]
        for group, scalars in evidence.scalars.items()
        for name, value in scalars.items()
        if first.get(group, {}).get(name) != value
    ]


_UNDIGESTED = {"zeroshard.checkpoint": "format version 1", "zeroshard.universal": "universal format version 1 or 2"}


def _basis(kind: str, expected: StateDigests | None) -> str:
    if expected is not None:
        return "the digests saved in"
    if kind in _UNDIGESTED:
        return f"the values read (no saved digests: {_UNDIGESTED[kind]}) from"
    return "the values read (no saved digests of ours) from"


def attest_alone(evidence: Evidence, world_size: int) -> Attestation:
    """One rank's verdict without the others (a load without a coordinator): all of it in a
    world of one; at larger world sizes, only what this rank holds whole. Raises AttestationError."""
    evidences = [evidence.partial()]
    verdict = judge(evidences, evidence.layout, evidence._expected, evidence.path, evidence.kind, complete=world_size == 1)
    if not verdict.ok:
        raise AttestationError(f"checkpoint {evidence.path} not loaded: {verdict.line()}")
    warn_if_unattested(verdict, evidence.kind, evidence.partial().rank)
    return verdict


def warn_if_unattested(verdict: Attestation, kind: str, rank: int) -> None:
    """A zeroshard checkpoint written before digests: say so, once (rank 0)."""
    if rank == 0 and kind in _UNDIGESTED and verdict.basis.startswith("the values read"):
        warnings.warn(
            f"{verdict.path}: saved without digests ({_UNDIGESTED[kind]}): attested only against the values read",
            UnattestedCheckpointWarning,
            stacklevel=3,
        )

