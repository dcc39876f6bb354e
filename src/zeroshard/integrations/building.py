"""A ZeroOptimizer from what a framework knows: its optimizer (a class, or one the user already
built), its settings, and an optional DeepSpeed-style config; and the checks every framework
makes first. No framework is imported here.

A DeepSpeed-style config goes through :func:`~zeroshard.deepspeed.config.from_deepspeed_config`,
as ``deepspeed.initialize`` would take it, after :func:`reconcile` has filled its ``"auto"``
values from the framework (as transformers' Trainer does for DeepSpeed) and refused, in one
line, the values that contradict it. The framework divides the loss for gradient
accumulation itself, so the engine never divides again (``gradient_accumulation_steps=1``).
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..deepspeed.config import from_deepspeed_config
from ..deepspeed.plan import read_config
from ..deepspeed.values import short
from ..engine import ZeroOptimizer

AUTO = "auto"

# ZeroOptimizer's own keyword arguments: a mapping of only these is engine options, not a
# config. gradient_accumulation_steps is a DeepSpeed key too, and the framework's to set.
ENGINE_KEYWORDS = frozenset(
    name
    for name, parameter in inspect.signature(ZeroOptimizer.__init__).parameters.items()
    if parameter.kind == inspect.Parameter.KEYWORD_ONLY and name != "gradient_accumulation_steps"
)


@dataclass(frozen=True)
class Setting:
    """One config key the framework decides: its value there, and what the framework calls it."""

    key: str  # dotted DeepSpeed key: "train_micro_batch_size_per_gpu", "optimizer.params.lr"
    value: Any
    source: str  # the framework's name for it: "per_device_train_batch_size 4"
    fill_missing: bool = True  # set the key when the config leaves it out (else only "auto")
    fix: str = ""  # what to do when the config says otherwise, if not "make them equal"


@dataclass
class BuiltEngine:
    """What :func:`build_engine` made: the engine, and the lr scheduler a config's
    ``scheduler`` section names (None without one)."""

    engine: ZeroOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def refuse_wrapped(model: nn.Module, owner: str) -> None:
    """Refuse a model some other data-parallel wrapper already owns, in one line.

    Raises:
        ValueError: ``model`` is a DistributedDataParallel, DataParallel, FSDP (1 or 2) or
            DeepSpeed engine.
    """
    kind, what = _wrapper_of(model)
    if kind is not None:
        raise ValueError(
            f"{owner}: the model is already wrapped in {kind}, which {what}; pass the bare model: "
            "zeroshard shards the optimizer state and reduce-scatters the gradients itself"
        )


def _wrapper_of(model: nn.Module) -> tuple[str | None, str]:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel", "would all-reduce every gradient before zeroshard reduce-scatters it"
    if isinstance(model, nn.DataParallel):
        return "DataParallel", "replicates the model on several devices of one process"
    names = {cls.__name__ for cls in type(model).__mro__}
    if names & {"FullyShardedDataParallel", "FSDPModule"}:
        return "FSDP", "shards the parameters itself"
    if "DeepSpeedEngine" in names:
        return "a DeepSpeed engine", "has an optimizer of its own"
    return None, ""


def split_settings(settings: Any, owner: str) -> tuple[Any, dict[str, Any]]:
    """``(config, engine_options)`` from a framework's ``zeroshard=`` value: None; a
    DeepSpeed-style config (a dict, or the path of its JSON file); or a dict of ZeroOptimizer
    keyword arguments (``{"stage": 1, "reduce_dtype": torch.bfloat16}``).

    Raises:
        ValueError: a dict mixes ZeroOptimizer arguments with other keys, or the value is
            neither a dict nor a path.
    """
    if settings is None:
        return None, {}
    if isinstance(settings, (str, os.PathLike)):
        return settings, {}
    if not isinstance(settings, Mapping):
        raise ValueError(
            f"{owner}: zeroshard= takes a DeepSpeed-style config (a dict or a JSON file's path) or a dict of "
            f"ZeroOptimizer arguments, got {type(settings).__name__}"
        )
    engine_keys = sorted(set(settings) & ENGINE_KEYWORDS)
    other_keys = sorted(set(settings) - ENGINE_KEYWORDS)
    if engine_keys and other_keys:
        raise ValueError(
            f"{owner}: zeroshard= mixes ZeroOptimizer arguments ({', '.join(engine_keys)}) with other keys "
            f"({', '.join(map(str, other_keys[:5]))}): give either a DeepSpeed-style config or ZeroOptimizer arguments"
        )
    return (None, dict(settings)) if engine_keys else (dict(settings), {})


def reconcile(config: Any, settings: Sequence[Setting], owner: str, framework: str) -> dict[str, Any]:
    """A copy of ``config`` (a dict or a JSON file's path) with every ``"auto"`` value of
    ``settings``' keys filled in from the framework, and the keys the framework decides that
    the config leaves out set. A ``settings`` key under ``optimizer.`` or ``scheduler.`` is
    only touched when the config has that section (else the framework's optimizer and
    scheduler are used). Other ``"auto"`` values stay, for the config reader to refuse.

    Raises:
        ValueError: one line naming every key whose value contradicts the framework's, and
            the fix; or as the config reader (a file that is not a JSON object, ...).
    """
    filled = copy.deepcopy(read_config(config))
    conflicts = []
    for setting in settings:
        section, _, _ = setting.key.partition(".")
        if section in ("optimizer", "scheduler") and not isinstance(filled.get(section), Mapping):
            continue
        parent, name = _parent(filled, setting.key)
        if name not in parent:
            if setting.fill_missing:
                parent[name] = setting.value
        elif parent[name] == AUTO:
            parent[name] = setting.value
        elif not _same(parent[name], setting.value):
            fix = setting.fix or "make them equal, or set the key to 'auto'"
            conflicts.append(f"{setting.key} = {short(parent[name])} but {setting.source}: {fix}")
    if conflicts:
        raise ValueError(f"{owner}: the zeroshard config contradicts the {framework}: {'; '.join(conflicts)}")
    return filled


def _parent(config: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    """The dict holding dotted ``key``'s last part (sections made as needed), and that part."""
    *sections, name = key.split(".")
    node = config
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):  # a value where a section belongs: the config reader refuses it
            return {}, name
    return node, name


