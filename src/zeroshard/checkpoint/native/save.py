"""Collective save in three phases: plan, write, commit.

* plan (collective): every rank checks its ShardedState and the ranks agree on the outcome,
  so all fail or none; rank 0 takes the root's writer lock (WriterLockedError on every rank
  if another process holds it), removes leftovers of interrupted saves and creates the
  staging directory ``<root>/.<tag>.tmp-<id>``; the result is a :class:`SavePlan`;
* write (local, the bulk of the time): every rank writes ``rank-RRRRR-of-DDDDD.safetensors``
  (rank 0 also ``model.safetensors``, without expert weights: those differ per EP rank and
  are the rank files' fp32 masters, and the model's config files, :mod:`..model_config`),
  hashing while writing, then fsyncs it; with a :class:`~zeroshard.state.ResumeState` also
  ``resume-RRRRR-of-DDDDD.json`` (:mod:`..run_state`). The same pass
  digests each fragment of the logical state while its bytes are in the CPU cache
  (:mod:`..attest.digests`), and each rank file records its binding (:mod:`.binding`);
* commit (collective): the block checksums and partial digests are gathered on rank 0 (also
  the barrier that says every rank's files are durable); rank 0 combines the digests (every
  logical tensor must be covered exactly once, and every rank's optimizer scalars must be
  rank 0's), writes manifest.json and fsyncs, renames the
  directory to ``<root>/<tag>`` and replaces ``latest``; then it broadcasts the outcome, so
  every rank returns, or raises, together, and releases the lock.

:func:`save_sharded` runs the three in a row; the :class:`~.checkpointer.Checkpointer` runs
them on a background thread from a host snapshot. Fault-injection points a test can crash
at: ``before_rank_file`` and ``after_rank_file`` (every rank), ``before_manifest``,
``before_rename``, ``mid_replace`` (when a tag is overwritten) and ``before_latest`` (rank 0).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

import torch

from ...layout.specs import tensor_name_problem
from ...state import ShardedState
from ..attest.digests import PartitionDigester, StateDigests, Terms, digests_from_terms, held_pieces, scalar_digest
from ...io import jsonvalue
from ...io.dtypes import itemsize_of
from ...io.checksum import FileRecord
from ..coordinator import Coordinator, default_coordinator
from ..directory import TagExistsError, fsync_dir, prepare_staging, publish, root_lock, write_file_durably
from ..format import (
    DEFAULT_BLOCK_SIZE,
    FORMAT_NAME,
    MANIFEST_FILE,
    MODEL_FILE,
    check_tag,
    fp32_key,
    rank_file_name,
    resume_file_name,
    scalar_key,
    state_key,
    state_name_problem,
)
from .binding import binding_metadata, layout_digest
from .manifest import GroupRecord, Manifest, ModelTensorRecord, ResumeRecord, dtype_name, expert_param_names
from .. import run_state
from .model_file import save_model_state
from ...io.safetensors_io import describe_os_error, named_os_error, write_safetensors
from ..model_config import config_problem, stored_name, write_config
from ...io.writer_lock import WriterLock, WriterLockedError

FaultHook = Callable[[str, int], None]
"""Called as ``fault(point, rank)`` at each point of FAULT_POINTS; raising there simulates a crash."""

FAULT_POINTS = (
    "before_rank_file",
    "after_rank_file",
    "before_manifest",
    "before_rename",
    "mid_replace",
    "before_latest",
)


@dataclass(frozen=True)
class SavePlan:
    """What the ranks agreed to save: the result of :func:`plan_save`, the same on every rank."""

    root: Path
    tag: str
    staging: Path
    groups: list[GroupRecord]
    block_size: int
    lock: WriterLock | None = field(default=None, compare=False)  # rank 0's, held until the commit ends

    def release(self) -> None:
        """Give up the root's writer lock (rank 0; idempotent): the save is over."""
        if self.lock is not None:
            self.lock.release()


@dataclass(frozen=True)
class WrittenFiles:
    """What one rank wrote: its files' records, the partial digests of its partitions and the
    digests of its optimizer scalars (per group), and rank 0's description of the model file
    (tensor records, aliases, digests)."""

    files: dict[str, FileRecord]
    terms: Terms = field(default_factory=Terms)
    scalars: list[dict[str, int]] = field(default_factory=list)
    model: tuple[dict[str, ModelTensorRecord], dict[str, str], dict[str, int]] | None = None


