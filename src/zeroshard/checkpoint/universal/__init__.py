"""Universal checkpoints: every parameter's fp32 master and optimizer state in its own shape,
no padding, no ranks; any world size, policy or bucket size loads one by range reads.

* :func:`to_universal` converts any saved run (native, DeepSpeed: any ShardSource), streaming;
* :func:`open_universal` / :class:`UniversalCheckpoint` read it range by range;
* :class:`UniversalSource` presents it as a ShardSource (a world of one), so the one
  loader and the fp32 export read it like any other checkpoint;
* :func:`load_universal` gives one rank's ShardedState for a new layout;
  :func:`load_from_source` does the same from any opened ShardSource.

docs/FORMAT.md describes the format.

May import: the checkpoint layer's hub (source, formats, loader, directory, ...) and
:mod:`..attest`, ``zeroshard.io``, ``layout`` and ``state``; not :mod:`..native` nor
:mod:`..export`.
"""

from __future__ import annotations

from ...lazy_exports import lazy_exports

# Imported on first use (PEP 562), like zeroshard.checkpoint's own exports: the converters
# import .format, .read and .write without paying for the loader.
_EXPORTS = {
    "FORMAT_NAME": ".format",
    "FORMAT_VERSION": ".format",
    "MANIFEST_FILE": ".format",
    "UniversalManifest": ".format",
    "is_universal_checkpoint": ".format",
    "load_from_source": ".load",
    "load_universal": ".load",
    "UniversalCheckpoint": ".read",
    "open_universal": ".read",
    "UniversalSource": ".source",
    "to_universal": ".write",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