def _same(given: Any, value: Any) -> bool:
    if isinstance(given, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(given) == len(value) and all(_same(a, b) for a, b in zip(given, value))
    return type(given) is not bool and type(value) is not bool and given == value or given is value


class AdoptedOptimizer:
    """Hands an optimizer the user built to a ZeroOptimizer as the torch optimizer it wraps:
    its param groups are pointed at the engine's fp32 partitions, so an lr scheduler already
    built on it keeps driving the lr the engine steps with (as DeepSpeed does with a client
    optimizer). It must be fresh: no state yet."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups, as ZeroOptimizer's ``param_groups`` argument."""
        return [dict(group) for group in self.optimizer.param_groups]

    def __call__(self, groups: list[dict[str, Any]], **options: Any) -> torch.optim.Optimizer:
        if options:
            raise ValueError(
                f"optimizer options {sorted(options)} were given for an optimizer already built; set them on it instead"
            )
        for mine, theirs in zip(self.optimizer.param_groups, groups, strict=True):
            mine["params"] = theirs["params"]
        return self.optimizer


def optimizer_source(
    optimizer: Any, param_groups: Iterable[Any] | None, owner: str
) -> tuple[Callable[..., torch.optim.Optimizer], Iterable[Any] | None]:
    """``(optimizer_class, param_groups)`` for ZeroOptimizer from a torch optimizer class (or
    factory) and its param groups, or from a torch optimizer the user already built (adopted,
    its own param groups).

    Raises:
        ValueError: a built optimizer together with ``param_groups``, one that already has
            state, or a ZeroOptimizer (build it yourself, or give its class).
    """
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError(f"{owner}: the optimizer is a ZeroOptimizer already; give the torch optimizer or its class")
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, param_groups
    if param_groups is not None:
        raise ValueError(f"{owner}: param_groups= is for an optimizer class; a built optimizer brings its own")
    if optimizer.state:
        raise ValueError(
            f"{owner}: the {type(optimizer).__name__} has taken steps already (it holds state); "
            "zeroshard adopts a fresh optimizer only"
        )
    adopted = AdoptedOptimizer(optimizer)
    return adopted, adopted.param_groups()


def build_engine(
    model: nn.Module,
    optimizer: Any,
    param_groups: Iterable[Any] | None = None,
    *,
    owner: str,
    framework: str,
    config: Any = None,
    settings: Sequence[Setting] = (),
    optimizer_options: Mapping[str, Any] | None = None,
    engine_defaults: Mapping[str, Any] | None = None,
    engine_options: Mapping[str, Any] | None = None,
) -> BuiltEngine:
    """Collective (it builds a ZeroOptimizer). The engine for ``model``.

    Args:
        optimizer: a torch optimizer class (or factory), or a fresh torch optimizer instance
            to adopt (:class:`AdoptedOptimizer`).
        param_groups: for an optimizer class; None: every trainable parameter.
        owner, framework: who is asking (``"ZeroShardTrainer"``) and what decides the
            settings (``"TrainingArguments"``), for the error lines.
        config: a DeepSpeed-style config (dict or path), reconciled with ``settings``.
        optimizer_options: the optimizer class's options (lr, betas, ...) unless the config
            has an ``optimizer`` section.
        engine_defaults: ZeroOptimizer arguments the framework implies (param_dtype,
            max_grad_norm, ...), used when there is no config.
        engine_options: ZeroOptimizer arguments the user gave; they win over both.

    Raises:
        ValueError: as :func:`reconcile`, :func:`optimizer_source`, ``from_deepspeed_config``
            or ZeroOptimizer, on every rank alike.
    """
    optimizer_class, groups = optimizer_source(optimizer, param_groups, owner)
    adopted = isinstance(optimizer_class, AdoptedOptimizer)
    options = {} if adopted else dict(optimizer_options or {})
    chosen = {**dict(engine_options or {}), "gradient_accumulation_steps": 1}  # the framework divides the loss
    if config is None:
        engine = ZeroOptimizer(model, optimizer_class, groups, **{**dict(engine_defaults or {}), **options, **chosen})
        return BuiltEngine(engine)
    filled = reconcile(config, settings, owner, framework)
    client = None if "optimizer" in filled else optimizer_class
    client_options = {} if "optimizer" in filled else options
    run = from_deepspeed_config(
        model, filled, param_groups=groups, optimizer_class=client, device=None, **client_options, **chosen
    )
    return BuiltEngine(run.engine, run.scheduler)


def dataloader_batch(config: Any, steps: int, world_size: int, source: str, owner: str) -> list[Setting]:
    """For a framework whose batch size is the dataloader's (Accelerate, Lightning) and whose
    accumulation steps are its own (``source``: ``"Accelerator(gradient_accumulation_steps=2)"``):
    the config's batch keys are only checked, against ``steps`` x ``world_size``; when it gives
    neither, a micro-batch of 1 stands in (the engine never uses it).

    Raises:
        ValueError: ``train_batch_size`` does not split over ``steps`` x ``world_size`` (and the
            config's micro-batch), naming the key to drop.
    """
    if config is None:
        return []
    given = read_config(config)
    train, micro = (given.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu"))
    train = train if isinstance(train, int) and not isinstance(train, bool) else None
    micro = micro if isinstance(micro, int) and not isinstance(micro, bool) else None
    fix = f"drop train_batch_size (the dataloader and {source} set the batch)"
    if train is not None and micro is not None and train != micro * steps * world_size:
        raise ValueError(
            f"{owner}: train_batch_size = {train} but train_micro_batch_size_per_gpu {micro} x {source} x world size "
            f"{world_size} = {micro * steps * world_size}: {fix}"
        )
    if train is not None and micro is None:
        if train % (steps * world_size):
            raise ValueError(f"{owner}: train_batch_size = {train} does not split over {source} x world size {world_size}: {fix}")
        return [Setting("train_micro_batch_size_per_gpu", train // (steps * world_size), "train_batch_size")]
    return [Setting("train_micro_batch_size_per_gpu", 1, "the dataloader's batch", fill_missing=micro is None)]


def param_dtype_for(precision: str, owner: str) -> torch.dtype | None:
    """The engine's parameter dtype for a framework's precision name ("bf16", "fp16", "no",
    Lightning's "bf16-mixed", ...): bf16 or fp16 parameters with fp32 masters (DeepSpeed's
    mixed precision), or None for fp32.

    Raises:
        ValueError: a precision zeroshard does not train in (fp8, fp64, ...).
    """
    name = str(precision).lower()
    if name in ("no", "32", "32-true", "fp32", "float32", "none"):
        return None
    if name in ("bf16", "bf16-mixed", "bf16-true", "bfloat16"):
        return torch.bfloat16
    if name in ("fp16", "16", "16-mixed", "16-true", "float16"):
        return torch.float16
    raise ValueError(f"{owner}: precision {precision!r}: zeroshard trains in fp32, bf16 or fp16 parameters")
