"""Resume files: each rank's random state and the training script's own states (format version 4).

A Checkpointer save takes, on every rank, its random state (:mod:`.rng`) and the
``state_dict()`` of every object the script registered (a data loader, a sampler, its own
iterator): per rank (``state=``), or the same on every rank (``global_state=``). They are
encoded as JSON at once (:func:`capture`, on the training thread: the save writes later) and
written as ``resume-RRRRR-of-DDDDD.json`` beside the rank file, listed in the manifest with
its block checksums like every other file.

A load reads them before the engine's state (:func:`read_for_rank`; damage is a
CheckpointDamagedError, so the Checkpointer's fallback takes an older checkpoint) and
applies them after it (:meth:`RestorePlan.apply`). At the saved world size every rank takes
its own. At another one (:func:`restore_plan`): rank ``r`` takes saved rank ``r mod D_old``'s
per-rank states and random streams; a rank with no saved rank of its own (``r >= D_old``)
derives fresh streams from that state and ``r`` (:func:`.rng.derived_rng`); global states
go to every rank from saved rank 0's file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..state import ResumeState
from .format import resume_file_name
from ..io import jsonvalue
from ..io.budget import quoted
from ..io.checksum import BlockHasher, FileRecord, block_crc
from ..io.damage import CheckpointDamagedError
from ..io.members import open_member
from .native.handle import Checkpoint
from .rng import capture_rng, derived_rng, restore_derived, restore_rng, saved_rank_for

RESUME_FORMAT = "zeroshard.resume"


def check_stateful(states: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``states`` as a dict of name -> object with ``state_dict`` and ``load_state_dict``;
    ValueError naming the argument and the state otherwise."""
    if not isinstance(states, Mapping):
        found = type(states).__name__
        raise ValueError(f"{where} must be a mapping of names to objects with state_dict(), got a {found}")
    for name, value in states.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: state name {name!r} is not a non-empty string")
        if not callable(getattr(value, "state_dict", None)) or not callable(getattr(value, "load_state_dict", None)):
            raise ValueError(f"{where}[{name!r}]: a {type(value).__name__} has no state_dict() and load_state_dict()")
    return dict(states)


def encoded_states(states: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each object's ``state_dict()``, encoded as JSON now (a copy: training goes on changing
    the object). ValueError naming the state when it cannot be stored without pickle."""
    return {name: jsonvalue.encode(obj.state_dict(), f"{where}[{name!r}].state_dict()") for name, obj in states.items()}


def capture(rng: bool, states: Mapping[str, Any], global_states: Mapping[str, Any]) -> ResumeState:
    """This rank's resume state now: its random streams (if ``rng``) and every registered state."""
    return ResumeState(
        rng=capture_rng() if rng else None,  # copies: encoded when the file is written
        states=encoded_states(states, "state"),
        global_states=encoded_states(global_states, "global_state"),
    )


def file_bytes(resume: ResumeState, rank: int, world_size: int) -> bytes:
    """The resume file of ``rank`` (JSON, ASCII)."""
    document = {
        "format": RESUME_FORMAT,
        "rank": rank,
        "world_size": world_size,
        "rng": None if resume.rng is None else jsonvalue.encode(resume.rng, "random state"),
        "states": resume.states,
        "global_states": resume.global_states,
    }
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode("ascii")


def file_record(data: bytes, block_size: int) -> FileRecord:
    """The manifest's record (size, block checksums) of a file holding ``data``."""
    hasher = BlockHasher(block_size)
    hasher.update(data)
    return hasher.record()


@dataclass(frozen=True)
class SavedRank:
    """One saved rank's resume file, read, checked and decoded."""

    rank: int
    rng: dict[str, Any] | None
    states: dict[str, Any]
    global_states: dict[str, Any]


def read_resume_file(checkpoint: Checkpoint, rank: int) -> SavedRank:
    """Saved rank ``rank``'s resume file: its bytes checked against the manifest's block
    checksums, then parsed. CheckpointDamagedError in one line naming the file otherwise."""
    manifest = checkpoint.manifest
    name = resume_file_name(rank, manifest.world_size)
    path = checkpoint.path(name)
    record = manifest.files[name]
    try:
        with open(open_member(path), "rb") as handle:
            data = handle.read(record.size + 1)
    except ValueError as err:  # a link, a FIFO
        raise CheckpointDamagedError(str(err)) from None
    if len(data) != record.size:
        size = f"{len(data)} bytes, the manifest says {record.size}"
        raise CheckpointDamagedError(f"{path}: truncated or altered: {size}")
    for index in range(len(record.crc32)):
        begin, end = record.block_range(index)
        if block_crc(data[begin:end]) != record.crc32[index]:
            where = f"block {index} (bytes {begin}-{end})"
            raise CheckpointDamagedError(f"{path}: checksum mismatch in {where}: the file is corrupted")
    assert manifest.resume is not None  # callers read resume files of checkpoints that have them
    return _parsed(path, data, rank, manifest.world_size, manifest.resume.rng, manifest.resume.states)


