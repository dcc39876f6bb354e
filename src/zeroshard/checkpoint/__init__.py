"""Sharded checkpoints: a directory of safetensors files and a JSON manifest, no pickle.

* :func:`save_sharded`: collective save of each rank's :class:`ShardedState`, atomic commit;
* :func:`load_sharded`: one rank's state for any new layout (world size, policy, buckets),
  reading only the byte ranges it needs;
* :func:`open_checkpoint`, :func:`verify_checkpoint`: inspection and full verification;
* :class:`WriterLockedError`: another process is saving into the same root.

docs/FORMAT.md describes the format.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562), so that reading and converting checkpoints, which needs
# no torch, does not pay for importing it through this package.
_EXPORTS = {
    "ParamGroupState": "..state",
    "ShardedState": "..state",
    "FileRecord": ".checksum",
    "Coordinator": ".coordinator",
    "RankFailedError": ".coordinator",
    "SingleProcessCoordinator": ".coordinator",
    "ThreadCoordinator": ".coordinator",
    "TorchDistributedCoordinator": ".coordinator",
    "default_coordinator": ".coordinator",
    "run_ranks": ".coordinator",
    "list_tags": ".directory",
    "resolve_checkpoint": ".directory",
    "DEFAULT_BLOCK_SIZE": ".format",
    "FORMAT_NAME": ".format",
    "FORMAT_VERSION": ".format",
    "rank_file_name": ".format",
    "Checkpoint": ".handle",
    "open_checkpoint": ".handle",
    "load_sharded": ".load",
    "GroupRecord": ".manifest",
    "Manifest": ".manifest",
    "ModelTensorRecord": ".manifest",
    "Copy": ".reshard",
    "GroupPlan": ".reshard",
    "plan_reads": ".reshard",
    "ReadStats": ".safetensors_io",
    "FAULT_POINTS": ".save",
    "FaultHook": ".save",
    "save_sharded": ".save",
    "verify_checkpoint": ".verify",
    "WriterLock": ".writer_lock",
    "WriterLockedError": ".writer_lock",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FAULT_POINTS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Checkpoint",
    "Coordinator",
    "Copy",
    "FaultHook",
    "FileRecord",
    "GroupPlan",
    "GroupRecord",
    "Manifest",
    "RankFailedError",
    "ModelTensorRecord",
    "ParamGroupState",
    "ReadStats",
    "ShardedState",
    "SingleProcessCoordinator",
    "ThreadCoordinator",
    "TorchDistributedCoordinator",
    "WriterLock",
    "WriterLockedError",
    "default_coordinator",
    "list_tags",
    "load_sharded",
    "open_checkpoint",
    "plan_reads",
    "rank_file_name",
    "resolve_checkpoint",
    "run_ranks",
    "save_sharded",
    "verify_checkpoint",
]
