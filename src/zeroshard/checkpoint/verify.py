"""Check a whole checkpoint against its manifest: every file, every checksum block, every header.

Native and universal checkpoints are checked against their manifests' checksums, then (format
versions with digests) every rank file's binding and every parameter's, expert's, scalar's
and module tensor's digest: each is read whole through the checkpoint's
:class:`~.source.ShardSource` and digested in logical order, so a manifest edited to describe
the files as something else fails here too. A saved run without checksums of ours (a
DeepSpeed checkpoint) is checked by reading every tensor through its source, so whatever
that reader checks is checked for every byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

from ..io.checksum import FileRecord
from .model_config import read_config
from .format import MODEL_FILE
from .native.handle import Checkpoint
from ..io.members import member_path
from .experts import exported_params, read_exported
from ..io.safetensors_io import check_entries, read_header, read_metadata, verify_file
from .native.binding import check_binding
from .param_groups import param_group_problems
from .attest.read_digests import ReadChecker
from .source import ShardSource
from .universal.format import UniversalManifest, shard_version_problem

Spec = tuple[str, tuple[int, ...]]  # a tensor's dtype name and shape
_READ_CHUNK = 1 << 24  # elements per read when reading a whole partition (64 MiB of fp32)


def verify_checkpoint(ckpt: Checkpoint) -> list[str]:
    """One line per problem found; empty when every file is present, intact and as described,
    and its param groups are what a universal checkpoint stores (see :mod:`.param_groups`)."""
    manifest = ckpt.manifest
    rank_tensors = manifest.rank_file_tensors()
    configs = manifest.config_files
    tensor_files = set(manifest.files) - set(configs) - set(manifest.resume_files())
    checked = {name: record for name, record in manifest.files.items() if name not in configs}  # resume files too
    expected = {name: manifest.model_file_tensors() if name == MODEL_FILE else rank_tensors for name in tensor_files}
    problems = _verify_files(ckpt.directory, checked, expected, listed=manifest.files)
    problems += config_problems(ckpt.directory, configs)
    if problems:
        return problems
    problems = _binding_problems(ckpt) + _resume_file_problems(ckpt)
    if problems:
        return problems
    from .native.source import NativeSource

    with NativeSource(ckpt) as source:
        return verify_digests(source) + param_group_problems(source)


def verify_universal(directory: Path, manifest: UniversalManifest) -> list[str]:
    """:func:`verify_checkpoint` for a universal checkpoint: every shard its manifest lists."""
    expected: dict[str, dict[str, Spec]] = {name: {} for name in manifest.shards}
    for key, spec in manifest.tensor_specs().items():
        expected[manifest.weight_map[key]][key] = spec
    problems = _verify_files(directory, manifest.shards, expected) + config_problems(directory, manifest.configs)
    if not problems:
        versions = (shard_version_problem(directory / name, read_metadata(directory / name), manifest) for name in manifest.shards)
        problems = [problem for problem in versions if problem]
    if problems:
        return problems
    from .universal.read import UniversalCheckpoint
    from .universal.source import UniversalSource

    with UniversalSource(UniversalCheckpoint(directory, manifest)) as source:
        return verify_digests(source) + param_group_problems(source)


def verify_digests(source: ShardSource) -> list[str]:
    """Read every parameter (each expert), every optimizer state, every scalar and module
    tensor of ``source`` whole and compare its digest with the saved one: one line per
    mismatch. A source without digests has nothing to compare (an empty list)."""
    if source.info.digests is None:
        return []
    checker = ReadChecker(source, collect=True)
    layout = source.info.layout
    for param in exported_params(layout):
        for key in ("fp32", *source.info.state_keys[layout.param(param.param)[0].index]):
            read_exported(source, param, key, checker.param)
    for group in layout.groups:
        checker.scalars(group.index, group.index, source.scalars(group.index))
    # The module tensors with digests: buffers and frozen parameters, and of a native
    # checkpoint also the trained weights its model file holds.
    for name in sorted(source.info.digests.model):
        checker.model_tensor(name, source.model_tensor(name))
    return checker.problems


def _binding_problems(ckpt: Checkpoint) -> list[str]:
    manifest = ckpt.manifest
    problems = []
    for rank, name in enumerate(manifest.rank_files()):
        metadata: dict = {}
        path = ckpt.path(name)
        try:
            read_header(path, manifest.files[name].size, metadata=metadata)
            check_binding(path, metadata, manifest.layout, manifest.binding_digest, rank)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _resume_file_problems(ckpt: Checkpoint) -> list[str]:
    """Every resume file parsed and checked against where the manifest puts it (version 3)."""
    from .run_state import resume_file_problems

    ranks = range(len(ckpt.manifest.resume_files()))
    return [problem for rank in ranks for problem in resume_file_problems(ckpt, rank)]


def read_every_tensor(source: ShardSource) -> list[str]:
    """Read every partition of every rank, and every model tensor, through ``source``: one
    line per rank file (or model tensor) that cannot be read; empty when all can."""
    problems: list[str] = []
    layout = source.info.layout
    for rank in range(layout.world_size):
        try:
            for group in layout.groups:
                for key in ("fp32", *source.info.state_keys[group.index]):
                    for start in range(0, group.partition_numel, _READ_CHUNK):
                        source.read(rank, group.index, key, start, min(start + _READ_CHUNK, group.partition_numel))
        except (OSError, ValueError) as err:
            problems.append(f"rank {rank}: {err}")
    for entry in source.info.model_entries:
        try:
            source.model_tensor(entry.name)
        except (KeyError, OSError, ValueError) as err:
            problems.append(f"model tensor {entry.name!r}: {err.args[0] if isinstance(err, KeyError) else err}")
    return problems


def config_problems(directory: Path, records: Mapping[str, FileRecord]) -> list[str]:
    """The model's config files against their records: checksums, size, one JSON object each."""
    problems = []
    for name, record in sorted(records.items()):
        try:
            read_config(directory, name, record)
        except (OSError, ValueError) as err:
            problems.append(str(err))
    return problems


def _verify_files(
    directory: Path,
    records: Mapping[str, FileRecord],
    expected: Mapping[str, Mapping[str, Spec]],
    listed: Iterable[str] | None = None,
) -> list[str]:
    problems: list[str] = []
    for name, record in sorted(records.items()):
        try:
            path = member_path(directory, name)
            file_problems = verify_file(path, record)
        except (OSError, ValueError) as err:
            problems.append(str(err))
            continue
        if not file_problems and name in expected:  # a safetensors file (not a resume file)
            file_problems = _header_problems(path, record.size, expected[name])
        problems += file_problems
    strays = _strays(directory, records if listed is None else listed)
    problems += [f"{directory / name}: not listed in the manifest" for name in strays]
    return problems


def _strays(directory: Path, records: Iterable[str]) -> list[str]:
    listed = set(records)
    return [name for name in sorted(os.listdir(directory)) if name.endswith(".safetensors") and name not in listed]


def _header_problems(path: Path, size: int, expected: Mapping[str, Spec]) -> list[str]:
    try:
        entries = read_header(path, size)
        check_entries(path, entries, expected)
        extra = sorted(set(entries) - set(expected))
        if extra:
            return [f"{path}: tensors not in the manifest: {', '.join(extra)}"]
    except ValueError as err:
        return [str(err)]
    return []
