"""A DeepSpeed config read and checked into what :func:`~zeroshard.deepspeed.config.from_deepspeed_config`
builds, before anything is built: the engine's arguments, the optimizer and scheduler
classes, the batch sizes. Every refusal is a one-line ValueError naming the key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..io import jsonvalue
from ..io.members import read_small_file
from .keys import classify
from .muon import MuonHalves, is_muon, muon_halves
from .optimizer import optimizer_from_config
from .values import arguments, flag, integer, number, positive, refusal, required_arguments, setting
from ..engine.scaler import DeepSpeedLossScaler, LossScaler
from ..layout import LayoutPolicy
from .lr_schedules import SCHEDULES

_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MAX_CONFIG_BYTES = 16 << 20  # a DeepSpeed config file holds a few KB of settings, not a stream
_MAX_SCALE_POWER = 127  # 2**127 is the largest power of two an fp32 holds


@dataclass(frozen=True)
class BatchSizes:
    """DeepSpeed's three batch numbers, resolved and checked as DeepSpeed does:
    ``train_batch_size == micro_batch_size * gradient_accumulation_steps * world_size``."""

    train_batch_size: int  # rows per optimizer step, over all ranks
    micro_batch_size: int  # rows one rank feeds one backward (train_micro_batch_size_per_gpu)
    gradient_accumulation_steps: int  # backward calls per optimizer step
    world_size: int  # data-parallel ranks


@dataclass
class Plan:
    """What the config asks for, checked, before anything is built."""

    values: dict[str, Any]
    ignored: dict[str, str]
    batch: BatchSizes
    dtype: torch.dtype | None
    optimizer_class: type[torch.optim.Optimizer]
    engine_options: dict[str, Any]
    notes: list[str]
    schedule: type[torch.optim.lr_scheduler.LRScheduler] | None
    schedule_params: dict[str, Any]
    muon: MuonHalves | None = None  # DeepSpeed's Muon: the param groups are built from the model


def plan_run(config: Any, world_size: int, client_optimizer: Any) -> Plan:
    """Read ``config`` (a dict or a JSON file's path) and check every key for a run of
    ``world_size`` ranks. Not collective: ``from_deepspeed_config`` agrees on the outcome.

    Raises:
        ValueError: one line naming every refused key and why, or the first value that
            cannot be honoured. FileNotFoundError: the config file does not exist.
    """
    raw = read_config(config)
    classified = classify(raw)
    refusals = classified.refusals + _auto_values(raw)
    if refusals:
        raise ValueError(f"DeepSpeed config refused: {'; '.join(refusals)}")
    values = classified.values
    dtype = _param_dtype(values, raw)
    stage = _stage(values)
    clip = number(values, "gradient_clipping", 0.0)
    if clip > 0 and raw.get("zero_optimization", {}).get("compute_grad_norm") is False:
        raise ValueError(
            "DeepSpeed config refused: zero_optimization.compute_grad_norm = False with gradient_clipping > 0: "
            "zeroshard clips by the norm it computes; drop one of the two"
        )
    muon = _muon(raw.get("optimizer"), client_optimizer, clip)
    if muon is not None:
        optimizer_class, optimizer_options, notes = torch.optim.Muon, {}, list(muon.notes)
    else:
        optimizer_class, optimizer_options, notes = optimizer_from_config(raw.get("optimizer"), client_optimizer)
    batch = resolve_batch_sizes(values, world_size)
    options: dict[str, Any] = {
        "stage": stage,
        "param_dtype": dtype,
        "reduce_dtype": _reduce_dtype(values),
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "max_grad_norm": clip if clip > 0 else None,
        "loss_scaler": _loss_scaler(values, dtype),
        "offload": _offload(values),
        **optimizer_options,
    }
    bucket = values.get("zero_optimization.reduce_bucket_size")
    if bucket is not None:
        bucket = positive(bucket, "zero_optimization.reduce_bucket_size")
    if bucket is not None and stage == 2:
        options["policy"] = LayoutPolicy.native(bucket_numel=bucket)
    _expert_parallel(values)
    schedule, schedule_params = _schedule(values)
    return Plan(
        values, classified.noops, batch, dtype, optimizer_class, options, notes, schedule, schedule_params, muon
    )


def _muon(section: Any, client_optimizer: Any, clip: float) -> MuonHalves | None:
    """DeepSpeed's Muon and the Adam beside it, when the section names it; else None."""
    if not is_muon(section):
        return None
    if client_optimizer is not None:
        raise ValueError("DeepSpeed config refused: optimizer: the config names one and optimizer_class= gives another")
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise refusal("optimizer.params", params, "must be a JSON object of the optimizer's arguments")
    return muon_halves(params, clip)


def read_config(config: Any) -> dict[str, Any]:
    """The config as a dict: a JSON file is read without waiting on a FIFO, at most
    16 MiB of it, nested at most jsonvalue.MAX_DEPTH deep (a dict given is held to that too)."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            data = read_small_file(path, _MAX_CONFIG_BYTES)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such DeepSpeed config file") from None
        except OSError as err:
            raise ValueError(f"{path}: cannot read the DeepSpeed config: {err.strerror or err}") from None
        try:
            config = jsonvalue.loads(data, path)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not valid JSON (not UTF-8 text)") from None
    elif jsonvalue.deeper_than(config, jsonvalue.MAX_DEPTH):
        raise ValueError(f"DeepSpeed config refused: nested more than {jsonvalue.MAX_DEPTH} levels deep")
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config is a JSON object of settings, got {type(config).__name__}")
    return dict(config)


def _auto_values(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keys whose value is "auto": the Hugging Face Trainer fills those in; DeepSpeed does not."""
    found = []
    for key, value in config.items():
        if isinstance(value, Mapping):
            found += _auto_values(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(f"{prefix}{key} = 'auto': the Hugging Face Trainer fills it in; give the value")
    return found


def _stage(values: Mapping[str, Any]) -> int:
    """The ZeRO stage: the integer 1 or 2. 0 and 3 are refused as what they are; any other
    value ("2", true, 2.0) as no stage at all, not taken for another."""
    stage = setting(values, "zero_optimization.stage", 0)
    if type(stage) is int and stage in (1, 2):
        return stage
    if type(stage) is int and stage in (0, 3):
        why = "no ZeRO (plain data parallelism)" if stage == 0 else "ZeRO-3, which zeroshard does not have"
        raise refusal("zero_optimization.stage", stage, f"{why}; set it to 1 or 2")
    raise refusal("zero_optimization.stage", stage, "must be the integer 1 or 2")


def _enabled(values: Mapping[str, Any], section: str) -> bool:
    return flag(values, f"{section}.enabled", False)


def _param_dtype(values: Mapping[str, Any], raw: Mapping[str, Any]) -> torch.dtype | None:
    bf16, bfloat16, fp16 = (_enabled(values, section) for section in ("bf16", "bfloat16", "fp16"))
    bf16 = bf16 or bfloat16
    if bf16 and fp16:
        raise ValueError("DeepSpeed config refused: bf16.enabled and fp16.enabled: only one can be on")
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    named = (raw.get("data_types") or {}).get("param_dtype")
    if named is not None and _DTYPE_NAMES.get(str(named).lower()) != (dtype or torch.float32):
        raise ValueError(
            f"DeepSpeed config refused: data_types.param_dtype = {named!r} differs from what bf16 / fp16 enable"
        )
    return dtype


def _reduce_dtype(values: Mapping[str, Any]) -> torch.dtype | None:
    name = values.get("communication_data_type")
    if name is None:
        return None  # the parameter dtype: DeepSpeed's default
    dtype = _DTYPE_NAMES.get(str(name).lower())
    if dtype is None:
        raise ValueError(f"DeepSpeed config refused: communication_data_type = {name!r}: must be fp32, fp16 or bf16")
    return dtype


def _loss_scaler(values: Mapping[str, Any], dtype: torch.dtype | None) -> LossScaler:
    """DeepSpeed's scaler for the run's dtype: dynamic or static for fp16, a check for
    inf/nan gradients for bf16 (``check_grad_overflow``), nothing for fp32. Every value of
    both sections is checked, whichever dtype the run has."""
    check = flag(values, "bf16.check_grad_overflow", flag(values, "bfloat16.check_grad_overflow", True))
    fp16 = _fp16_scaler(values)
    if dtype == torch.bfloat16:
        return DeepSpeedLossScaler(scale=1.0, dynamic=False, check_overflow=check)
    return fp16 if dtype == torch.float16 else LossScaler.disabled()


def _fp16_scaler(values: Mapping[str, Any]) -> DeepSpeedLossScaler:
    static = number(values, "fp16.loss_scale", 0.0)
    power = integer(setting(values, "fp16.initial_scale_power", 16), "fp16.initial_scale_power", 0, _MAX_SCALE_POWER)
    return DeepSpeedLossScaler(
        scale=static if static > 0 else 2.0**power,
        dynamic=static == 0,
        growth_interval=positive(setting(values, "fp16.loss_scale_window", 1000), "fp16.loss_scale_window"),
        hysteresis=positive(setting(values, "fp16.hysteresis", 2), "fp16.hysteresis"),
        consecutive_hysteresis=flag(values, "fp16.consecutive_hysteresis", False),
        min_scale=float(positive(setting(values, "fp16.min_loss_scale", 1), "fp16.min_loss_scale")),
        check_overflow=True,
    )


def _offload(values: Mapping[str, Any]) -> bool:
    device = values.get("zero_optimization.offload_optimizer.device")
    if device not in (None, "none", "cpu"):
        why = "offloading to NVMe is DeepSpeed's own" if device == "nvme" else "must be 'cpu' or 'none'"
        raise ValueError(f"DeepSpeed config refused: zero_optimization.offload_optimizer.device = {device!r}: {why}")
    return flag(values, "zero_optimization.cpu_offload", False) or device == "cpu"


def _expert_parallel(values: Mapping[str, Any]) -> None:
    """Check the values from_deepspeed_config reads of the ``expert_parallel`` section."""
    flag(values, "expert_parallel.enabled", False)
    if values.get("expert_parallel.autoep_size") is not None:
        positive(values["expert_parallel.autoep_size"], "expert_parallel.autoep_size")


def resolve_batch_sizes(values: Mapping[str, Any], world_size: int) -> BatchSizes:
    """DeepSpeed's rule: any two of train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps give the third (one alone: accumulation 1); then
    ``train == micro * accumulation * world_size`` must hold.

    Raises:
        ValueError: neither batch size is given, one is not a positive integer, or they do
            not add up at this world size.
    """
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, steps = (None if values.get(key) is None else positive(values[key], key) for key in keys)
    if train is None and micro is None:
        raise ValueError("DeepSpeed config refused: give train_batch_size or train_micro_batch_size_per_gpu")
    all_three = None not in (train, micro, steps)
    if micro is None:
        steps = steps or 1
        micro = train // world_size // steps
    elif train is None:
        steps = steps or 1
        train = micro * steps * world_size
    elif steps is None:
        steps = train // micro // world_size
    if micro < 1 or steps < 1 or train != micro * steps * world_size:
        fix = _batch_fix(train, micro, world_size) if all_three else ""
        raise ValueError(
            f"DeepSpeed config refused: train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {steps} x world size {world_size}{fix}"
        )
    return BatchSizes(train, micro, steps, world_size)


def _batch_fix(train: int, micro: int, world_size: int) -> str:
    """How to make a config that gives all three batch numbers fit this world size."""
    derived, rest = divmod(train, micro * world_size)
    if rest == 0 and derived >= 1:
        return (
            f"; to keep train_batch_size {train} at world size {world_size}, drop gradient_accumulation_steps "
            f"and it is derived ({derived})"
        )
    return f"; no gradient_accumulation_steps fits: train_batch_size must be a multiple of {micro} x {world_size}"


def _schedule(values: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The scheduler class the config names (None if none) and its arguments, checked: a
    concrete schedule whose step() DeepSpeedRun.step can call, arguments of its types."""
    name = values.get("scheduler.type")
    if name is None:
        return None, {}
    if not isinstance(name, str):
        raise refusal("scheduler.type", name, "must be the name of a scheduler (a string)")
    schedule = SCHEDULES.get(name) or getattr(torch.optim.lr_scheduler, name, None)
    if not (isinstance(schedule, type) and issubclass(schedule, torch.optim.lr_scheduler.LRScheduler)):
        raise refusal("scheduler.type", name, "neither DeepSpeed's nor torch's scheduler")
    needs = required_arguments(schedule.step)
    if needs:
        raise refusal(
            "scheduler.type",
            name,
            f"its step() needs {', '.join(needs)}, which DeepSpeedRun.step does not pass; build and step it yourself",
        )
    params = arguments(schedule, setting(values, "scheduler.params", {}), "scheduler.params", skip=("optimizer",))
    if schedule.get_lr is torch.optim.lr_scheduler.LRScheduler.get_lr:
        raise refusal("scheduler.type", name, "the base class of torch's schedulers, not a schedule")
    return schedule, params
