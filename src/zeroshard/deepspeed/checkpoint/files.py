"""What DeepSpeed's ZeRO-1/2 checkpoint files hold, as plain dataclasses.

Two kinds of file in a tag folder (DeepSpeed 0.19; docs/DEEPSPEED.md):

* ``mp_rank_00_model_states.pt``: the full module state_dict, each optimizer group's
  parameter names and shapes in flat-buffer order, step counters, lr scheduler;
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: rank R's fp32 master partition of
  every group (tail padding stripped), its optimizer state (tail padding kept), and what
  DeepSpeed says about its layout (paddings, partition counts, slice mappings).

Finding the files (tag folder, ``latest``, rank files, layouts and formats we refuse) is
:mod:`.paths`'s job.
Parsing checks types and shapes, not the layout; that is :mod:`.source`'s job. Every file
is read within its budget (:mod:`zeroshard.io.budget`): what parsing walks again
for each reference to a shared container, the tensors kept and the values copied out are
charged to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ...io.budget import DICT_ITEM_BYTES, UNCHARGED_BYTES, Budget, BudgetExceeded, quoted
from . import fields
from .autoep_files import AutoEP, parse_autoep
from .pickled import (
    DeepSpeedFormatError,
    FragmentAddress,
    LossScaler,
    ZeroStageEnum,
    load_checkpoint_file,
)
from ...torchfile.torch_file import StoredTensor, TorchFileError

PARAM_BYTES = 512  # what a parameter of param_shapes costs in the layout rebuilt from it, at most

@dataclass
class ModelStates:
    """The model-states file, reduced to what an importer needs."""

    path: Path
    module: dict[str, StoredTensor]  # full state_dict; empty when DeepSpeed stored None
    param_shapes: list[dict[str, tuple[int, ...]]]  # per group, flat-buffer order
    buffer_names: list[str]
    shared_params: dict[str, str]  # alias -> canonical name
    counters: dict[str, Any]  # global_steps, global_samples, skipped_steps, dp_world_size
    lr_scheduler: Any
    ds_config: dict[str, Any]
    ds_version: str | None
    autoep: AutoEP | None = None  # ds_autoep_layers: a run with DeepSpeed AutoEP
    budget: Budget | None = field(default=None, repr=False, compare=False)  # the file's, charged on


@dataclass
class RankShard:
    """One rank's optimizer-states file."""

    path: Path
    rank: int
    zero_stage: int
    fp32: list[StoredTensor]  # per group; tail padding stripped
    states: list[dict[str, StoredTensor]]  # per group; partition-shaped optimizer state
    scalars: list[dict[str, Any]]  # per group; the rest (step): tensors (see read_scalars) or plain values
    param_groups: list[dict[str, Any]]  # the inner optimizer's hyperparameters, per group
    group_paddings: list[int]
    param_alignment_paddings: list[list[int]] | None  # None: written before DeepSpeed had the key
    partition_count: list[int]
    slice_mappings: list[dict[str, tuple[int, int]]]  # per group: name -> (numel, start)
    loss_scaler: dict[str, Any]
    clip_grad: Any
    ds_version: str | None  # (its ds_config is the model-states file's; not read here)
    pickle: bytes = field(default=b"", repr=False, compare=False)  # what the file's pickle was
    kept_bytes: int = field(default=0, repr=False, compare=False)  # of its tensors, charged to its budget
    budget: Budget | None = field(default=None, repr=False, compare=False)  # the file's, charged on


_Read = TypeVar("_Read", bound=Callable[..., Any])


def _within_budget(read: _Read) -> _Read:
    """A file that costs more than its budget is a DeepSpeedFormatError, as any other fault."""

    @functools.wraps(read)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return read(*args, **kwargs)
        except BudgetExceeded as err:
            raise DeepSpeedFormatError(str(err)) from None

    return checked  # type: ignore[return-value]


