"""ShardSource: a saved ZeRO run seen through its layout, whatever wrote it.

Native zeroshard checkpoints and DeepSpeed ZeRO-1/2 checkpoints both present themselves
this way, so resharded loading, universal conversion and fp32 export are written once.
A source never holds a whole partition in memory: ``read`` returns one range. Tensors are
numpy arrays (see :mod:`.dtypes`): reading a checkpoint needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..layout import Layout, global_shape, locate_global
from ..state import ParamGroupState
from .format import state_name_problem

if TYPE_CHECKING:
    from .attest.digests import StateDigests


@dataclass(frozen=True)
class ModelEntry:
    """A module state_dict entry that is not a trainable parameter's master copy."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "buffer" or "frozen"


@dataclass
class SourceInfo:
    """What a source knows besides the partitioned tensors."""

    layout: Layout  # the layout the run was saved with
    optimizer_class: str  # "torch.optim.adamw.AdamW", ...
    param_groups: list[ParamGroupState]  # hyperparameters and the layout groups of each
    state_keys: list[list[str]]  # per layout group: partition-shaped optimizer states
    model_entries: list[ModelEntry]  # buffers and frozen parameters
    aliases: dict[str, str] = field(default_factory=dict)  # state_dict name -> trained param it ties to
    extra: dict[str, Any] = field(default_factory=dict)  # global_steps, loss scaler, lr scheduler
    # per layout group: the dtype a tensor kind ("fp32" or a state name) is stored in, where
    # it is not float32; a load gives it back in that dtype
    stored_dtypes: list[dict[str, str]] = field(default_factory=list)
    # the trained parameters' weights are their fp32 masters cast (no low-precision copy
    # is stored), so a run may load them in another dtype
    weights_from_masters: bool = False
    # the saved run's digests (native, universal); None for a source without them (DeepSpeed,
    # a version 1 native checkpoint): a load then digests what it reads instead
    digests: StateDigests | None = None

    def __post_init__(self) -> None:
        # Every source's backstop: read(..., "fp32", ...) must mean the master weights.
        for group, names in enumerate(self.state_keys):
            problem = next(filter(None, map(state_name_problem, names)), None)
            if problem:
                raise ValueError(f"layout group {group}: {problem}")

    def stored_dtype(self, group: int, key: str) -> str:
        """The dtype ``key`` ("fp32" or a state name) of layout group ``group`` is stored in."""
        return self.stored_dtypes[group].get(key, "float32") if group < len(self.stored_dtypes) else "float32"


