"""The one loader: one rank's :class:`ShardedState` for any layout, from any checkpoint.

Native, universal and DeepSpeed checkpoints all come in as a :class:`ShardSource`
(:func:`~zeroshard.checkpoint.formats.open_source`), so every load option (full, module only,
without optimizer state, strict or not, resharded) behaves the same for each:

* before anything is read, the run's parameters are compared with the checkpoint's (names,
  shapes, dtypes), and the rest of the run's state_dict too when ``module_state`` is given.
  ``strict=True``: any difference is a ValueError naming every parameter concerned, in one
  line. ``strict=False``: the parameters both have are loaded; the checkpoint's extra ones are
  ignored, and the run's parameters the checkpoint lacks keep their values from ``base``
  (the run's own state: weights, fp32 masters and optimizer state), or zeros without one.
  A dtype change is refused either way, except from a universal checkpoint, whose weights
  are cast from its fp32 masters;
* the new layout decides everything (world size, policy, bucket size, grouping): each
  fragment of the new rank's partition is read from the old ranks that hold it, by the runs
  :func:`plan_reads` computes, so a rank reads about its share, not the checkpoint;
* without optimizer state the fp32 master partitions are the loaded weights, as the engine
  rebuilds them, and no master is read;
* loading with the other ranks of a job (``share``, as ``engine_io.load_checkpoint`` does),
  a rank reads no weight and no whole master: the trained parameters' weights are its fp32
  master partitions cast (the engine all-gathers them), attested against the saved weights
  piece by piece; of the buffers and frozen parameters it reads only those ``share`` gives
  it (:mod:`.shared_module`); without optimizer state it reads its master partitions and
  nothing else. A checksummed record that several ranks need parts of (a DeepSpeed zip
  record, a native or universal checksum block) is checked by those ranks together, each
  reading only its part (``check_records_with``, :mod:`..io.shared_checks`). So the job
  reads each byte it needs once.

The result is built in new tensors and returned only when everything passed, so a failed
load leaves the caller's state as it was. Every load attests (:mod:`.attest`): the loader
digests what the rank now holds, and a load that does not hold what was saved is refused.
Alone, a rank checks what it holds whole; :func:`~.attest.attested.load_attested` with a
coordinator checks everything, every rank agreeing.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..layout import Layout
from ..layout.coordinates import shard_rank
from ..state import ParamGroupState, ShardedState
from .attest.attestation import Evidence, attest_alone
from .compat import Mismatch, compare_module, compare_params
from ..io.dtypes import arrays_to_torch, cast, dtype_info, dtype_of, to_numpy, to_torch
from ..io.host_memory import new_zeros
from .reshard import GroupPlan, JobReads, plan_reads
from .shared_module import ModuleShare
from .param_groups import map_param_groups
from .module_state import module_weights, to_torch_keeping_ties
from .source import ShardSource, read_into, read_model_tensors

PREFETCH_BYTES = 1 << 30  # what a group's reads hint ahead at most (see _prefetch)
PAGE_BYTES = 4096  # see _phase
IN_PLACE_ALIGNMENT = 16  # bytes: a state array starts aligned as the parameters do (DESIGN.md), at least


def load_state(
    source: ShardSource,
    layout: Layout,
    rank: int,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
    module_state: Mapping[str, torch.Tensor] | None = None,
    base: ShardedState | None = None,
    evidence: Evidence | None = None,
    share: ModuleShare | None = None,
    on_masters: Callable[[int, np.ndarray], Any] | None = None,
) -> ShardedState:
    """This rank's state under ``layout`` (the new run's), read from ``source``.

    Args:
        load_optimizer_states: False leaves optimizer state empty; the fp32 masters are the
            checkpoint's weights.
        load_module_only: the module's weights only (masters from them); no optimizer class,
            param groups or ``extra``.
        strict: the checkpoint's parameters must be the run's; False loads those both have.
        module_state: the run's ``module.state_dict()``, to check frozen parameters,
            buffers and tied names before anything is read.
        base: the run's current state on this rank: what the checkpoint lacks keeps its
            values from here (with ``strict=False``) instead of zeros.
        evidence: filled with what the load digests, for the caller to judge with the
            other ranks' (:func:`~.attest.attested.load_attested`). Without it the rank attests alone: all of
            the state in a world of one, else what it holds whole (AttestationError).
        share: the job loads together (every rank of ``layout``, attested together): the
            state's ``model_state`` then holds only the module tensors ``share`` gives this
            rank to read, and no trained parameter's weight; ``fp32_partitions`` are what
            the weights are rebuilt from, also without optimizer state
            (``import_state(..., weights_from_masters=True)``).
        on_masters: with ``share``: called with each group's index and fp32 partition as
            soon as it is read, before that group's optimizer state (in group order, every
            group once), so the caller can gather the weights while the rest is read. It may
            return the weights it made of the partition (``(partition offset, values)``
            pieces in the run's dtype, covering it): the attestation then digests those, the
            weights the caller holds, instead of casting the partition again.
    """
    alone = evidence is None
    evidence = Evidence() if alone else evidence
    if share is not None and alone:
        raise ValueError("a load shared with the other ranks is attested with them: pass evidence")
    options = (load_optimizer_states, load_module_only, strict)
    state = _load(source, layout, rank, *options, module_state, base, evidence, share, on_masters)
    if alone:
        attest_alone(evidence, layout.world_size)
    return state


def _load(
    source: ShardSource,
    layout: Layout,
    rank: int,
    load_optimizer_states: bool,
    load_module_only: bool,
    strict: bool,
    module_state: Mapping[str, torch.Tensor] | None,
    base: ShardedState | None,
    evidence: Evidence,
    share: ModuleShare | None = None,
    on_masters: Callable[[int, np.ndarray], Any] | None = None,
) -> ShardedState:
    info = source.info
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside world size {layout.world_size}")
    if base is not None and (base.layout != layout or base.rank != rank):
        raise ValueError("base must be this rank's state under the layout being loaded")
    loadable = _check_match(source, layout, module_state, strict)
    full = load_optimizer_states and not load_module_only
    # A module-only load reads the weights alone, into any grouping (an AdamW run's
    # checkpoint into a Muon run's owner groups, and the reverse): no param group to map.
    param_groups = [] if load_module_only else map_param_groups(source, layout, loadable)
    plans = plan_reads(info.layout, layout, rank, loadable)
    evidence.begin(source, layout, rank, loadable, full)
    if share is not None:
        kind = (full, load_module_only)
        check_together = getattr(source, "check_records_with", None)
        if check_together is not None and evidence.enabled:  # judged with every rank's, in the agreement
            module = tuple(tensor.name for tensor in share.tensors)
            check_together(evidence.record_terms(), JobReads(info.layout, layout, frozenset(loadable), full, module))
        return _load_shared(source, layout, rank, plans, kind, param_groups, base, evidence, share, on_masters)
    # Weights cast from whole fp32 masters: their fragments also fill the rank's fp32
    # partitions, so no master byte is read twice.
    from_masters = _partitions_from_masters(source, layout, plans, base) if full and info.weights_from_masters else {}
    weights = module_weights(source, layout, rank, loadable, None if strict else module_state, from_masters, evidence)
    fp32, states, scalars = [], [], []
    for plan in plans:
        if full:
            group_fp32, group_states, group_scalars = _read_group(
                source, layout, plan, base, from_masters.get(plan.group), evidence
            )
            evidence.held(plan.group, group_fp32, group_states)
        else:
            group_fp32 = _fp32_from_weights(layout, rank, plan.group, weights, loadable, base)
            group_states, group_scalars = {}, {}
        fp32.append(group_fp32)
        states.append(group_states)
        scalars.append(group_scalars)
    model_state = to_torch_keeping_ties(weights, info.aliases)
    return _state(source, layout, rank, fp32, states, scalars, param_groups, load_module_only, model_state)


def _state(
    source: ShardSource,
    layout: Layout,
    rank: int,
    fp32: list[np.ndarray],
    states: list[dict[str, np.ndarray]],
    scalars: list[dict[str, torch.Tensor]],
    param_groups: list[ParamGroupState],
    module_only: bool,
    model_state: dict[str, torch.Tensor],
) -> ShardedState:
    info = source.info
    return ShardedState(
        layout=layout,
        rank=rank,
        fp32_partitions=[to_torch(array) for array in fp32],
        optimizer_states=[{name: to_torch(array) for name, array in group.items()} for group in states],
        optimizer_scalars=scalars,
        param_groups=param_groups,  # none for a module-only load
        optimizer_class="" if module_only else info.optimizer_class,
        model_state=model_state,
        extra={} if module_only else arrays_to_torch(dict(info.extra)),
    )


def _load_shared(
    source: ShardSource,
    layout: Layout,
    rank: int,
    plans: tuple[GroupPlan, ...],
    kind: tuple[bool, bool],
    param_groups: list[ParamGroupState],
    base: ShardedState | None,
    evidence: Evidence,
    share: ModuleShare,
    on_masters: Callable[[int, np.ndarray], Any] | None,
) -> ShardedState:
    """:func:`_load` of one rank of a job loading together (see the module docstring);
    ``kind``: whether the load is full (optimizer states too), and module only."""
    full, module_only = kind
    if share.rank != rank or share.world_size != layout.world_size:
        raise ValueError(f"the module share is rank {share.rank} of {share.world_size}'s, not rank {rank} of {layout.world_size}'s")

    def masters_read(group: int, masters: np.ndarray) -> None:
        made = on_masters(group, masters) if on_masters is not None else None
        # Digested now, while the storage reads the group's optimizer states ahead.
        evidence.rebuilt(group, masters, layout.groups[group].dtype, made)

    fp32, states, scalars = [], [], []
    for plan in plans:
        dtype = layout.groups[plan.group].dtype
        if full:
            group_fp32, group_states, group_scalars = _read_group(source, layout, plan, base, None, evidence, masters_read)
        else:
            dest = _destination(source, plan, base, layout, "fp32")
            _prefetch(source, plan, ["fp32"], {"fp32": dest})
            group_fp32 = _fill(source, plan, "fp32", dest, evidence)
            group_states, group_scalars = {}, {}
            masters_read(plan.group, group_fp32)
        evidence.held(plan.group, group_fp32, group_states)
        fp32.append(group_fp32 if full else cast(cast(group_fp32, dtype), "float32"))  # without states: masters from the weights
        states.append(group_states)
        scalars.append(group_scalars)
    shared = {name: to_torch(array) for name, array in _shared_reads(source, share, evidence).items()}
    return _state(source, layout, rank, fp32, states, scalars, param_groups, module_only, shared)


def _shared_reads(source: ShardSource, share: ModuleShare, evidence: Evidence) -> dict[str, np.ndarray]:
    """The module tensors ``share`` gives this rank to read, checked as :func:`.module_state.module_weights` does."""
    digests: dict[str, tuple] | None = {} if evidence.enabled else None
    found = read_model_tensors(source, share.mine, digests)
    for name, values in found.items():
        evidence.model_tensor(name, values, digests.get(name) if digests else None)
    return found


def _check_match(
    source: ShardSource, layout: Layout, module_state: Mapping[str, torch.Tensor] | None, strict: bool
) -> set[str]:
    """Names of the run's parameters to read; raises (strict, or a dtype change) or warns.

    A run's parameter with no elements that the checkpoint lacks is no difference: there is
    nothing to load (DeepSpeed leaves such parameters out of its buffers)."""
    info = source.info
    params = compare_params(info.layout, layout)
    if info.weights_from_masters:
        params = dataclasses.replace(params, retyped=())
    empty = {slot.name for group in layout.groups for slot in group.params if slot.numel == 0}
    absent_empty = set(params.missing) & empty
    params = dataclasses.replace(params, missing=tuple(n for n in params.missing if n not in absent_empty))
    module = compare_module(info, layout, module_state) if module_state is not None else Mismatch()
    for mismatch, what in ((params, "parameters"), (module, "state_dict")):
        label = f"{source.path}: checkpoint does not match the run's {what}"
        if mismatch and (strict or mismatch.retyped):
            raise ValueError(mismatch.describe(label))
        if mismatch:
            warnings.warn(mismatch.describe(label) + "; loading the rest (strict=False)", stacklevel=4)
    return set(layout.param_names) - params.skipped() - absent_empty


def _read_group(
    source: ShardSource,
    layout: Layout,
    plan: GroupPlan,
    base: ShardedState | None,
    fp32: np.ndarray | None,
    evidence: Evidence,
    on_masters: Callable[[int, np.ndarray], Any] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """fp32 master (unless given: filled already), optimizer states and scalars of one new
    group; ``on_masters`` gets the master before the states are read."""
    group = plan.group
    if not plan.source_groups and base is not None:  # the checkpoint has none of its parameters
        own_states = base.optimizer_states[group]
        kept = _start(base, layout, group, None, "float32")
        if on_masters is not None:
            on_masters(group, kept)
        return (
            kept,
            {name: _start(base, layout, group, name, dtype_of(t).name) for name, t in own_states.items()},
            {name: value.clone() for name, value in base.optimizer_scalars[group].items()},
        )

    names = _state_names(group, [tuple(source.info.state_keys[g]) for g in plan.source_groups])
    keys = (["fp32"] if fp32 is None else []) + list(names)
    # Every destination first (new memory, mapped as the reads land): the read-ahead reads into them.
    dests = {key: _destination(source, plan, base, layout, key) for key in keys}
    _prefetch(source, plan, keys, dests)
    fp32 = _fill(source, plan, "fp32", dests["fp32"], evidence) if fp32 is None else fp32
    if on_masters is not None:
        on_masters(group, fp32)
    states = {name: _fill(source, plan, name, dests[name], evidence) for name in names}
    # Last: a source may take them from a file it has opened for the partitions.
    scalars = _torch_scalars(source.scalars(plan.source_groups[0])) if plan.source_groups else {}
    if plan.source_groups:
        evidence.scalars(group, plan.source_groups[0], scalars)
    return fp32, states, scalars


def _prefetch(source: ShardSource, plan: GroupPlan, keys: list[str], dests: Mapping[str, np.ndarray]) -> None:
    """Announce the ranges of ``keys`` that this rank reads for a group, in the order it
    reads them, up to PREFETCH_BYTES: the storage keeps reading (past the page cache, or
    into it, see :mod:`zeroshard.io.direct_reads`) while the loader maps the group's memory
    and checks what has arrived, so a load from shared storage takes about its read time
    (benchmarks/load_bytes.py ``--read-bps``). Bounded, so that bytes hinted into the page
    cache are not evicted before their read; ranges past the budget are read
    ahead within their own read. A source that ``reads_in_place`` is told where each range
    goes in ``dests``."""
    hint = getattr(source, "prefetch", None)
    if hint is None:
        return
    in_place = getattr(source, "reads_in_place", False)
    budget = PREFETCH_BYTES
    for key in keys:
        itemsize = dtype_info(_stored_dtype(source, plan, key)).itemsize
        for copy in plan.copies:
            length = min(copy.length, budget // itemsize)
            if length <= 0:
                return
            where = (copy.source_rank, copy.source_group, key, copy.source_start, copy.source_start + length)
            if in_place:
                hint(*where, into=dests[key][copy.dest_start : copy.dest_start + length])
            else:
                hint(*where)
            budget -= length * itemsize


def _fill(source: ShardSource, plan: GroupPlan, key: str, dest: np.ndarray, evidence: Evidence) -> np.ndarray:
    """Copy the plan's ranges of ``key`` into ``dest``, in place."""
    for copy in plan.copies:
        out = dest[copy.dest_start : copy.dest_start + copy.length]
        read_from = (copy.source_rank, copy.source_group, copy.source_start)
        observer = evidence.observer(plan.group, key, copy.dest_start, dest.dtype.itemsize, read_from)
        done = read_into(source, copy.source_rank, copy.source_group, key, copy.source_start, out, observer)
        evidence.observed(plan.group, key, done)
        if not done:  # else the observer digested the values as read too
            evidence.read(copy.source_rank, copy.source_group, key, copy.source_start, out)
    return dest


def _stored_dtype(source: ShardSource, plan: GroupPlan, key: str) -> str:
    """The dtype ``key`` is stored in by the old groups a new group draws from (they must agree)."""
    found = {g: source.info.stored_dtype(g, key) for g in plan.source_groups}
    if len(set(found.values())) > 1:
        raise ValueError(
            f"group {plan.group} takes parameters from old groups {list(found)} that store {key!r} in different dtypes "
            f"({found})"
        )
    return next(iter(found.values()), "float32")


def _destination(source: ShardSource, plan: GroupPlan, base: ShardedState | None, layout: Layout, key: str) -> np.ndarray:
    """The new partition a group's ``key`` ("fp32" or a state's name) is read into."""
    dtype = _stored_dtype(source, plan, key)
    return _start(base, layout, plan.group, None if key == "fp32" else key, dtype, _phase(source, plan, key, dtype))


def _phase(source: ShardSource, plan: GroupPlan, key: str, dtype: str) -> int:
    """Where in its first page a group's new partition of ``key`` starts so that its biggest
    range has the alignment it has in its file (a source that ``reads_in_place`` then reads
    it straight into the partition); 0 where that would leave the partition less than
    IN_PLACE_ALIGNMENT-aligned, or the source cannot say."""
    if not plan.copies or not getattr(source, "reads_in_place", False):
        return 0
    biggest = max(plan.copies, key=lambda copy: copy.length)
    offset = source.file_offset(biggest.source_rank, biggest.source_group, key, biggest.source_start)
    if offset is None:  # no file holds that element
        return 0
    phase = (offset - biggest.dest_start * dtype_info(dtype).itemsize) % PAGE_BYTES
    return phase if phase % IN_PLACE_ALIGNMENT == 0 else 0


def _start(
    base: ShardedState | None, layout: Layout, group: int, name: str | None, dtype: str, phase: int = 0
) -> np.ndarray:
    """A partition before the checkpoint's ranges land in it: the base's values, or zeros
    (starting ``phase`` bytes into a page when big, see :func:`~..io.host_memory.new_zeros`)."""
    if base is not None:
        tensor = base.fp32_partitions[group] if name is None else base.optimizer_states[group].get(name)
        if tensor is not None and dtype_of(tensor).name == dtype:
            kept = new_zeros(tensor.numel(), dtype_info(dtype).numpy, phase=phase)
            np.copyto(kept, to_numpy(tensor).reshape(-1))
            return kept
    # Mapped as the reads land (they populate each chunk's pages just before it).
    return new_zeros(layout.groups[group].partition_numel, dtype_info(dtype).numpy, populated=False, phase=phase)


def _fp32_from_weights(
    layout: Layout, rank: int, group: int, weights: Mapping[str, np.ndarray], loadable: set[str], base: ShardedState | None
) -> np.ndarray:
    partition = _start(base, layout, group, None, "float32")
    for fragment in layout.groups[group].fragments(shard_rank(layout.groups[group], rank)):
        if fragment.name in loadable:
            weight = weights[fragment.name].reshape(-1)[fragment.param_start : fragment.param_start + fragment.length]
            partition[fragment.partition_start : fragment.partition_start + fragment.length] = cast(weight, "float32")
    return partition


def _partitions_from_masters(
    source: ShardSource, layout: Layout, plans: tuple[GroupPlan, ...], base: ShardedState | None
) -> dict[int, np.ndarray]:
    """The fp32 partitions :func:`.module_state.module_weights` fills from the masters it reads whole, as
    they start (the base's values, or zeros), by new group; groups the checkpoint has none of,
    and expert groups (whose weights are read expert by expert), are read as usual."""
    return {
        plan.group: _start(base, layout, plan.group, None, _stored_dtype(source, plan, "fp32"))
        for plan in plans
        if plan.source_groups and not layout.groups[plan.group].is_expert_group
    }


def _torch_scalars(scalars: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Scalars as the engine keeps them: tensors (a plain number becomes a 0-d tensor)."""
    return {name: to_torch(v) if isinstance(v, np.ndarray) else torch.tensor(v) for name, v in scalars.items()}


def _state_names(group: int, per_group: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The optimizer states of a new group: every old group it draws from must have the same ones."""
    names = per_group[0] if per_group else ()
    for other in per_group[1:]:
        if set(other) != set(names):
            raise ValueError(
                f"layout group {group} mixes parameters with optimizer states {sorted(names)} and {sorted(other)}"
            )
    return tuple(names)
