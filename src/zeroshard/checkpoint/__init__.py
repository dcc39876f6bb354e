"""Sharded checkpoints: a directory of safetensors files and a JSON manifest, no pickle.

* :class:`Checkpointer`: periodic (asynchronous) saves, retention, resume from ``latest``;
* :func:`save_sharded`: collective save of each rank's :class:`ShardedState`, atomic commit;
* :func:`load_sharded`: one rank's state for any new layout (world size, policy, buckets),
  reading only the byte ranges it needs;
* :func:`open_source`: any checkpoint zeroshard reads (native, universal, DeepSpeed) as a
  ShardSource, its kind recognised by :func:`recognise` from the registered formats;
  :func:`load_state` loads one rank's state from any of them;
* :func:`open_checkpoint`, :func:`verify_checkpoint`: inspection and full verification;
* every load attests (:mod:`.attest`): :class:`AttestationError` when the ranks would not
  hold what was saved; :class:`CheckpointDamagedError` for damage of any kind;
* :class:`WriterLockedError`: another process is saving into the same root.

docs/FORMAT.md describes the format.

Owns every checkpoint kind as a ShardSource (:mod:`.source`), the formats registry
(:mod:`.formats`), the one loader (:mod:`.loader`), the Checkpointer (its writer thread:
:mod:`.async_save`) and its resume and retention, the atomic-directory protocol of
checkpoint roots and conversion outputs (:mod:`.directory`, :mod:`.output_dir`,
:mod:`.in_place`), verification, and the sub-packages :mod:`.attest` (digests and every
load's attestation), :mod:`.native`, :mod:`.universal` and :mod:`.export`, in that order
from the bottom (``native`` and ``universal`` import not each other).

May import: the engine (through its public methods), ``zeroshard.state``, ``io``,
``layout`` and the package face (the version, the formats table); not the readers built on
it (``zeroshard.deepspeed.checkpoint``), which ``zeroshard.CHECKPOINT_FORMATS`` names for
:mod:`.formats` to import on first use.
"""

from __future__ import annotations

from ..lazy_exports import lazy_exports

# Imported on first use (PEP 562), so that reading and converting checkpoints, which needs
# no torch, does not pay for importing it through this package.
_EXPORTS = {
    "ParamGroupState": "..state",
    "ShardedState": "..state",
    "FileRecord": "..io.checksum",
    "Attestation": ".attest.attestation",
    "AttestationError": ".attest.attestation",
    "UnattestedCheckpointWarning": ".attest.attestation",
    "CheckpointDamagedError": "..io.damage",
    "StateDigests": ".attest.digests",
    "Checkpointer": ".checkpointer",
    "CheckpointSaveError": ".checkpointer",
    "SaveStats": ".checkpointer",
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
    "SourceFormat": ".formats",
    "UnsupportedCheckpointError": ".formats",
    "checkpoint_kind": ".formats",
    "registered_formats": ".formats",
    "open_source": ".formats",
    "recognise": ".formats",
    "register_format": ".formats",
    "unregister_format": ".formats",
    "load_state": ".loader",
    "ShardSource": ".source",
    "SourceInfo": ".source",
    "Checkpoint": ".native.handle",
    "open_checkpoint": ".native.handle",
    "load_sharded": ".native.load",
    "GroupRecord": ".native.manifest",
    "Manifest": ".native.manifest",
    "ModelTensorRecord": ".native.manifest",
    "Copy": ".reshard",
    "GroupPlan": ".reshard",
    "plan_reads": ".reshard",
    "ReadStats": "..io.read_stats",
    "FAULT_POINTS": ".native.save",
    "FaultHook": ".native.save",
    "save_sharded": ".native.save",
    "verify_checkpoint": ".verify",
    "WriterLock": "..io.writer_lock",
    "WriterLockedError": "..io.writer_lock",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FAULT_POINTS",
    "Attestation",
    "AttestationError",
    "CheckpointDamagedError",
    "StateDigests",
    "UnattestedCheckpointWarning",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointSaveError",
    "Checkpointer",
    "Coordinator",
    "Copy",
    "FaultHook",
    "FileRecord",
    "GroupPlan",
    "GroupRecord",
    "Manifest",
    "RankFailedError",
    "SaveStats",
    "ModelTensorRecord",
    "ParamGroupState",
    "ReadStats",
    "ShardedState",
    "ShardSource",
    "SingleProcessCoordinator",
    "SourceFormat",
    "SourceInfo",
    "ThreadCoordinator",
    "TorchDistributedCoordinator",
    "UnsupportedCheckpointError",
    "WriterLock",
    "WriterLockedError",
    "checkpoint_kind",
    "default_coordinator",
    "list_tags",
    "load_sharded",
    "load_state",
    "open_checkpoint",
    "open_source",
    "plan_reads",
    "rank_file_name",
    "recognise",
    "register_format",
    "registered_formats",
    "resolve_checkpoint",
    "run_ranks",
    "save_sharded",
    "unregister_format",
    "verify_checkpoint",
]
