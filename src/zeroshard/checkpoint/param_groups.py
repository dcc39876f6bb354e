"""A saved run's optimizer param groups as a universal checkpoint stores them: each layout
group in exactly one param group, and one set of scalars (``step``) per param group.

``to-universal`` builds its manifest from :func:`universal_param_groups`, and ``inspect
--verify`` reports what it refuses (:func:`param_group_problems`), so a checkpoint that
verifies also converts. A load needs less (it takes each layout group's own scalars), so
these are checked here, not when a checkpoint is opened. A load maps the saved param groups
onto its new layout's groups (:func:`map_param_groups`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..io.budget import quoted
from ..io.dtypes import arrays_to_torch
from ..layout import GroupLayout, Layout
from ..state import ParamGroupState
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


def map_param_groups(source: ShardSource, layout: Layout, loadable: set[str]) -> list[ParamGroupState]:
    """A load's param groups: the saved param groups that hold ``layout``'s groups (of the
    parameters in ``loadable``), each listing its new layout groups. Optimizer
    hyperparameters and scalars follow the parameters.

    Raises:
        ValueError: a new layout group holds parameters of two saved param groups, or of none
            (naming a parameter of each, and what its group trained it with).
    """
    info = source.info
    old_owner = param_group_owners(source)
    owner_of_param = {slot.name: old_owner.get(g.index, -1) for g in info.layout.groups for slot in g.params}
    owners: list[int | None] = []
    for group in layout.groups:
        found = {owner_of_param[slot.name] for slot in group.params if slot.name in loadable}
        if len(found) > 1 or -1 in found:
            raise ValueError(_mixed_groups_message(source, group, loadable, owner_of_param))
        owners.append(found.pop() if found else None)
    states = [
        ParamGroupState(
            arrays_to_torch(dict(saved.hyperparameters)),
            [g for g, owner in enumerate(owners) if owner == index],
            saved.optimizer,
        )
        for index, saved in enumerate(info.param_groups)
    ]
    return [state for state in states if state.layout_groups]


SHOWN_GROUPS = 3  # saved param groups a mixed-groups error describes (a hostile file may have thousands)


def _mixed_groups_message(
    source: ShardSource, group: GroupLayout, loadable: set[str], owner_of_param: Mapping[str, int]
) -> str:
    """Names the first parameter of each saved param group that ``group`` draws from, with what
    that group trained it with (its optimizer class where recorded, its states, DeepSpeed's
    ``use_muon`` flag when it has one): a Muon matrix grouped with AdamW's parameters is found here."""
    first_of: dict[int, str] = {}
    for slot in group.params:
        if slot.name in loadable:
            first_of.setdefault(owner_of_param[slot.name], slot.name)
    described = []
    for owner, name in sorted(first_of.items())[:SHOWN_GROUPS]:
        if owner == -1:
            described.append(f"{quoted(name)} (in no saved param group)")
            continue
        saved = source.info.param_groups[owner]
        states = sorted({key for g in saved.layout_groups for key in source.info.state_keys[g]})
        flag = saved.hyperparameters.get("use_muon")
        flag_text = f"use_muon {str(flag).lower()}, " if isinstance(flag, bool) else ""
        trained_by = f"optimizer {saved.optimizer}, " if saved.optimizer else ""
        what = f"{trained_by}{flag_text}states {quoted(states)}"
        described.append(f"{quoted(name)} of saved param group {owner} ({what})")
    if len(first_of) > SHOWN_GROUPS:
        described.append(f"{len(first_of) - SHOWN_GROUPS} more")
    return (
        f"layout group {group.index} holds parameters of saved param groups {quoted(sorted(first_of))}: "
        f"{'; '.join(described)}; group the run's parameters as the checkpoint does, or load with load_module_only"
    )
