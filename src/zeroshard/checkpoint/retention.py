"""Which checkpoints a run keeps: the last K, every N-th step, and always the ``latest`` one.

The Checkpointer names its checkpoints ``step-<step>`` (:func:`step_tag`) and manages only
tags of that form; others under the root (say "best") are never deleted. Deletion happens
after a newer checkpoint is committed, under the root's writer lock, never touches a tag
newer than the one committed nor the one ``latest`` names, and renames each tag hidden
before removing it (:func:`~.directory.delete_tag`). A tag that is a symbolic link is no
checkpoint of the root's (nothing loads it) and is never touched. Only checkpoints that
verify count towards ``keep_last`` (their manifest reads and every file it lists is there
at its recorded size): a damaged one among the newest is not counted and not deleted (it is
logged and kept for inspection), so it never pushes out the newest checkpoint that
verifies; past the kept ones it goes with the rest.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Collection, Mapping

from .directory import delete_tag, list_tags, read_latest

log = logging.getLogger(__name__)

_STEP_TAG = re.compile(r"step-(\d{8,})")


def step_tag(step: int) -> str:
    """``step-00000100``: the tag of the checkpoint saved after step ``step``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be a non-negative integer, got {step!r}")
    return f"step-{step:08d}"


def tag_step(tag: str) -> int | None:
    """The step of a tag :func:`step_tag` made, else None."""
    match = _STEP_TAG.fullmatch(tag)
    return int(match.group(1)) if match and step_tag(int(match.group(1))) == tag else None


def tags_to_delete(
    steps: Mapping[str, int],
    committed: str,
    keep_last: int | None,
    keep_every: int | None,
    protected: Collection[str] = (),
    verifies: Callable[[str], bool] = lambda tag: True,
) -> list[str]:
    """The tags to delete once ``committed`` is: of the tags older than it (``steps`` maps
    tag -> step), all but the newest that, with ``committed``, make ``keep_last`` tags that
    ``verifies``, except steps divisible by ``keep_every``, ``protected`` tags and tags that
    do not verify. ``verifies`` is asked newest first, only until the kept ones are found."""
    if keep_last is None:
        return []
    older = sorted(((step, tag) for tag, step in steps.items() if step < steps[committed]), reverse=True)
    wanted = keep_last - (1 if verifies(committed) else 0)
    kept: set[str] = set()
    doomed = []
    for step, tag in older:
        if len(kept) < wanted:
            if verifies(tag):
                kept.add(tag)
            continue  # kept, or damaged: neither counted nor deleted
        if tag not in protected and not (keep_every and step % keep_every == 0):
            doomed.append(tag)
    return sorted(doomed, key=steps.__getitem__)


def apply_retention(root: Path, committed: str, keep_last: int | None, keep_every: int | None) -> list[str]:
    """Delete what :func:`tags_to_delete` names under ``root``; returns the deleted tags.
    A tag that cannot be deleted is logged and kept. Call it holding the root's writer lock
    (the Checkpointer does, right after its commit), so that ``latest``, read here, stays put."""
    steps = {tag: step for tag in list_tags(root) if (step := tag_step(tag)) is not None}
    if committed not in steps:
        return []
    latest = read_latest(root)
    deleted = []
    protected = {latest} if latest else ()
    for tag in tags_to_delete(steps, committed, keep_last, keep_every, protected, lambda tag: _verifies(root, tag)):
        try:
            delete_tag(root, tag)
            deleted.append(tag)
        except OSError as err:
            log.warning("retention: could not delete checkpoint %s: %s", root / tag, err)
    return deleted


def _verifies(root: Path, tag: str) -> bool:
    """The checkpoint opens: its manifest reads, and every file it lists is there at its size."""
    from .native.handle import open_checkpoint

    try:
        open_checkpoint(root / tag)
        return True
    except (OSError, ValueError) as err:
        log.warning("retention: checkpoint %s does not verify, so it is not counted (nor deleted): %s", root / tag, err)
        return False
