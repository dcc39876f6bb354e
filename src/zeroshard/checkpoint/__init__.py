"""Sharded checkpoints: a directory of safetensors files and a JSON manifest, no pickle.

* :func:`save_sharded`: collective save of each rank's :class:`ShardedState`, atomic commit;
* :func:`load_sharded`: one rank's state for any new layout (world size, policy, buckets),
  reading only the byte ranges it needs;
* :func:`open_checkpoint`, :func:`verify_checkpoint`: inspection and full verification.

docs/FORMAT.md describes the format.
"""

from ..state import ParamGroupState, ShardedState
from .checksum import FileRecord
from .coordinator import (
    Coordinator,
    RankFailedError,
    SingleProcessCoordinator,
    ThreadCoordinator,
    TorchDistributedCoordinator,
    default_coordinator,
    run_ranks,
)
from .directory import list_tags, resolve_checkpoint
from .format import DEFAULT_BLOCK_SIZE, FORMAT_NAME, FORMAT_VERSION, rank_file_name
from .load import Checkpoint, load_sharded, open_checkpoint
from .manifest import GroupRecord, Manifest, ModelTensorRecord
from .reshard import Copy, GroupPlan, plan_reads
from .safetensors_io import ReadStats
from .save import FAULT_POINTS, FaultHook, save_sharded
from .verify import verify_checkpoint

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