@_within_budget
def read_model_states(path: Path) -> ModelStates:
    """The model-states file ``path`` (``mp_rank_00_model_states.pt``), every field the
    importer uses checked, and what it keeps charged to the file's budget.

    Raises:
        DeepSpeedFormatError: the file does not unpickle under the allowed globals, a field
            is missing or of the wrong type, the AutoEP metadata is inconsistent, or it costs
            more than its budget; one line naming the file (and the field).
    """
    raw, _, budget = load_checkpoint_file(path)
    module = fields.optional_mapping(raw.get("module"), "module", path)
    strays = [name for name, value in module.items() if not isinstance(value, StoredTensor)]
    if strays:
        raise DeepSpeedFormatError(f"{path}: module entries {quoted(strays[:3])} are not tensors")
    fields.charge_tensors(module.values(), budget, "reading the module's tensors")
    counter_keys = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size")
    ds_config = _ds_config(raw.get("ds_config"), path, budget)
    return ModelStates(
        path=path,
        module=module,
        param_shapes=_param_shapes(_require(raw, "param_shapes", path), path, budget),
        buffer_names=fields.texts(raw.get("buffer_names") or [], "buffer_names", path),
        shared_params={
            alias: fields.text(target, f"shared_params[{quoted(alias)}]", path)
            for alias, target in fields.optional_mapping(raw.get("shared_params"), "shared_params", path).items()
        },
        counters={key: fields.integer(raw[key], key, path) for key in counter_keys if raw.get(key) is not None},
        lr_scheduler=fields.plain(raw.get("lr_scheduler"), "lr_scheduler", path, budget),
        ds_config=ds_config,
        ds_version=fields.optional_text(raw.get("ds_version"), "ds_version", path),
        autoep=parse_autoep(raw, ds_config, path, budget),
        budget=budget,
    )


@_within_budget
def read_rank_shard(
    path: Path, rank: int, like: RankShard | None = None, after: RankShard | None = None
) -> RankShard:
    """Rank ``rank``'s optimizer file. Values equal to those of ``like`` (rank 0's shard, its
    fields checked already) are not walked again: at large D every rank repeats the same
    hyperparameters and paddings. (Equality with a checked value bounds a hostile one: the
    comparison stops at the checked value's depth.) A file whose pickle is byte for byte that
    of ``after`` (the shard read before it) is not checked again at all: the same bytes
    unpickle to the same values, so only its tensors, views of its own records, are new."""
    raw, pickled, budget = load_checkpoint_file(path)
    if after is not None and after.pickle and pickled == after.pickle:
        if after.kept_bytes > UNCHARGED_BYTES:
            budget.charge(after.kept_bytes, "reading its tensors")
        return _same_pickle_as(after, raw, path, rank, budget)
    state = _require(raw, "optimizer_state_dict", path)
    if not fields.is_mapping(state):
        state = fields.mapping(state, "optimizer_state_dict", path)
    if "zero_stage" not in state:
        raise DeepSpeedFormatError(
            f"{path}: no zero_stage: not written by DeepSpeed's ZeRO stage 1/2 optimizer "
            "(BF16_Optimizer checkpoints are not supported)"
        )
    stage = fields.integer(state["zero_stage"], "zero_stage", path)
    if stage not in (ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients):
        raise DeepSpeedFormatError(f"{path}: ZeRO stage {stage} checkpoints are not supported (only stages 1 and 2)")
    base = _require(state, "base_optimizer_state", path)
    if isinstance(base, list):
        raise DeepSpeedFormatError(f"{path}: elastic_checkpoint optimizer state is not supported")
    if not fields.is_mapping(base):
        base = fields.mapping(base, "base_optimizer_state", path)
    fp32_key = "single_partition_of_fp32_groups"
    fp32 = fields.sequence(_require(state, fp32_key, path), fp32_key, path)
    groups = fields.sequence(_require(base, "param_groups", path), "param_groups", path)
    param_groups = [_param_group(group, i, path, budget) for i, group in enumerate(groups)]
    optimizer_state = fields.optional_dict(base.get("state"), "base_optimizer_state['state']", path)
    states, scalars = _split_optimizer_state(optimizer_state, param_groups, path, budget)
    fp32 = [t if fields.is_vector(t) else fields.vector(t, f"{fp32_key}[{i}]", path) for i, t in enumerate(fp32)]
    kept = [*fp32, *(t for group in states for t in group.values())]
    kept += [value for group in scalars for value in group.values() if isinstance(value, StoredTensor)]
    return RankShard(
        path=path,
        rank=rank,
        zero_stage=stage,
        fp32=fp32,
        states=states,
        scalars=scalars,
        param_groups=_hyperparameters(param_groups, path, like.param_groups if like else None, budget),
        group_paddings=fields.integers(_require(state, "group_paddings", path), "group_paddings", path),
        param_alignment_paddings=_alignment_paddings(
            state.get("param_alignment_paddings"), path, like.param_alignment_paddings if like else None, budget
        ),
        partition_count=fields.integers(_require(state, "partition_count", path), "partition_count", path),
        slice_mappings=_slice_mappings(_require(state, "param_slice_mappings", path), path, budget),
        loss_scaler=_loss_scaler(state.get("loss_scaler"), path, budget),
        clip_grad=fields.plain(state.get("clip_grad"), "clip_grad", path, budget),
        ds_version=fields.optional_text(raw.get("ds_version"), "ds_version", path),
        pickle=pickled,
        kept_bytes=fields.charge_tensors(kept, budget, "reading its tensors"),
        budget=budget,
    )


