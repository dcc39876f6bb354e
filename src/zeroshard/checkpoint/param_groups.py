"""A saved run's optimizer param groups as a universal checkpoint stores them: each layout
group in exactly one param group, and one set of scalars (``step``) per param group.

``to-universal`` builds its manifest from :func:`universal_param_groups`, and ``inspect
--verify`` reports what it refuses (:func:`param_group_problems`), so a checkpoint that
verifies also converts. A load needs less (it takes each layout group's own scalars), so
these are checked here, not when a checkpoint is opened.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .attest.read_digests import ReadChecker
from .source import ShardSource, param_group_owners


def universal_param_groups(
    source: ShardSource, checker: ReadChecker | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """The param group of each layout group, and each param group's scalars (which
    ``checker``, if given, checks against the saved digests as they are read).

    Raises:
        ValueError: naming the checkpoint: a layout group in no param group or in two, or
            two layout groups of one param group holding different scalars.
    """
    owner = param_group_owners(source)
    missing = [g.index for g in source.info.layout.groups if g.index not in owner]
    if missing:
        raise ValueError(f"{source.path}: layout groups {missing} belong to no optimizer param group")
    groups = source.info.param_groups
    scalars = [_scalars_of(source, index, state.layout_groups, checker) for index, state in enumerate(groups)]
    return [owner[g.index] for g in source.info.layout.groups], scalars


def param_group_problems(source: ShardSource) -> list[str]:
    """What :func:`universal_param_groups` refuses in ``source``, as one line (or none)."""
    try:
        universal_param_groups(source)
    except ValueError as err:
        return [str(err)]
    return []


def _scalars_of(
    source: ShardSource, index: int, layout_groups: list[int], checker: ReadChecker | None
) -> dict[str, Any]:
    """The param group's scalars; every layout group of it must hold the same ones."""
    found = [source.scalars(g) for g in layout_groups]
    if checker is not None:
        for group, scalars in zip(layout_groups, found):
            checker.scalars(index, group, scalars)
    for group, other in zip(layout_groups[1:], found[1:]):
        if not _same_scalars(found[0], other):
            raise ValueError(
                f"{source.path}: param group {index}: layout groups {layout_groups[0]} and {group} hold different "
                "optimizer scalars (step); a universal checkpoint keeps one set per param group"
            )
    return found[0] if found else {}


def _same_scalars(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and _same_array(x, y)):
                return False
        elif x != y:
            return False
    return True


def _same_array(x: np.ndarray, y: np.ndarray) -> bool:
    """Same dtype, shape and bytes (so NaN equals NaN, and -0.0 differs from 0.0)."""
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
