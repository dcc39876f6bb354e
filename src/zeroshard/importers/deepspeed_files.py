"""What DeepSpeed's ZeRO-1/2 checkpoint files hold, as plain dataclasses.

Two kinds of file in a tag folder (DeepSpeed 0.19; docs/DEEPSPEED.md):

* ``mp_rank_00_model_states.pt``: the full module state_dict, each optimizer group's
  parameter names and shapes in flat-buffer order, step counters, lr scheduler;
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: rank R's fp32 master partition of
  every group (tail padding stripped), its optimizer state (tail padding kept), and what
  DeepSpeed says about its layout (paddings, partition counts, slice mappings).

Finding the files (tag folder, ``latest``, rank files, layouts we refuse) is here too.
Parsing checks types and shapes, not the layout; that is :mod:`.deepspeed`'s job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deepspeed_pickle import DeepSpeedFormatError, FragmentAddress, LossScaler, ZeroStageEnum, load_checkpoint_file
from .torch_file import StoredTensor

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
LATEST_FILE = "latest"
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_UNSUPPORTED_FILES = (
    (re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$"), "ZeRO stage 3 checkpoints are not supported"),
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline-parallel checkpoints are not supported"),
    (
        re.compile(r"^mp_rank_(0[1-9]|[1-9]\d*)_model_states\.pt$"),
        "tensor/model-parallel checkpoints are not supported",
    ),
    (
        re.compile(r"^(bf16_)?expp?_rank_\d+_mp_rank_\d+_optim_states\.pt$|^.*expert_\d+.*\.pt$"),
        "MoE checkpoints are not supported",
    ),
)


def find_tag_dir(path: str | Path) -> Path:
    """The tag folder of a DeepSpeed checkpoint: ``path`` itself, or the folder its
    ``latest`` file names. Raises FileNotFoundError or DeepSpeedFormatError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise DeepSpeedFormatError(f"{path}: not a directory")
    if (path / MODEL_STATES_FILE).is_file() or _rank_files(path):
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise DeepSpeedFormatError(f"{latest}: does not name a tag folder ({tag!r})")
        if not (path / tag).is_dir():
            raise DeepSpeedFormatError(f"{latest}: names tag {tag!r}, but {path / tag} does not exist")
        return path / tag
    raise DeepSpeedFormatError(f"{path}: not a DeepSpeed checkpoint (no {MODEL_STATES_FILE} and no {LATEST_FILE} file)")


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint (tag folder or its parent).
    Only file names are looked at; :func:`open_deepspeed` checks the content."""
    try:
        tag_dir = find_tag_dir(path)
    except (OSError, ValueError):
        return False
    return (tag_dir / MODEL_STATES_FILE).is_file() or any(
        p.name.endswith("_model_states.pt") for p in tag_dir.iterdir()
    )


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


@dataclass
class RankShard:
    """One rank's optimizer-states file."""

    path: Path
    rank: int
    zero_stage: int
    fp32: list[StoredTensor]  # per group; tail padding stripped
    states: list[dict[str, StoredTensor]]  # per group; partition-shaped optimizer state
    scalars: list[dict[str, Any]]  # per group; the rest (step): numpy arrays or plain values
    param_groups: list[dict[str, Any]]  # the inner optimizer's hyperparameters, per group
    group_paddings: list[int]
    param_alignment_paddings: list[list[int]] | None  # None: written before DeepSpeed had the key
    partition_count: list[int]
    slice_mappings: list[dict[str, tuple[int, int]]]  # per group: name -> (numel, start)
    loss_scaler: dict[str, Any]
    clip_grad: Any
    ds_config: dict[str, Any]
    ds_version: str | None


def read_model_states(path: Path) -> ModelStates:
    raw = load_checkpoint_file(path)
    module = raw.get("module") or {}
    strays = [name for name, value in module.items() if not isinstance(value, StoredTensor)]
    if strays:
        raise DeepSpeedFormatError(f"{path}: module entries {strays[:3]} are not tensors")
    param_shapes = _require(raw, "param_shapes", list, path)
    try:
        shapes = [{str(name): tuple(int(d) for d in shape) for name, shape in group.items()} for group in param_shapes]
    except (AttributeError, TypeError, ValueError):
        raise DeepSpeedFormatError(f"{path}: param_shapes is not a list of name -> shape mappings") from None
    counter_keys = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size")
    return ModelStates(
        path=path,
        module=dict(module),
        param_shapes=shapes,
        buffer_names=list(raw.get("buffer_names") or []),
        shared_params=dict(raw.get("shared_params") or {}),
        counters={key: raw[key] for key in counter_keys if key in raw},
        lr_scheduler=raw.get("lr_scheduler"),
        ds_config=dict(raw.get("ds_config") or {}),
        ds_version=raw.get("ds_version"),
    )


