"""Conversion outputs appear whole or not at all, and replace only a conversion's own output.

A converter writes into a staging directory next to ``OUT`` and publishes it as ``OUT`` by
the same atomic-directory protocol as a save (:mod:`.directory`): a crash leaves either the
previous ``OUT`` or the new one, and the next write to ``OUT`` recovers what a crash left. A
failure removes the staging directory, so nothing under ``OUT`` ever looks complete unless
it is. An empty ``OUT`` that is a mount point is staged inside itself, on its own file
system, and published file by file (:mod:`.in_place`). A conversion holds ``.OUT.lock``
(next to ``OUT``) throughout, so a second one into the same ``OUT`` fails at once with a
WriterLockedError naming the first, instead of deleting its staging directory.

What is replaced: ``OUT`` is never the input, inside it or around it (a checkpoint tag holds
``model.safetensors`` too), and an existing non-empty ``OUT`` is replaced only when asked and
only when it is provably an output of the same kind (:class:`OutputKind`): nothing but the
file names that kind writes, the safetensors files carrying its metadata, and files its
record lists with the CRC-32 they were written with (an fp32 export's ``config.json``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from ..io.checksum import crc32
from .directory import Fault, fsync_dir, new_staging, publish_dir, read_json_file, recover_target
from .in_place import check_empty_mount_point, publish_in_place, recover_in_place, stages_in_place
from ..io.members import open_member
from ..io.safetensors_io import read_metadata
from ..io.writer_lock import WriterLock


@dataclass(frozen=True)
class OutputKind:
    """What one converter writes, so that an existing output of it can be told from anything else."""

    what: str  # "universal checkpoint"
    file_names: str  # a regular expression every file of such an output matches whole
    markers: tuple[str, ...]  # an output holding one of these is complete
    metadata: Mapping[str, str] = field(default_factory=dict)  # in the metadata of each of its .safetensors files
    # a JSON file of the output (of a name above) whose "files" object lists other files it
    # wrote, each with the CRC-32 of its bytes, and a regular expression of the names it may
    # list: only those files, unchanged, are its own too
    record: str | None = None
    recorded_names: str = ""

    def foreign(self, directory: Path) -> str | None:
        """Why the non-empty ``directory`` is not a complete output of this kind, or None."""
        names = []
        listed: dict[str, int] | None = None
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                return f"it holds {entry.name!r}, which is not a regular file"
            if re.fullmatch(self.file_names, entry.name):
                names.append(entry.name)
                continue
            listed = self._listed(directory) if listed is None else listed
            if entry.name not in listed:
                return f"it holds {entry.name!r}, {self._not_ours(directory, entry.name)}"
            if _crc_of(directory / entry.name) != listed[entry.name]:
                return f"{entry.name} is not the file zeroshard wrote there: it changed since"
        if not set(self.markers) & set(names):
            return f"it has no {' or '.join(self.markers)}"
        for name in names:
            if name.endswith(".safetensors") and not self._carries_metadata(directory / name):
                return f"{name} was not written as a {self.what} by zeroshard"
        return None

    def _not_ours(self, directory: Path, name: str) -> str:
        if self.record and re.fullmatch(self.recorded_names, name) and (directory / self.record).is_file():
            return f"which its {self.record} does not list: zeroshard did not write it"
        return f"which a {self.what} does not"

    def _listed(self, directory: Path) -> dict[str, int]:
        """The files the output's record lists as its own, with their CRC-32 (none without one)."""
        if self.record is None or not (directory / self.record).is_file():
            return {}
        try:
            record = read_json_file(directory / self.record, self.what)
        except (OSError, ValueError):
            return {}
        files = record.get("files") if isinstance(record, dict) else None
        if not isinstance(files, dict):
            return {}
        return {
            name: crc for name, crc in files.items() if type(crc) is int and re.fullmatch(self.recorded_names, name)
        }

    def _carries_metadata(self, path: Path) -> bool:
        try:
            metadata = read_metadata(path)
        except ValueError:
            return False
        return all(metadata.get(key) == value for key, value in self.metadata.items())


def _crc_of(path: Path) -> int:
    """The CRC-32 of the regular file ``path``'s bytes (never a link), read in 1 MiB chunks."""
    crc = 0
    with open(open_member(path), "rb", buffering=0) as handle:
        while chunk := handle.read(1 << 20):
            crc = crc32(chunk, crc)
    return crc


