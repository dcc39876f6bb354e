"""Check a whole checkpoint against its manifest: every file, every checksum block, every header."""

from __future__ import annotations

import os
from pathlib import Path

from .format import MODEL_FILE
from .handle import Checkpoint
from .members import member_path
from .safetensors_io import check_entries, read_header, verify_file


def verify_checkpoint(ckpt: Checkpoint) -> list[str]:
    """One line per problem found; empty when every file is present, intact and as described."""
    problems: list[str] = []
    manifest = ckpt.manifest
    for name, record in sorted(manifest.files.items()):
        try:
            path = member_path(ckpt.directory, name)
            file_problems = verify_file(path, record)
        except (OSError, ValueError) as err:
            problems.append(str(err))
            continue
        if not file_problems:
            file_problems = _header_problems(ckpt, name)
        problems += file_problems
    for entry in sorted(os.listdir(ckpt.directory)):
        if entry.endswith(".safetensors") and entry not in manifest.files:
            problems.append(f"{ckpt.path(entry)}: not listed in the manifest")
    return problems


def _header_problems(ckpt: Checkpoint, name: str) -> list[str]:
    manifest = ckpt.manifest
    path: Path = ckpt.path(name)
    expected = manifest.model_file_tensors() if name == MODEL_FILE else manifest.rank_file_tensors()
    try:
        entries = read_header(path, manifest.files[name].size)
        check_entries(path, entries, expected)
        extra = sorted(set(entries) - set(expected))
        if extra:
            return [f"{path}: tensors not in the manifest: {', '.join(extra)}"]
    except ValueError as err:
        return [str(err)]
    return []
