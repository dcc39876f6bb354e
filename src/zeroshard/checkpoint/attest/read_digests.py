"""What a converter reads, digested and checked against the checkpoint's saved digests.

A conversion reads every parameter whole (each expert of a stack on its own), so it digests
each in logical order as it passes, compares it with the source's digest (refusing, in one
line, a checkpoint that does not hold what was saved), and keeps what it computed: the
digests a universal checkpoint carries. A source without digests (DeepSpeed, a native
checkpoint of format version 1) is only digested. Torch-free.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .digests import StateDigests, array_digest, describe_key, scalar_digest
from ...io.damage import CheckpointDamagedError
from ...io.dtypes import cast
from ..source import ShardSource


class ReadChecker:
    """Checks and records the digests of what is read from ``source``: the first mismatch
    raises CheckpointDamagedError, or, with ``collect``, each is appended to ``problems``."""

    def __init__(self, source: ShardSource, *, collect: bool = False) -> None:
        self.source = source
        self.expected: StateDigests | None = source.info.digests
        self.collect = collect
        self.problems: list[str] = []
        self.checked = 0
        self._params: dict[str, dict[str, dict[int | None, int]]] = {}
        self._scalars: dict[int, dict[str, int]] = {}
        self._model: dict[str, int] = {}

    def param(self, name: str, expert: int | None, kind: str, values: np.ndarray) -> None:
        """``values``: the fp32 ``kind`` ("fp32" or a state) of parameter ``name`` (of one
        expert), flat, in logical order. The saved digest is of the dtype it is stored in."""
        group = self.source.info.layout.param(name)[0]
        stored = self.source.info.stored_dtype(group.index, kind)
        found = array_digest(values)
        key = (name, expert, kind)
        as_stored = found if stored == "float32" else array_digest(cast(values, stored))
        self._check(describe_key(key), as_stored, self.expected.get(key) if self.expected else None)
        self._params.setdefault(name, {}).setdefault(kind, {})[expert] = found

    def model_tensor(self, name: str, values: np.ndarray) -> None:
        """``values``: module tensor ``name`` (a buffer or frozen parameter) as read; checked
        against its saved digest (CheckpointDamagedError on a mismatch, unless ``collect``)."""
        found = array_digest(values)
        self._check(f"module tensor {name!r}", found, self.expected.model.get(name) if self.expected else None)
        self._model[name] = found

    def scalars(self, param_group: int, layout_group: int, scalars: Mapping[str, Any]) -> None:
        """Param group ``param_group``'s scalars, read from layout group ``layout_group``."""
        found = {name: scalar_digest(value) for name, value in scalars.items()}
        recorded = self.expected.scalars if self.expected else []
        saved = recorded[layout_group] if layout_group < len(recorded) else {}
        for name, value in found.items():
            self._check(f"layout group {layout_group} scalar {name!r}", value, saved.get(name))
        self._scalars[param_group] = found

    def digests(self, param_groups: int, model: list[str]) -> StateDigests:
        """What was read, as digests: every parameter read in every kind (a stack's experts in
        order), ``param_groups`` sets of scalars, the ``model`` tensors."""
        params = {
            name: {kind: _one_or_per_expert(found) for kind, found in kinds.items()} for name, kinds in self._params.items()
        }
        scalars = [self._scalars.get(index, {}) for index in range(param_groups)]
        return StateDigests(params, scalars, {name: self._model[name] for name in model})

    def _check(self, what: str, found: int, saved: int | None) -> None:
        if self.expected is None:
            return
        self.checked += 1
        if saved is None:
            problem = f"{self.source.path}: {what} has no saved digest"
        elif found != saved:
            problem = (
                f"{self.source.path}: {what} reads as digest {found:08x}, the checkpoint saved {saved:08x}: "
                "it does not hold what was saved"
            )
        else:
            return
        if not self.collect:
            raise CheckpointDamagedError(problem)
        self.problems.append(problem)


def _one_or_per_expert(found: dict[int | None, int]) -> int | tuple[int, ...]:
    return found[None] if None in found else tuple(found[expert] for expert in sorted(found))
