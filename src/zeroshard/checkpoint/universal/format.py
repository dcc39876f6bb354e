"""The universal checkpoint's vocabulary and manifest (``universal.json``).

A universal checkpoint holds every trained parameter's fp32 master and optimizer states in
the parameter's own shape, with no padding and no ranks, so any world size, policy or bucket
size loads it by range reads. An expert stack is one tensor ``[E, ...]`` under its own name,
its description (:class:`~zeroshard.layout.ExpertStack`) in the manifest's ``expert_stacks``
(version 3); a legacy stack (MoEGPT's ``[E, in, out]``, exported per expert) is one tensor
per expert, named by global id in ``nn.Linear`` orientation (:mod:`..experts`), which the
manifest's ``experts`` lists in expert order (version 2). From version 4 it carries the
digests of the run's logical state (``digests``, :mod:`..attest.digests`: in the run's names and
orientation, stacked experts by global id), as the native manifest records them. A
checkpoint is written in the lowest version that expresses it: 1 without experts, 2 with
legacy stacks only, 3 with stored stacks, 4 with digests (what zeroshard writes now), 5
with the model's config files, carried from the source (``model_configs``: each file's
record, :mod:`..model_config`); every older version still loads. docs/FORMAT.md describes
it; this module spells its names and parses its manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import __version__
from ...layout import (
    EXPERT_SHARD_GROUP,
    LEGACY_STACK,
    ExpertStack,
    GroupSpec,
    ParamSpec,
    canonical_dtype,
    contiguous_expert_map,
)
from ...layout.stacks import check_stack_shape, per_expert_name_clash
from ..format import state_name_problem
from ...io import jsonvalue
from ...io.budget import quoted
from ...io.checksum import FileRecord
from ..directory import read_json_file
from ..model_config import STORED_NAMES
from ..attest.digests import StateDigests
from ..source import ModelEntry

FORMAT_NAME = "zeroshard.universal"
FORMAT_VERSION = 5  # the newest read: with the model's config files; see the module docstring for the older ones
_WITHOUT_EXPERTS_VERSION = 1
_LEGACY_EXPERTS_VERSION = 2
_STACKS_VERSION = 3  # stored expert stacks, no digests
DIGESTS_VERSION = 4  # with digests: what a conversion of a run without config files writes (public: the writer)
MANIFEST_FILE = "universal.json"
# Each manifest field a later version added, with that version: an older reader ignores it.
_ADDED_IN = (
    ("experts", _LEGACY_EXPERTS_VERSION),
    ("expert_stacks", _STACKS_VERSION),
    ("digests", DIGESTS_VERSION),
    ("model_configs", FORMAT_VERSION),
)
DEFAULT_MAX_SHARD_SIZE = 2**31
MODEL_ENTRY_KINDS = ("buffer", "frozen", "other")  # "other": written by a run that did not tell them apart


def shard_metadata(version: int) -> dict[str, str]:
    """The safetensors metadata of every shard of a universal checkpoint of format ``version``:
    the shards tell which manifest version they belong to, so a manifest edited to claim an
    older version (whose reader skips the digests) is caught when a shard is read."""
    return {"format": FORMAT_NAME, "version": str(version)}


def shard_version_problem(path: Path, metadata: dict[str, Any], manifest: UniversalManifest) -> str | None:
    """What is wrong when shard ``path``'s ``metadata`` names another format version than
    ``manifest`` (shards written before version 5 name none), or None."""
    written = metadata.get("version")
    if written is None or written == str(manifest.format_version):
        return None
    return (
        f"{path}: written as universal format version {quoted(written)}, but {MANIFEST_FILE} claims version "
        f"{manifest.format_version}: a manifest may not claim another version than its shards"
    )


def shard_file_name(index: int, count: int) -> str:
    """``universal-00001-of-00003.safetensors`` for shard ``index`` (from 0) of ``count``."""
    return f"universal-{index + 1:05d}-of-{count:05d}.safetensors"


def param_key(name: str, key: str) -> str:
    """Tensor key of a trained parameter's ``key`` ("fp32" or an optimizer state name)."""
    return f"param/{name}/{key}"


