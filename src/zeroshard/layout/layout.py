"""Build a Layout: parameter specs + world size + policy -> every offset and partition.

This is the only place where offsets, padding and partition boundaries are computed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .dtypes import itemsize
from .group import Bucket, GroupLayout, ParamSlot
from .policy import LayoutPolicy
from .specs import ParamSpec

FORMAT_NAME = "zeroshard.layout"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PaddingStats:
    """Padding of a whole layout, in elements and bytes."""

    param_numel: int
    param_bytes: int
    inter_param_elements: int
    tail_elements: int
    padding_bytes: int

    @property
    def padding_elements(self) -> int:
        return self.inter_param_elements + self.tail_elements

    @property
    def fraction(self) -> float:
        """Padding bytes as a fraction of the parameters' bytes."""
        return self.padding_bytes / self.param_bytes if self.param_bytes else 0.0


@dataclass(frozen=True)
class Layout:
    """Every group's flat buffer at one world size under one policy. A comparable value."""

    world_size: int
    policy: LayoutPolicy
    groups: tuple[GroupLayout, ...]

    def param(self, name: str) -> tuple[GroupLayout, ParamSlot]:
        """The group and slot of the parameter called ``name``."""
        try:
            group_index, param_index = self._index[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the layout") from None
        group = self.groups[group_index]
        return group, group.params[param_index]

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(slot.name for group in self.groups for slot in group.params)

    def padding(self) -> PaddingStats:
        param_numel = sum(group.param_numel for group in self.groups)
        param_bytes = sum(group.param_numel * itemsize(group.dtype) for group in self.groups)
        inter = sum(group.inter_param_padding for group in self.groups)
        tail = sum(group.tail_padding for group in self.groups)
        padding_bytes = sum(
            (group.inter_param_padding + group.tail_padding) * itemsize(group.dtype) for group in self.groups
        )
        return PaddingStats(param_numel, param_bytes, inter, tail, padding_bytes)

    def specs(self) -> list[list[ParamSpec]]:
        """The inputs this layout was built from."""
        return [[slot.spec for slot in group.params] for group in self.groups]

    def with_world_size(self, world_size: int) -> Layout:
        """The same parameters and policy at another world size."""
        return build_layout(self.specs(), world_size, self.policy)

    def with_policy(self, policy: LayoutPolicy) -> Layout:
        return build_layout(self.specs(), self.world_size, policy)

    # ---- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "world_size": self.world_size,
            "policy": self.policy.to_dict(),
            "groups": [_group_to_dict(group) for group in self.groups],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """Rebuild from ``to_dict`` output; the stored offsets must match the recomputed ones."""
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a zeroshard layout (format {data.get('format')!r})")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"layout format version {version!r} is not supported (this zeroshard reads {FORMAT_VERSION})")
        try:
            specs = [
                [ParamSpec.of(param["name"], param["shape"], group["dtype"]) for param in group["params"]]
                for group in data["groups"]
            ]
            layout = build_layout(specs, data["world_size"], LayoutPolicy.from_dict(data["policy"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"layout JSON is malformed: {type(err).__name__}: {err}") from None
        if layout.to_dict() != data:
            raise ValueError("layout JSON is inconsistent: its offsets differ from those its parameters give")
        return layout

    @classmethod
    def from_json(cls, text: str) -> Layout:
        return cls.from_dict(json.loads(text))

    @functools.cached_property
    def _index(self) -> dict[str, tuple[int, int]]:
        return {slot.name: (group.index, slot.index) for group in self.groups for slot in group.params}


def build_layout(
    groups: Sequence[Sequence[ParamSpec | tuple[str, Sequence[int], object]]],
    world_size: int,
    policy: LayoutPolicy | None = None,
) -> Layout:
    """Lay out ``groups`` (ordered params of one dtype each) over ``world_size`` ranks.

    Params may be ParamSpec or (name, shape, dtype) tuples. Raises ValueError naming the
    parameter (or group) and the problem for any bad input.
    """
    policy = policy or LayoutPolicy()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    checked = [_check_group(index, group, policy) for index, group in enumerate(groups)]
    _check_unique_names(checked)
    return Layout(world_size, policy, tuple(_lay_out_group(i, specs, world_size, policy) for i, specs in enumerate(checked)))


def _check_group(index: int, params: Iterable[Any], policy: LayoutPolicy) -> list[ParamSpec]:
    specs = [param if isinstance(param, ParamSpec) else ParamSpec.of(*param) for param in params]
    if not specs:
        raise ValueError(f"group {index} has no parameters")
    dtype = specs[0].dtype
    for spec in specs:
        if spec.dtype != dtype:
            raise ValueError(f"parameter {spec.name!r} is {spec.dtype} but group {index} is {dtype}; one dtype per group")
    problem = policy.check_dtype(dtype)
    if problem:
        raise ValueError(f"parameter {specs[0].name!r} (group {index}): {problem}")
    return specs


def _check_unique_names(groups: list[list[ParamSpec]]) -> None:
    seen: set[str] = set()
    for spec in (spec for group in groups for spec in group):
        if spec.name in seen:
            raise ValueError(f"parameter {spec.name!r} appears more than once")
        seen.add(spec.name)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _split_into_buckets(specs: list[ParamSpec], policy: LayoutPolicy) -> list[list[int]]:
    """Parameter indices per bucket. Depends on sizes and policy only, never on world size."""
    if policy.bucket_numel is None:
        return [list(range(len(specs)))]
    align = policy.param_alignment(specs[0].dtype)
    buckets: list[list[int]] = [[]]
    filled = 0
    for index, spec in enumerate(specs):
        size = _round_up(spec.numel, align)
        if buckets[-1] and filled + size > policy.bucket_numel:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


def _lay_out_group(index: int, specs: list[ParamSpec], world_size: int, policy: LayoutPolicy) -> GroupLayout:
    dtype = specs[0].dtype
    param_align = policy.param_alignment(dtype)
    tail_multiple = world_size * policy.partition_alignment(dtype)
    slots: list[ParamSlot] = []
    buckets: list[Bucket] = []
    flat = logical = partition = 0
    for bucket_index, members in enumerate(_split_into_buckets(specs, policy)):
        bucket_start, logical_start = flat, logical
        # The last parameter that holds elements; empty ones after it take no padding.
        last_real = max((i for i in members if specs[i].numel), default=-1)
        for param_index in members:
            spec = specs[param_index]
            end = flat + spec.numel
            pads = policy.pads_last_param() or param_index < last_real
            padding = _round_up(end, param_align) - end if pads else 0
            slots.append(ParamSlot(spec, param_index, bucket_index, flat, padding, logical + flat - bucket_start))
            flat = end + padding
        content = flat - bucket_start
        padded = _round_up(content, tail_multiple)
        bucket = Bucket(
            index=bucket_index,
            first_param=members[0],
            num_params=len(members),
            start=bucket_start,
            content_numel=content,
            tail_padding=padded - content,
            partition_numel=padded // world_size,
            partition_start=partition,
            logical_start=logical_start,
        )
        buckets.append(bucket)
        flat = bucket.end
        logical += content
        partition += bucket.partition_numel
    return GroupLayout(index, dtype, world_size, tuple(slots), tuple(buckets))


def _group_to_dict(group: GroupLayout) -> dict[str, Any]:
    return {
        "dtype": group.dtype,
        "numel": group.numel,
        "partition_numel": group.partition_numel,
        "params": [
            {
                "name": slot.name,
                "shape": list(slot.spec.shape),
                "offset": slot.offset,
                "padding": slot.padding,
                "logical_offset": slot.logical_offset,
                "bucket": slot.bucket,
            }
            for slot in group.params
        ],
        "buckets": [
            {
                "start": bucket.start,
                "content_numel": bucket.content_numel,
                "tail_padding": bucket.tail_padding,
                "partition_numel": bucket.partition_numel,
            }
            for bucket in group.buckets
        ],
    }
