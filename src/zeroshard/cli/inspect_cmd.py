"""``zeroshard inspect CKPT``: what a checkpoint holds; ``--verify`` checks every byte of it.

The checkpoint's kind is what :func:`~zeroshard.checkpoint.formats.recognise` says, as for
every loader and converter: native (a tag directory, or a root with ``latest``), universal,
or DeepSpeed ZeRO-1/2; opening a kind zeroshard recognises but does not read (DeepSpeed's own
universal format) refuses it by name. Torch is never imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.formats import NATIVE, UnsupportedCheckpointError, open_source, recognise
from ..checkpoint.io.directory import resolve_checkpoint
from ..checkpoint.native.handle import Checkpoint, open_checkpoint
from ..checkpoint.native.manifest import read_manifest
from ..checkpoint.universal.format import read_universal_manifest
from ..checkpoint.universal.read import open_universal
from ..checkpoint.verify import read_every_tensor, verify_checkpoint, verify_universal
from .inspect_report import describe_deepspeed, describe_native, describe_universal


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect",
        help="describe a checkpoint (native, universal or DeepSpeed); --verify checks every byte of it",
    )
    parser.add_argument(
        "checkpoint", type=Path, help="a native, universal or DeepSpeed checkpoint directory, or a root with 'latest'"
    )
    parser.add_argument("--verify", action="store_true", help="check every file (checksums, headers); exit 1 on damage")
    parser.add_argument("--files", action="store_true", help="list every rank file or shard, not only the first few")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path: Path = args.checkpoint
    found = recognise(path)
    kind = found.kind if found is not None else NATIVE
    if kind not in _DESCRIBE:  # a registered format this command has no report for
        what = found.description or f"{kind} checkpoint"
        raise ValueError(f"{path}: a {what}, which inspect does not describe; open_source reads it")
    if args.verify:
        return _report_verification(*_VERIFY[kind](path))
    for line in _DESCRIBE[kind](path, args.files):
        print(line)
    return 0


def _describe_native(path: Path, list_all: bool) -> list[str]:
    return describe_native(open_checkpoint(path), list_all_files=list_all)


def _describe_universal(path: Path, list_all: bool) -> list[str]:
    with open_universal(path) as ckpt:
        return describe_universal(ckpt, list_all_files=list_all)


def _describe_deepspeed(path: Path, list_all: bool) -> list[str]:
    from ..importers.deepspeed_files import model_states_path, rank_file_paths

    with open_source(path) as source:
        files = [model_states_path(source.path), *rank_file_paths(source.path)]
        return describe_deepspeed(source, path, files, list_all_files=list_all)


# ---- --verify: (what was checked, the problems found) ---------------------------------------


def _verify_native(path: Path) -> tuple[str, list[str]]:
    try:
        directory = resolve_checkpoint(path)
        ckpt = Checkpoint(directory, read_manifest(directory))
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)]
    total = sum(record.size for record in ckpt.manifest.files.values())
    checked = "every checksum, binding and digest matches" if ckpt.manifest.digests else "every checksum matches (no digests)"
    summary = f"{directory}: OK, {len(ckpt.manifest.files)} files, {total:,} bytes, {checked}"
    return summary, verify_checkpoint(ckpt)


def _verify_universal(path: Path) -> tuple[str, list[str]]:
    try:
        manifest = read_universal_manifest(path)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)]
    total = sum(record.size for record in manifest.shards.values())
    shards = len(manifest.shards)
    checked = "every checksum and digest matches" if manifest.digests else "every checksum matches (no digests)"
    summary = f"{path}: OK, universal checkpoint, {shards} shards, {total:,} bytes, {checked}"
    return summary, verify_universal(path, manifest)


def _verify_deepspeed(path: Path) -> tuple[str, list[str]]:
    """Opening checks every rank file's structure against the model-states file; then every
    tensor is read (each zip record's CRC-32 is checked where the reader checks it)."""
    from ..importers.deepspeed_files import model_states_path, rank_file_paths

    try:
        source = open_source(path)
    except UnsupportedCheckpointError:
        raise  # not damage: a kind zeroshard does not read (exit 2, as without --verify)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)]
    with source:
        files = [model_states_path(source.path), *rank_file_paths(source.path)]
        total = sum(file.stat().st_size for file in files)
        summary = (
            f"{source.path}: OK, DeepSpeed checkpoint, {len(files)} files, {total:,} bytes: every rank file agrees "
            "with the model states and every tensor reads"
        )
        return summary, [f"{source.path}: {problem}" for problem in read_every_tensor(source)]


def _report_verification(summary: str, problems: list[str]) -> int:
    for problem in problems:
        print(" ".join(problem.split()))
    if problems:
        return 1
    print(summary)
    return 0


# by SourceFormat.kind
_DESCRIBE = {NATIVE: _describe_native, "universal": _describe_universal, "deepspeed": _describe_deepspeed}
_VERIFY = {NATIVE: _verify_native, "universal": _verify_universal, "deepspeed": _verify_deepspeed}
