"""Save and load a training run: the engine's exported state through the checkpoint format.

These functions use only the engine's public surface (``export_state``, ``import_state``,
``layout``, ``rank``, ``model``, ``comm``), so the on-disk format knows nothing of engine
internals. Both are collective: every rank calls them, and every rank succeeds or raises
together. A load validates everything on every rank before any rank changes anything, and
attests (:mod:`.attest`): the ranks' loaded state, digested, must be what the checkpoint
saved, or no rank loads it.

A load reads each byte it needs once over the job: every rank its own partitions, the
engine rebuilds the weights from them (cast and all-gathered, each group's while the rest is
read: :class:`_WeightsGather`), and each buffer and frozen parameter is read by one rank and
broadcast once the ranks agreed (:mod:`.shared_module`).
Alone (D = 1), a load without optimizer state reads the saved low-precision weights instead
of the fp32 masters: half the bytes for bf16 weights, the same values (the masters are the
weights cast, as the engine rebuilds them).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..io.dtypes import to_numpy, to_torch, torch_dtype
from ..io.host_memory import wait_released
from ..io.read_stats import ReadStats
from ..state import ShardedState
from .coordinator import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from .attest.attestation import Attestation, Evidence
from .formats import checkpoint_kind, open_source  # noqa: F401  (checkpoint_kind: re-exported)
from .attest.attested import attested_load
from .loader import load_state
from .native.save import FaultHook, save_sharded
from .shared_module import ModuleShare, broadcast_module, share_checkpoint
from .source import ShardSource

if TYPE_CHECKING:
    from ..engine import ZeroOptimizer

LR_SCHEDULER_KEY = "lr_scheduler"


def save_checkpoint(
    engine: ZeroOptimizer,
    root: str | os.PathLike[str],
    tag: str | None = None,
    *,
    lr_scheduler: Any = None,
    fault: FaultHook | None = None,
) -> Path:
    """Collective over the engine's ranks: save the run as ``<root>/<tag>`` (default tag
    ``step-<global step>``) and point ``<root>/latest`` at it. Returns the checkpoint
    directory on every rank.

    Raises:
        ValueError: on every rank, when the ranks save different tags, the tag is not valid,
            or any rank's state cannot be saved; nothing is published then.
        OSError: on every rank, when a write fails; WriterLockedError (an OSError naming
            the holder) when another process is saving into ``root``.
    """
    tag = tag or f"step-{engine.global_steps:08d}"
    engine.comm.agree(f"save_checkpoint(tag={tag!r})")  # every rank saves the same tag
    state = engine.export_state()
    if lr_scheduler is not None:
        state.extra[LR_SCHEDULER_KEY] = lr_scheduler.state_dict()
    buffer_names = [name for name, _ in engine.model.named_buffers()]
    return save_sharded(root, tag, state, coordinator=_coordinator(engine), fault=fault, buffer_names=buffer_names)


def load_checkpoint(
    engine: ZeroOptimizer,
    path: str | os.PathLike[str],
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    lr_scheduler: Any = None,
    stats: ReadStats | None = None,
) -> dict[str, Any]:
    """Collective over the engine's ranks: load a checkpoint into the running engine,
    resharding as needed.

    ``path`` is a native checkpoint (a tag directory or a root with ``latest``), a
    universal checkpoint or a DeepSpeed ZeRO-1/2 checkpoint, saved at any world size and
    layout policy: whatever :func:`~zeroshard.checkpoint.formats.open_source` opens.
    ``strict=False`` loads the parameters both have; the run's parameters the checkpoint
    lacks keep their values (weights, fp32 masters, optimizer state), and the checkpoint's
    extra ones are ignored. Returns the checkpoint's ``extra`` (step counters and the like).
    Raises ValueError on every rank when any rank cannot load it, and AttestationError (a
    CheckpointDamagedError) when the ranks would not hold what it saved; nothing changes then.
    ``stats`` counts the bytes this rank reads, and gets what every rank read
    (``stats.ranks``, ``stats.job_total``).
    """
    return load_checkpoint_attested(
        engine,
        path,
        load_optimizer_states=load_optimizer_states,
        load_module_only=load_module_only,
        strict=strict,
        lr_scheduler=lr_scheduler,
        stats=stats,
    )[0]


def load_checkpoint_attested(
    engine: ZeroOptimizer,
    path: str | os.PathLike[str],
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    lr_scheduler: Any = None,
    stats: ReadStats | None = None,
) -> tuple[dict[str, Any], Attestation]:
    """:func:`load_checkpoint`, also returning its attestation (``.line()`` says what was
    checked). Collective, and raises as :func:`load_checkpoint` does."""
    options = dict(load_optimizer_states=load_optimizer_states, load_module_only=load_module_only, strict=strict)
    layout, rank = engine.layout, engine.rank
    wait_released()  # the state the last load replaced, freed before this one builds another
    module_state = engine.model.state_dict()
    base = None if strict else engine.export_state()  # what the checkpoint lacks keeps the run's values

    gather = _WeightsGather(engine)

    def read(evidence: Evidence) -> tuple[ShardedState, ModuleShare | None, dict[str, str]]:
        try:
            with open_source(Path(path)) as source:
                share = None
                if not _reads_saved_weights(engine, source, load_optimizer_states and not load_module_only):
                    share = share_checkpoint(source.info.model_entries, layout, rank, None if strict else module_state)
                on_masters = gather.start if share is not None else None
                state = load_state(
                    source, layout, rank, evidence=evidence, module_state=module_state, base=base, share=share,
                    on_masters=on_masters, **options,
                )  # fmt: skip
                aliases = dict(source.info.aliases)
                # What the import would refuse, refused now: the load's agreement carries it.
                engine.check_import(_as_broadcast(state, share, aliases), **options, weights_from_masters=share is not None)
                return state, share, aliases
        finally:
            gather.start_rest()  # a rank that failed still starts every gather the others start

    def fingerprint(read: tuple[ShardedState, ModuleShare | None, dict[str, str]]) -> int:
        return read[1].fingerprint() if read[1] is not None else 0

    try:
        (state, share, aliases), attestation = attested_load(
            _coordinator(engine), str(path), read, layout, options, agree_also=fingerprint, stats=stats
        )
        if share is not None:
            # Only now, every rank agreed: no rank waits for a tensor another failed to read.
            shared = broadcast_module(engine.comm, share, state.model_state)
            state.model_state = {**shared, **{alias: shared[target] for alias, target in aliases.items() if target in shared}}
        gather.wait()
        # Read for this call: no copies.
        gathered = gather.loaded
        engine.import_state(
            state, **options, take=True, weights_from_masters=share is not None, params_gathered=gathered, checked=True
        )
    except Exception:
        gather.restore()  # every rank raises alike (agreed): put back the weights the run had
        raise
    if lr_scheduler is not None and LR_SCHEDULER_KEY in state.extra and not load_module_only:
        lr_scheduler.load_state_dict(state.extra[LR_SCHEDULER_KEY])
    return dict(state.extra), attestation


def _as_broadcast(state: ShardedState, share: ModuleShare | None, aliases: dict[str, str]) -> ShardedState:
    """``state`` with the model state it holds once the shared module tensors are broadcast
    (every one of ``share``'s, and the names tied to them), in names and shapes only."""
    if share is None:
        return state
    shared = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in share.tensors}
    shared.update({alias: shared[target] for alias, target in aliases.items() if target in shared})
    return dataclasses.replace(state, model_state=shared)


