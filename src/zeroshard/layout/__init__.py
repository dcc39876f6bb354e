"""Pure layout math: where every element of every parameter lives, and which rank owns it.

No torch, no process group, no allocation: parameter specs, a world size and a policy in,
a frozen, comparable, JSON-serialisable :class:`Layout` out.
"""

from .dtypes import canonical_dtype, itemsize
from .group import Bucket, Fragment, GroupLayout, LogicalPiece, LogicalRange, ParamSlot, Piece
from .layout import FORMAT_VERSION, Layout, PaddingStats, build_layout
from .policy import LayoutPolicy
from .specs import ParamSpec

__all__ = [
    "FORMAT_VERSION",
    "Bucket",
    "Fragment",
    "GroupLayout",
    "Layout",
    "LayoutPolicy",
    "LogicalPiece",
    "LogicalRange",
    "PaddingStats",
    "ParamSlot",
    "ParamSpec",
    "Piece",
    "build_layout",
    "canonical_dtype",
    "itemsize",
]
