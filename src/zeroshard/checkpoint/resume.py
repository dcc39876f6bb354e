"""Which checkpoint a Checkpointer resumes from, decided from its root (on rank 0, so that
every rank loads the same), and never in a way that makes the resumed run save over one.

:func:`plan_resume` lists the tags to try, newest first:

* the tag ``latest`` names (the checkpoint the last save committed), then, for the fallback,
  the older ``step-*`` entries;
* without ``latest``, the ``step-*`` entries, and the resume says so: a root that holds
  checkpoints never looks empty (a run started from scratch there would come to save over
  them);
* a ``step-*`` entry newer than the checkpoint ``latest`` names (a save that stopped before
  moving ``latest``, or ``latest`` moved back by hand) refuses the resume in one line: the
  resumed run would come to save that step again, and a Checkpointer never replaces a
  checkpoint. Which of the two it was, only a person can say.

Every name of the form ``step-<step>`` counts, whatever it is (a directory, a link, a file):
each is a name a save would meet. Before a tag is loaded, :func:`tag_problem` checks that it
is a checkpoint directory of the root: one that is missing, a symbolic link (never followed:
it may be another run's checkpoint) or without a regular manifest is damage, as the loader's
own findings are. The fallback sets each damaged tag it passed over aside
(:func:`set_aside`: ``<tag>.damaged``, kept for inspection) once an older one has loaded:
the resumed run saves those steps again, and retention, which manages ``step-*`` tags only,
never counts them.

:func:`load_newest` is the collective part: rank 0 reads the root (:func:`decided_on_rank0`),
every rank gets its verdict and loads the same tag, so every rank resumes the same
checkpoint or raises the same one-line error.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from .attest.attestation import Attestation
from .coordinator import Coordinator
from .engine_io import load_checkpoint_attested
from .format import LATEST_FILE, LOCK_FILE, MANIFEST_FILE
from ..io.damage import CheckpointDamagedError
from .directory import fsync_dir, read_latest, resolve_checkpoint
from ..io.writer_lock import WriterLock
from .retention import tag_step

if TYPE_CHECKING:
    from ..engine import ZeroOptimizer

log = logging.getLogger("zeroshard.checkpoint.checkpointer")  # the Checkpointer's: one logger to watch
_T = TypeVar("_T")

DAMAGED_SUFFIX = ".damaged"  # a damaged tag the fallback passed over: <tag>.damaged[-N]
_SHOWN = 3  # tags a refusal names; it counts the rest


@dataclass(frozen=True)
class ResumePlan:
    """The tags to load, newest first (without the fallback, only the first is tried)."""

    candidates: tuple[str, ...] = ()
    latest: str | None = None  # the tag ``latest`` names, if it is read
    note: str | None = None  # why the first is not the tag ``latest`` names


def step_entries(root: Path) -> dict[str, int]:
    """Every name under ``root`` of the form ``step-<step>``, whatever it is, and its step."""
    return {entry.name: step for entry in root.iterdir() if (step := tag_step(entry.name)) is not None}


def plan_resume(root: Path, fallback: bool) -> ResumePlan:
    """What to resume under ``root`` (nothing when it is absent or holds no ``step-*`` entry
    nor ``latest``). ValueError in one line when the resume must not happen (a ``step-*``
    entry newer than what ``latest`` names); CheckpointDamagedError when ``latest`` is
    unreadable, unless ``fallback`` (then the ``step-*`` entries are tried, newest first)."""
    if not root.is_dir():
        return ResumePlan()
    steps = step_entries(root)
    newest_first = sorted(steps, key=steps.__getitem__, reverse=True)
    try:
        latest = read_latest(root)
    except CheckpointDamagedError as err:
        if not fallback or not newest_first:
            raise
        return ResumePlan(tuple(newest_first), note=f"{err}; resuming the newest checkpoint, {newest_first[0]}")
    if latest is None:
        if not newest_first:
            return ResumePlan()
        note = f"{root / LATEST_FILE} is missing; resuming the newest checkpoint, {newest_first[0]}"
        return ResumePlan(tuple(newest_first), note=note)
    at = tag_step(latest)
    if at is not None:
        newer = [tag for tag in reversed(newest_first) if steps[tag] > at]
        if newer:
            raise ValueError(_newer_than_latest(root, latest, newer))
    older = [tag for tag in newest_first if tag != latest and (at is None or steps[tag] < at)]
    return ResumePlan((latest, *older), latest=latest)


def _newer_than_latest(root: Path, latest: str, newer: list[str]) -> str:
    shown = ", ".join(newer[:_SHOWN]) + (f" and {len(newer) - _SHOWN:,} more" if len(newer) > _SHOWN else "")
    return (
        f"checkpoint root {root}: {LATEST_FILE} names {latest}, but newer checkpoints are there ({shown}); "
        f"resuming {latest} would save over them, which a Checkpointer never does: point {LATEST_FILE} at the "
        f"one to resume (echo {newer[-1]} > {root / LATEST_FILE}), or move the newer ones out of {root}"
    )


def tag_problem(root: Path, tag: str) -> str | None:
    """Why ``root/tag`` is no checkpoint directory of the root, in one line naming it; None
    when the loader may open it (it checks the rest). A tag a save committed is a directory,
    not a link, holding a regular ``manifest.json``."""
    path = root / tag
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        try:
            resolve_checkpoint(path)  # the previous version, if a save replacing it (save_checkpoint) was cut short
        except FileNotFoundError:
            return f"{path}: missing"
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path}: a symbolic link, not a checkpoint directory of {root} (a Checkpointer never follows one)"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path}: not a directory"
    manifest = path / MANIFEST_FILE
    try:
        info = os.lstat(manifest)
    except FileNotFoundError:
        return f"{manifest}: missing; every checkpoint a save committed has one"
    if not stat.S_ISREG(info.st_mode):
        return f"{manifest}: {'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'not a regular file'}"
    return None


def set_aside(root: Path, tags: Sequence[str]) -> list[tuple[str, str]]:
    """Rename each damaged ``root/<tag>`` to ``<tag>.damaged`` (``.damaged-2``, ... when that
    is taken), holding the root's writer lock; returns (tag, new name) for each. A tag already
    gone is skipped. WriterLockedError when a save into the root is running."""
    moved = []
    with WriterLock(root / LOCK_FILE, "setting damaged checkpoints aside"):
        for tag in tags:
            if not os.path.lexists(root / tag):
                continue
            name = _free_name(root, tag)
            os.rename(root / tag, root / name)
            moved.append((tag, name))
        fsync_dir(root)
    return moved


def _free_name(root: Path, tag: str) -> str:
    for index in range(1, 1000):
        name = f"{tag}{DAMAGED_SUFFIX}" + (f"-{index}" if index > 1 else "")
        if not os.path.lexists(root / name):
            return name
    raise FileExistsError(f"{root / tag}: 999 damaged copies of it are already set aside; move them out of {root}")


# ---- the collective part: every rank loads what rank 0 found ----------------------------------------


def load_newest(
    engine: ZeroOptimizer,
    root: Path,
    plan: ResumePlan,
    coord: Coordinator,
    *,
    fallback: bool,
    lr_scheduler: Any,
    prepare: Callable[[Path], _T],
) -> tuple[dict[str, Any], Path, Attestation, _T]:
    """Collective: load the first of the plan's candidates that loads and attests (only the
    first, unless ``fallback``: then each damaged one passed over is said and set aside).
    ``prepare(path)`` (collective) runs before each load: what it raises counts as the
    tag's (damage falls back). Returns what it saved (its ``extra``), its path, the
    attestation and what ``prepare`` returned. Raises as
    :meth:`~.checkpointer.Checkpointer.load` says, on every rank alike."""
    passed: list[str] = []
    for index, tag in enumerate(plan.candidates):
        try:
            prepared, saved, attestation = _load_tag(
                engine, root, tag, coord, lr_scheduler, prepare, named_by_latest=tag == plan.latest
            )
        except CheckpointDamagedError as err:  # raised on every rank alike
            if not fallback or index + 1 == len(plan.candidates):
                raise
            if coord.rank == 0:
                older = plan.candidates[index + 1]
                log.warning("%s does not verify, resuming from the older %s: %s", root / tag, older, err)
            passed.append(tag)
            continue
        _set_aside_passed(root, passed, coord)
        return saved, root / tag, attestation, prepared
    raise AssertionError("unreachable: the last candidate returns or raises")


def _load_tag(
    engine: ZeroOptimizer,
    root: Path,
    tag: str,
    coord: Coordinator,
    lr_scheduler: Any,
    prepare: Callable[[Path], _T],
    *,
    named_by_latest: bool,
) -> tuple[_T, dict[str, Any], Attestation]:
    """Collective: load ``root/tag`` once rank 0 has seen it is a checkpoint directory of the
    root and ``prepare`` has read what it needs of it."""
    path = root / tag
    problem = decided_on_rank0(coord, lambda: tag_problem(root, tag))
    if problem is not None:
        named = f" ({root / LATEST_FILE} names it)" if named_by_latest else ""
        raise CheckpointDamagedError(f"checkpoint {path} not loaded (nothing changed): {problem}{named}")
    prepared = prepare(path)
    return (prepared, *load_checkpoint_attested(engine, path, lr_scheduler=lr_scheduler))


def _set_aside_passed(root: Path, tags: list[str], coord: Coordinator) -> None:
    """Collective: rank 0 sets the damaged ``tags`` aside, so that the resumed run can save
    those steps again. The checkpoint is loaded by now: a failure is a warning (a save of such
    a step then refuses, naming the tag), not an error."""
    if not tags:
        return
    try:
        moved = decided_on_rank0(coord, lambda: set_aside(root, tags))
    except ValueError as err:
        if coord.rank == 0:
            what = ", ".join(tags)
            log.warning("could not set the damaged %s aside (a save of its step refuses until it is moved): %s", what, err)
        return
    if coord.rank == 0 and moved:
        renamed = ", ".join(f"{tag} as {name}" for tag, name in moved)
        log.warning("%s: set aside the damaged %s, for inspection", root, renamed)


def agreed_on_every_rank(coord: Coordinator, action: Callable[[], _T]) -> _T:
    """Collective: ``action()`` runs on every rank; if it fails on any, every rank raises the
    first failing rank's error in one line (CheckpointDamagedError for damage, else
    ValueError), so no rank goes on alone."""
    outcome: tuple[str, Any]
    try:
        outcome = ("ok", action())
    except CheckpointDamagedError as err:
        outcome = ("damage", str(err))
    except Exception as err:  # noqa: BLE001 - every rank must learn of it
        outcome = ("error", str(err) if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {err}")
    everyone = coord.all_gather_object((outcome[0], None if outcome[0] == "ok" else outcome[1]))
    for rank, (kind, text) in enumerate(everyone):
        if kind != "ok":
            error = CheckpointDamagedError if kind == "damage" else ValueError
            raise error(text if coord.world_size == 1 else f"rank {rank}: {text}")
    return outcome[1]


def decided_on_rank0(coord: Coordinator, action: Callable[[], _T]) -> _T:
    """Collective: ``action()`` runs on rank 0 (it reads the root); its result, or its error in
    one line (CheckpointDamagedError for damage, else ValueError), on every rank."""
    outcome: tuple[str, Any] | None = None
    if coord.rank == 0:
        try:
            outcome = ("ok", action())
        except CheckpointDamagedError as err:
            outcome = ("damage", str(err))
        except ValueError as err:
            outcome = ("error", str(err))
        except Exception as err:  # noqa: BLE001 - every rank waits for the outcome: it must get one
            outcome = ("error", f"{type(err).__name__}: {err}")
    kind, value = coord.broadcast_object(outcome)
    if kind == "damage":
        raise CheckpointDamagedError(value)
    if kind == "error":
        raise ValueError(value)
    return value
