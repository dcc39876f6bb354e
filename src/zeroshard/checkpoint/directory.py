"""The checkpoint root on disk: one atomic-directory protocol, and the ``latest`` pointer.

Every directory zeroshard writes (a save's tag, a conversion's output) appears whole or not
at all, by one protocol:

1. write everything into ``<parent>/.<name>.tmp-<id>`` and fsync it;
2. if ``<parent>/<name>`` exists, rename it aside to ``<parent>/.<name>.old-<id>``;
3. rename the staging directory to ``<parent>/<name>`` and fsync the parent (the commit);
4. delete the old directory.

Recovery (:func:`recover_target`, :func:`clean_interrupted_saves`), run before the next
write: staging directories are deleted; an old directory is put back if the crash fell
between steps 2 and 3 (``<name>`` is missing), else deleted; a directory that retention
was deleting (``.<name>.del-<id>``) is deleted. A save then replaces ``latest``. Nothing
whose name starts with a dot is ever loaded, except that :func:`resolve_checkpoint` reads
an old directory a crash left moved aside.

Every write holds the writer lock of its target throughout (a save: ``<root>/.lock``, see
:func:`root_lock`; a conversion: ``.<OUT>.lock``), and recovery runs only under that lock, so
it only ever removes what writers that died left behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from ..io import jsonvalue
from ..io.checksum import FileRecord
from ..io.damage import CheckpointDamagedError, MissingFileError
from .format import (
    DELETE_MARKER,
    LATEST_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    OLD_MARKER,
    TEMP_MARKER,
    check_tag,
    old_dir_name,
    temp_dir_name,
)
from ..io.members import member_path, open_member, read_small_file
from ..io.read_stats import count_read
from ..io.safetensors_io import named_os_error
from ..io.writer_lock import WriterLock

log = logging.getLogger(__name__)

Fault = Callable[[str], None]
_UNIQUE = re.compile(r"[0-9a-f]{12}")
_MARKERS = (TEMP_MARKER, OLD_MARKER, DELETE_MARKER)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        raise named_os_error(err, path) from err
    finally:
        os.close(fd)


def write_file_durably(path: Path, text: str | bytes) -> None:
    """Write and fsync ``path`` (``bytes`` as they are); an OSError (a full disk) names it."""
    try:
        with open(path, "wb" if isinstance(text, bytes) else "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        raise named_os_error(err, path) from err


def replace_file_atomically(path: Path, text: str) -> None:
    """Readers see the old content or the new, never a partial file; a failure (a full disk)
    leaves the old one and no temporary file, and names the file it failed on."""
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}")
    try:
        write_file_durably(temp, text)
        try:
            os.replace(temp, path)
        except OSError as err:
            raise named_os_error(err, path) from err
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def new_staging(target: Path, parent: Path | None = None) -> Path:
    """Create the empty staging directory ``<parent>/.<name>.tmp-<id>`` of ``target`` (its
    parent unless ``parent`` is given: see :mod:`.in_place`)."""
    staging = (target.parent if parent is None else parent) / temp_dir_name(target.name, uuid.uuid4().hex[:12])
    staging.mkdir()
    return staging


def root_lock(root: Path, tag: str) -> WriterLock:
    """The writer lock of ``root`` (created if absent) for saving ``tag``, not yet acquired.

    Hold it from :func:`prepare_staging` until :func:`publish` returns: a second writer then
    gets a WriterLockedError naming the holder instead of deleting the first one's staging.
    """
    root.mkdir(parents=True, exist_ok=True)
    return WriterLock(root / LOCK_FILE, f"saving tag {tag!r}")


class TagExistsError(FileExistsError):
    """A save that does not replace a checkpoint found its tag taken; nothing was written."""


def prepare_staging(root: Path, tag: str, *, clean: bool = True, replace: bool = True) -> Path:
    """Clean up after earlier interrupted saves (unless ``clean`` is False: the root could
    not be locked), then create a fresh staging directory. Unless ``replace``, a ``root/tag``
    that exists (whatever it is) refuses the save first: TagExistsError, one line."""
    root.mkdir(parents=True, exist_ok=True)
    if clean:
        clean_interrupted_saves(root)
    target = root / tag
    if not replace and (target.exists() or target.is_symlink()):
        raise TagExistsError(
            f"{target}: exists, and this save never replaces a checkpoint: move it out of {root} to save {tag!r} again"
        )
    return new_staging(target)


def clean_interrupted_saves(root: Path) -> None:
    """Recover every name under ``root`` (see the module docstring).

    Call it holding the root's lock (:func:`root_lock`): every writer takes it, so every
    staging directory found then belongs to a save that died.
    """
    for entry in sorted(root.iterdir()):
        _recover_entry(entry)
    fsync_dir(root)


def recover_target(target: Path) -> None:
    """Recover ``target`` alone: the leftovers of interrupted writes of that one name.

    Call it holding ``target``'s writer lock, for the same reason as :func:`clean_interrupted_saves`.
    """
    if not target.parent.is_dir():
        return
    for entry in sorted(target.parent.iterdir()):
        parsed = _parse_hidden(entry.name)
        if parsed is not None and parsed[0] == target.name:
            _recover_entry(entry)
    fsync_dir(target.parent)


def _parse_hidden(name: str) -> tuple[str, str] | None:
    """(target name, marker) of a hidden directory this protocol made, else None."""
    if not name.startswith("."):
        return None
    for marker in _MARKERS:
        target, found, unique = name[1:].rpartition(marker)
        if found and target and _UNIQUE.fullmatch(unique):
            return target, marker
    return None


def _recover_entry(entry: Path) -> None:
    parsed = _parse_hidden(entry.name)
    if parsed is None or entry.is_symlink():
        return
    name, marker = parsed
    if not entry.is_dir():  # the temporary file of a replace_file_atomically that died
        if marker == TEMP_MARKER and entry.is_file():
            entry.unlink(missing_ok=True)
        return
    target = entry.parent / name
    if marker == OLD_MARKER and not target.exists() and not target.is_symlink():
        os.rename(entry, target)
        log.warning("restored %s, moved aside by an interrupted write", target)
    else:
        shutil.rmtree(entry, ignore_errors=True)


def publish_dir(staging: Path, target: Path, fault: Fault | None = None) -> Path:
    """Rename the finished ``staging`` directory to ``target``, replacing what is there:
    the commit point of a save or a conversion. Fault points: ``before_rename``, and
    ``mid_replace`` when ``target`` is replaced."""
    fire = fault or (lambda point: None)
    moved_aside = None
    fire("before_rename")
    if target.exists() or target.is_symlink():
        moved_aside = target.parent / old_dir_name(target.name, staging.name.rsplit(TEMP_MARKER, 1)[1])
        os.rename(target, moved_aside)
        fsync_dir(target.parent)
        fire("mid_replace")
    try:
        os.rename(staging, target)
    except OSError as err:
        if moved_aside is not None:  # put the previous one back
            os.rename(moved_aside, target)
        raise named_os_error(err, target) from err
    fsync_dir(target.parent)
    if moved_aside is not None:
        shutil.rmtree(moved_aside, ignore_errors=True)
    return target


def publish(root: Path, tag: str, staging: Path, fault: Fault) -> Path:
    """Publish a save's staging directory as ``root/tag``, then point ``latest`` at it."""
    target = publish_dir(staging, root / tag, fault)
    fault("before_latest")
    try:
        replace_file_atomically(root / LATEST_FILE, tag + "\n")
    except OSError as err:
        reason = f"{target} is complete, but {root / LATEST_FILE} still names the previous checkpoint: {err.strerror}"
        raise OSError(err.errno, reason, err.filename) from err
    return target


