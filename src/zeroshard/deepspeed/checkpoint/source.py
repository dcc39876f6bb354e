"""DeepSpeed ZeRO stage 1/2 checkpoints as a :class:`~zeroshard.checkpoint.source.ShardSource`.

:class:`DeepSpeedSource`, given the tag folder (:func:`~.opener.open_deepspeed` finds it),
reads the model-states file, rebuilds the flat layout DeepSpeed used and checks it against
what every rank's optimizer file says before anything is read (:mod:`.layout_check`).

Each rank file is parsed once, when the source is opened: its structure is checked against
the layout and only its tensor records are kept (a few hundred bytes per rank, whatever the
checkpoint's size), so a conversion reads every file's pickle once, not once per parameter
it holds a piece of. Tensor bytes are read range by range when asked for (with ``pread``, or
through a mapping of just that range when it is 8 MiB or more; no file is held mapped, so a
conversion's resident memory is what it holds, not what it has read). Neither torch nor
DeepSpeed is imported.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.format import state_name_problem
from ...io.budget import BudgetExceeded, quoted
from ...io.dtypes import itemsize_of, to_float32
from ...checkpoint.source import ModelEntry, SourceInfo, in_place_target
from ...collector import collector_paused
from ...layout import GroupLayout, Layout
from ...state import ParamGroupState
from .autoep_experts import ExpertWeights, check_placement, expert_file_names, read_expert_files
from .muon import PartitionMomentum, muon_groups, partition_states
from .optimizers import TORCH_OPTIMIZERS, deepspeed_optimizer, group_optimizers, optimizer_class  # noqa: F401
from .files import ModelStates, RankShard, read_model_states, read_rank_shard, read_scalars
from .layout_check import RankChecks, rebuild_layout
from .paths import MODEL_STATES_FILE, model_states_path, rank_file_paths, refuse_unsupported
from .pickled import DeepSpeedFormatError
from ...torchfile.torch_file import StoredTensor, TorchFileError
from ...torchfile.record_cache import RecordCache, record_elements
from ...torchfile.shared_reads import announce, read_shared, record_key
from ...io.observe import observe_bytes
from ...io.direct_reads import ReadAhead
from ...io.shared_checks import NeededElements, RecordTerms, SharedRecordChecks
from ...checkpoint.reshard import JobReads

@dataclass(frozen=True, slots=True)
class RankTensors:
    """What reading needs of one rank's file: its tensors, per layout group."""

    fp32: list[StoredTensor]
    states: list[dict[str, StoredTensor | PartitionMomentum]]