def save_sharded(
    root: str | os.PathLike[str],
    tag: str,
    state: ShardedState,
    *,
    coordinator: Coordinator | None = None,
    fault: FaultHook | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    buffer_names: Collection[str] | None = None,
) -> Path:
    """Save this rank's share of a run as checkpoint ``<root>/<tag>``. Collective over the
    ``coordinator``'s ranks (default: torch.distributed's default group when it is
    initialised with several ranks, else a world of one).

    ``model_state`` and ``extra`` are taken from rank 0. ``buffer_names`` marks which
    non-trainable state_dict entries are buffers (the rest are frozen parameters). Returns
    the published directory on every rank.

    Raises:
        ValueError: on every rank, when the tag is not valid or any rank's state is unusable
            (or differs from rank 0's in layout or state names); nothing is published then.
        OSError: on every rank, when a write fails; nothing is published then.
            WriterLockedError (an OSError naming the holder) when another process is saving
            into ``root``: one writer per root at a time.
    """
    coord = coordinator or default_coordinator()
    plan = plan_save(root, tag, state, coord, block_size=block_size)
    try:
        written = write_rank_files(plan, state, buffer_names, coord, fault)
        return commit_save(plan, state, written, coord, fault)
    finally:
        plan.release()


def plan_save(
    root: str | os.PathLike[str],
    tag: str,
    state: ShardedState | None,
    coord: Coordinator,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    problem: str | None = None,
    replace: bool = True,
) -> SavePlan:
    """Collective: check every rank's state and agree; rank 0 prepares the staging directory.

    ``problem`` is this rank's reason not to save (say, its snapshot failed): every rank
    then raises it, instead of this rank alone leaving the others waiting. Unless
    ``replace``, a ``<root>/<tag>`` that exists refuses the save on every rank
    (TagExistsError) before anything is written.
    """
    root = Path(root)
    check_tag(tag)
    groups = _agree_on_state(tag, state, coord, problem)
    taken: list[WriterLock] = []  # rank 0's lock, once it holds it

    def begin() -> str:  # on rank 0; whatever it raises reaches every rank
        lock = root_lock(root, tag).acquire()
        try:
            staging = prepare_staging(root, tag, clean=lock.held, replace=replace)
        except BaseException:
            lock.release()
            raise
        taken.append(lock)
        return str(staging)

    staging = Path(_on_rank0_then_broadcast(coord, begin))
    return SavePlan(root, tag, staging, groups, block_size, taken[0] if taken else None)


def write_rank_files(
    plan: SavePlan,
    state: ShardedState,
    buffer_names: Collection[str] | None,
    coord: Coordinator,
    fault: FaultHook | None = None,
) -> WrittenFiles | str:
    """Not collective (local): write and fsync this rank's files. Returns their records, or a
    one-line error (never raises for a failed write, so that every rank reaches the commit's
    collective)."""
    _fire(fault, "before_rank_file", coord.rank)
    written = _write_own_files(plan, state, buffer_names)
    _fire(fault, "after_rank_file", coord.rank)
    return written


def commit_save(
    plan: SavePlan,
    state: ShardedState,
    written: WrittenFiles | str,
    coord: Coordinator,
    fault: FaultHook | None = None,
    after_publish: Callable[[], None] | None = None,
) -> Path:
    """Collective: once every rank's files are durable, rank 0 writes the manifest, publishes
    the directory and points ``latest`` at it. Every rank returns the path, or raises.

    ``after_publish`` runs on rank 0 once ``latest`` names the new checkpoint, still under
    the root's writer lock (retention: no other writer can move ``latest`` meanwhile); it
    must not raise. Rank 0 releases the lock when the commit ends, either way."""
    try:
        outcomes = coord.all_gather_object(written)
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            if coord.rank == 0:
                shutil.rmtree(plan.staging, ignore_errors=True)
            raise OSError(f"checkpoint {plan.root / plan.tag} not saved: {failures[0]}")

        def commit() -> str:
            try:
                _fire(fault, "before_manifest", coord.rank)
                manifest = _manifest(plan, state, outcomes)
                write_file_durably(plan.staging / MANIFEST_FILE, manifest.to_json())
                fsync_dir(plan.staging)
                published = publish(plan.root, plan.tag, plan.staging, lambda point: _fire(fault, point, coord.rank))
            except Exception as err:
                if not _is_simulated_crash(err):  # a failure (a full disk), not a death: clean up now
                    shutil.rmtree(plan.staging, ignore_errors=True)
                raise
            if after_publish is not None:
                after_publish()
            return str(published)

        return Path(_on_rank0_then_broadcast(coord, commit))
    finally:
        plan.release()


