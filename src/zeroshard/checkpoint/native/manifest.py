"""The manifest: everything about a checkpoint but the tensors, as one JSON document.

It is written last, so a directory without one is an unfinished save. Reading it checks
the format name and version, rebuilds the Layout (which re-derives every offset) and
checks that the file list matches the world size. From format version 2 it also holds the
digests of the logical state (:mod:`..attest.digests`), one per parameter (per global expert),
tensor kind, optimizer scalar and module tensor; version 1 manifests, written before, have
none and still load. Version 3 (written only then) also lists the model's config files
(:mod:`..model_config`) with the others; version 4 (written only then) one resume file per
rank (each rank's random state and the training script's own states, :class:`ResumeRecord`).
A checkpoint saved without them is written as the version its fields need, as before, and
every older version still loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import __version__
from ...layout import Layout
from ...state import ParamGroupState
from ..attest.digests import StateDigests, logical_keys
from ..experts import per_expert_clash
from ..model_config import config_records
from ..format import (
    DIGESTED_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    UNDIGESTED_LAYOUT_VERSION,
    UNDIGESTED_VERSION,
    CONFIG_VERSION,
    RESUME_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    fp32_key,
    rank_file_name,
    resume_file_name,
    scalar_key,
    state_key,
    state_name_problem,
)
from ...io import jsonvalue
from ...io.budget import quoted
from ...io.checksum import FileRecord
from ...io.damage import CheckpointDamagedError
from ..directory import read_json_file
from .binding import layout_digest

TENSOR_KINDS = ("trainable", "frozen", "buffer", "other")
RESUME_SCOPES = ("rank", "global")


def dtype_name(dtype: object) -> str:
    """A dtype's name without the "torch." prefix: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GroupRecord:
    """Which tensors each rank file holds for one layout group, and their dtypes."""

    fp32_dtype: str
    states: dict[str, str]  # partition-shaped optimizer state: name -> dtype
    scalars: dict[str, tuple[str, tuple[int, ...]]]  # other optimizer state: name -> (dtype, shape)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the manifest records for the group; :meth:`from_dict` reads it."""
        return {
            "fp32_dtype": self.fp32_dtype,
            "states": dict(self.states),
            "scalars": {name: {"dtype": dtype, "shape": list(shape)} for name, (dtype, shape) in self.scalars.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupRecord:
        """Parse one group's record; ValueError for a malformed shape, KeyError for a missing
        field (:meth:`Manifest.from_dict` turns both into one line naming the manifest)."""
        scalars = {
            name: (str(s["dtype"]), jsonvalue.read_shape(s["shape"], "the shape of scalar {}", name))
            for name, s in data["scalars"].items()
        }
        return cls(str(data["fp32_dtype"]), {str(k): str(v) for k, v in data["states"].items()}, scalars)


@dataclass(frozen=True)
class ResumeRecord:
    """What a checkpoint's resume files hold (format version 4): every rank's random state
    (``rng``), and the training script's states by name, each "rank" (every rank saved its
    own) or "global" (the same on every rank; a load takes rank 0's)."""

    rng: bool
    states: dict[str, str]  # name -> scope

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the manifest records; :meth:`from_dict` reads it."""
        return {"rng": self.rng, "states": dict(sorted(self.states.items()))}

    @classmethod
    def from_dict(cls, data: Any) -> ResumeRecord:
        """Parse; ValueError naming what is malformed."""
        if not isinstance(data, dict) or type(data.get("rng")) is not bool or not isinstance(data.get("states"), dict):
            expected = "an object with rng (a boolean) and states (an object)"
            raise ValueError(f"resume is {quoted(data)}, expected {expected}")
        for name, scope in data["states"].items():
            if not name or scope not in RESUME_SCOPES:
                expected = f"expected one of {RESUME_SCOPES}"
                raise ValueError(f"resume state {quoted(name)} has scope {quoted(scope)}, {expected}")
        return cls(data["rng"], dict(data["states"]))


@dataclass(frozen=True)
class ModelTensorRecord:
    """One entry of the module's state_dict."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # one of TENSOR_KINDS; "other" is a frozen parameter or a buffer, not told apart


@dataclass(frozen=True)
class Manifest:
    """The parsed manifest.json of one checkpoint."""

    tag: str
    layout: Layout
    optimizer_class: str
    param_groups: list[ParamGroupState]
    groups: tuple[GroupRecord, ...]
    model_tensors: dict[str, ModelTensorRecord]
    aliases: dict[str, str]  # state_dict name -> the name whose tensor it shares (stored once)
    extra: dict[str, Any]
    files: dict[str, FileRecord]
    digests: StateDigests | None = None  # None: a version 1 checkpoint, saved without them
    resume: ResumeRecord | None = None  # None: no resume files (versions 1 and 2, or none saved)
    version: int | None = None  # None: the version the fields need (3 with resume files, 2 with digests)
    created_by: str = f"zeroshard {__version__}"
    stored_layout: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # as read

    @property
    def format_version(self) -> int:
        """The version read, or for a new manifest the one its fields need (4 with resume files,
        3 with config files, 2 with digests, 1 without)."""
        if self.version is not None:
            return self.version
        if self.resume is not None:
            return RESUME_VERSION
        if self.config_files:
            return CONFIG_VERSION
        return DIGESTED_VERSION if self.digests is not None else UNDIGESTED_VERSION

    @property
    def config_files(self) -> dict[str, FileRecord]:
        """The model's config files the checkpoint stores (``model.config.json``, ...), by stored name."""
        return config_records(self.files)

    @property
    def layout_digest(self) -> str:
        """The digest every rank file's binding records (see :mod:`.binding`)."""
        return layout_digest(self.layout.to_dict() if self.stored_layout is None else self.stored_layout)

    @property
    def binding_digest(self) -> str | None:
        """The layout digest every rank file's binding records; None for format version 1,
        which wrote no bindings (:func:`.binding.check_binding` then refuses a file with one)."""
        return self.layout_digest if self.digests is not None else None

    @property
    def world_size(self) -> int:
        """The number of ranks that saved it (one rank file each)."""
        return self.layout.world_size

    def rank_files(self) -> list[str]:
        """The rank files' names, in rank order."""
        return [rank_file_name(rank, self.world_size) for rank in range(self.world_size)]

    def resume_files(self) -> list[str]:
        """The resume files' names, in rank order (none when the checkpoint has none)."""
        if self.resume is None:
            return []
        return [resume_file_name(rank, self.world_size) for rank in range(self.world_size)]

    def rank_file_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The (dtype, shape) of every tensor each rank file holds, by key."""
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for group, record in zip(self.layout.groups, self.groups):
            shape = (group.partition_numel,)
            tensors.update({scalar_key(group.index, n): spec for n, spec in record.scalars.items()})
            tensors[fp32_key(group.index)] = (record.fp32_dtype, shape)
            tensors.update({state_key(group.index, n): (dtype, shape) for n, dtype in record.states.items()})
        return tensors

    def model_file_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The (dtype, shape) of every tensor the model file holds, by stored name."""
        return {name: (t.dtype, t.shape) for name, t in self.model_tensors.items()}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object manifest.json holds; :meth:`from_dict` reads it."""
        digests = {} if self.digests is None else {"digests": self.digests.to_dict()}
        resume = {} if self.resume is None else {"resume": self.resume.to_dict()}
        return {
            "format": FORMAT_NAME,
            "version": self.format_version,
            "created_by": self.created_by,
            "tag": self.tag,
            "world_size": self.world_size,
            "layout": self.layout.to_dict(),
            "optimizer": {
                "class": self.optimizer_class,
                "param_groups": [
                    {
                        "hyperparameters": jsonvalue.encode(g.hyperparameters, f"param_groups[{i}]"),
                        "layout_groups": list(g.layout_groups),
                    }
                    for i, g in enumerate(self.param_groups)
                ],
            },
            "groups": [group.to_dict() for group in self.groups],
            "model": {
                "file": MODEL_FILE,
                "tensors": {
                    name: {"shape": list(t.shape), "dtype": t.dtype, "kind": t.kind}
                    for name, t in self.model_tensors.items()
                },
                "aliases": dict(self.aliases),
            },
            "extra": jsonvalue.encode(self.extra, "extra"),
            "files": {name: record.to_dict() for name, record in sorted(self.files.items())},
            **digests,
            **resume,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text (NaN and infinity refused: ValueError)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any, source: str = "manifest") -> Manifest:
        """Parse and check, with one-line errors naming ``source``: a CheckpointDamagedError
        for a manifest no zeroshard writes (another format name, fields malformed or
        inconsistent: the file is not what was saved), a plain ValueError for one a newer
        zeroshard wrote."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointDamagedError(f"{source}: not a zeroshard checkpoint manifest (format {quoted(found)})")
        version = data.get("version")
        if type(version) is not int or version < 1:
            raise CheckpointDamagedError(f"{source}: format version {quoted(version)} is not valid")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{source}: format version {version} is newer than this zeroshard reads ({FORMAT_VERSION}); upgrade zeroshard"
            )
        try:
            return cls._checked(data, source)
        except ValueError as err:  # every manifest a save writes passes these checks
            raise CheckpointDamagedError(str(err)) from None

    @classmethod
    def _checked(cls, data: dict[str, Any], source: str) -> Manifest:
        try:
            layout = Layout.from_dict(data["layout"])
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        except (KeyError, TypeError, AttributeError) as err:  # no layout, or not an object
            raise ValueError(f"{source}: malformed manifest ({type(err).__name__}: {err})") from None
        newer = _newer_than_claimed(data)
        if newer:
            raise ValueError(
                f"{source}: format version {data['version']}, but {newer}: a manifest may not claim an older version "
                "than it holds"
            )
        try:
            manifest = cls._fields_from_dict(data, layout)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{source}: malformed manifest ({type(err).__name__}: {err})") from None
        manifest._check_consistent(data, source)
        return manifest

    @classmethod
    def _fields_from_dict(cls, data: dict[str, Any], layout: Layout) -> Manifest:
        optimizer = data["optimizer"]
        model = data["model"]
        return cls(
            tag=str(data["tag"]),
            layout=layout,
            optimizer_class=str(optimizer["class"]),
            param_groups=[
                ParamGroupState(
                    jsonvalue.decode(g["hyperparameters"]),
                    [jsonvalue.read_int(i, "param group {} has a layout group that", n) for i in g["layout_groups"]],
                )
                for n, g in enumerate(optimizer["param_groups"])
            ],
            groups=tuple(GroupRecord.from_dict(group) for group in data["groups"]),
            model_tensors={
                str(name): ModelTensorRecord(
                    jsonvalue.read_shape(t["shape"], "the shape of module tensor {}", name),
                    str(t["dtype"]),
                    str(t["kind"]),
                )
                for name, t in model["tensors"].items()
            },
            aliases={str(k): str(v) for k, v in model["aliases"].items()},
            extra=jsonvalue.decode(data["extra"]),
            files={str(name): FileRecord.from_dict(record) for name, record in data["files"].items()},
            digests=StateDigests.from_dict(data["digests"]) if data["version"] > UNDIGESTED_VERSION else None,
            resume=ResumeRecord.from_dict(data["resume"]) if "resume" in data else None,
            version=int(data["version"]),
            created_by=str(data.get("created_by", "")),
            stored_layout=data["layout"],
        )

    def _check_consistent(self, data: dict[str, Any], source: str) -> None:
        if data.get("world_size") != self.world_size or type(data.get("world_size")) is not int:
            raise ValueError(
                f"{source}: world_size {quoted(data.get('world_size'))} disagrees with the layout's {self.world_size}"
            )
        if len(self.groups) != len(self.layout.groups):
            raise ValueError(f"{source}: {len(self.groups)} group records for {len(self.layout.groups)} layout groups")
        configs = self.config_files
        per_rank = 2 if self.resume is not None else 1
        # Compared first: the world size is what the file declares.
        if len(self.files) - len(configs) != self.world_size * per_rank + 1:
            kinds = "a rank file and a resume file" if self.resume is not None else "one"
            expected = f"{self.world_size * per_rank + 1:,} expected (the model file and {kinds} per rank"
            raise ValueError(
                f"{source}: file list does not match world size {self.world_size}: {len(self.files)} files listed, "
                f"{expected}, besides config files)"
            )
        if configs and self.format_version < CONFIG_VERSION:
            raise ValueError(f"{source}: format version {self.format_version} lists config files {sorted(configs)}")
        for index, record in enumerate(self.groups):
            problem = next(filter(None, map(state_name_problem, record.states)), None)
            if problem:
                raise ValueError(f"{source}: group {index}: {problem}")
        expected = {MODEL_FILE, *self.rank_files(), *self.resume_files()}
        if set(self.files) - set(configs) != expected:
            missing = sorted(expected - set(self.files))[:3]
            unknown = sorted(set(self.files) - expected - set(configs))[:3]
            raise ValueError(
                f"{source}: file list does not match world size {self.world_size} "
                f"(missing {quoted(missing)}, unknown {quoted(unknown)})"
            )
        for alias, target in self.aliases.items():
            if target not in self.model_tensors or alias in self.model_tensors:
                raise ValueError(f"{source}: alias {quoted(alias)} -> {quoted(target)} does not name a stored tensor")
        problem = _model_tensor_kind_problem(
            self.model_tensors, set(self.layout.param_names) - expert_param_names(self.layout), expert_param_names(self.layout)
        )
        problem = problem or per_expert_clash(self.layout, [*self.model_tensors, *self.aliases])
        if problem:
            raise ValueError(f"{source}: {problem}")
        problem = self._digests_problem()
        if problem:
            raise ValueError(f"{source}: digests: {problem}")

    def _digests_problem(self) -> str | None:
        """The digests must name exactly the layout's parameters, kinds and experts, each
        group's scalars and the stored module tensors."""
        if self.digests is None:
            return None
        kinds = {group.index: ("fp32", *record.states) for group, record in zip(self.layout.groups, self.groups)}
        expected = set(logical_keys(self.layout, kinds))
        found = set(self.digests.keys())
        if found != expected:
            missing, unknown = sorted(expected - found, key=str)[:3], sorted(found - expected, key=str)[:3]
            return f"they do not name exactly the layout's tensors (missing {missing}, unknown {unknown})"
        if [set(group) for group in self.digests.scalars] != [set(record.scalars) for record in self.groups]:
            return "the scalars do not match the groups' optimizer scalars"
        if set(self.digests.model) != set(self.model_tensors):
            return "the module digests do not name exactly the module tensors"
        return None


def _newer_than_claimed(data: dict[str, Any]) -> str | None:
    """What a manifest holds that only versions after the one it claims write (its layout
    already read, so its version is a valid one)."""
    if data["version"] < RESUME_VERSION and "resume" in data:
        return f"it lists resume files, which version {RESUME_VERSION} added"
    if data["version"] != UNDIGESTED_VERSION:
        return None
    if "digests" in data:
        return "it holds digests, which version 2 added"
    if data["layout"]["version"] > UNDIGESTED_LAYOUT_VERSION:
        return f"its layout is version {data['layout']['version']}, which came after format version 2"
    return None


def expert_param_names(layout: Layout) -> set[str]:
    """The layout's expert weights: their values differ per EP rank, so the model file (rank
    0's) leaves them out; the rank files hold them by global expert id."""
    return {slot.name for group in layout.groups if group.is_expert_group for slot in group.params}


def _model_tensor_kind_problem(tensors: dict[str, ModelTensorRecord], trained: set[str], experts: set[str]) -> str | None:
    """A module tensor's ``kind`` must be known, and "trainable" exactly for the layout's dense
    parameters; expert weights are not in the model file."""
    for name, record in tensors.items():
        if name in experts:
            return f"module tensor {quoted(name)} is an expert weight, which the model file does not hold"
        if record.kind not in TENSOR_KINDS:
            expected = ", ".join(TENSOR_KINDS)
            return f"module tensor {quoted(name)} has unknown kind {quoted(record.kind)} (expected one of {expected})"
        if (record.kind == "trainable") != (name in trained):
            state = "is" if name in trained else "is not"
            kind = quoted(record.kind)
            return f"module tensor {quoted(name)} has kind {kind} but {state} a trained parameter of the layout"
    return None


def read_manifest(directory: Path) -> Manifest:
    """Read and check ``directory``'s manifest.json.

    Raises:
        FileNotFoundError: it is missing.
        CheckpointDamagedError: it is no regular file, not valid JSON or UTF-8, not a
            zeroshard manifest, or its fields are malformed or inconsistent.
        ValueError: a newer zeroshard wrote it (its format version); the message names the file.
    """
    path = directory / MANIFEST_FILE
    return Manifest.from_dict(read_json_file(path, "checkpoint"), str(path))
