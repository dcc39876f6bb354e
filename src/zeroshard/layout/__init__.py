"""Pure layout math: where every element of every parameter lives, and which rank owns it.

No torch, no process group, no allocation: parameter specs, a world size and a policy in,
a frozen, comparable, JSON-serialisable :class:`Layout` out. Each group is partitioned over
its own shard group (all ranks, or the ranks holding the same experts); :mod:`.experts`
holds the rank arithmetic of expert parallelism.

May import: nothing of zeroshard (it is the bottom layer every other builds on), and no torch.
"""

from .dtypes import canonical_dtype, itemsize
from .group import Bucket, Fragment, GroupLayout, LogicalPiece, LogicalRange, ParamSlot, Piece
from .layout import FORMAT_VERSION, Layout, PaddingStats, build_layout
from .policy import LayoutPolicy
from .owners import OwnerBalance, newton_schulz_cost
from .experts import ExpertMesh, contiguous_expert_map
from .coordinates import GlobalRun, global_shape, locate_global, rank_runs
from .specs import DENSE_SHARD_GROUP, EXPERT_SHARD_GROUP, GroupSpec, ParamSpec
from .stacks import LEGACY_STACK, UNDECLARED_STACK, ExpertStack, check_expert_map, expert_slots

__all__ = [
    "DENSE_SHARD_GROUP",
    "EXPERT_SHARD_GROUP",
    "FORMAT_VERSION",
    "Bucket",
    "ExpertMesh",
    "ExpertStack",
    "LEGACY_STACK",
    "UNDECLARED_STACK",
    "check_expert_map",
    "expert_slots",
    "Fragment",
    "GlobalRun",
    "GroupLayout",
    "GroupSpec",
    "Layout",
    "LayoutPolicy",
    "OwnerBalance",
    "newton_schulz_cost",
    "LogicalPiece",
    "LogicalRange",
    "PaddingStats",
    "ParamSlot",
    "ParamSpec",
    "Piece",
    "build_layout",
    "canonical_dtype",
    "contiguous_expert_map",
    "global_shape",
    "locate_global",
    "rank_runs",
    "itemsize",
]