def _same_pickle_as(checked: RankShard, raw: dict[str, Any], path: Path, rank: int, budget: Budget) -> RankShard:
    """The shard of a file unpickled from the bytes ``checked`` was: every value and verdict is
    ``checked``'s, and its tensors sit where :func:`read_rank_shard` found ``checked``'s."""
    state = raw["optimizer_state_dict"]
    base = state["base_optimizer_state"]
    optimizer_state = base.get("state") or {}
    states, scalars = [], []
    for group, vectors, others in zip(base["param_groups"], checked.states, checked.scalars):
        entries = optimizer_state.get(group["params"][0]) or {}
        states.append({key: entries[key] for key in vectors})
        scalars.append({key: entries[key] for key in others})
    fp32 = list(state["single_partition_of_fp32_groups"])
    return replace(checked, path=path, rank=rank, fp32=fp32, states=states, scalars=scalars, budget=budget)


def _param_shapes(value: Any, path: Path, budget: Budget) -> list[dict[str, tuple[int, ...]]]:
    """Per group, each parameter's shape; every parameter (and every dimension) charged to
    ``budget`` for the layout built from it before it is copied, however often the pickle
    repeats a group or a shape."""
    groups = []
    for index, group in enumerate(fields.sequence(value, "param_shapes", path, budget)):
        where = f"param_shapes[{index}]"
        entries = len(group) if isinstance(group, dict) else 0  # charged before the dict is walked or copied
        budget.charge(PARAM_BYTES * entries, "rebuilding the layout of param_shapes[{}]", index)
        shapes = fields.mapping(group, where, path)
        parsed = {name: fields.shape(dims, f"{where}[{quoted(name)}]", path, budget) for name, dims in shapes.items()}
        groups.append(parsed)
    return groups


def _param_group(group: Any, index: int, path: Path, budget: Budget) -> dict[str, Any]:
    budget.charge(DICT_ITEM_BYTES * len(group) if isinstance(group, dict) else 0, "reading param_groups")
    if fields.is_mapping(group):
        return group
    return fields.mapping(group, f"base_optimizer_state['param_groups'][{index}]", path)


# Sections of ds_config the importer reads, which must be dicts where present
# (zero_optimization may also be DeepSpeed's legacy bool).
_CONFIG_SECTIONS = ("bf16", "bfloat16", "fp16", "optimizer")


def _ds_config(value: Any, path: Path, budget: Budget) -> dict[str, Any]:
    config = fields.plain(fields.optional_mapping(value, "ds_config", path), "ds_config", path, budget)
    for section in _CONFIG_SECTIONS:
        fields.optional_mapping(config.get(section), f"ds_config[{section!r}]", path)
    if not isinstance(config.get("zero_optimization"), bool):
        fields.optional_mapping(config.get("zero_optimization"), "ds_config['zero_optimization']", path)
    optimizer = config.get("optimizer") or {}
    fields.optional_mapping(optimizer.get("params"), "ds_config['optimizer']['params']", path)
    fields.optional_text(optimizer.get("type"), "ds_config['optimizer']['type']", path)
    return config


def _hyperparameters(
    groups: list[dict[str, Any]], path: Path, checked: list[dict[str, Any]] | None, budget: Budget
) -> list[dict[str, Any]]:
    hypers = [{key: value for key, value in group.items() if key != "params"} for group in groups]
    if hypers == checked:
        return checked
    where = "base_optimizer_state['param_groups']"
    return [fields.plain(hyper, f"{where}[{index}]", path, budget) for index, hyper in enumerate(hypers)]


