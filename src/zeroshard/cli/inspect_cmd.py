"""``zeroshard inspect CKPT``: what a checkpoint holds; ``--verify`` checks every byte of it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint.block_reader import array_view
from ..checkpoint.directory import resolve_checkpoint
from ..checkpoint.format import MANIFEST_FILE, MODEL_FILE, rank_file_name, scalar_key
from ..checkpoint.handle import Checkpoint, open_checkpoint
from ..checkpoint.manifest import read_manifest
from ..checkpoint.safetensors_io import VerifiedRanges, read_header
from ..checkpoint.verify import verify_checkpoint

_STEP_KEYS = ("global_step", "global_steps", "step", "iteration")
_LISTED_RANK_FILES = 8


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect", help="describe a checkpoint; --verify checks every file against the manifest"
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a root with a 'latest' file")
    parser.add_argument("--verify", action="store_true", help="recompute every checksum; exit 1 on any problem")
    parser.add_argument("--files", action="store_true", help="list every rank file, not only the first few")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.verify:
        return _verify(args.checkpoint)
    ckpt = open_checkpoint(args.checkpoint)
    for line in describe(ckpt, list_all_files=args.files):
        print(line)
    return 0


def _verify(path: Path) -> int:
    try:
        directory = resolve_checkpoint(path)
        ckpt = Checkpoint(directory, read_manifest(directory))
    except (ValueError, FileNotFoundError) as err:
        print(err)
        return 1
    problems = verify_checkpoint(ckpt)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    total = sum(record.size for record in ckpt.manifest.files.values())
    print(f"{ckpt.directory}: OK, {len(ckpt.manifest.files)} files, {total:,} bytes, every checksum matches")
    return 0


def describe(ckpt: Checkpoint, *, list_all_files: bool = False) -> list[str]:
    """The report ``zeroshard inspect`` prints, line by line."""
    manifest = ckpt.manifest
    layout = manifest.layout
    lines = [
        f"checkpoint {ckpt.directory} (tag {manifest.tag!r}, format version {manifest.version}, {manifest.created_by})",
        f"step: {_step(ckpt)}",
        f"world size: {manifest.world_size}",
        f"layout policy: {layout.policy.describe()}",
        f"optimizer: {manifest.optimizer_class or '-'}, {len(manifest.param_groups)} param group(s)",
        "groups:",
    ]
    for group, record in zip(layout.groups, manifest.groups):
        padding = group.inter_param_padding + group.tail_padding
        lines.append(
            f"  group {group.index} ({group.dtype}): {len(group.params)} parameters, {group.param_numel:,} elements, "
            f"{len(group.buckets)} bucket(s), {group.partition_numel:,} elements per rank, {padding:,} padding; "
            f"state {', '.join(record.states) or '-'}; scalars {', '.join(record.scalars) or '-'}"
        )
    trainable = sum(len(group.params) for group in layout.groups)
    frozen = sum(1 for t in manifest.model_tensors.values() if t.kind != "trainable")
    stats = layout.padding()
    lines += [
        f"parameters: {trainable} trainable ({stats.param_numel:,} elements); model state: {len(manifest.model_tensors)} "
        f"tensors stored ({frozen} not trainable), {len(manifest.aliases)} tied alias(es)",
        f"padding overhead: {stats.padding_elements:,} elements, {stats.padding_bytes:,} bytes, "
        f"{100 * stats.fraction:.3f}% of parameter bytes",
    ]
    lines += _file_lines(ckpt, list_all_files)
    return lines


def _file_lines(ckpt: Checkpoint, list_all: bool) -> list[str]:
    manifest = ckpt.manifest
    rank_files = manifest.rank_files()
    sizes = [manifest.files[name].size for name in rank_files]
    manifest_size = ckpt.path(MANIFEST_FILE).stat().st_size
    total = sum(record.size for record in manifest.files.values()) + manifest_size
    lines = [
        f"files: {total:,} bytes in all",
        f"  {MANIFEST_FILE}: {manifest_size:,} bytes",
        f"  {MODEL_FILE}: {manifest.files[MODEL_FILE].size:,} bytes",
        f"  {len(rank_files)} rank files: {sum(sizes):,} bytes (smallest {min(sizes):,}, largest {max(sizes):,})",
    ]
    shown = rank_files if list_all else rank_files[:_LISTED_RANK_FILES]
    lines += [f"  {name}: {manifest.files[name].size:,} bytes" for name in shown]
    if len(shown) < len(rank_files):
        lines.append(f"  ... {len(rank_files) - len(shown)} more (--files lists them all)")
    return lines


def _step(ckpt: Checkpoint) -> str:
    for key in _STEP_KEYS:
        if isinstance(ckpt.manifest.extra.get(key), int):
            return f"{ckpt.manifest.extra[key]} (extra[{key!r}])"
    return _optimizer_step(ckpt)


def _optimizer_step(ckpt: Checkpoint) -> str:
    """The optimizer's ``step`` scalar of group 0, read from rank 0's file."""
    manifest = ckpt.manifest
    if not manifest.groups or "step" not in manifest.groups[0].scalars:
        return "unknown"
    name = rank_file_name(0, manifest.world_size)
    record = manifest.files[name]
    entry = read_header(ckpt.path(name), record.size)[scalar_key(0, "step")]
    data = VerifiedRanges(ckpt.path(name), record, [(entry.begin, entry.end)], None)
    dtype, shape = manifest.groups[0].scalars["step"]
    value = array_view(data.view(entry.begin, entry.end), dtype).reshape(shape)
    return f"{value.item():g} (optimizer step of group 0)"