class _WeightsGather:
    """The weights of a load gathered while it reads: each layout group's fp32 partition
    cast into this rank's slices of the parameter buffer and all-gathered as soon as the
    loader has it, so the cast and the gather run while the optimizer state is read (alone,
    D = 1, the cast, which is all there is). The buffer is the run's own: a load that fails
    on any rank puts the run's weights back by gathering them again from its masters, which
    a load changes only once every rank has agreed. Every rank starts the same gathers in
    the same order (group by group), also a rank whose read failed (:meth:`start_rest`), so
    no collective is left unmatched."""

    def __init__(self, engine: ZeroOptimizer) -> None:
        self.engine = engine
        self.handles: list[Any] = []
        self.next_group = 0
        self.loaded = False  # every group started from the loaded partitions

    def start(self, group: int, fp32: Any) -> list[tuple[int, Any]] | None:
        """The loader's ``on_masters``: group ``group``'s loaded fp32 partition. Returns the
        weights it made of it, this rank's slices of the parameter buffer (partition offset,
        values), for the load's attestation to digest the weights the engine holds (None
        where they are not in host memory: the attestation casts the partition itself)."""
        if group != self.next_group:
            raise AssertionError(f"weights of group {group} gathered out of order (expected {self.next_group})")
        self.handles += self.engine.start_params_gather(group, to_torch(fp32))
        self.next_group += 1
        self.loaded = self.next_group == len(self.engine.layout.groups)
        own = self.engine.own_params(group)
        if any(values.device.type != "cpu" for _, values in own):
            return None
        return [(start, to_numpy(values)) for start, values in own]

    def start_rest(self) -> None:
        """Start the gathers of the groups not yet started, from the run's own masters (alone,
        none: no other rank waits on them, and the import casts what it needs)."""
        if self.engine.world_size == 1:
            return
        for group in range(self.next_group, len(self.engine.layout.groups)):
            self.handles += self.engine.start_params_gather(group)
        self.next_group = len(self.engine.layout.groups)

    def wait(self) -> None:
        """Wait for every gather started."""
        for handle in self.handles:
            handle.wait()
        self.handles = []

    def restore(self) -> None:
        """Collective, after a failed load: the run's weights again, from its masters (alone,
        only where the load wrote some)."""
        if self.engine.world_size == 1 and self.next_group == 0:
            return
        self.start_rest()
        self.wait()
        self.engine.sync_params_from_masters()


def _reads_saved_weights(engine: ZeroOptimizer, source: ShardSource, full: bool) -> bool:
    """Whether the load reads the saved low-precision weights rather than rebuilding them
    from the fp32 masters: alone, without optimizer state, from a source that has them (a
    universal checkpoint's weights are its masters cast). No other rank would read them
    and no all-gather follows, and a bf16 weight is half a master's bytes."""
    return engine.world_size == 1 and not full and not source.info.weights_from_masters


def _coordinator(engine: ZeroOptimizer) -> Coordinator:
    if engine.world_size == 1:
        return SingleProcessCoordinator()
    return TorchDistributedCoordinator(engine.comm.group)