def _split_optimizer_state(
    state: dict[Any, Any], param_groups: list[dict[str, Any]], path: Path, budget: Budget
) -> tuple[list[dict[str, StoredTensor]], list[dict[str, Any]]]:
    """Per group: 1-D state (one value per partition element) and everything else."""
    vectors: list[dict[str, StoredTensor]] = []
    scalars: list[dict[str, Any]] = []
    for index, group in enumerate(param_groups):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != 1 or type(ids[0]) is not int:
            raise DeepSpeedFormatError(
                f"{path}: optimizer group {index} should hold one flat partition: params={quoted(ids)}"
            )
        entries = state.get(ids[0])
        walked = len(entries) if isinstance(entries, dict) else 0  # charged before it is walked or copied
        budget.charge(DICT_ITEM_BYTES * walked, "reading base_optimizer_state['state']")
        if not fields.is_mapping(entries):
            entries = fields.optional_mapping(entries, f"base_optimizer_state['state'][{quoted(ids[0])}]", path)
        group_vectors: dict[str, StoredTensor] = {}
        group_scalars: dict[str, Any] = {}
        for key, value in entries.items():
            if fields.is_vector(value):
                group_vectors[key] = value
                continue
            where = f"base_optimizer_state['state'][{quoted(ids[0])}][{quoted(key)}]"
            if _is_vector(value):  # 1-D, but not a flat partition: an error naming the entry
                group_vectors[key] = fields.vector(value, where, path)
            else:
                group_scalars[key] = _as_value(value, where, path, budget)
        vectors.append(group_vectors)
        scalars.append(group_scalars)
    return vectors, scalars


def _alignment_paddings(
    value: Any, path: Path, checked: list[list[int]] | None, budget: Budget
) -> list[list[int]] | None:
    if value is None:
        return None
    if value == checked:
        return checked
    field = "param_alignment_paddings"
    groups = fields.sequence(value, field, path, budget)
    return [fields.integers(group, f"{field}[{i}]", path, budget) for i, group in enumerate(groups)]


def _slice_mappings(value: Any, path: Path, budget: Budget) -> list[dict[str, tuple[int, int]]]:
    parsed: list[dict[str, tuple[int, int]]] = []
    for index, mapping in enumerate(fields.sequence(value, "param_slice_mappings", path)):
        entries = len(mapping) if isinstance(mapping, dict) else 0
        budget.charge(DICT_ITEM_BYTES * entries, "reading param_slice_mappings")
        if not fields.is_mapping(mapping):
            mapping = fields.mapping(mapping, f"param_slice_mappings[{index}]", path)
        group: dict[str, tuple[int, int]] = {}
        for name, address in mapping.items():
            if isinstance(address, FragmentAddress):
                numel, start = vars(address).get("numel"), vars(address).get("start")
                if type(numel) is int and type(start) is int and numel >= 0 and start >= 0:
                    group[name] = (numel, start)
                    continue
            group[name] = _fragment(address, f"param_slice_mappings[{index}][{quoted(name)}]", path)
        parsed.append(group)
    return parsed


def _fragment(address: Any, field: str, path: Path) -> tuple[int, int]:
    """(numel, start) of a fragment_address, or the error saying what is wrong with it."""
    if not isinstance(address, FragmentAddress):
        raise fields.field_error(path, field, f"is {type(address).__name__}, expected a fragment_address")
    numel, start = (fields.integer(vars(address).get(k), f"{field}.{k}", path) for k in ("numel", "start"))
    return numel, start


def _loss_scaler(value: Any, path: Path, budget: Budget) -> dict[str, Any]:
    if isinstance(value, LossScaler):
        # Plain values only: the stand-in object itself cannot go into a manifest.
        found = {k: v for k, v in vars(value).items() if isinstance(v, (bool, int, float, str)) or v is None}
        return fields.plain(found, "loss_scaler", path, budget)
    return {}


def _is_vector(value: Any) -> bool:
    return isinstance(value, StoredTensor) and len(value.shape) == 1


def _as_value(value: Any, field: str, path: Path, budget: Budget) -> Any:
    """A tensor as it is (not read yet: only rank 0's are used); anything else, if plain."""
    return value if isinstance(value, StoredTensor) else fields.plain(value, field, path, budget)


def read_scalars(scalars: dict[str, Any]) -> dict[str, Any]:
    """A group's scalars with its tensors read into numpy arrays."""
    try:
        return {key: value.numpy() if isinstance(value, StoredTensor) else value for key, value in scalars.items()}
    except TorchFileError as err:
        raise DeepSpeedFormatError(str(err)) from None


def _require(container: dict[str, Any], key: str, path: Path) -> Any:
    if key not in container:
        raise DeepSpeedFormatError(f"{path}: missing {key!r}")
    return container[key]
