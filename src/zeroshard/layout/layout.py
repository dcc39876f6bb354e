"""Build a Layout: parameter specs + world size + policy -> every offset and partition.

This is the only place where offsets, padding and partition boundaries are computed.

A group is partitioned over its own process group (its shard group): dense groups over all
W ranks, expert groups over the W / EP ranks that hold the same experts. JSON is written in
the lowest version that expresses the layout: version 1 when every group is dense (byte for
byte as before shard groups existed), version 2 when the expert groups' stacks are all
``LEGACY_STACK`` (as before stacks were described), version 3 otherwise (each expert
parameter's ``stack``), version 4 when a group is an owner group (:mod:`.owners`: its
``owner`` flag and ``bounds``). Older readers refuse a newer version.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Sequence

from .dtypes import itemsize
from .group import Bucket, GroupLayout, ParamSlot
from .inputs import GroupInput, checked_groups, is_int
from .owners import OwnerBalance, bounds_problem, owner_balance, owner_bounds
from .policy import LayoutPolicy
from .specs import DENSE_SHARD_GROUP, GroupSpec, ParamSpec
from .stacks import LEGACY_STACK, ExpertStack

FORMAT_NAME = "zeroshard.layout"
FORMAT_VERSION = 4  # the newest written; versions 1 (dense), 2 (legacy stacks) and 3 are still written and read
_DENSE_ONLY_VERSION = 1
_LEGACY_STACKS_VERSION = 2
_STACKS_VERSION = 3  # expert stacks described
_OWNER_VERSION = 4  # owner groups

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
        """Padding elements of both kinds: after parameters and at bucket tails."""
        return self.inter_param_elements + self.tail_elements

    @property
    def fraction(self) -> float:
        """Padding bytes as a fraction of the parameters' bytes."""
        return self.padding_bytes / self.param_bytes if self.param_bytes else 0.0


