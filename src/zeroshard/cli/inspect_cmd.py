"""``zeroshard inspect CKPT``: what a checkpoint holds; ``--verify`` checks every byte of it.

The checkpoint's kind is what :func:`~zeroshard.checkpoint.formats.recognise` says, as for
every loader and converter: native (a tag directory, or a root with ``latest``), universal,
or DeepSpeed ZeRO-1/2; opening a kind zeroshard recognises but does not read (DeepSpeed's own
universal format) refuses it by name. An fp32 export (``to-fp32`` output) is no checkpoint,
but ``inspect`` says what it holds too. ``--verify --files`` lists every file it checked.
Torch is never imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.formats import NATIVE, UnsupportedCheckpointError, open_source, recognise
from ..checkpoint.directory import resolve_checkpoint
from ..checkpoint.native.handle import Checkpoint, open_checkpoint
from ..checkpoint.native.manifest import read_manifest
from ..checkpoint.native.source import is_native_checkpoint
from ..checkpoint.universal.format import read_universal_manifest
from ..checkpoint.universal.read import open_universal
from ..checkpoint.export.fp32 import is_fp32_export
from ..checkpoint.format import MANIFEST_FILE
from ..checkpoint.universal.format import MANIFEST_FILE as UNIVERSAL_MANIFEST_FILE
from ..checkpoint.param_groups import param_group_problems
from ..checkpoint.verify import read_every_tensor, verify_checkpoint, verify_universal
from .export_report import describe_fp32_export, verify_fp32_export
from .inspect_report import describe_deepspeed, describe_native, describe_universal

FP32_EXPORT = "fp32 export"  # not a SourceFormat: weights only, no checkpoint


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand and its arguments to ``commands``."""
    parser = commands.add_parser(
        "inspect",
        help="describe a checkpoint (native, universal or DeepSpeed) or an fp32 export; --verify checks every byte of it",
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        help="a native, universal or DeepSpeed checkpoint directory, a root with 'latest', or a to-fp32 output",
    )
    parser.add_argument("--verify", action="store_true", help="check every file (checksums, headers); exit 1 on damage")
    parser.add_argument(
        "--files", action="store_true", help="list every file (with --verify: every file checked), not only the first few"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the report of ``args.checkpoint``, or verify it (exit status 1 on damage)."""
    path: Path = args.checkpoint
    found = None if is_fp32_export(path) else recognise(path)
    kind = found.kind if found is not None else FP32_EXPORT if is_fp32_export(path) else NATIVE
    if kind not in _DESCRIBE:  # a registered format this command has no report for
        what = found.description or f"{kind} checkpoint"
        raise ValueError(f"{path}: a {what}, which inspect does not describe; open_source reads it")
    if args.verify:
        summary, problems, checked = _VERIFY[kind](path)
        return _report_verification(summary, problems, checked if args.files else {})
    for line in _DESCRIBE[kind](path, args.files):
        print(line)
    return 0


def _describe_native(path: Path, list_all: bool) -> list[str]:
    return describe_native(open_checkpoint(path), list_all_files=list_all)


def _describe_universal(path: Path, list_all: bool) -> list[str]:
    with open_universal(path) as ckpt:
        return describe_universal(ckpt, list_all_files=list_all)


def _describe_deepspeed(path: Path, list_all: bool) -> list[str]:
    with open_source(path) as source:
        return describe_deepspeed(source, path, _deepspeed_files(source), list_all_files=list_all)


def _deepspeed_files(source) -> list[Path]:
    """The model-states file, the rank files in rank order, then AutoEP's per-expert files."""
    from ..deepspeed.checkpoint.paths import model_states_path, rank_file_paths

    raw = getattr(source, "raw", source)
    experts = raw.experts.paths if raw.experts is not None else []
    return [model_states_path(raw.path), *rank_file_paths(raw.path), *experts]


# ---- --verify: (what was checked, the problems found) ---------------------------------------


Verified = tuple[str, list[str], dict[str, int]]  # summary, problems, every file checked -> its size


def _verify_native(path: Path) -> Verified:
    try:
        directory = resolve_checkpoint(path)
    except (ValueError, FileNotFoundError) as err:
        if not is_native_checkpoint(path):
            raise  # nothing there claims to be a checkpoint: bad input (exit 2), not damage found
        return "", [str(err)], {}
    try:
        ckpt = Checkpoint(directory, read_manifest(directory))
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)], {}
    total = sum(record.size for record in ckpt.manifest.files.values())
    how = "every checksum, binding and digest matches" if ckpt.manifest.digests else "every checksum matches (no digests)"
    summary = f"{directory}: OK, {len(ckpt.manifest.files)} files, {total:,} bytes, {how}"
    checked = {MANIFEST_FILE: (directory / MANIFEST_FILE).stat().st_size}
    checked.update((name, record.size) for name, record in ckpt.manifest.files.items())
    return summary, verify_checkpoint(ckpt), checked


