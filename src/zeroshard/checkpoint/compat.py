"""Does a checkpoint fit the run? Name every parameter that does not, in one line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..layout import Layout, global_shape
from .native.manifest import dtype_name
from .source import SourceInfo

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Mismatch:
    """Differences between the checkpoint's tensors and the run's, by name."""

    missing: tuple[str, ...] = ()  # in the run, not in the checkpoint
    unexpected: tuple[str, ...] = ()  # in the checkpoint, not in the run
    reshaped: tuple[str, ...] = ()  # "name (checkpoint [..], run [..])"
    retyped: tuple[str, ...] = ()  # "name (checkpoint bfloat16, run float16)"
    regrouped: tuple[str, ...] = ()  # "name (checkpoint expert, run dense)"
    reoriented: tuple[str, ...] = ()  # "name (checkpoint out_in, run in_out)": expert stacks

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.reshaped or self.retyped or self.regrouped or self.reoriented)

    def describe(self, what: str) -> str:
        """One line: ``what``, then each kind of difference with its count and names."""
        parts = []
        for label, names in (
            ("missing from the checkpoint", self.missing),
            ("not in the run", self.unexpected),
            ("with another shape", self.reshaped),
            ("with another dtype", self.retyped),
            ("expert weights on one side, dense on the other", self.regrouped),
            ("expert stacks with another orientation", self.reoriented),
        ):
            if names:
                parts.append(f"{len(names)} {label}: {', '.join(names)}")
        return f"{what}: " + "; ".join(parts)

    def skipped(self) -> set[str]:
        """Names a non-strict load leaves out (present on one side only, or reshaped)."""
        changed = {entry.split(" (")[0] for entry in self.reshaped + self.regrouped + self.reoriented}
        return set(self.missing) | set(self.unexpected) | changed


def compare_params(old: Layout, new: Layout) -> Mismatch:
    """The run's trainable parameters (``new``) against the checkpoint's (``old``). Expert
    weights compare by their global shape (every expert stacked), so a change of EP is no
    difference and a change of expert count is one; two stacks that both claim an
    orientation must claim the same (a square stack would otherwise load transposed)."""
    old_specs, new_specs = _param_specs(old), _param_specs(new)
    found = _compare(
        {name: (shape, dtype) for name, (shape, dtype, _) in old_specs.items()},
        {name: (shape, dtype) for name, (shape, dtype, _) in new_specs.items()},
    )
    regrouped = tuple(
        f"{name} (checkpoint {_kind(old_specs[name][2])}, run {_kind(expert)})"
        for name, (_, _, expert) in new_specs.items()
        if name in old_specs and old_specs[name][2] != expert
    )
    old_stacks, new_stacks = _orientations(old), _orientations(new)
    reoriented = tuple(
        f"{name} (checkpoint {old_stacks[name]}, run {orientation})"
        for name, orientation in new_stacks.items()
        if old_stacks.get(name, "none") not in ("none", orientation) and orientation != "none"
    )
    return dataclasses.replace(found, regrouped=regrouped, reoriented=reoriented)


def _orientations(layout: Layout) -> dict[str, str]:
    return {slot.name: group.stacks[slot.index].orientation for group in layout.groups for slot in group.params if group.stacks}


def _param_specs(layout: Layout) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """Name -> (global shape, dtype, is an expert weight)."""
    return {
        slot.name: (global_shape(group, slot), slot.spec.dtype, group.is_expert_group)
        for group in layout.groups
        for slot in group.params
    }


def _kind(expert: bool) -> str:
    return "expert" if expert else "dense"


def compare_module(info: SourceInfo, run_layout: Layout, module_state: Mapping[str, torch.Tensor]) -> Mismatch:
    """The run's state_dict entries that are not its trained parameters (frozen parameters,
    buffers, tied names) against what the checkpoint holds under those names. Trained
    parameters are :func:`compare_params`'s, so each difference is reported once."""
    trained_by_run = set(run_layout.param_names)
    run = {
        name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in module_state.items() if name not in trained_by_run
    }
    any_dtype = info.weights_from_masters  # trained weights are cast from the fp32 masters
    trained = {
        slot.name: (slot.spec.shape, None if any_dtype else slot.spec.dtype)
        for group in info.layout.groups
        for slot in group.params
    }
    saved = {entry.name: (entry.shape, entry.dtype) for entry in info.model_entries}
    saved.update({name: spec for name, spec in trained.items() if name in run})  # frozen in the run
    for alias, target in info.aliases.items():
        if target in trained or target in saved:
            saved[alias] = trained.get(target) or saved[target]
    return _compare({name: spec for name, spec in saved.items() if name not in trained_by_run}, run)


def compare_shapes(saved: Mapping[str, tuple[int, ...]], run: Mapping[str, tuple[int, ...]]) -> Mismatch:
    """Names and shapes only (dtypes may differ)."""
    return _compare({n: (shape, None) for n, shape in saved.items()}, {n: (shape, None) for n, shape in run.items()})


def _compare(saved: Mapping[str, tuple], run: Mapping[str, tuple]) -> Mismatch:
    both = [name for name in run if name in saved]
    return Mismatch(
        missing=tuple(name for name in run if name not in saved),
        unexpected=tuple(name for name in saved if name not in run),
        reshaped=tuple(
            f"{name} (checkpoint {list(saved[name][0])}, run {list(run[name][0])})"
            for name in both
            if tuple(saved[name][0]) != tuple(run[name][0])
        ),
        retyped=tuple(
            f"{name} (checkpoint {saved[name][1]}, run {run[name][1]})"
            for name in both
            if tuple(saved[name][0]) == tuple(run[name][0]) and saved[name][1] not in (None, run[name][1])
        ),
    )
