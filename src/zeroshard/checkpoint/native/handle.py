"""An opened native checkpoint: its directory and its checked manifest (no tensors read)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..directory import check_files_present, resolve_checkpoint
from .manifest import Manifest, read_manifest


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: its directory and checked manifest. Reuse it across ranks' loads."""

    directory: Path
    manifest: Manifest

    def path(self, file_name: str) -> Path:
        """``file_name`` inside the checkpoint's directory."""
        return self.directory / file_name


def open_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """Resolve ``path`` (a tag directory, or a root with ``latest``), read and check its manifest."""
    if isinstance(path, Checkpoint):
        return path
    directory = resolve_checkpoint(Path(path))
    manifest = read_manifest(directory)
    check_files_present(directory, manifest.files)
    return Checkpoint(directory, manifest)