def delete_tag(root: Path, tag: str) -> None:
    """Remove checkpoint ``root/tag``: renamed hidden first, so a crash mid-delete never
    leaves a partial tag that looks complete."""
    doomed = root / f".{tag}{DELETE_MARKER}{uuid.uuid4().hex[:12]}"
    if (root / check_tag(tag)).is_symlink():
        raise ValueError(f"{root / tag}: a symbolic link, not a checkpoint directory; not deleted")
    os.rename(root / tag, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed, ignore_errors=True)


_MAX_LATEST_BYTES = 4096  # a tag and a newline


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names, or None when there is no ``latest``. CheckpointDamagedError
    in one line when it is no regular file (a FIFO is never waited on) or holds no tag."""
    path = root / LATEST_FILE
    try:
        raw = read_small_file(path, _MAX_LATEST_BYTES)
    except FileNotFoundError:
        return None
    except ValueError as err:  # a FIFO, a directory, more than a tag
        raise CheckpointDamagedError(str(err)) from None
    try:
        return check_tag(raw.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        shown = raw[:64].decode("utf-8", "replace").strip()
        more = "..." if len(raw) > 64 else ""
        raise CheckpointDamagedError(f"{path}: holds {shown!r}{more}, not a checkpoint tag") from None


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the tag its ``latest`` file names.

    FileNotFoundError or ValueError in one line when there is none; CheckpointDamagedError
    (MissingFileError for a missing tag) when ``latest`` is damaged or names no checkpoint.
    """
    if (path / MANIFEST_FILE).is_file():
        return path
    if (path / LATEST_FILE).is_file():  # what latest names was committed: anything else is damage
        tag = read_latest(path)
        assert tag is not None
        if (path / tag).is_symlink():
            raise CheckpointDamagedError(
                f"{path / LATEST_FILE}: names tag {tag!r}, a symbolic link at {path / tag}; a tag must be a directory"
            )
        target = _existing_or_moved_aside(path / tag)
        if target is None:
            raise MissingFileError(f"{path / LATEST_FILE}: names tag {tag!r} but {path / tag} does not exist")
        if not (target / MANIFEST_FILE).is_file():
            raise CheckpointDamagedError(f"{path / LATEST_FILE}: names tag {tag!r} but {target} has no {MANIFEST_FILE}")
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
    """Tags of the complete checkpoints under ``root`` (directories, not symbolic links)."""
    return sorted(
        e.name
        for e in root.iterdir()
        if not e.name.startswith(".") and not e.is_symlink() and (e / MANIFEST_FILE).is_file()
    )


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
    """The JSON in ``path`` (a regular file, not a link). One-line errors: FileNotFoundError
    for a missing file; CheckpointDamagedError for a link or anything but a regular file, text
    that is not UTF-8 or not JSON, or JSON nested too deeply to parse safely."""
    try:
        fd = open_member(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing: not a complete {what}") from None
    except ValueError as err:  # a link, a FIFO: not the file that was written
        raise CheckpointDamagedError(str(err)) from None
    with open(fd, "rb") as handle:
        raw = handle.read()
    count_read(None, path.name, len(raw), opening=True)
    try:
        return jsonvalue.loads(raw, path)
    except json.JSONDecodeError as err:
        raise CheckpointDamagedError(f"{path}: corrupted: not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise CheckpointDamagedError(f"{path}: corrupted: not UTF-8 text") from None
    except ValueError as err:  # jsonvalue's own line: nested too deeply, an integer too long
        raise CheckpointDamagedError(str(err)) from None


def check_files_present(directory: Path, records: Mapping[str, FileRecord]) -> None:
    """Every file a manifest lists is a regular file in ``directory`` (see :mod:`..io.members`)
    with its recorded size (one lstat each)."""
    for name, record in records.items():
        size = member_path(directory, name).lstat().st_size
        if size != record.size:
            raise CheckpointDamagedError(f"{directory / name}: truncated or altered: {size} bytes, the manifest says {record.size}")