def _verify_universal(path: Path) -> Verified:
    try:
        manifest = read_universal_manifest(path)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)], {}
    total = sum(record.size for record in manifest.shards.values())
    shards = len(manifest.shards)
    how = "every checksum and digest matches" if manifest.digests else "every checksum matches (no digests)"
    summary = f"{path}: OK, universal checkpoint, {shards} shards, {total:,} bytes, {how}"
    checked = {UNIVERSAL_MANIFEST_FILE: (path / UNIVERSAL_MANIFEST_FILE).stat().st_size}
    checked.update((name, record.size) for name, record in {**manifest.configs, **manifest.shards}.items())
    return summary, verify_universal(path, manifest), checked


def _verify_deepspeed(path: Path) -> Verified:
    """Opening checks every rank file's structure against the model states (and an AutoEP
    run's expert files against its metadata); then every tensor is read (each zip record's
    CRC-32 is checked where the reader checks it)."""
    try:
        source = open_source(path)
    except UnsupportedCheckpointError:
        raise  # not damage: a kind zeroshard does not read (exit 2, as without --verify)
    except (ValueError, FileNotFoundError) as err:
        return "", [str(err)], {}
    with source:
        raw = getattr(source, "raw", source)  # an AutoEP run's files in DeepSpeed's own layout
        files = _deepspeed_files(source)
        total = sum(file.stat().st_size for file in files)
        summary = (
            f"{source.path}: OK, DeepSpeed checkpoint, {len(files)} files, {total:,} bytes: every rank file agrees "
            "with the model states and every tensor reads"
        )
        checked = {file.name: file.stat().st_size for file in files}
        problems = [f"{source.path}: {problem}" for problem in read_every_tensor(raw)]
        problems += raw.experts.unreadable(raw.autoep) if raw.experts is not None else []
        problems += [] if problems else param_group_problems(source)
        return summary, problems, checked


def _report_verification(summary: str, problems: list[str], listed: dict[str, int]) -> int:
    """Print the problems (exit status 1) or the summary, then the ``listed`` files."""
    for problem in problems:
        print(" ".join(problem.split()))
    if not problems:
        print(summary)
    if listed:
        print(f"files checked: {len(listed)}, {sum(listed.values()):,} bytes")
        for name, size in listed.items():
            print(f"  {name}: {size:,} bytes")
    return 1 if problems else 0


def _describe_fp32_export(path: Path, list_all: bool) -> list[str]:
    return describe_fp32_export(path, list_all_files=list_all)


# by SourceFormat.kind
_DESCRIBE = {
    NATIVE: _describe_native,
    "universal": _describe_universal,
    "deepspeed": _describe_deepspeed,
    FP32_EXPORT: _describe_fp32_export,
}
_VERIFY = {
    NATIVE: _verify_native,
    "universal": _verify_universal,
    "deepspeed": _verify_deepspeed,
    FP32_EXPORT: verify_fp32_export,
}
