"""ParamSpec: what the layout needs to know of a parameter, validated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .dtypes import canonical_dtype, itemsize
from .stacks import ExpertStack

# The most bytes a tensor's dimensions may describe, its zero dimensions counted as ones:
# what safetensors, numpy and torch address (a [0, 2**64] tensor holds nothing, and none of
# them opens it).
MAX_TENSOR_BYTES = 2**63 - 1


def tensor_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tensor in a safetensors file, or None when it can."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (it holds a lone surrogate)"
    return None


def shape_problem(shape: Sequence[int], item_bytes: int) -> str | None:
    """Why a tensor of ``shape`` cannot be stored, or None when it can (the dimensions are
    non-negative integers)."""
    size = item_bytes
    for dim in shape:
        size *= max(dim, 1)
        if size > MAX_TENSOR_BYTES:
            return f"shape {list(shape)} describes more than 2**63 bytes, which no safetensors reader opens"
    return None


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as the layout sees it: a name, a shape and a dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """The parameter's elements."""
        return math.prod(self.shape)

    @classmethod
    def of(cls, name: str, shape: Sequence[Any], dtype: object) -> ParamSpec:
        """Validate and canonicalise; ValueError names the parameter and the problem."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter name must be a non-empty string, got {name!r}")
        problem = tensor_name_problem(name)
        if problem:
            raise ValueError(f"parameter name {name!r} {problem}")
        try:
            dims = tuple(shape)
        except TypeError:
            raise ValueError(f"parameter {name!r}: shape {shape!r} is not a sequence") from None
        for dim in dims:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise ValueError(f"parameter {name!r}: shape {list(dims)} has a non-integer dimension {dim!r}")
            if dim < 0:
                raise ValueError(f"parameter {name!r}: shape {list(dims)} has a negative dimension {dim}")
        try:
            dtype_name = canonical_dtype(dtype)
        except ValueError as err:
            raise ValueError(f"parameter {name!r}: {err}") from None
        problem = shape_problem(dims, itemsize(dtype_name))
        if problem:
            raise ValueError(f"parameter {name!r}: {problem}")
        return cls(name, dims, dtype_name)


DENSE_SHARD_GROUP = "dp"  # the process group of all ranks; dense groups are partitioned over it
EXPERT_SHARD_GROUP = "expert_dp"  # the ranks that hold the same experts


@dataclass(frozen=True)
class GroupSpec:
    """A group of same-dtype parameters and the process group it is partitioned over.

    A plain list of parameters is a dense group: partitioned over all ranks (``"dp"``). An
    expert group is partitioned over the ranks that hold the same experts: ``world_size`` is
    the world size of that group (W / EP), and ``expert_map[e]`` lists the global expert ids
    that expert-parallel rank ``e`` holds, in local order. Its parameters are stacked expert
    weights whose first dimension counts the local experts; ``stacks`` describes each
    (:class:`~.stacks.ExpertStack`, one per parameter, in order; empty: ``LEGACY_STACK``).

    ``owner``: every matrix of the group (a parameter, or one expert of a stack) lies whole
    in one rank's partition, for optimizers that update whole matrices (Muon); see
    :mod:`~.owners`. False: the group is cut into equal partitions anywhere.
    """

    params: tuple[ParamSpec, ...]
    shard_group: str = DENSE_SHARD_GROUP
    world_size: int | None = None  # None: all ranks of the layout
    expert_map: tuple[tuple[int, ...], ...] = ()
    stacks: tuple[ExpertStack, ...] = ()
    owner: bool = False
