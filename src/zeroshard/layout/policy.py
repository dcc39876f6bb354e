"""Layout policies: where padding goes in a flat buffer.

A policy answers three questions for a group of one dtype:

* how many elements a parameter start is aligned to (padding goes after each parameter);
* whether the last parameter of a bucket is padded too;
* how many elements each partition start is aligned to (the bucket's tail is padded to a
  multiple of ``world_size`` times that).

``native`` (the default) aligns every parameter start and every partition start to
``alignment_bytes`` (16 by default). ``native`` with ``compact=True`` keeps the 16-byte
partition starts but packs parameters back to back, as older checkpoints did.
``deepspeed`` reproduces DeepSpeed 0.19's ZeRO stage 1/2 buffers: partitions aligned to
2 elements, and with its ``parameter_alignment`` option a 16-byte aligned start for every
parameter but the padding after the last one dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .dtypes import itemsize

PolicyKind = Literal["native", "deepspeed"]

_DEEPSPEED_PARTITION_ALIGNMENT = 2  # elements: DeepSpeed's 4-byte NCCL start alignment in fp16
_DEEPSPEED_PARAMETER_ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class LayoutPolicy:
    """How a group's flat buffer is padded and cut into buckets. ValueError at construction
    for an unknown kind, a non-positive ``alignment_bytes`` or ``bucket_numel``, or
    ``bucket_numel`` with the deepspeed kind.

    Attributes:
        kind: "native" or "deepspeed".
        alignment_bytes: native only; parameter and partition starts are multiples of this.
        compact: native only; no padding between parameters (legacy checkpoints).
        parameter_alignment: deepspeed only; DeepSpeed's ``parameter_alignment`` option.
        bucket_numel: split each group into buckets of about this many elements, each
            partitioned across all ranks on its own; None keeps one bucket per group.
    """

    kind: PolicyKind = "native"
    alignment_bytes: int = 16
    compact: bool = False
    parameter_alignment: bool = False
    bucket_numel: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("native", "deepspeed"):
            raise ValueError(f"unknown layout policy kind {self.kind!r}")
        if not _is_int(self.alignment_bytes) or self.alignment_bytes < 1:
            raise ValueError(f"alignment_bytes must be a positive integer, got {self.alignment_bytes!r}")
        if self.bucket_numel is not None and (not _is_int(self.bucket_numel) or self.bucket_numel < 1):
            raise ValueError(f"bucket_numel must be a positive integer or None, got {self.bucket_numel!r}")
        for flag in ("compact", "parameter_alignment"):
            if type(getattr(self, flag)) is not bool:
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.kind == "deepspeed" and self.bucket_numel is not None:
            raise ValueError("the deepspeed policy has one partitioned bucket per group; bucket_numel must be None")

    @classmethod
    def native(cls, alignment_bytes: int = 16, *, compact: bool = False, bucket_numel: int | None = None) -> LayoutPolicy:
        """zeroshard's own policy: every parameter start (unless ``compact``) and every
        partition start on ``alignment_bytes``; buckets of ~``bucket_numel`` elements."""
        return cls("native", alignment_bytes=alignment_bytes, compact=compact, bucket_numel=bucket_numel)

    @classmethod
    def deepspeed(cls, *, parameter_alignment: bool = False) -> LayoutPolicy:
        """DeepSpeed 0.19's ZeRO stage 1/2 buffers (with its ``parameter_alignment`` option)."""
        return cls("deepspeed", parameter_alignment=parameter_alignment)

    def param_alignment(self, dtype: str) -> int:
        """Elements a parameter start is aligned to (1 means no padding between parameters)."""
        if self.kind == "deepspeed":
            return _DEEPSPEED_PARAMETER_ALIGNMENT_BYTES // itemsize(dtype) if self.parameter_alignment else 1
        return 1 if self.compact else self.alignment_bytes // itemsize(dtype)

    def pads_last_param(self) -> bool:
        """Whether the padding after a bucket's last parameter belongs to the bucket's content.

        Native layouts keep it, so every bucket's content ends aligned and parameter offsets
        stay independent of the world size. DeepSpeed drops it.
        """
        return self.kind == "native"

    def partition_alignment(self, dtype: str) -> int:
        """Elements each partition start is aligned to."""
        if self.kind == "deepspeed":
            return _DEEPSPEED_PARTITION_ALIGNMENT
        return self.alignment_bytes // itemsize(dtype)

    def check_dtype(self, dtype: str) -> str | None:
        """A description of why ``dtype`` cannot be laid out under this policy, or None."""
        if self.kind == "native" and self.alignment_bytes % itemsize(dtype):
            return (
                f"alignment of {self.alignment_bytes} bytes is not a multiple of the "
                f"{itemsize(dtype)}-byte element size of {dtype}"
            )
        return None

    def describe(self) -> str:
        """One line for reports: "native, 16-byte alignment", "deepspeed with parameter_alignment", ..."""
        if self.kind == "deepspeed":
            return "deepspeed" + (" with parameter_alignment" if self.parameter_alignment else "")
        kind = "compact" if self.compact else "native"
        buckets = f", buckets of ~{self.bucket_numel:,} elements" if self.bucket_numel else ""
        return f"{kind}, {self.alignment_bytes}-byte alignment{buckets}"

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutPolicy:
        """From :meth:`to_dict` output.

        Raises:
            TypeError: an unknown field. ValueError: a bad value (as the constructor).
        """
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