def model_key(name: str) -> str:
    """Tensor key of a buffer or frozen parameter."""
    return f"model/{name}"


def is_universal_checkpoint(path: Path) -> bool:
    """Whether directory ``path`` holds a ``universal.json`` (checks nothing else)."""
    return (Path(path) / MANIFEST_FILE).is_file()


@dataclass(frozen=True)
class UniversalParam:
    """A trained parameter: its shape, the dtype it trained in, its param group, its states."""

    shape: tuple[int, ...]
    dtype: str
    group: int
    states: tuple[str, ...]

    @property
    def numel(self) -> int:
        """Number of elements: the product of the shape."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class UniversalParamGroup:
    """An optimizer param group: hyperparameters, member parameters, non-partitioned state."""

    hyperparameters: dict[str, Any]
    params: tuple[str, ...]
    scalars: dict[str, Any]  # "step" and the like, usually 0-d tensors
    optimizer: str = ""  # the group's optimizer class where the run's is several; "": the run's


@dataclass(frozen=True)
class UniversalManifest:
    """The parsed ``universal.json``."""

    source: dict[str, Any]  # kind, world_size, policy of the run it was converted from
    optimizer_class: str
    param_groups: list[UniversalParamGroup]
    params: dict[str, UniversalParam]  # in the source's layout order
    model_entries: dict[str, ModelEntry]  # buffers and frozen parameters
    aliases: dict[str, str]  # state_dict name -> the stored name it ties to
    extra: dict[str, Any]
    shards: dict[str, FileRecord] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor key -> shard file
    # the run's stacked expert weight -> the names of its experts' tensors, by global expert id
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # stored stacks (in ``params`` under their own name, global shape) -> their description
    expert_stacks: dict[str, ExpertStack] = field(default_factory=dict)
    # digests of the run's logical state: params by the run's names (scalars per param group)
    digests: StateDigests | None = None
    # the model's config files (``model.config.json``, ...: :mod:`..model_config`) -> their records
    configs: dict[str, FileRecord] = field(default_factory=dict)
    version: int | None = None  # None: the lowest version that expresses the manifest
    created_by: str = f"zeroshard {__version__}"

    @property
    def format_version(self) -> int:
        """The version read, or for a new manifest the lowest that expresses it (see the module docstring)."""
        if self.version is not None:
            return self.version
        if self.configs:
            return FORMAT_VERSION
        if self.digests is not None:
            return DIGESTS_VERSION
        if self.expert_stacks:
            return _STACKS_VERSION
        return _LEGACY_EXPERTS_VERSION if self.experts else _WITHOUT_EXPERTS_VERSION

    def run_params(self) -> dict[str, tuple[tuple[str, ...], int | None]]:
        """The run's trained parameters (each stack once): name -> (states, the number of
        experts for a stack, else None), in the manifest's order."""
        stack_of = {name: stack for stack, names in self.experts.items() for name in names}
        found: dict[str, tuple[tuple[str, ...], int | None]] = {}
        for name, param in self.params.items():
            stack = stack_of.get(name)
            if name in self.expert_stacks:
                found[name] = (param.states, param.shape[0])
            elif stack is None:
                found[name] = (param.states, None)
            elif stack not in found:
                found[stack] = (param.states, len(self.experts[stack]))
        return found

    def stacked(self, name: str) -> UniversalParam:
        """A trained parameter of the run: a stored one (a stored stack too, ``[E, ...]``), or
        a legacy stack (shape ``[E, in, out]``, from its experts' ``[out, in]`` tensors)."""
        names = self.experts.get(name)
        if names is None:
            return self.params[name]
        first = self.params[names[0]]
        d_out, d_in = first.shape
        return UniversalParam((len(names), d_in, d_out), first.dtype, first.group, first.states)

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor the shards hold, by key, in the order they are written: (dtype name, shape)."""
        specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, param in self.params.items():
            for key in ("fp32", *param.states):
                specs[param_key(name, key)] = ("float32", param.shape)
        for name, entry in self.model_entries.items():
            specs[model_key(name)] = (entry.dtype, entry.shape)
        return specs

    def param_specs(self) -> list[list[ParamSpec]]:
        """The stored parameters in groups: one per (param group, dtype), first seen first."""
        groups: dict[tuple[int, str], list[ParamSpec]] = {}
        for name, param in self.params.items():
            groups.setdefault((param.group, param.dtype), []).append(ParamSpec.of(name, param.shape, param.dtype))
        return list(groups.values())

    def layout_groups(self, ep_size: int = 1) -> list[list[ParamSpec] | GroupSpec]:
        """Layout groups as a run would form them, one per (param group, dtype, dense or
        experts), first seen first; each expert stack once, ``[E / ep_size, ...]``, in an
        expert group with the contiguous expert map and its description."""
        stack_of = {name: stack for stack, names in self.experts.items() for name in names}
        groups: dict[tuple[int, str, bool], list[ParamSpec]] = {}
        stacks: dict[tuple[int, str, bool], list[ExpertStack]] = {}
        experts: dict[tuple[int, str, bool], int] = {}
        for name, param in self.params.items():
            stack = stack_of.get(name)
            if stack is not None and name != self.experts[stack][0]:
                continue  # a legacy stack is listed at its first expert
            if stack is None and name in self.expert_stacks:
                stack = name
            key = (param.group, param.dtype, stack is not None)
            if stack is None:
                groups.setdefault(key, []).append(ParamSpec.of(name, param.shape, param.dtype))
                continue
            whole = self.stacked(stack)
            local = (whole.shape[0] // ep_size, *whole.shape[1:])
            groups.setdefault(key, []).append(ParamSpec.of(stack, local, param.dtype))
            stacks.setdefault(key, []).append(self.expert_stacks.get(stack, LEGACY_STACK))
            if experts.setdefault(key, whole.shape[0]) != whole.shape[0]:
                raise ValueError(f"expert stack {stack!r} has {whole.shape[0]} experts, others in its group {experts[key]}")
        return [
            GroupSpec(tuple(specs), EXPERT_SHARD_GROUP, None, contiguous_expert_map(experts[key], ep_size), tuple(stacks[key]))
            if key[2]
            else specs
            for key, specs in groups.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``universal.json`` holds; :meth:`from_dict` reads it. ValueError
        names a hyperparameter or scalar that JSON cannot hold."""
        stacks = {"experts": {stack: list(names) for stack, names in self.experts.items()}} if self.experts else {}
        if self.expert_stacks:
            stacks["expert_stacks"] = {name: stack.to_dict() for name, stack in self.expert_stacks.items()}
        digests = {} if self.digests is None else {"digests": self.digests.to_dict()}
        configs = {"model_configs": {name: r.to_dict() for name, r in self.configs.items()}} if self.configs else {}
        return {
            "format": FORMAT_NAME,
            "version": self.format_version,
            "created_by": self.created_by,
            "source": self.source,
            "optimizer": {
                "class": self.optimizer_class,
                "param_groups": [
                    {
                        "hyperparameters": jsonvalue.encode(group.hyperparameters, f"param_groups[{index}]"),
                        "params": list(group.params),
                        "scalars": jsonvalue.encode(group.scalars, f"param_groups[{index}].scalars"),
                        **({"optimizer": group.optimizer} if group.optimizer else {}),
                    }
                    for index, group in enumerate(self.param_groups)
                ],
            },
            "params": {
                name: {"shape": list(p.shape), "dtype": p.dtype, "group": p.group, "states": list(p.states)}
                for name, p in self.params.items()
            },
            "model": {
                "tensors": {
                    name: {"shape": list(e.shape), "dtype": e.dtype, "kind": e.kind}
                    for name, e in self.model_entries.items()
                },
                "aliases": dict(self.aliases),
            },
            "extra": jsonvalue.encode(self.extra, "extra"),
            "shards": {name: record.to_dict() for name, record in self.shards.items()},
            "weight_map": dict(self.weight_map),
            **stacks,
            **digests,
            **configs,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text (NaN and infinity refused: ValueError)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any, where: str = MANIFEST_FILE) -> UniversalManifest:
        """Parse and check; ValueError naming ``where`` and the problem in one line."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: not a zeroshard universal checkpoint (format {quoted(found)})")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{where}: format version {quoted(version)} is not valid")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{where}: format version {version} is newer than this zeroshard reads ({FORMAT_VERSION}); upgrade zeroshard"
            )
        newer = next((f"{key}, which version {since} added" for key, since in _ADDED_IN if version < since and data.get(key)), None)
        if newer:  # read as the older version, it would be ignored: digests dropped, expert lists unchecked
            raise ValueError(
                f"{where}: format version {version}, but it holds {newer}: "
                "a manifest may not claim an older version than it holds"
            )
        try:
            manifest = _fields_from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: malformed manifest ({type(err).__name__}: {err})") from None
        problem = manifest.inconsistency()
        if problem:
            raise ValueError(f"{where}: inconsistent manifest: {problem}")
        return manifest

    def inconsistency(self) -> str | None:
        """What contradicts itself in this manifest, or None."""
        for name, param in self.params.items():
            if not 0 <= param.group < len(self.param_groups) or name not in self.param_groups[param.group].params:
                return f"parameter {quoted(name)} is not a member of its param group {param.group}"
            problem = next(filter(None, map(state_name_problem, param.states)), None)
            if problem or len(set(param.states)) != len(param.states):
                return f"parameter {quoted(name)}: {problem or 'an optimizer state is listed twice'}"
        members = [name for group in self.param_groups for name in group.params]
        if len(members) != len(set(members)) or sorted(members) != sorted(self.params):
            return "the param groups' members are not exactly the parameters"
        for alias, target in self.aliases.items():
            if alias in self.params or alias in self.model_entries:
                return f"alias {quoted(alias)} is also a stored name"
            if target not in self.params and target not in self.model_entries:
                return f"alias {quoted(alias)} -> {quoted(target)} does not name a stored tensor"
        for name, entry in self.model_entries.items():
            if entry.kind not in MODEL_ENTRY_KINDS:
                expected = ", ".join(MODEL_ENTRY_KINDS)
                kind = quoted(entry.kind)
                return f"module tensor {quoted(name)} has unknown kind {kind} (expected one of {expected})"
            if name in self.params:
                return f"module tensor {quoted(name)} is also a trained parameter"
        specs = self.tensor_specs()
        if set(self.weight_map) != set(specs):
            missing = sorted(set(specs) - set(self.weight_map))[:3]
            unknown = sorted(set(self.weight_map) - set(specs))[:3]
            return (
                f"weight_map does not list exactly the tensors (missing {quoted(missing)}, unknown {quoted(unknown)})"
            )
        unlisted = sorted(set(self.weight_map.values()) - set(self.shards))
        if unlisted:
            return f"weight_map names shards not in the shard list: {quoted(unlisted[:3])}"
        unknown = sorted(set(self.configs) - set(STORED_NAMES))
        if unknown:
            return f"model_configs names {quoted(unknown[:3])}, not a model config file ({', '.join(STORED_NAMES)})"
        return self._experts_inconsistency() or self._digests_inconsistency()

    def _digests_inconsistency(self) -> str | None:
        """The digests name exactly the run's parameters (every expert of a stack), each with
        its master and states, every param group's scalars and the module tensors."""
        if self.digests is None:
            return None
        expected = {
            (name, expert, kind)
            for name, (states, experts) in self.run_params().items()
            for kind in ("fp32", *states)
            for expert in ([None] if experts is None else range(experts))
        }
        if set(self.digests.keys()) != expected:
            return "digests do not name exactly the parameters, their experts and states"
        if [set(s) for s in self.digests.scalars] != [set(group.scalars) for group in self.param_groups]:
            return "digests of the scalars do not match the param groups' scalars"
        if set(self.digests.model) != set(self.model_entries):
            return "digests of the module tensors do not name exactly the module tensors"
        return None

    def _experts_inconsistency(self) -> str | None:
        """Each stacked weight lists >= 1 stored [out, in] tensors, alike in shape, dtype,
        param group and states, none listed twice; its name is no stored name."""
        listed: set[str] = set()
        for stack, names in self.experts.items():
            if stack in self.params or stack in self.model_entries or stack in self.aliases:
                return f"expert weight {quoted(stack)} is also a stored name"
            if not names or any(name not in self.params for name in names):
                return f"expert weight {quoted(stack)} lists experts that are not trained parameters"
            if listed & set(names) or len(set(names)) != len(names):
                return f"expert weight {quoted(stack)} lists an expert tensor listed before"
            listed.update(names)
            first = self.params[names[0]]
            if len(first.shape) != 2 or any(self.params[name] != first for name in names):
                return f"the experts of {quoted(stack)} are not alike [out, in] matrices (shape, dtype, group, states)"
        for name, stack in self.expert_stacks.items():
            if name not in self.params or name in listed:
                return f"expert stack {quoted(name)} is not a stored trained parameter of its own"
            try:
                check_stack_shape(name, stack, self.params[name].shape)
            except ValueError as err:
                return str(err)
        return self._per_expert_clash(listed)

    def _per_expert_clash(self, listed: set[str]) -> str | None:
        """A per-expert export (of the run's stacks, legacy ones included) names each tensor once."""
        stacks = [(name, stack, self.params[name].shape[0]) for name, stack in self.expert_stacks.items()]
        stacks += [(name, LEGACY_STACK, len(names)) for name, names in self.experts.items()]
        others = {*(set(self.params) - listed), *self.experts, *self.model_entries, *self.aliases}
        return per_expert_name_clash(stacks, others)