def resume_file_problems(checkpoint: Checkpoint, rank: int) -> list[str]:
    """What ``inspect --verify`` says of saved rank ``rank``'s resume file (nothing when it is intact)."""
    try:
        read_resume_file(checkpoint, rank)
    except (OSError, ValueError) as err:
        return [str(err)]
    return []


def _parsed(
    path: os.PathLike[str], data: bytes, rank: int, world_size: int, rng: bool, scopes: Mapping[str, str]
) -> SavedRank:
    try:
        document = jsonvalue.loads(data, path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointDamagedError(f"{path}: corrupted: not JSON ({err})") from None
    except ValueError as err:
        raise CheckpointDamagedError(str(err)) from None
    if not isinstance(document, dict) or document.get("format") != RESUME_FORMAT:
        raise CheckpointDamagedError(f"{path}: not a zeroshard resume file")
    found_rank, found_world = document.get("rank"), document.get("world_size")
    if type(found_rank) is not int or type(found_world) is not int or (found_rank, found_world) != (rank, world_size):
        found = f"rank {quoted(found_rank)} of {quoted(found_world)}"
        raise CheckpointDamagedError(f"{path}: holds {found}, but the manifest puts rank {rank} of {world_size} here")
    per_rank, shared = document.get("states"), document.get("global_states")
    if not isinstance(per_rank, dict) or not isinstance(shared, dict):
        raise CheckpointDamagedError(f"{path}: its states are not JSON objects")
    declared = {**{n: "rank" for n in per_rank}, **{n: "global" for n in shared}}
    if declared != dict(scopes):
        listed = f"the manifest lists {sorted(scopes)}"
        raise CheckpointDamagedError(f"{path}: holds the states {sorted(declared)}, {listed}")
    if (document.get("rng") is not None) != rng:
        found, said = ("lacks", "holds") if rng else ("holds", "lacks")
        raise CheckpointDamagedError(f"{path}: {found} a random state, the manifest says it {said} one")
    try:
        decoded = [jsonvalue.decode(document.get(key)) for key in ("rng", "states", "global_states")]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointDamagedError(f"{path}: corrupted: {err}") from None
    return SavedRank(rank, *decoded)


@dataclass
class RestorePlan:
    """What one rank of the resumed run takes from a checkpoint's resume files, and how."""

    rank: int
    world_size: int
    saved_world_size: int
    source: SavedRank  # the saved rank whose streams and per-rank states it takes
    shared: SavedRank  # saved rank 0's, for the global states
    derive: bool  # no saved rank of its own: its streams are derived from ``source``'s
    where: str = ""
    notes: list[str] = field(default_factory=list)

    def rule(self) -> str:
        """The rule that ran, for the resume line (the same on every rank)."""
        old, new = self.saved_world_size, self.world_size
        if old == new:
            return "each rank its own, as saved"
        ranks = f"rank {old}" if new == old + 1 else f"ranks {old}-{new - 1}"
        derived = f"; {ranks}, which no saved rank was, seed their random streams from it and r" if new > old else ""
        return f"D {old} -> {new}: rank r takes saved rank r mod {old}'s{derived}"

    def apply(self, rng: bool, states: Mapping[str, Any], global_states: Mapping[str, Any]) -> None:
        """Restore the random streams (if ``rng`` and saved) and load every registered state
        the checkpoint holds. A state's own ``load_state_dict`` error passes through."""
        from ..io.dtypes import arrays_to_torch

        if rng and self.source.rng is not None:
            if self.derive:
                restore_derived(derived_rng(self.source.rng, self.rank, self.where))
            else:
                restore_rng(self.source.rng, self.where)
        for name, value in states.items():
            if name in self.source.states:
                value.load_state_dict(arrays_to_torch(self.source.states[name]))
        for name, value in global_states.items():
            if name in self.shared.global_states:
                value.load_state_dict(arrays_to_torch(self.shared.global_states[name]))


def read_for_rank(checkpoint: Checkpoint, rank: int, world_size: int) -> RestorePlan | None:
    """What rank ``rank`` of a run of ``world_size`` ranks restores from ``checkpoint`` (None:
    it has no resume files). Reads and checks the files it needs, and its random state, so
    that damage is found before anything is loaded."""
    if checkpoint.manifest.resume is None:
        return None
    saved_world = checkpoint.manifest.world_size
    source_rank = saved_rank_for(rank, saved_world)
    source = read_resume_file(checkpoint, source_rank)
    shared = source if source_rank == 0 else read_resume_file(checkpoint, 0)
    where = str(checkpoint.path(resume_file_name(source_rank, saved_world)))
    if source.rng is not None:
        try:
            derived_rng(source.rng, rank, where)  # checks every field of the saved state
        except ValueError as err:
            raise CheckpointDamagedError(str(err)) from None
    return RestorePlan(rank, world_size, saved_world, source, shared, derive=rank >= saved_world, where=where)