class DeepSpeedSource:
    """A DeepSpeed ZeRO-1/2 checkpoint read range by range (the ShardSource protocol)."""

    observes_reads = True  # read_into digests what it reads (``observe``)
    reads_in_place = True  # prefetch takes ``into``, and file_offset says where ranges lie

    def __init__(self, tag_dir: Path) -> None:
        self.path = tag_dir
        refuse_unsupported(tag_dir)
        self._model = read_model_states(model_states_path(tag_dir))
        if self._model.autoep is None and expert_file_names(tag_dir):
            raise DeepSpeedFormatError(
                f"{tag_dir}: MoE checkpoints are not supported (only AutoEP's; found {expert_file_names(tag_dir)[0]}, "
                f"and {MODEL_STATES_FILE} has no ds_autoep_layers)"
            )
        rank_paths = rank_file_paths(tag_dir)
        first = read_rank_shard(rank_paths[0], 0)
        layout = rebuild_layout(self._model, first, world_size=len(rank_paths))
        muon = muon_groups(layout, first.param_groups, first.states, rank_paths[0])
        self._ranks: list[RankTensors] = []
        checks = RankChecks(layout, muon)
        shard = first
        with collector_paused():
            for rank, path in enumerate(rank_paths):
                shard = first if rank == 0 else read_rank_shard(path, rank, like=first, after=shard)
                checks.check(shard)
                states = partition_states(layout, shard.states, shard.param_groups, rank, muon, path)
                self._ranks.append(RankTensors(shard.fp32, states))
        problem = next(filter(None, (state_name_problem(name) for group in first.states for name in group)), None)
        if problem:  # an optimizer state no reader could tell from the fp32 masters
            raise DeepSpeedFormatError(f"{rank_paths[0]}: {problem}")
        self.info = _source_info(layout, self._model, first)
        charge_outputs(layout, self._model, first, self.info.aliases)
        self._partition_numels = [group.partition_numel for group in layout.groups]
        self._scalars = [read_scalars(group) for group in first.scalars]
        self.autoep = self._model.autoep  # None unless DeepSpeed AutoEP made the run
        self._records = RecordCache()  # see read_into
        self._together: SharedRecordChecks | None = None  # see check_records_with
        self._ahead = ReadAhead()  # reads past the page cache, for a load checking records together
        self._views: dict[tuple[str, str], list[tuple[int, int, StoredTensor]]] = {}
        self._needed_elements: NeededElements = lambda rank, group: []
        self.experts = self._read_expert_files() if self.autoep is not None else None

    def _read_expert_files(self) -> ExpertWeights:
        group = next(group for group in self.layout.groups if group.is_expert_group)
        shapes = {slot.name: slot.spec.shape[1:] for slot in group.params}
        experts = read_expert_files(self.path, self.autoep, shapes, group.dtype)
        fp32 = [shard.fp32[group.index] for shard in self._ranks]
        check_placement(experts, self.autoep, self.layout, fp32, self._model.path)
        return experts

    @property
    def layout(self) -> Layout:
        """The layout of the run that saved it, rebuilt from its files (``info.layout``)."""
        return self.info.layout

    def read(self, rank: int, group: int, key: str, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of ``rank``'s partition of ``key`` ("fp32" or an optimizer
        state name) in layout group ``group``, as an fp32 array the caller may keep (read-only
        when big: a view of a mapping)."""
        saved = self._saved(rank, group, key, start, end)
        try:  # as _named_errors, without a context manager's cost on every piece
            if key == "fp32":
                return _read_zero_extended(saved, start, end)
            return to_float32(saved.read(start, end))
        except TorchFileError as err:
            raise DeepSpeedFormatError(str(err)) from None

    def read_into(self, rank: int, group: int, key: str, start: int, out: np.ndarray, observe: Any = None) -> None:
        """:meth:`read` into the 1-D array ``out``: an fp32 partition read straight into its
        memory (the record's CRC-32 checked on the bytes as they arrive when it covers the
        record), without the mapping and the copy out of it that :meth:`read` costs.

        In a load whose ranks check the records together (:meth:`check_records_with`) the
        range is read alone, its CRC combined with the other ranks'; otherwise a part of a
        record comes from the record read once and kept for the load's other ranges of it
        (:class:`~...torchfile.record_cache.RecordCache`); :meth:`read`, which converters
        use parameter by parameter, keeps nothing. ``observe`` (a digester, offsets in
        ``out``'s bytes) gets the CRC of every segment of ``out``: of a range read alone,
        from the pass that computes its CRC for the record's check."""
        end = start + out.size
        saved = self._saved(rank, group, key, start, end)
        if out.dtype != np.float32 or saved.dtype != "float32" or not saved.is_contiguous():
            out[...] = self.read(rank, group, key, start, end)  # checks the whole record
            if self._together is not None and isinstance(saved, StoredTensor):
                self._together.terms.whole.add(record_key(saved.storage))
            _observe_all(out, 0, observe)
            return
        stop = max(start, min(end, saved.numel())) if key == "fp32" else end  # fp32: saved without tail padding
        with _named_errors():
            if self._together is not None:
                if stop > start:
                    needed = functools.partial(self._needed, saved)
                    read_shared(saved, start, out[: stop - start], self._together, needed, self._ahead, observe)
            else:
                kept = self._records.elements(saved, start, stop)
                if kept is not None:
                    out[: stop - start] = kept
                else:
                    saved.read_into(start, out[: stop - start])
                _observe_all(out[: stop - start], 0, observe)
        out[stop - start :] = 0
        _observe_all(out[stop - start :], (stop - start) * out.itemsize, observe)

    def prefetch(self, rank: int, group: int, key: str, start: int, end: int, into: np.ndarray | None = None) -> None:
        """Say that :meth:`read_into` of elements [start, end) of ``rank``'s partition of
        ``key`` in ``group`` comes next (into ``into`` when given), after those announced
        before: in a load whose ranks check the records together, a big range the page cache
        lacks starts being read past it, straight into ``into`` where it has the file's
        alignment (:mod:`...torchfile.shared_reads`). A hint: nothing is checked or counted here."""
        if self._together is None:
            return  # the reads check whole records, through the page cache and the record cache
        saved = self._saved(rank, group, key, start, end)
        if isinstance(saved, StoredTensor) and saved.dtype == "float32" and saved.is_contiguous():
            stop = max(start, min(end, saved.numel())) if key == "fp32" else end
            target = in_place_target(into, np.float32, end - start)
            if stop > start:
                announce(saved, start, stop, self._ahead, target[: stop - start] if target is not None else None)

    def file_offset(self, rank: int, group: int, key: str, start: int) -> int | None:
        """Where element ``start`` of ``rank``'s partition of ``key`` in ``group`` lies in its
        file (bytes), as :meth:`~zeroshard.checkpoint.native.source.NativeSource.file_offset`;
        None where it is not stored as one contiguous fp32 run."""
        saved = self._saved(rank, group, key, start, start)
        if not isinstance(saved, StoredTensor) or saved.dtype != "float32" or not saved.is_contiguous():
            return None
        return saved.storage.data_offset + (saved.storage_offset + start) * 4

    def check_records_with(self, terms: RecordTerms, reads: JobReads) -> None:
        """From now on, check the zip records of the fp32 partitions and optimizer states that
        :meth:`read_into` reads together with the other ranks of a load: each read adds the
        CRC-32 terms of its range, and of the bytes nobody needs that this rank owns, to
        ``terms``, which the load's agreement combines and judges (:mod:`...io.shared_checks`).
        ``reads``: what the ranks of the load read (the same on every rank). Each byte is
        then read once over the job, where checking a record alone needs all of it on every
        rank that reads a part. (The model-states file's tensors, each read by one rank, are
        records of their own and checked whole.)"""
        views: dict[tuple[str, str], list[tuple[int, int, StoredTensor]]] = {}
        for rank, shard in enumerate(self._ranks):
            for group, (fp32, states) in enumerate(zip(shard.fp32, shard.states)):
                for saved in (fp32, *states.values()):
                    if isinstance(saved, StoredTensor):
                        views.setdefault((str(saved.storage.path), saved.storage.record_name), []).append((rank, group, saved))
        self._together = SharedRecordChecks(terms)
        self._views, self._needed_elements = views, reads.elements

    def _needed(self, saved: StoredTensor) -> list[tuple[int, int]]:
        """The bytes of ``saved``'s record that the load needs, over every tensor viewing it."""
        found = []
        for rank, group, view in self._views[(str(saved.storage.path), saved.storage.record_name)]:
            itemsize = itemsize_of(view.dtype)
            for start, end in self._needed_elements(rank, group):
                end = min(end, view.numel())  # an fp32 partition is saved without its tail padding
                if end > start:
                    found.append(((view.storage_offset + start) * itemsize, (view.storage_offset + end) * itemsize))
        return found

    def _saved(self, rank: int, group: int, key: str, start: int, end: int) -> StoredTensor | PartitionMomentum:
        self._group(group)
        partition_numel = self._partition_numels[group]
        if not 0 <= start <= end <= partition_numel:
            raise ValueError(
                f"range [{start}, {end}) is outside group {group}'s partition of {partition_numel} elements"
            )
        shard = self._rank(rank)
        if key == "fp32":
            return shard.fp32[group]
        if key not in shard.states[group]:
            states = quoted(sorted(shard.states[group]))
            raise KeyError(f"group {group} has no optimizer state {key!r} (it has {states})")
        return shard.states[group][key]

    def scalars(self, group: int) -> dict[str, Any]:
        """Non-partitioned optimizer state of ``group`` (``step``), as saved by rank 0."""
        self._group(group)
        return {key: value.copy() if isinstance(value, np.ndarray) else value for key, value in self._scalars[group].items()}

    def model_tensor(self, name: str) -> np.ndarray:
        """A tensor of the module state_dict (bf16/fp16 weights, buffers, frozen params)."""
        name = self.info.aliases.get(name, name)
        if name not in self._model.module:
            raise KeyError(f"{self._model.path.name} has no module tensor {name!r}")
        with _named_errors():
            return self._model.module[name].numpy()

    def model_tensors(self, names: list[str]) -> dict[str, np.ndarray]:
        """:meth:`model_tensor` of each name, each zip record read once: DeepSpeed's bf16
        weights are views of one flat storage per param group, one record whose CRC-32
        covers all of it, so reading them one by one would read that record once per weight.
        A record that several tensors view is read whole, checked, and kept for this call
        (at most the model-states file's size); their arrays are views of it.

        Raises:
            KeyError: a name the model-states file has no tensor of.
            DeepSpeedFormatError: a record found damaged (its CRC-32) or cut short."""
        stored = {}
        for name in names:
            resolved = self.info.aliases.get(name, name)
            if resolved not in self._model.module:
                raise KeyError(f"{self._model.path.name} has no module tensor {name!r}")
            stored[name] = resolved
        tensors = {resolved: self._model.module[resolved] for resolved in stored.values()}
        shared = _records_viewed_more_than_once(tensors.values())
        records: dict[tuple[str, str], np.ndarray] = {}
        read: dict[str, np.ndarray] = {}
        with _named_errors():
            for resolved, saved in tensors.items():
                key = (str(saved.storage.path), saved.storage.record_name)
                if key in shared and saved.is_contiguous():
                    if key not in records:
                        records[key] = saved.record()
                    read[resolved] = record_elements(records[key], saved, 0, saved.numel()).reshape(saved.shape)
                else:
                    read[resolved] = saved.numpy()
        return {name: read[resolved] for name, resolved in stored.items()}

    def close(self) -> None:
        """Drop the rank files' tensors and the records kept; the source cannot be read after."""
        self._ranks = []
        self._records.clear()
        self._ahead.close()

    def __enter__(self) -> DeepSpeedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _group(self, group: int) -> GroupLayout:
        if not 0 <= group < len(self.info.layout.groups):
            raise ValueError(f"group {group} does not exist (the checkpoint has {len(self.info.layout.groups)})")
        return self.info.layout.groups[group]

    def _rank(self, rank: int) -> RankTensors:
        if not 0 <= rank < len(self._ranks):
            raise ValueError(f"rank {rank} is outside world size {len(self._ranks)}")
        return self._ranks[rank]


def _records_viewed_more_than_once(stored: Iterable[StoredTensor]) -> set[tuple[str, str]]:
    """(file, record name) of each record that more than one of ``stored`` views."""
    views = collections.Counter((str(saved.storage.path), saved.storage.record_name) for saved in stored)
    return {key for key, count in views.items() if count > 1}


@contextlib.contextmanager
def _named_errors() -> Iterator[None]:
    """Bytes found damaged when read (a CRC mismatch, a file cut short since it was opened)
    are a DeepSpeedFormatError too; the message already names the file and the record."""
    try:
        yield
    except TorchFileError as err:
        raise DeepSpeedFormatError(str(err)) from None


def _observe_all(out: np.ndarray, at: int, observe: Any) -> None:
    """Hand ``observe`` the CRCs of ``out``'s bytes, which lie at byte ``at`` of the array it
    observes: a pass of their own, for reads whose checks computed none over them."""
    if observe is not None and out.size:
        observe_bytes(memoryview(np.ascontiguousarray(out).reshape(-1).view(np.uint8)), 0, out.nbytes, observe, at)


def _read_zero_extended(saved: StoredTensor, start: int, end: int) -> np.ndarray:
    """[start, end) of a partition saved without its tail padding; the tail reads as zeros."""
    stop = min(end, saved.numel())
    if stop >= end:
        return to_float32(saved.read(start, end))
    out = np.zeros(end - start, dtype=np.float32)
    if start < stop:
        out[: stop - start] = saved.read(start, stop)
    return out


KEY_BYTES = 64  # what naming one tensor in an output costs besides its name (a header entry)


def charge_outputs(layout: Layout, model: ModelStates, first: RankShard, aliases: dict[str, str]) -> None:
    """Charge what a conversion repeats from these files, in files of their own size's order:
    every parameter's name once for each tensor an output holds for it (fp32 and each state
    rank 0's file names) and every state's name once per parameter, to rank 0's file; every
    tied alias's copy of its target (an fp32 export writes the tensor again under each name),
    to the model-states file."""
    named = 0
    for group, states in zip(layout.groups, first.states):
        name_bytes = sum(len(slot.name) + KEY_BYTES for slot in group.params)
        named += name_bytes * (1 + len(states)) + sum(map(len, states)) * len(group.params)
    tied = sum(len(alias) + KEY_BYTES + 4 * layout.param(target)[1].numel for alias, target in aliases.items())
    try:
        if first.budget is not None:
            first.budget.charge(named, "naming every parameter's optimizer states in an output")
        if model.budget is not None:
            model.budget.charge(tied, "copying {:,} tied parameters into an export", len(aliases))
    except BudgetExceeded as err:
        raise DeepSpeedFormatError(str(err)) from None


# ---- SourceInfo ----------------------------------------------------------------------------------


def _source_info(layout: Layout, model: ModelStates, first: RankShard) -> SourceInfo:
    trained = set(layout.param_names)
    aliases = {alias: target for alias, target in model.shared_params.items() if target in trained}
    optimizers = group_optimizers(model.ds_config, first.param_groups)  # MuonWithAuxAdam's two, per group
    return SourceInfo(
        layout=layout,
        optimizer_class=optimizer_class(model.ds_config, first.param_groups),
        param_groups=[
            ParamGroupState(dict(hyper), [index], optimizer)
            for index, (hyper, optimizer) in enumerate(zip(first.param_groups, optimizers))
        ],
        state_keys=[list(states) for states in first.states],
        model_entries=_model_entries(model, trained | set(aliases)),
        aliases=aliases,
        extra={
            "source": "deepspeed",
            "deepspeed_version": first.ds_version or model.ds_version,
            "zero_stage": first.zero_stage,
            **model.counters,
            "lr_scheduler": model.lr_scheduler,
            "loss_scaler": first.loss_scaler,
            "clip_grad": first.clip_grad,
            "deepspeed_optimizer": deepspeed_optimizer(model.ds_config),
        },
    )


def _model_entries(model: ModelStates, trained: set[str]) -> list[ModelEntry]:
    """Buffers, and every module tensor DeepSpeed did not optimize (frozen or empty params).

    Frozen params come from ``module``: stage 1 saves no frozen_param_shapes."""
    buffers = set(model.buffer_names)
    entries = []
    for name, tensor in model.module.items():
        if name in trained:
            continue
        kind = "buffer" if name in buffers else "frozen"
        entries.append(ModelEntry(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), kind))
    return entries
