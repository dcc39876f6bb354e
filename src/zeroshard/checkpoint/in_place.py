"""A conversion's output published into a mount point, where no directory can be renamed over it.

The atomic-directory protocol (:mod:`.directory`) stages ``OUT`` next to it and renames the
staging directory over it. An ``OUT`` that is a mount point (a volume mounted for the
output) can be neither moved aside nor replaced, and a staging directory next to it lies on
the parent's file system: the whole output would be written there, filling the wrong disk,
only to fail at the rename. So an empty ``OUT`` that is a mount point is staged inside
itself, in ``OUT/.<name>.tmp-<id>`` on its own file system, and published entry by entry:
every file but the output kind's markers, then the markers, each a rename within one file
system, ``OUT`` fsynced after each batch. Until a marker is in, ``OUT`` does not look
complete. A failure removes what it moved in and the staging directory; the next
conversion to ``OUT``, holding its lock, removes what a crash left (``OUT`` was empty when
the dead one began, so whatever it holds then came from it). A complete output in a mount
point cannot be replaced atomically: that is refused, before anything is written.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Sequence

from .format import temp_dir_name
from .directory import Fault, fsync_dir

_UNIQUE = "[0-9a-f]{12}"  # as directory.new_staging names them


def stages_in_place(out_dir: Path) -> bool:
    """Whether ``out_dir`` is an existing directory that is a mount point: staged inside
    itself, since no directory can be renamed over it."""
    return out_dir.is_dir() and not out_dir.is_symlink() and os.path.ismount(out_dir)


def check_empty_mount_point(out_dir: Path, what: str) -> None:
    """FileExistsError when the mount point ``out_dir`` holds anything: replacing an output
    there would not be atomic (``what``: the kind of output, for the message)."""
    if any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir}: a mount point holding a {what}; it cannot be replaced there atomically: "
            "empty it first, or write to a directory inside it"
        )


def publish_in_place(staging: Path, out_dir: Path, markers: Sequence[str], fault: Fault | None = None) -> Path:
    """Move every entry of ``staging`` (inside ``out_dir``) into ``out_dir``, the ``markers``
    last, then remove ``staging``. ``out_dir`` must hold nothing else (FileExistsError,
    nothing moved). Fault points: ``before_rename``, ``mid_publish`` (all but the markers moved)."""
    fire = fault or (lambda point: None)
    strays = sorted(entry.name for entry in out_dir.iterdir() if entry.name != staging.name)
    if strays:
        raise FileExistsError(f"{out_dir}: {strays[0]!r} appeared there while the output was written; not published")
    names = sorted(os.listdir(staging))
    batches = ([name for name in names if name not in markers], [name for name in names if name in markers])
    moved: list[str] = []
    fire("before_rename")
    try:
        for batch, point in zip(batches, ("mid_publish", None)):
            for name in batch:
                os.rename(staging / name, out_dir / name)
                moved.append(name)
            fsync_dir(out_dir)
            if point:
                fire(point)
    except BaseException:
        for name in moved:
            (out_dir / name).unlink(missing_ok=True)
        raise
    os.rmdir(staging)
    fsync_dir(out_dir)
    return out_dir


def recover_in_place(out_dir: Path, file_names: str, markers: Sequence[str]) -> None:
    """Remove what a conversion that died publishing into the mount point ``out_dir`` left:
    its staging directories, and (no marker having been moved in) the files of the output
    kind (``file_names``: a regular expression they match whole) it had moved in. Call it
    holding ``out_dir``'s writer lock, so that no live conversion's staging is touched."""
    if not stages_in_place(out_dir):
        return
    pattern = re.escape(temp_dir_name(out_dir.name, "")) + _UNIQUE
    leftovers = [entry for entry in out_dir.iterdir() if re.fullmatch(pattern, entry.name) and not entry.is_symlink()]
    if not leftovers:
        return
    for entry in leftovers:
        shutil.rmtree(entry, ignore_errors=True)
    names = os.listdir(out_dir)
    if not set(markers) & set(names):
        for name in names:
            path = out_dir / name
            if re.fullmatch(file_names, name) and path.is_file() and not path.is_symlink():
                path.unlink()
    fsync_dir(out_dir)
