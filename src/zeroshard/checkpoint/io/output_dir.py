"""Conversion outputs appear whole or not at all.

A converter writes into a staging directory next to ``OUT`` and publishes it as ``OUT`` by
the same atomic-directory protocol as a save (:mod:`.directory`): a crash leaves either the
previous ``OUT`` or the new one, and the next write to ``OUT`` recovers what a crash left. A
failure removes the staging directory, so nothing under ``OUT`` ever looks complete unless
it is. A conversion holds ``.OUT.lock`` (next to ``OUT``) throughout, so a second one into the
same ``OUT`` fails at once with a WriterLockedError naming the first, instead of deleting its
staging directory. An existing complete output is replaced only when asked; a non-empty directory that
is not one is never touched.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from .directory import Fault, fsync_dir, new_staging, publish_dir, recover_target
from .writer_lock import WriterLock


@contextmanager
def staged_output(
    out_dir: str | os.PathLike[str],
    *,
    markers: Sequence[str],
    overwrite: bool,
    what: str,
    fault: Fault | None = None,
) -> Iterator[Path]:
    """Yield an empty staging directory; on a normal exit it becomes ``out_dir``.

    ``markers`` are the file names whose presence makes a directory a complete ``what``
    (e.g. "universal checkpoint"). Checked before any work starts and again at the end.
    ``fault`` is called at the publish's fault points (tests simulate crashes there).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir, what) as lock:
        if lock.held:  # else another writer may be live: leave every leftover alone
            recover_target(out_dir)  # first, so an output a crash moved aside counts as existing
        check_destination(out_dir, markers, overwrite, what)
        staging = new_staging(out_dir)
        try:
            yield staging
            fsync_dir(staging)
            check_destination(out_dir, markers, overwrite, what)
            publish_dir(staging, out_dir, fault)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def output_lock(out_dir: Path, what: str) -> WriterLock:
    """The writer lock of ``out_dir``: ``.<name>.lock`` next to it, present only while held."""
    return WriterLock(out_dir.with_name(f".{out_dir.name}.lock"), f"writing a {what} to {out_dir}")


def check_destination(out_dir: Path, markers: Sequence[str], overwrite: bool, what: str) -> None:
    """FileExistsError unless ``out_dir`` is absent, empty, or (with ``overwrite``) a complete ``what``."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if _is_complete(out_dir, markers):
        if overwrite:
            return
        raise FileExistsError(f"{out_dir}: already holds a complete {what}; pass --overwrite (overwrite=True) to replace it")
    raise FileExistsError(f"{out_dir}: exists, is not empty and is not a {what}; refusing to write there")


def _is_complete(directory: Path, markers: Sequence[str]) -> bool:
    return any((directory / marker).is_file() for marker in markers)