class ShardSource(Protocol):
    """Read access to a saved run, range by range.

    :func:`~zeroshard.checkpoint.formats.open_source` opens any checkpoint zeroshard reads
    as one; :func:`~zeroshard.checkpoint.loader.load_state` loads any of them into a run.
    Optional besides: ``read_into`` (see :func:`read_into`) and ``prefetch(rank, group, key,
    start, end)``, a hint that the loader reads that range next (the native source's starts
    the reads, see :meth:`~zeroshard.checkpoint.native.source.NativeSource.prefetch`).
    """

    path: Path
    info: SourceInfo

    def read(self, rank: int, group: int, key: str, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of rank ``rank``'s partition of ``key`` in layout group
        ``group``, as fp32. ``key`` is "fp32" (the master weights) or an optimizer state
        name from ``info.state_keys[group]``. Padding reads as zeros. The array is the
        caller's to keep, and may be read-only (a view of a mapped file or a cached block)."""
        ...

    def scalars(self, group: int) -> dict[str, Any]:
        """Optimizer state of the group that is not partition-shaped (e.g. ``step``):
        numpy arrays or plain Python values."""
        ...

    def model_tensor(self, name: str) -> np.ndarray:
        """A buffer or frozen parameter, or a trained parameter's low-precision weight, in
        its own dtype and shape."""
        ...

    def close(self) -> None:
        """Release what the source holds open or cached."""
        ...


def param_group_owners(source: ShardSource) -> dict[int, int]:
    """Layout group -> the optimizer param group that holds it (layout groups in none are
    left out). ValueError naming the checkpoint when two param groups claim one layout group:
    whose hyperparameters it trains with would be a guess."""
    owner: dict[int, int] = {}
    for index, state in enumerate(source.info.param_groups):
        for group in state.layout_groups:
            if group in owner:
                raise ValueError(f"{source.path}: layout group {group} is in param groups {owner[group]} and {index}")
            owner[group] = index
    return owner


def in_place_target(into: np.ndarray | None, dtype: np.dtype | type, count: int) -> np.ndarray | None:
    """``into`` where a prefetch of ``count`` elements of ``dtype`` may land in it with no
    copy (that dtype, C-contiguous, writable, exactly ``count`` long); None otherwise, and
    the read then goes through a buffer of its own."""
    if into is None or into.dtype != dtype or into.size != count:
        return None
    return into if into.flags.c_contiguous and into.flags.writeable else None


def read_into(
    source: ShardSource, rank: int, group: int, key: str, start: int, out: np.ndarray, observe: Any = None
) -> bool:
    """Elements [start, start + out.size) of ``rank``'s partition of ``key`` in ``group``
    into the 1-D array ``out``, cast (exactly, if the checkpoint stores them narrower) to its
    dtype. A source with a ``read_into`` method of this signature fills ``out`` itself (the
    native one reads the file's bytes straight into it); others go through ``read``. A
    source that ``observes_reads`` also hands ``observe`` (a digester) the CRC of each
    segment of ``out``; returns whether it did."""
    fill = getattr(source, "read_into", None)
    if observe is not None and getattr(source, "observes_reads", False):
        fill(rank, group, key, start, out, observe)
        return True
    if fill is not None:
        fill(rank, group, key, start, out)
    else:
        out[...] = source.read(rank, group, key, start, start + out.size)
    return False


def read_model_tensors(
    source: ShardSource, names: list[str], digests: dict[str, tuple] | None = None
) -> dict[str, np.ndarray]:
    """``source.model_tensor`` of each name, the arrays the caller's. A source with a
    ``model_tensors`` method of this signature reads them together (the native one in a few
    large reads); others one by one. A source that ``digests_model_tensors`` also puts in
    ``digests`` each one's ``(address, nbytes, digest)``, from the CRCs its read computes."""
    read_all = getattr(source, "model_tensors", None)
    if digests is not None and getattr(source, "digests_model_tensors", False):
        return read_all(names, digests)
    if read_all is not None:
        return read_all(names)
    return {name: source.model_tensor(name) for name in names}


def read_model_configs(source: ShardSource) -> dict[str, str]:
    """The model's config files ``source`` recorded (``config.json``, ``generation_config.json``:
    name -> JSON text, checked as read), from a source with a ``model_configs()`` method of
    that signature; empty for one without (a DeepSpeed checkpoint, or a run of a model
    without a transformers-style config)."""
    read = getattr(source, "model_configs", None)
    return read() if read is not None else {}


def read_param(source: ShardSource, name: str, key: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Elements [start, end) of parameter ``name``'s global ``key`` tensor (an expert weight:
    every expert stacked by global id, see :mod:`zeroshard.layout.coordinates`), flattened,
    as fp32, assembled from the ranks that hold them (each piece read once)."""
    group, slot = source.info.layout.param(name)
    end = math.prod(global_shape(group, slot)) if end is None else end
    out = np.empty(end - start, dtype=np.float32)
    for run in locate_global(group, slot, start, end - start):
        begin = run.global_start - start
        out[begin : begin + run.length] = source.read(
            run.rank, group.index, key, run.partition_start, run.partition_start + run.length
        )
    return out


def read_whole_param(source: ShardSource, name: str, key: str) -> np.ndarray:
    """:func:`read_param` of a whole parameter, without its copy when one rank holds all of it."""
    group, slot = source.info.layout.param(name)
    pieces = () if group.is_expert_group else group.pieces(slot.index)
    if len(pieces) == 1:
        start = pieces[0].partition_start
        return source.read(pieces[0].rank, group.index, key, start, start + slot.numel)
    return read_param(source, name, key)
