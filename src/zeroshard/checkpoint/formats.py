"""Which kind of checkpoint a path holds, and :func:`open_source` for all of them.

Every format zeroshard reads (native, universal, DeepSpeed ZeRO-1/2) is a
:class:`SourceFormat`: a name, a cheap test on file names, an opener that returns a
:class:`~zeroshard.checkpoint.source.ShardSource`, and what a person calls it. This is the
one place a checkpoint's kind is recognised: the loaders, the converters and ``zeroshard
inspect`` all ask :func:`recognise` or :func:`open_source`. A format may also recognise a
kind it does not read (DeepSpeed's own universal format), so that opening it refuses it by
name with :class:`UnsupportedCheckpointError` instead of misreading it. The built-in ones are declared by name in
``zeroshard.CHECKPOINT_FORMATS`` and imported on first use, so this module never imports
the importers (which build on the checkpoint layer); :func:`register_format` adds others.

    from zeroshard.checkpoint import open_source, recognise
    recognise(path)            # the SourceFormat, or None: kind only, nothing opened
    with open_source(path) as source:   # checked and ready to read
        source.info.layout, source.read(rank, group, "fp32", 0, 100)
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .source import ShardSource

NATIVE = "native"  # what a path no format recognises is opened as: its reader says what is wrong


class UnsupportedCheckpointError(ValueError):
    """A checkpoint of a kind zeroshard recognises but does not read; its one line names
    the path, the kind, and what to use instead."""


@dataclass(frozen=True)
class SourceFormat:
    """A checkpoint format zeroshard reads."""

    kind: str  # "native", "universal", "deepspeed", ...
    recognise: Callable[[Path], bool]  # from file names alone; never raises
    open: Callable[[Path], ShardSource]  # checks what it opens; one-line errors
    description: str = ""  # what a person calls it: "DeepSpeed ZeRO stage 1/2 checkpoint"


_registered: list[SourceFormat] = []
_builtins_loaded = False
_lock = threading.Lock()


def register_format(source_format: SourceFormat) -> None:
    """Add a format, tried before the others; it replaces a format of the same kind."""
    _load_builtins()
    with _lock:
        _registered[:] = [source_format] + [f for f in _registered if f.kind != source_format.kind]


def unregister_format(kind: str) -> None:
    """Forget the format called ``kind`` (a built-in one too)."""
    _load_builtins()
    with _lock:
        _registered[:] = [f for f in _registered if f.kind != kind]


def registered_formats() -> tuple[SourceFormat, ...]:
    """Every known format, in the order they are tried."""
    _load_builtins()
    return tuple(_registered)


def recognise(path: str | os.PathLike[str]) -> SourceFormat | None:
    """The format of the checkpoint at ``path`` (a tag directory, or a root that names one),
    from file names alone; None when no format recognises it."""
    path = Path(path)
    return next((f for f in registered_formats() if f.recognise(path)), None)


def checkpoint_kind(path: str | os.PathLike[str]) -> str:
    """"native", "universal" or "deepspeed" (or a registered kind): how :func:`open_source`
    will open ``path``."""
    found = recognise(path)
    return found.kind if found is not None else NATIVE


def open_source(path: str | os.PathLike[str] | ShardSource) -> ShardSource:
    """The checkpoint at ``path`` as a ShardSource, whatever its kind; an opened source is
    returned as it is. A path no format recognises is opened as a native checkpoint, whose
    reader names what is missing (an unfinished save has no manifest yet)."""
    if not isinstance(path, (str, os.PathLike)):
        return path
    path = Path(path)
    found = recognise(path) or next((f for f in registered_formats() if f.kind == NATIVE), None)
    if found is None:
        raise ValueError(f"{path}: no registered checkpoint format recognises it")
    return found.open(path)


def _load_builtins() -> None:
    global _builtins_loaded
    with _lock:
        if _builtins_loaded:
            return
        from .. import CHECKPOINT_FORMATS

        for entry in CHECKPOINT_FORMATS:
            module, _, attribute = entry.partition(":")
            try:
                _registered.append(getattr(importlib.import_module(module), attribute))
            except ModuleNotFoundError as err:
                if err.name is None or not module.startswith(err.name):
                    raise  # the module is there but needs something missing: a real error
        _builtins_loaded = True