def read_rank_shard(path: Path, rank: int) -> RankShard:
    raw = load_checkpoint_file(path)
    state = _require(raw, "optimizer_state_dict", dict, path)
    if "zero_stage" not in state:
        raise DeepSpeedFormatError(
            f"{path}: no zero_stage: not written by DeepSpeed's ZeRO stage 1/2 optimizer "
            "(BF16_Optimizer checkpoints are not supported)"
        )
    stage = int(state["zero_stage"])
    if stage not in (ZeroStageEnum.optimizer_states, ZeroStageEnum.gradients):
        raise DeepSpeedFormatError(f"{path}: ZeRO stage {stage} checkpoints are not supported (only stages 1 and 2)")
    base = _require(state, "base_optimizer_state", (dict, list), path)
    if not isinstance(base, dict):
        raise DeepSpeedFormatError(f"{path}: elastic_checkpoint optimizer state is not supported")
    fp32 = _require(state, "single_partition_of_fp32_groups", list, path)
    param_groups = _require(base, "param_groups", list, path)
    states, scalars = _split_optimizer_state(base.get("state") or {}, param_groups, path)
    return RankShard(
        path=path,
        rank=rank,
        zero_stage=stage,
        fp32=[_require_vector(t, f"single_partition_of_fp32_groups[{i}]", path) for i, t in enumerate(fp32)],
        states=states,
        scalars=scalars,
        param_groups=[{k: v for k, v in group.items() if k != "params"} for group in param_groups],
        group_paddings=[int(p) for p in _require(state, "group_paddings", list, path)],
        param_alignment_paddings=_alignment_paddings(state.get("param_alignment_paddings"), path),
        partition_count=[int(c) for c in _require(state, "partition_count", list, path)],
        slice_mappings=_slice_mappings(_require(state, "param_slice_mappings", list, path), path),
        loss_scaler=_loss_scaler(state.get("loss_scaler")),
        clip_grad=state.get("clip_grad"),
        ds_config=dict(raw.get("ds_config") or {}),
        ds_version=raw.get("ds_version"),
    )


def _split_optimizer_state(
    state: dict[Any, Any], param_groups: list[dict[str, Any]], path: Path
) -> tuple[list[dict[str, StoredTensor]], list[dict[str, Any]]]:
    """Per group: 1-D state (one value per partition element) and everything else."""
    vectors: list[dict[str, StoredTensor]] = []
    scalars: list[dict[str, Any]] = []
    for index, group in enumerate(param_groups):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != 1:
            raise DeepSpeedFormatError(
                f"{path}: optimizer group {index} should hold one flat partition, found params={ids!r}"
            )
        entries = state.get(ids[0], {})
        vectors.append({k: v for k, v in entries.items() if _is_vector(v)})
        scalars.append({k: _as_value(v) for k, v in entries.items() if not _is_vector(v)})
    return vectors, scalars


def _alignment_paddings(value: Any, path: Path) -> list[list[int]] | None:
    if value is None:
        return None
    try:
        return [[int(p) for p in group] for group in value]
    except (TypeError, ValueError):
        raise DeepSpeedFormatError(f"{path}: param_alignment_paddings is not a list of integer lists") from None


def _slice_mappings(groups: list[Any], path: Path) -> list[dict[str, tuple[int, int]]]:
    parsed: list[dict[str, tuple[int, int]]] = []
    for index, mapping in enumerate(groups):
        if not isinstance(mapping, dict) or not all(isinstance(a, FragmentAddress) for a in mapping.values()):
            raise DeepSpeedFormatError(
                f"{path}: param_slice_mappings[{index}] is not a name -> fragment_address mapping"
            )
        parsed.append({str(name): (int(a.numel), int(a.start)) for name, a in mapping.items()})
    return parsed


def _loss_scaler(value: Any) -> dict[str, Any]:
    if isinstance(value, LossScaler):
        # Plain values only: the stand-in object itself cannot go into a manifest.
        return {k: v for k, v in vars(value).items() if isinstance(v, (bool, int, float, str)) or v is None}
    return {}


def _is_vector(value: Any) -> bool:
    return isinstance(value, StoredTensor) and len(value.shape) == 1


def _as_value(value: Any) -> Any:
    """A small tensor read into a numpy array; anything else as it is."""
    return value.numpy() if isinstance(value, StoredTensor) else value


def _require(container: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    if key not in container:
        raise DeepSpeedFormatError(f"{path}: missing {key!r}")
    value = container[key]
    if not isinstance(value, kind):
        raise DeepSpeedFormatError(f"{path}: {key!r} is a {type(value).__name__}, expected {kind}")
    return value


def _require_vector(value: Any, what: str, path: Path) -> StoredTensor:
    if not _is_vector(value) or not value.is_contiguous():
        raise DeepSpeedFormatError(f"{path}: {what} is not a 1-D tensor")
    return value


# ---- finding the files ------------------------------------------------------------------


def refuse_unsupported(tag_dir: Path) -> None:
    names = [p.name for p in tag_dir.iterdir()]
    for pattern, message in _UNSUPPORTED_FILES:
        found = next((n for n in names if pattern.match(n)), None)
        if found:
            raise DeepSpeedFormatError(f"{tag_dir}: {message} (found {found})")


def model_states_path(tag_dir: Path) -> Path:
    path = tag_dir / MODEL_STATES_FILE
    if not path.is_file():
        raise DeepSpeedFormatError(f"{tag_dir}: {MODEL_STATES_FILE} is missing")
    return path


def _rank_files(tag_dir: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = _RANK_FILE.match(path.name)
        if match:
            rank = int(match.group(2))
            if rank in found:
                raise DeepSpeedFormatError(
                    f"{tag_dir}: two optimizer files for rank {rank}: {found[rank].name}, {path.name}"
                )
            found[rank] = path
    return found


def rank_file_paths(tag_dir: Path) -> list[Path]:
    """Rank files in rank order; a gap is a missing file, named."""
    found = _rank_files(tag_dir)
    if not found:
        raise DeepSpeedFormatError(f"{tag_dir}: no *zero_pp_rank_*_mp_rank_00_optim_states.pt files")
    prefix = "bf16_" if found[min(found)].name.startswith("bf16_") else ""
    for rank in range(max(found) + 1):
        if rank not in found:
            raise DeepSpeedFormatError(f"{tag_dir}: {prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt is missing")
    return [found[rank] for rank in range(len(found))]