@dataclass(frozen=True)
class Layout:
    """Every group's flat buffer at one world size under one policy. A comparable value.

    ``world_size`` is the number of ranks W; each group carries the size of the process
    group it is partitioned over (W for dense groups).
    """

    world_size: int
    policy: LayoutPolicy
    groups: tuple[GroupLayout, ...]

    def param(self, name: str) -> tuple[GroupLayout, ParamSlot]:
        """The group and slot of the parameter called ``name``.

        Raises:
            KeyError: no parameter of that name.
        """
        try:
            group_index, param_index = self._index[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r} in the layout") from None
        group = self.groups[group_index]
        return group, group.params[param_index]

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every parameter's name, group by group, in buffer order."""
        return tuple(slot.name for group in self.groups for slot in group.params)

    def owner_balance(self) -> OwnerBalance:
        """The Newton-Schulz cost of one iteration over the matrices each global rank owns
        in the owner groups (:mod:`.owners`), and its imbalance."""
        alignments = [self.policy.partition_alignment(group.dtype) for group in self.groups]
        return owner_balance(self.groups, self.world_size, alignments)

    def padding(self) -> PaddingStats:
        """The layout's padding, summed over its groups."""
        param_numel = sum(group.param_numel for group in self.groups)
        param_bytes = sum(group.param_numel * itemsize(group.dtype) for group in self.groups)
        inter = sum(group.inter_param_padding for group in self.groups)
        tail = sum(group.tail_padding for group in self.groups)
        padding_bytes = sum(
            (group.inter_param_padding + group.tail_padding) * itemsize(group.dtype) for group in self.groups
        )
        return PaddingStats(param_numel, param_bytes, inter, tail, padding_bytes)

    @property
    def is_dense(self) -> bool:
        """Whether every group is partitioned over all ranks."""
        return all(group.shard_group == DENSE_SHARD_GROUP for group in self.groups)

    @property
    def shard_groups(self) -> dict[str, int]:
        """The world size of each shard group the groups name, in order of first use."""
        return {group.shard_group: group.world_size for group in self.groups}

    def specs(self) -> list[list[ParamSpec]]:
        """The parameters of each group, in order."""
        return [[slot.spec for slot in group.params] for group in self.groups]

    def group_specs(self) -> list[GroupSpec]:
        """The inputs this layout was built from, shard groups included."""
        return [
            GroupSpec(
                tuple(slot.spec for slot in group.params),
                group.shard_group,
                group.world_size,
                group.expert_map,
                group.stacks,
                group.owner,
            )
            for group in self.groups
        ]

    def with_world_size(self, world_size: int) -> Layout:
        """The same parameters and policy at another world size (dense layouts only: an
        expert group's shapes and shard group depend on the expert parallelism too).

        Raises:
            ValueError: the layout has expert groups, or ``world_size`` is not an integer >= 1.
        """
        if not self.is_dense:
            raise ValueError(
                f"layout has shard groups {self.shard_groups}; rebuild it with build_layout for the new world size and EP"
            )
        return build_layout(self.specs(), world_size, self.policy)

    def with_policy(self, policy: LayoutPolicy) -> Layout:
        """The same groups, shard groups included, at the same world size under ``policy``.

        Raises:
            ValueError: as :func:`build_layout` (a dtype the policy cannot align).
        """
        return build_layout(self.group_specs(), self.world_size, policy)

    # ---- JSON ----------------------------------------------------------------------------

    def storage_problem(self) -> str | None:
        """Why this layout cannot be stored and read back (:meth:`from_dict` refuses it), or
        None. Stored, a group over a shard group other than "dp" must be an expert group: its
        expert map says which ranks hold which of its values (without one, a reader would take
        the ranks of one shard group for the whole of it)."""
        for group in self.groups:
            if group.shard_group != DENSE_SHARD_GROUP and not group.expert_map:
                return (
                    f"group {group.index}: shard group {group.shard_group!r} of {group.world_size} ranks holds no "
                    f"expert map; only expert groups are partitioned over a shard group other than {DENSE_SHARD_GROUP!r}"
                )
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the lowest version that can express the layout."""
        if any(group.owner for group in self.groups):
            return self._to_dict(_OWNER_VERSION)
        if self.is_dense:
            return self._to_dict(_DENSE_ONLY_VERSION)
        legacy = all(stack == LEGACY_STACK for group in self.groups for stack in group.stacks)
        return self._to_dict(_LEGACY_STACKS_VERSION if legacy else _STACKS_VERSION)

    def _to_dict(self, version: int) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": version,
            "world_size": self.world_size,
            "policy": self.policy.to_dict(),
            "groups": [_group_to_dict(group, version) for group in self.groups],
        }

    def to_json(self, indent: int | None = None) -> str:
        """:meth:`to_dict` as JSON text (``indent`` as for ``json.dumps``)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """Rebuild from ``to_dict`` output; the stored offsets must match the recomputed ones.

        Raises:
            ValueError: a dict that is not a zeroshard layout, of a version this zeroshard
                does not read, malformed, or inconsistent (offsets or shard groups that its
                parameters do not give).
        """
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a zeroshard layout (format {data.get('format')!r})")
        version = data.get("version")
        if not is_int(version) or version not in range(_DENSE_ONLY_VERSION, FORMAT_VERSION + 1):
            raise ValueError(
                f"layout format version {version!r} is not supported (this zeroshard reads versions "
                f"{_DENSE_ONLY_VERSION} to {FORMAT_VERSION})"
            )
        try:
            groups = [_group_from_dict(group, version) for group in data["groups"]]
            layout = build_layout(groups, data["world_size"], LayoutPolicy.from_dict(data["policy"]))
            layout = _with_recorded_bounds(layout, data["groups"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"layout JSON is malformed: {type(err).__name__}: {err}") from None
        if not _same_json(layout._to_dict(version), data):
            raise ValueError(
                "layout JSON is inconsistent: its offsets and sizes differ from those its parameters give "
                "(in value or JSON type)"
            )
        problem = layout.storage_problem()
        if problem:
            raise ValueError(f"layout JSON is inconsistent: {problem}")
        return layout

    @classmethod
    def from_json(cls, text: str) -> Layout:
        """Rebuild from :meth:`to_json` output.

        Raises:
            ValueError: the text is not JSON (``json.JSONDecodeError``), or as :meth:`from_dict`.
        """
        return cls.from_dict(json.loads(text))

    @functools.cached_property
    def _index(self) -> dict[str, tuple[int, int]]:
        return {slot.name: (group.index, slot.index) for group in self.groups for slot in group.params}


def build_layout(groups: Sequence[GroupInput], world_size: int, policy: LayoutPolicy | None = None) -> Layout:
    """Lay out ``groups`` (ordered params of one dtype each) over ``world_size`` ranks.

    A group is a :class:`GroupSpec` or a plain sequence of params (a dense group); params
    may be ParamSpec or (name, shape, dtype) tuples. Raises ValueError naming the parameter
    (or group) and the problem for any bad input.
    """
    policy = policy or LayoutPolicy()
    checked = checked_groups(groups, world_size, policy)
    laid_out = [_lay_out_group(i, group, policy) for i, group in enumerate(checked)]
    alignments = [policy.partition_alignment(group.dtype) for group in laid_out]
    owners = [group.owner for group in checked]
    for index, bounds in enumerate(owner_bounds(laid_out, owners, world_size, alignments)):
        if bounds:
            laid_out[index] = dataclasses.replace(laid_out[index], bounds=bounds)
    return Layout(world_size, policy, tuple(laid_out))


def _same_json(a: object, b: object) -> bool:
    """Equal and of the same JSON types throughout: ``==`` takes ``true`` for 1 and 5.0 for 5."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[key], b[key]) for key in a)  # type: ignore[attr-defined,index]
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same_json, a, b))  # type: ignore[arg-type]
    return a == b


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


def _lay_out_group(index: int, group: GroupSpec, policy: LayoutPolicy) -> GroupLayout:
    specs, world_size = list(group.params), group.world_size
    assert world_size is not None  # filled in by _check_shard
    dtype = specs[0].dtype
    param_align = policy.param_alignment(dtype)
    # An owner group has no tail padding: its ranks' runs are cut by bounds (owners.py).
    tail_multiple = 1 if group.owner else world_size * policy.partition_alignment(dtype)
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
            partition_numel=0 if group.owner else padded // world_size,
            partition_start=0 if group.owner else partition,
            logical_start=logical_start,
            uneven=group.owner,
        )
        buckets.append(bucket)
        flat = bucket.end
        logical += content
        partition += bucket.partition_numel
    return GroupLayout(
        index, dtype, world_size, tuple(slots), tuple(buckets), group.shard_group, group.expert_map, group.stacks
    )


def _with_recorded_bounds(layout: Layout, groups: list[dict[str, Any]]) -> Layout:
    """``layout`` with each owner group's bounds as the JSON records them: any cut between
    whole matrices is a valid layout, so a layout written under another balancing (an older
    or newer zeroshard) still reads; other offsets are still checked against the parameters.

    Raises:
        ValueError: recorded bounds that are no such cut (:func:`~.owners.bounds_problem`).
    """
    rebuilt = list(layout.groups)
    for index, group in enumerate(layout.groups):
        recorded = groups[index].get("bounds") if group.owner else None
        if recorded is None or recorded == list(group.bounds):
            continue
        problem = bounds_problem(group, recorded, layout.policy.partition_alignment(group.dtype))
        if problem:
            raise ValueError(f"layout JSON is inconsistent: owner group {index}: {problem}")
        rebuilt[index] = dataclasses.replace(group, bounds=tuple(recorded))
    return Layout(layout.world_size, layout.policy, tuple(rebuilt))


def _group_from_dict(data: dict[str, Any], version: int) -> GroupSpec:
    params = tuple(ParamSpec.of(param["name"], param["shape"], data["dtype"]) for param in data["params"])
    if version == _DENSE_ONLY_VERSION:
        return GroupSpec(params)
    expert_map = data.get("expert_map", ())
    stacks = ()
    if expert_map and version >= _STACKS_VERSION:
        stacks = tuple(ExpertStack.from_dict(param["stack"]) for param in data["params"])
    owner = data.get("owner", False) if version >= _OWNER_VERSION else False
    return GroupSpec(params, data["shard_group"], data["world_size"], expert_map, stacks, owner)


def _group_to_dict(group: GroupLayout, version: int) -> dict[str, Any]:
    shard: dict[str, Any] = {}
    if version > _DENSE_ONLY_VERSION:
        shard = {"shard_group": group.shard_group, "world_size": group.world_size}
        if group.expert_map:
            shard["expert_map"] = [list(experts) for experts in group.expert_map]
    with_stacks = version >= _STACKS_VERSION and bool(group.expert_map)
    if group.owner:
        shard.update(owner=True, bounds=list(group.bounds))
    return {
        **shard,
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
                **({"stack": group.stacks[slot.index].to_dict()} if with_stacks else {}),
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
