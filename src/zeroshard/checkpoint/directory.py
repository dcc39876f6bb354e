"""The checkpoint root on disk: its writer lock, staging, atomic publication, ``latest``.

A save holds the root's lock (``<root>/.lock``, see :mod:`.writer_lock`) throughout, writes into ``<root>/.<tag>.tmp-<id>`` and becomes visible with one rename to
``<root>/<tag>``; ``latest`` is replaced after that. Saving over an existing tag first moves
the old directory aside to ``<root>/.<tag>.old-<id>``; if a crash falls between the two
renames, :func:`resolve_checkpoint` finds the old one there, and the next save puts it back.
Nothing whose name starts with a dot is ever loaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from . import jsonvalue
from .checksum import FileRecord
from .format import (
    LATEST_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    OLD_MARKER,
    TEMP_MARKER,
    check_tag,
    old_dir_name,
    temp_dir_name,
)
from .members import member_path, open_member
from .writer_lock import WriterLock

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def replace_file_atomically(path: Path, text: str) -> None:
    """Readers see the old content or the new, never a partial file."""
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{uuid.uuid4().hex[:8]}")
    write_file_durably(temp, text)
    os.replace(temp, path)
    fsync_dir(path.parent)


def root_lock(root: Path, tag: str) -> WriterLock:
    """The writer lock of ``root`` (created if absent) for saving ``tag``, not yet acquired.

    Hold it from :func:`prepare_staging` until :func:`publish` returns: a second writer then
    gets a WriterLockedError naming the holder instead of deleting the first one's staging.
    """
    root.mkdir(parents=True, exist_ok=True)
    return WriterLock(root / LOCK_FILE, f"saving tag {tag!r}")


def prepare_staging(root: Path, tag: str, *, clean: bool = True) -> Path:
    """Clean up after earlier interrupted saves (unless ``clean`` is False: the root could
    not be locked), then create a fresh staging directory."""
    root.mkdir(parents=True, exist_ok=True)
    if clean:
        clean_interrupted_saves(root)
    staging = root / temp_dir_name(tag, uuid.uuid4().hex[:12])
    staging.mkdir()
    return staging


def clean_interrupted_saves(root: Path) -> None:
    """Delete staging directories; put back an old tag a crash left moved aside, else delete it.

    Call it holding the root's lock (:func:`root_lock`): every writer takes it, so every
    staging directory found then belongs to a save that died.
    """
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(".") or not entry.is_dir():
            continue
        if TEMP_MARKER in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
        elif OLD_MARKER in entry.name:
            tag = entry.name[1:].rsplit(OLD_MARKER, 1)[0]
            if not (root / tag).exists() and (entry / MANIFEST_FILE).exists():
                os.rename(entry, root / tag)
                log.warning("restored checkpoint %s, moved aside by an interrupted save", root / tag)
            else:
                shutil.rmtree(entry, ignore_errors=True)
    fsync_dir(root)


def publish(root: Path, tag: str, staging: Path, fault: Callable[[str], None]) -> Path:
    """Rename the finished ``staging`` directory to ``root/tag``: the commit point of a save."""
    target = root / tag
    moved_aside = None
    fault("before_rename")
    if target.exists():
        moved_aside = root / old_dir_name(tag, staging.name.rsplit(TEMP_MARKER, 1)[1])
        os.rename(target, moved_aside)
        fsync_dir(root)
        fault("mid_replace")
    os.rename(staging, target)
    fsync_dir(root)
    fault("before_latest")
    replace_file_atomically(root / LATEST_FILE, tag + "\n")
    if moved_aside is not None:
        shutil.rmtree(moved_aside, ignore_errors=True)
    return target


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the tag its ``latest`` file names.

    FileNotFoundError or ValueError in one line when there is none.
    """
    if (path / MANIFEST_FILE).is_file():
        return path
    if (path / LATEST_FILE).is_file():
        tag = (path / LATEST_FILE).read_text().strip()
        try:
            check_tag(tag)
        except ValueError:
            raise ValueError(f"{path / LATEST_FILE}: holds {tag!r}, not a checkpoint tag") from None
        if (path / tag).is_symlink():
            raise ValueError(f"{path / LATEST_FILE}: names tag {tag!r}, a symbolic link; a tag must be a directory")
        target = _existing_or_moved_aside(path / tag)
        if target is None:
            raise FileNotFoundError(f"{path / LATEST_FILE}: names tag {tag!r} but {path / tag} does not exist")
        if not (target / MANIFEST_FILE).is_file():
            raise ValueError(f"{path / LATEST_FILE}: names tag {tag!r} but {target} has no {MANIFEST_FILE}")
        return target
    if not path.exists():
        moved = _existing_or_moved_aside(path)
        if moved is None:
            raise FileNotFoundError(f"{path}: no such checkpoint directory")
        return moved
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory; a checkpoint is a directory with {MANIFEST_FILE}")
    if not any(path.iterdir()):
        raise ValueError(f"{path}: empty directory, not a checkpoint")
    tags = list_tags(path)
    if tags:
        raise ValueError(f"{path}: no {LATEST_FILE} file; name one of its checkpoints: {', '.join(tags)}")
    raise ValueError(f"{path}: no {MANIFEST_FILE}: not a checkpoint, or an unfinished save")


def list_tags(root: Path) -> list[str]:
    """Tags of the complete checkpoints under ``root``."""
    return sorted(e.name for e in root.iterdir() if not e.name.startswith(".") and (e / MANIFEST_FILE).is_file())


def _existing_or_moved_aside(target: Path) -> Path | None:
    if target.exists():
        return target
    if not target.parent.is_dir():
        return None
    prefix = f".{target.name}{OLD_MARKER}"
    aside = [e for e in target.parent.iterdir() if e.name.startswith(prefix) and (e / MANIFEST_FILE).is_file()]
    if not aside:
        return None
    log.warning("%s was being replaced when a save stopped; loading the previous version from %s", target, aside[0])
    return aside[0]


def read_json_file(path: Path, what: str) -> Any:
    """The JSON in ``path`` (a regular file, not a link); one-line errors for a missing file,
    invalid JSON or JSON nested too deeply to parse safely."""
    try:
        fd = open_member(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing: not a complete {what}") from None
    with open(fd, "rb") as handle:
        raw = handle.read()
    try:
        return jsonvalue.loads(raw, path)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: corrupted: not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: corrupted: not UTF-8 text") from None


def check_files_present(directory: Path, records: Mapping[str, FileRecord]) -> None:
    """Every file a manifest lists is a regular file in ``directory`` (see :mod:`.members`)
    with its recorded size (one lstat each)."""
    for name, record in records.items():
        size = member_path(directory, name).lstat().st_size
        if size != record.size:
            raise ValueError(f"{directory / name}: truncated or altered: {size} bytes, the manifest says {record.size}")
