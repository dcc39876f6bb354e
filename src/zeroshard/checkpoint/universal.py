"""Universal checkpoints: every parameter's fp32 master and optimizer state in its own shape,
no padding, no ranks; any world size, policy or bucket size loads one by range reads.

* :func:`to_universal` converts any saved run (native, DeepSpeed: any ShardSource), streaming;
* :func:`open_universal` / :class:`UniversalCheckpoint` read it range by range;
* :class:`UniversalSource` presents it as a ShardSource (a world of one), so the one
  loader and the fp32 export read it like any other checkpoint;
* :func:`load_universal` gives one rank's ShardedState for a new layout;
  :func:`load_from_source` does the same from any opened ShardSource.

docs/FORMAT.md describes the format.
"""

from .universal_format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, UniversalManifest, is_universal_checkpoint
from .universal_load import load_from_source, load_universal
from .universal_read import UniversalCheckpoint, open_universal
from .universal_source import UniversalSource
from .universal_write import to_universal

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "UniversalCheckpoint",
    "UniversalManifest",
    "UniversalSource",
    "is_universal_checkpoint",
    "load_from_source",
    "load_universal",
    "open_universal",
    "to_universal",
]