@contextmanager
def staged_output(
    out_dir: str | os.PathLike[str],
    *,
    kind: OutputKind,
    overwrite: bool,
    inputs: Sequence[str | os.PathLike[str]] = (),
    fault: Fault | None = None,
) -> Iterator[Path]:
    """Yield an empty staging directory; on a normal exit it becomes ``out_dir``.

    ``inputs`` are the paths the conversion reads: ``out_dir`` may be none of them, nor lie
    inside one or hold one (ValueError). An existing ``out_dir`` must be empty, or (with
    ``overwrite``) a complete output of ``kind`` (FileExistsError otherwise); checked before
    any work starts and again at the end. ``fault`` is called at the publish's fault points
    (tests simulate crashes there).
    """
    out_dir = output_path(out_dir)
    check_apart(out_dir, inputs)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir, kind.what) as lock:
        if lock.held:  # else another writer may be live: leave every leftover alone
            recover_target(out_dir)  # first, so an output a crash moved aside counts as existing
            recover_in_place(out_dir, kind.file_names, kind.markers)
        check_destination(out_dir, kind, overwrite)
        in_place = stages_in_place(out_dir)  # a mount point: staged on its own file system
        if in_place:
            check_empty_mount_point(out_dir, kind.what)
        staging = new_staging(out_dir, out_dir if in_place else None)
        try:
            yield staging
            fsync_dir(staging)
            if in_place:
                publish_in_place(staging, out_dir, kind.markers, fault)
            else:
                check_destination(out_dir, kind, overwrite)
                publish_dir(staging, out_dir, fault)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def output_path(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir`` as a path with a name of its own: ``.``, ``..`` and ``a/..`` resolved to
    the directory they mean (its lock and staging directory sit next to it, by name)."""
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        out = real_path(out)
        if not out.name:
            raise ValueError(f"{out_dir}: the root directory cannot be an output directory")
    return out


def check_apart(out_dir: Path, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """ValueError when ``out_dir`` is one of ``inputs``, lies inside one or holds one
    (links resolved): replacing it would delete what is being converted."""
    out_real = real_path(out_dir)
    resolved = [(given, real_path(Path(given))) for given in inputs]
    for relation, overlaps in (
        ("is the input", lambda real: out_real == real),
        ("lies inside the input", out_real.is_relative_to),
        ("holds the input", lambda real: real.is_relative_to(out_real)),
    ):
        for given, real in resolved:
            if overlaps(real):
                raise ValueError(f"{out_dir}: the output directory {relation} {given}; write the output somewhere else")


def real_path(path: Path) -> Path:
    """``path`` absolute, with every link resolved as far as it exists; OSError (ELOOP)
    naming ``path`` when its links loop (Path.resolve raises RuntimeError for that before
    Python 3.13, and returns the path unresolved after)."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except OSError as err:
        if err.errno == errno.ELOOP:
            where = "" if os.path.abspath(err.filename) == os.path.abspath(path) else f" (at {err.filename})"
            raise OSError(errno.ELOOP, f"{err.strerror}{where}", str(path)) from None
    return Path(os.path.realpath(path))  # a part is missing: past it, nothing is a link


def output_lock(out_dir: Path, what: str) -> WriterLock:
    """The writer lock of ``out_dir``: ``.<name>.lock`` next to it, present only while held."""
    return WriterLock(out_dir.with_name(f".{out_dir.name}.lock"), f"writing a {what} to {out_dir}")


def check_destination(out_dir: Path, kind: OutputKind, overwrite: bool) -> None:
    """FileExistsError unless ``out_dir`` is absent, empty, or (with ``overwrite``) a
    complete output of ``kind``."""
    if out_dir.is_symlink():
        raise FileExistsError(f"{out_dir}: a symbolic link; give the output directory itself")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    foreign = kind.foreign(out_dir)
    if foreign is not None:
        raise FileExistsError(
            f"{out_dir}: exists, is not empty and is not a {kind.what} ({foreign}); refusing to write there"
        )
    if not overwrite:
        raise FileExistsError(
            f"{out_dir}: already holds a complete {kind.what}; pass --overwrite (overwrite=True) to replace it"
        )