def _fire(fault: FaultHook | None, point: str, rank: int) -> None:
    if fault is None:
        return
    try:
        fault(point, rank)
    except BaseException as err:
        err.simulated_crash = point  # type: ignore[attr-defined]  # a death, not an error to report
        raise


def _is_simulated_crash(err: BaseException) -> bool:
    return getattr(err, "simulated_crash", None) is not None


def _on_rank0_then_broadcast(coord: Coordinator, action: Callable[[], Any]) -> Any:
    """Run ``action`` on rank 0 and hand its result, or its error, to every rank."""
    outcome: tuple[str, Any] | None = None
    if coord.rank == 0:
        try:
            outcome = ("ok", action())
        except WriterLockedError as err:
            outcome = ("locked", str(err))
        except TagExistsError as err:
            outcome = ("exists", str(err))
        except Exception as err:  # noqa: BLE001 - every rank waits for the outcome: it must get one
            if _is_simulated_crash(err):
                raise
            outcome = ("error", describe_os_error(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}")
    kind, value = coord.broadcast_object(outcome)
    if kind == "locked":
        raise WriterLockedError(f"checkpoint save refused: {value}")
    if kind == "exists":
        raise TagExistsError(value)
    if kind == "error":
        raise OSError(f"checkpoint save failed on rank 0: {value}")
    return value


def _agree_on_state(
    tag: str, state: ShardedState | None, coord: Coordinator, problem: str | None
) -> list[GroupRecord]:
    if problem is None and state is None:
        problem = "no state to save"
    try:  # whatever this rank alone hits, it must still reach the gather below
        problem = problem or _problem_with(state, coord)  # type: ignore[arg-type]
        records = None if problem else _group_records(state)  # type: ignore[arg-type]
        layout_json = None if problem else state.layout.to_json()  # type: ignore[union-attr]
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        problem, records, layout_json = f"checking its state failed: {type(err).__name__}: {err}", None, None
    digest = hashlib.sha256(layout_json.encode()).hexdigest() if layout_json else None
    resume = _resume_record(state)
    summary = (problem, tag, digest, [r.to_dict() for r in records] if records else None, resume)
    everyone = coord.all_gather_object(summary)
    for rank, (their_problem, their_tag, their_digest, their_records, their_resume) in enumerate(everyone):
        if their_problem:
            raise ValueError(f"cannot save: rank {rank}: {their_problem}")
        if their_tag != tag:
            raise ValueError(f"cannot save: rank {rank} saves tag {their_tag!r}, this rank {tag!r}")
        if their_digest != everyone[0][2]:
            raise ValueError(f"cannot save: rank {rank}'s layout differs from rank 0's")
        if their_records != everyone[0][3]:
            raise ValueError(f"cannot save: rank {rank}'s optimizer state names or dtypes differ from rank 0's")
        if their_resume != everyone[0][4]:
            raise ValueError(f"cannot save: rank {rank}'s random state or states ({their_resume}) differ from rank 0's")
    return records  # type: ignore[return-value]


def _resume_record(state: ShardedState | None) -> ResumeRecord | None:
    """What the rank's resume file holds, as the manifest records it (every rank's must agree)."""
    if state is None or state.resume is None:
        return None
    return ResumeRecord(rng=state.resume.rng is not None, states=state.resume.scopes())


def _problem_with(state: ShardedState, coord: Coordinator) -> str | None:
    layout = state.layout
    if state.rank != coord.rank or layout.world_size != coord.world_size:
        return f"state is rank {state.rank} of {layout.world_size} but the coordinator is rank {coord.rank} of {coord.world_size}"
    problem = layout.storage_problem()
    if problem:
        return f"the layout cannot be stored: {problem}"
    groups = len(layout.groups)
    for field_name in ("fp32_partitions", "optimizer_states", "optimizer_scalars"):
        if len(getattr(state, field_name)) != groups:
            return f"{field_name} has {len(getattr(state, field_name))} entries for {groups} layout groups"
    for group in layout.groups:
        expected = (group.partition_numel,)
        tensors = {fp32_key(group.index): state.fp32_partitions[group.index]}
        tensors.update({state_key(group.index, n): t for n, t in state.optimizer_states[group.index].items()})
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                return f"{key} has shape {shape}, expected the partition shape {list(expected)}"
        if not state.fp32_partitions[group.index].is_floating_point():
            return f"{fp32_key(group.index)} is {state.fp32_partitions[group.index].dtype}, not a floating point type"
        for name in state.optimizer_states[group.index]:
            problem = state_name_problem(name)
            if problem:
                return f"group {group.index}: {problem}"
        for name in state.optimizer_scalars[group.index]:
            if not isinstance(name, str) or not name or "/" in name:
                return f"group {group.index}: optimizer state name {name!r} cannot be stored"
    if coord.rank == 0:  # only rank 0's are written: the others never encode theirs
        for name in state.model_state:
            problem = tensor_name_problem(name) if isinstance(name, str) else "is not a string"
            if problem:
                return f"model state name {name!r} {problem}; no safetensors file can hold it"
        for name, text in state.model_configs.items():
            problem = config_problem(name, text)
            if problem:
                return problem
        values = [(state.extra, "extra")]
        values += [(group.hyperparameters, f"param_groups[{i}]") for i, group in enumerate(state.param_groups)]
        for value, where in values:
            try:
                jsonvalue.encode(value, where)
            except ValueError as err:
                return str(err)
            except Exception as err:  # noqa: BLE001 - RecursionError: a value that contains itself
                return f"{where} cannot be encoded: {type(err).__name__}: {err}"
    return None


def _group_records(state: ShardedState) -> list[GroupRecord]:
    return [
        GroupRecord(
            fp32_dtype=dtype_name(state.fp32_partitions[g].dtype),
            states={name: dtype_name(t.dtype) for name, t in sorted(state.optimizer_states[g].items())},
            scalars={
                name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in sorted(state.optimizer_scalars[g].items())
            },
        )
        for g in range(len(state.layout.groups))
    ]


def _write_own_files(plan: SavePlan, state: ShardedState, buffer_names: Collection[str] | None) -> WrittenFiles | str:
    """This rank's file records (and rank 0's model description), or a one-line error."""
    writing = rank_file_name(state.rank, state.layout.world_size)
    try:
        terms = Terms()
        files = {writing: _write_rank_file(plan.staging / writing, state, plan.block_size, terms)}
        if state.resume is not None:
            writing = resume_file_name(state.rank, state.layout.world_size)
            data = run_state.file_bytes(state.resume, state.rank, state.layout.world_size)
            write_file_durably(plan.staging / writing, data)
            files[writing] = run_state.file_record(data, plan.block_size)
        scalars = [{n: scalar_digest(t) for n, t in group.items()} for group in state.optimizer_scalars]
        if state.rank != 0:
            return WrittenFiles(files, terms, scalars)
        writing = MODEL_FILE
        experts = expert_param_names(state.layout)  # the rank files hold them, by global expert id
        module_state = {name: t for name, t in state.model_state.items() if name not in experts}
        trainable = set(state.layout.param_names) - experts
        # Read in slices too (each buffer and frozen parameter by one rank of a load): blocks as small.
        model_bytes = sum(t.numel() * t.element_size() for t in module_state.values())
        model_blocks = _block_size_for(model_bytes, plan.block_size)
        model = save_model_state(plan.staging / MODEL_FILE, module_state, trainable, buffer_names, model_blocks)
        files[MODEL_FILE] = model.record
        for config, text in state.model_configs.items():
            files[stored_name(config)] = write_config(plan.staging, stored_name(config), text, plan.block_size)
        return WrittenFiles(files, terms, scalars, (model.tensors, model.aliases, model.digests))
    except OSError as err:  # a full disk: the path of the one file it was writing, once
        return f"rank {state.rank}: {describe_os_error(named_os_error(err, plan.staging / writing))}"
    except Exception as err:  # any error: this rank must still reach the commit's collective
        return f"rank {state.rank}: writing {writing}: {type(err).__name__}: {err}"


def _write_rank_file(path: Path, state: ShardedState, block_size: int, terms: Terms) -> FileRecord:
    """Write the rank file, adding the terms of its partitions' logical tensors to ``terms``."""
    # Scalars first: they sit in the first checksum block with the header, cheap to read alone.
    scalars, partitions = [], []
    observers = {}
    for group in state.layout.groups:
        g = group.index
        pieces = held_pieces(group, state.rank)
        scalars += [(scalar_key(g, n), t) for n, t in sorted(state.optimizer_scalars[g].items())]
        kinds = [("fp32", fp32_key(g), state.fp32_partitions[g])]
        kinds += [(n, state_key(g, n), t) for n, t in sorted(state.optimizer_states[g].items())]
        for kind, key, tensor in kinds:
            partitions.append((key, tensor))
            observers[key] = PartitionDigester(pieces, kind, tensor.element_size(), terms)
    metadata = {"format": FORMAT_NAME, "rank": str(state.rank), "world_size": str(state.layout.world_size)}
    metadata.update(binding_metadata(state.layout, layout_digest(state.layout.to_dict()), state.rank))
    data_bytes = sum(t.numel() * t.element_size() for _, t in scalars + partitions)
    # The partitions from a page boundary: a load reads them past the page cache straight
    # into its state, allocated with the same alignment (io.direct_reads).
    first = partitions[0][0] if partitions else None
    return write_safetensors(path, scalars + partitions, _block_size_for(data_bytes, block_size), metadata, observers, first)


def _block_size_for(data_bytes: int, block_size: int) -> int:
    """At least 16 checksum blocks per rank file (down to 4 KiB blocks), so a reader of a
    slice of a small file (large D) does not read and check the whole file for it."""
    smaller = block_size
    while smaller > 4096 and smaller * 16 > data_bytes:
        smaller //= 2
    return smaller


def _manifest(plan: SavePlan, state: ShardedState, outcomes: list[WrittenFiles]) -> Manifest:
    files: dict[str, FileRecord] = {}
    for outcome in outcomes:
        files.update(outcome.files)
    assert outcomes[0].model is not None
    tensors, aliases, model_digests = outcomes[0].model
    return Manifest(
        tag=plan.tag,
        layout=state.layout,
        optimizer_class=state.optimizer_class,
        param_groups=list(state.param_groups),
        groups=tuple(plan.groups),
        model_tensors=dict(tensors),
        aliases=dict(aliases),
        extra=state.extra,
        files=files,
        digests=_combined_digests(plan, state, outcomes, model_digests),
        resume=_resume_record(state),
    )


def _combined_digests(
    plan: SavePlan, state: ShardedState, outcomes: list[WrittenFiles], model: dict[str, int]
) -> StateDigests:
    """Every rank's partial digests combined; ValueError when a logical tensor is not covered
    exactly once or a rank's optimizer scalars differ from rank 0's (a bug: nothing is saved)."""
    for rank, outcome in enumerate(outcomes):
        if outcome.scalars != outcomes[0].scalars:
            differ = [g for g, (a, b) in enumerate(zip(outcome.scalars, outcomes[0].scalars)) if a != b]
            raise ValueError(f"rank {rank}'s optimizer scalars (groups {differ}) differ from rank 0's; they must be equal")
    terms = Terms()
    for outcome in outcomes:
        terms.merge(outcome.terms)
    kinds = {g: ("fp32", *record.states) for g, record in enumerate(plan.groups)}
    sizes = {(g, "fp32"): itemsize_of(record.fp32_dtype) for g, record in enumerate(plan.groups)}
    sizes.update({(g, n): itemsize_of(dtype) for g, record in enumerate(plan.groups) for n, dtype in record.states.items()})
    params, problems = digests_from_terms(state.layout, terms, kinds, sizes)
    if problems:
        raise ValueError(f"the ranks' partitions do not tile the logical state: {problems[0]}")
    return StateDigests(params, list(outcomes[0].scalars), model)
