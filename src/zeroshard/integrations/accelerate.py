"""zeroshard in an Accelerate script: one call beside ``accelerator.prepare``.

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)         # as before
    model, optimizer = prepare_zeroshard(accelerator, model, optimizer) # the added line
    loader, scheduler = accelerator.prepare(loader, get_scheduler(..., optimizer))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")          # every rank writes its shard: ckpt/zeroshard
    accelerator.load_state("ckpt")          # at any world size, attested

:func:`prepare_zeroshard` builds the ZeroOptimizer and keeps the model out of Accelerate's
DistributedDataParallel (which would all-reduce every gradient before the engine
reduce-scatters it) and out of its autocast (the engine owns the precision: Accelerate's
``mixed_precision`` becomes the parameter dtype, with fp32 masters). The optimizer it returns
is Accelerate's kind of prepared optimizer: it steps (and clears the gradients, as
DeepSpeed's engine does) only when ``accelerator.sync_gradients`` says the accumulation is
complete, and reports a skipped fp16 step to Accelerate's schedulers. It registers save and
load pre-hooks: ``save_state`` writes the engine's state as ``<dir>/zeroshard`` from every
rank instead of rank 0's model weights and optimizer shard, ``load_state`` reads it back at
any world size before Accelerate loads the rest (schedulers, samplers, RNG states).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..engine import ZeroOptimizer
from .building import ENGINE_KEYWORDS, Setting, build_engine, dataloader_batch, param_dtype_for, refuse_wrapped
from .saves import TAG, FolderSaves, check_resumable

log = logging.getLogger(__name__)

OWNER = "prepare_zeroshard"
MARKER = {"zeroshard": f"the optimizer state is the sharded checkpoint {TAG}/ beside this file, every rank's shard"}


class ZeroShardAcceleratedOptimizer(AcceleratedOptimizer):
    """A ZeroOptimizer as Accelerate's prepared optimizer.

    ``step`` runs the engine's step (collective) and clears the gradients when
    ``accelerator.sync_gradients`` is set, and does nothing while gradients accumulate;
    ``zero_grad`` likewise. ``param_groups``, ``state`` and ``defaults`` are the engine's.
    ``state_dict`` is a marker: the state itself is saved by ``save_state`` as a sharded
    checkpoint. ``grad_norm`` is the engine's global gradient norm of the last step.
    """

    _is_accelerate_prepared = True  # accelerator.prepare passes it through as it is

    def __init__(self, engine: ZeroOptimizer) -> None:
        # Not AcceleratedOptimizer.__init__: it would reload the state dict for device
        # placement (a collective load of the engine's own shard) and take Accelerate's scaler.
        from accelerate.state import AcceleratorState, GradientState

        self.engine = engine
        self.optimizer = engine.optimizer  # what an lr scheduler built on an adopted optimizer points at
        self.scaler = None
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self.device_placement = False
        self._is_overflow = False
        self._pending_norms: list[torch.Tensor] = []

    def step(self, closure: None = None) -> None:
        """Collective when the accumulation is complete: the engine's step, then ``zero_grad``."""
        if not self.gradient_state.sync_gradients:
            return
        self._is_overflow = not self.engine.step(closure)
        for norm in self._pending_norms:
            norm.fill_(self.grad_norm if self.grad_norm is not None else float("nan"))
        self._pending_norms.clear()
        self.engine.zero_grad()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the engine's gradients, unless they are still accumulating."""
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad()

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping), over every rank."""
        return self.engine.last_grad_norm

    def pending_norm(self) -> torch.Tensor:
        """A 0-d tensor holding NaN that the next step fills with its gradient norm (what
        ``accelerator.clip_grad_norm_`` returns for the engine's parameters)."""
        norm = torch.full((), float("nan"))
        self._pending_norms.append(norm)
        return norm

    def state_dict(self) -> dict[str, Any]:
        """A marker, not the state: ``save_state`` saves every rank's shard as ``zeroshard/``."""
        return dict(MARKER)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts only the marker (``load_state`` has loaded the sharded checkpoint already).

        Raises:
            ValueError: any other optimizer state (one rank's, written by a stock Accelerate run).
        """
        if state_dict != MARKER:
            raise ValueError(
                f"{OWNER}: an optimizer state that is not zeroshard's marker (keys {sorted(state_dict)[:4]}): "
                "a stock Accelerate optimizer file holds one rank's optimizer only; load a folder save_state "
                "wrote with zeroshard"
            )


class EngineLossScale:
    """``accelerator.scaler`` for an fp16 engine: ``accelerator.backward`` multiplies the loss
    by the engine's dynamic loss scale; the engine unscales, checks for overflow and updates
    the scale in its step (its state is in the sharded checkpoint)."""

    def __init__(self, engine: ZeroOptimizer) -> None:
        self.engine = engine

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the engine's current loss scale."""
        return loss * self.engine.scaler.scale

    def unscale_(self, optimizer: Any) -> None:
        """Nothing: the engine unscales its gradient partition in its step."""

    def get_scale(self) -> float:
        """The engine's current loss scale."""
        return float(self.engine.scaler.scale)

    def is_enabled(self) -> bool:
        """Always: the engine scales fp16 losses."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """Empty: the scaler's state is saved with the engine's."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the sharded checkpoint restored the engine's scaler."""


def prepare_zeroshard(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Any = torch.optim.AdamW,
    param_groups: Iterable[Any] | None = None,
    *,
    config: Any = None,
    async_save: bool = True,
    **engine_options: Any,
) -> tuple[nn.Module, ZeroShardAcceleratedOptimizer]:
    """Collective: every process calls it, before ``accelerator.prepare`` of the model, the
    optimizer and a scheduler built on it. Make ``model`` train with a ZeroOptimizer under
    ``accelerator``.

    Args:
        accelerator: the Accelerator, without a DeepSpeed or FSDP plugin.
        model: the bare model (moved to ``accelerator.device`` here).
        optimizer: a torch optimizer class (its options in ``engine_options``: ``lr=...``),
            or a fresh torch optimizer over the model's parameters, adopted with its param
            groups and options (an lr scheduler already built on it keeps working).
        param_groups: for an optimizer class (None: every trainable parameter).
        config: a DeepSpeed-style config (dict or JSON path), as Accelerate's DeepSpeed
            plugin takes it; ``"auto"`` values are filled from the accelerator.
        async_save: ``save_state`` writes the shards in the background.
        **engine_options: ZeroOptimizer arguments (``stage``, ``max_grad_norm``,
            ``reduce_dtype``, ...) and an optimizer class's options.

    Returns:
        ``(model, optimizer)``: the same model (marked prepared: ``accelerator.prepare`` will
        not wrap it) and the prepared optimizer; pass either to ``accelerator.prepare`` or not.

    Raises:
        ValueError: on every process, before the model changes: the accelerator has a
            DeepSpeed or FSDP plugin, the model is wrapped (DDP, FSDP, ...) or the optimizer
            prepared by Accelerate already, the precision is
            not fp32/bf16/fp16, the config is refused (ZeRO-3, a batch size the world size
            does not divide, ...); or as ZeroOptimizer.
    """
    _check_accelerator(accelerator)
    refuse_wrapped(model, OWNER)
    if isinstance(optimizer, AcceleratedOptimizer):
        raise ValueError(
            f"{OWNER}: the optimizer went through accelerator.prepare already; call prepare_zeroshard with the "
            "optimizer you built, before accelerator.prepare"
        )
    dtype = param_dtype_for(accelerator.mixed_precision, OWNER)
    if accelerator.device_placement:
        model.to(accelerator.device)
    optimizer_options = {key: engine_options.pop(key) for key in list(engine_options) if key not in ENGINE_KEYWORDS}
    built = build_engine(
        model,
        optimizer,
        param_groups,
        owner=OWNER,
        framework="Accelerator",
        config=config,
        settings=_settings(accelerator, config, dtype),
        optimizer_options=optimizer_options,
        engine_defaults={"param_dtype": dtype},
        engine_options=engine_options,
    )
    engine = built.engine
    prepared = ZeroShardAcceleratedOptimizer(engine)
    model._is_accelerate_prepared = True  # accelerator.prepare leaves it as it is: no DDP, no autocast
    accelerator.prepare_model(model)
    accelerator.prepare_optimizer(prepared)
    if built.scheduler is not None:
        accelerator.prepare_scheduler(built.scheduler)
    if engine.scaler.scale != 1.0:
        accelerator.scaler = EngineLossScale(engine)
    _install_hooks(accelerator, model, prepared, FolderSaves(engine, async_save=async_save))
    return model, prepared


def _check_accelerator(accelerator: Accelerator) -> None:
    for plugin, name in (("deepspeed_plugin", "DeepSpeed"), ("fsdp_plugin", "FSDP")):
        if getattr(accelerator.state, plugin, None) is not None:
            raise ValueError(
                f"{OWNER}: the Accelerator has a {name} plugin, which would wrap the model itself; "
                f"build the Accelerator without {plugin}= (pass a DeepSpeed config as config= here instead)"
            )


def _settings(accelerator: Accelerator, config: Any, dtype: torch.dtype | None) -> list[Setting]:
    steps = accelerator.gradient_accumulation_steps
    source = f"Accelerator(gradient_accumulation_steps={steps})"
    precision = f"Accelerator(mixed_precision={accelerator.mixed_precision!r})"
    return [
        Setting(
            "gradient_accumulation_steps",
            steps,
            source,
            fix="drop the key from the config: the Accelerator's gradient_accumulation_steps sets it",
        ),
        Setting("bf16.enabled", dtype == torch.bfloat16, precision),
        Setting("fp16.enabled", dtype == torch.float16, precision),
        *dataloader_batch(config, steps, accelerator.num_processes, source, OWNER),
    ]


def _install_hooks(
    accelerator: Accelerator, model: nn.Module, prepared: ZeroShardAcceleratedOptimizer, saves: FolderSaves
) -> None:
    """save_state / load_state pre-hooks for the engine's sharded checkpoint, and
    ``clip_grad_norm_`` of the engine's parameters handed to the engine."""

    def save_hook(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
        for index, candidate in enumerate(models):
            if candidate is model and index < len(weights):
                del weights[index]  # rank 0's model weights: the sharded checkpoint holds the model
        saves.save(output_dir)

    def load_hook(models: list[nn.Module], input_dir: str) -> None:
        from pathlib import Path

        check_resumable(Path(input_dir), _stock_state, prepared.engine.comm.group)
        _, attestation = saves.load(input_dir)
        if prepared.engine.rank == 0:
            log.info("loaded %s: %s", Path(input_dir) / TAG, attestation.line())
        models[:] = [candidate for candidate in models if candidate is not model]

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    unclipped = accelerator.clip_grad_norm_
    own = {id(param) for group in prepared.engine.grouping.layout_params for param in group}

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if not params or any(id(param) not in own for param in params):
            return unclipped(params, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"{OWNER}: clip_grad_norm_ with norm_type={norm_type}: the engine clips by the L2 norm")
        prepared.engine.max_grad_norm = float(max_norm)  # the engine clips by the global norm in its step
        return prepared.pending_norm()

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _stock_state(folder: Any) -> str | None:
    """A folder a stock ``save_state`` wrote: an optimizer file but no sharded checkpoint."""
    if (folder / "optimizer.bin").is_file():
        return (
            f"{folder}: has optimizer.bin but no finished zeroshard/ checkpoint: written by a stock "
            "accelerator.save_state (rank 0's optimizer state only), or a zeroshard save that did not finish; "
            "resume from a folder save_state wrote with zeroshard"
        )
    return None