def _fields_from_dict(data: dict[str, Any]) -> UniversalManifest:
    optimizer = data["optimizer"]
    model = data["model"]
    return UniversalManifest(
        source=dict(data["source"]),
        optimizer_class=str(optimizer["class"]),
        param_groups=[
            UniversalParamGroup(
                hyperparameters=jsonvalue.decode(group["hyperparameters"]),
                params=tuple(str(name) for name in group["params"]),
                scalars=jsonvalue.decode(group["scalars"]),
                optimizer=jsonvalue.read_class_name(group["optimizer"], f"param group {n}'s optimizer") if "optimizer" in group else "",
            )
            for n, group in enumerate(optimizer["param_groups"])
        ],
        params={
            str(name): UniversalParam(
                shape=jsonvalue.read_shape(p["shape"], "params[{}]['shape']", name),
                dtype=canonical_dtype(p["dtype"]),
                group=jsonvalue.read_int(p["group"], "params[{}]['group']", name),
                states=tuple(str(s) for s in p["states"]),
            )
            for name, p in data["params"].items()
        },
        model_entries={
            str(name): ModelEntry(
                str(name),
                jsonvalue.read_shape(e["shape"], "the shape of model tensor {}", name),
                str(e["dtype"]),
                str(e["kind"]),
            )
            for name, e in model["tensors"].items()
        },
        aliases={str(k): str(v) for k, v in model["aliases"].items()},
        extra=jsonvalue.decode(data["extra"]),
        shards={str(name): FileRecord.from_dict(record) for name, record in data["shards"].items()},
        weight_map={str(k): str(v) for k, v in data["weight_map"].items()},
        experts={
            str(stack): tuple(str(name) for name in names)
            for stack, names in (data.get("experts", {}) if data["version"] > _WITHOUT_EXPERTS_VERSION else {}).items()
        },
        expert_stacks={
            str(name): ExpertStack.from_dict(stack)
            for name, stack in (data.get("expert_stacks", {}) if data["version"] >= _STACKS_VERSION else {}).items()
        },
        digests=StateDigests.from_dict(data["digests"]) if data["version"] >= DIGESTS_VERSION else None,
        configs={
            str(name): FileRecord.from_dict(record)
            for name, record in (data["model_configs"] if data["version"] >= FORMAT_VERSION else {}).items()
        },
        version=int(data["version"]),
        created_by=str(data.get("created_by", "")),
    )


def read_universal_manifest(directory: Path) -> UniversalManifest:
    """Read and check ``directory``'s ``universal.json``.

    Raises:
        FileNotFoundError: it is missing.
        CheckpointDamagedError: it is not valid JSON or UTF-8.
        ValueError: it is not a universal manifest this zeroshard reads (format, version),
            or its fields are malformed or inconsistent; the message names the file.
    """
    path = directory / MANIFEST_FILE
    return UniversalManifest.from_dict(read_json_file(path, "universal checkpoint"), str(path))
