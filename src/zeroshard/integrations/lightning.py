"""``ZeroShardStrategy``: a ZeroOptimizer under Lightning's ``Trainer``.

    import zeroshard.integrations.lightning  # registers "zeroshard"
    trainer = Trainer(strategy="zeroshard", accelerator="cpu", devices=2, precision="bf16-mixed",
                      accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(module, ckpt_path="last")   # a sharded directory checkpoint, at any world size

The LightningModule's ``configure_optimizers`` stays as it is: its (one) optimizer is adopted
by a ZeroOptimizer (its param groups and options; its lr schedulers keep driving the lr).
The model is not wrapped in DistributedDataParallel. Lightning's precision flags become the
engine's parameter dtype with fp32 masters (``bf16-mixed`` and ``bf16-true``: bf16
parameters; ``32-true``: fp32; ``16-mixed`` / ``16-true``: fp16 with the engine's dynamic loss
scale); float inputs are cast to it. Lightning divides the loss for ``accumulate_grad_batches``
and steps at the boundaries; the engine accumulates the reduced gradient partitions and
clips by the global norm over every rank (``gradient_clip_val``; clipping by value is refused).

A checkpoint is a directory (``epoch=1-step=4.ckpt/``): the engine's state as the zeroshard
checkpoint ``zeroshard/`` written by every rank (asynchronously), and Lightning's own
dictionary (loops, callbacks, lr schedulers; no weights, no optimizer state) as
``lightning.ckpt``, written by rank 0 with the strategy's CheckpointIO. ``ckpt_path=`` loads
it at any world size, attested; a single-file checkpoint another strategy wrote is refused.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from ..engine import ZeroOptimizer
from .building import Setting, build_engine, dataloader_batch, param_dtype_for
from .saves import TAG, FolderSaves, check_resumable

log = logging.getLogger(__name__)

OWNER = "ZeroShardStrategy"
LIGHTNING_FILE = "lightning.ckpt"  # Lightning's own dictionary, beside the sharded checkpoint
_WITHOUT = ("state_dict", "optimizer_states")  # what the sharded checkpoint holds instead


class ZeroShardPrecision(Precision):
    """Lightning's precision flag as the engine's parameter dtype: no autocast, no module
    conversion by Lightning (the engine casts the parameters and keeps fp32 masters), float
    inputs cast to the parameter dtype, fp16 losses scaled by the engine's loss scale, and
    gradient clipping handed to the engine."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision  # type: ignore[assignment]
        self.param_dtype = param_dtype_for(precision, OWNER)
        self.engine: ZeroOptimizer | None = None

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors in the parameter dtype (the engine does not cast inputs)."""
        if self.param_dtype is None:
            return data
        return _cast_floats(data, self.param_dtype)

    def forward_context(self) -> Any:
        """No autocast: the parameters are in the training dtype already."""
        return nullcontext()

    def pre_backward(self, tensor: torch.Tensor, module: LightningModule) -> torch.Tensor:
        """Lightning's hooks, then the loss times the engine's loss scale (fp16)."""
        tensor = super().pre_backward(tensor, module)
        if self.engine is not None and self.engine.scaler.scale != 1.0:
            tensor = tensor * self.engine.scaler.scale
        return tensor

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (training step and backward), Lightning's before-step hooks, then
        the engine's step (collective), which takes no closure."""
        result = self._wrap_closure(model, optimizer, closure)
        if result is None and isinstance(model, LightningModule) and model.automatic_optimization:
            return None  # training_step returned None: no backward, no step (as Lightning's AMP plugin)
        optimizer.step(**kwargs)
        return result

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        """Hand the clip to the engine: it clips by the global L2 norm over every rank in its step.

        Raises:
            ValueError: clipping by value (the engine clips by norm).
        """
        if clip_val and gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(f"{OWNER}: gradient_clip_algorithm='value': the engine clips by the global norm only")
        if self.engine is not None:
            self.engine.max_grad_norm = float(clip_val) if clip_val and clip_val > 0 else None


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, Mapping):
        return type(data)({key: _cast_floats(value, dtype) for key, value in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_cast_floats(value, dtype) for value in data)
    return data


class ZeroShardStrategy(DDPStrategy):
    """Lightning's multi-process strategy with a ZeroOptimizer instead of DDP.

    Args:
        config: a DeepSpeed-style config (dict or JSON path); its ``"auto"`` values and the
            keys Lightning decides (``gradient_accumulation_steps``, ``gradient_clipping``, the
            precision) are filled from the Trainer, contradictions refused in one line.
        async_save: write checkpoints in the background.
        **engine_options: ZeroOptimizer arguments (``stage``, ``reduce_dtype``, ``offload``, ...).
        Lightning's DDPStrategy arguments (``process_group_backend``, ``timeout``,
        ``start_method``, ...) go to it by keyword; DDP's own (``find_unused_parameters``,
        comm hooks) have nothing to do here and are refused.

    Raises:
        ValueError: at setup, on every rank: more than one optimizer, a refused config,
            clipping by value, a precision other than fp32 / bf16 / fp16; at ``ckpt_path=``, a
            checkpoint with no zeroshard save (one another strategy wrote).
    """

    strategy_name = "zeroshard"

    def __init__(self, *, config: Any = None, async_save: bool = True, **options: Any) -> None:
        ddp_only = sorted(set(options) & {"find_unused_parameters", "ddp_comm_hook", "ddp_comm_state", "static_graph"})
        if ddp_only:
            raise ValueError(f"{OWNER}: {', '.join(ddp_only)}: DDP options, and zeroshard does not wrap the model in DDP")
        strategy_keys = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
        strategy_keys |= {"process_group_backend", "timeout", "start_method"}
        super().__init__(**{key: options.pop(key) for key in list(options) if key in strategy_keys})
        self.config = config
        self.engine_options = options
        self.async_save = async_save
        self.engine: ZeroOptimizer | None = None
        self._saves: FolderSaves | None = None

    @property
    def precision_plugin(self) -> Precision:
        """A :class:`ZeroShardPrecision` for the Trainer's precision flag."""
        return self._precision_plugin if self._precision_plugin is not None else ZeroShardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroShardPrecision):
            plugin = ZeroShardPrecision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    def configure_ddp(self) -> None:
        """Nothing to wrap: the engine reduce-scatters the gradients itself."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def setup_optimizers(self, trainer: Any) -> None:
        """Collective: adopt the LightningModule's optimizer into a ZeroOptimizer.

        Raises:
            ValueError: on every rank, as :func:`~zeroshard.integrations.building.build_engine`,
                or more than one optimizer.
        """
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"{OWNER}: configure_optimizers gave {len(self.optimizers)} optimizers; zeroshard takes one")
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise ValueError(f"{OWNER}: gradient_clip_algorithm='value': the engine clips by the global norm only")
        precision = self.precision_plugin
        assert isinstance(precision, ZeroShardPrecision)
        clip = trainer.gradient_clip_val
        built = build_engine(
            self.lightning_module,
            self.optimizers[0],
            owner=OWNER,
            framework="Lightning Trainer",
            config=self.config,
            settings=_settings(trainer, precision, self.config),
            engine_defaults={"param_dtype": precision.param_dtype, "max_grad_norm": float(clip) if clip else None},
            engine_options=self.engine_options,
        )
        self.engine = precision.engine = built.engine
        self.optimizers = [built.engine]
        self._saves = FolderSaves(built.engine, async_save=self.async_save)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing for Lightning's dictionary: the sharded checkpoint holds every rank's state."""
        return {}

    # ---- checkpoints --------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The engine must exist before its state can be loaded."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The engine's state (optimizer included) is loaded by :meth:`load_checkpoint`."""
        return False

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Collective: the engine's state as ``<filepath>/zeroshard`` from every rank, and
        Lightning's dictionary without weights and optimizer state as ``<filepath>/lightning.ckpt``
        (rank 0, the strategy's CheckpointIO)."""
        folder = Path(self.broadcast(str(filepath)))
        rest = {key: value for key, value in checkpoint.items() if key not in _WITHOUT}
        if self._saves is None:  # not fitting: there is no engine state to save
            raise ValueError(f"{OWNER}: save_checkpoint needs a fitted engine (trainer.fit) to save from")
        self._saves.save(folder)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(rest, folder / LIGHTNING_FILE, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: check the directory on every rank, load the engine's state at this world
        size (fitting), and return Lightning's dictionary for the loops, callbacks and lr
        schedulers; outside fitting, the model's weights from the sharded checkpoint.

        Raises:
            ValueError: on every rank, before anything loads: no finished zeroshard save there
                (a single-file checkpoint another strategy wrote, a save cut short).
        """
        folder = Path(checkpoint_path)
        check_resumable(folder, _other_strategy)
        checkpoint = self.checkpoint_io.load_checkpoint(folder / LIGHTNING_FILE, weights_only=weights_only)
        if self._saves is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            _, attestation = self._saves.load(folder)
            if self.is_global_zero:
                log.info("%s: resumed from %s: %s", OWNER, folder / TAG, attestation.line())
        else:
            checkpoint["state_dict"] = _module_state(folder / TAG, self.lightning_module.state_dict())
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Outside fitting, Lightning's load of the weights; when fitting the engine has them."""
        if "state_dict" in checkpoint:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the engine's state."""

    def teardown(self) -> None:
        """Collective: wait for the last save, then Lightning's teardown."""
        if self._saves is not None:
            self._saves.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"zeroshard"`` (ZeRO-2) and ``"zeroshard_stage_1"``."""
        strategy_registry.register("zeroshard", cls, description="zeroshard ZeRO stage 2", override=True)
        strategy_registry.register(
            "zeroshard_stage_1", cls, description="zeroshard ZeRO stage 1", override=True, stage=1
        )


def _settings(trainer: Any, precision: ZeroShardPrecision, config: Any) -> list[Setting]:
    steps, clip = trainer.accumulate_grad_batches, trainer.gradient_clip_val
    source = f"Trainer(accumulate_grad_batches={steps})"
    flag = f"Trainer(precision={precision.precision!r})"
    return [
        Setting(
            "gradient_accumulation_steps",
            steps,
            source,
            fix="drop the key from the config: Lightning's accumulate_grad_batches sets it",
        ),
        Setting("gradient_clipping", float(clip or 0.0), f"Trainer(gradient_clip_val={clip})"),
        Setting("bf16.enabled", precision.param_dtype == torch.bfloat16, flag),
        Setting("fp16.enabled", precision.param_dtype == torch.float16, flag),
        *dataloader_batch(config, steps, trainer.world_size, source, OWNER),
    ]


def _module_state(tag: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state_dict from a sharded checkpoint's module file (rank 0 wrote it), tied
    names included, for a run that has no engine (validate, test, predict)."""
    from ..checkpoint import open_source
    from ..io.dtypes import to_torch

    with open_source(tag) as source:
        arrays = source.model_tensors(list(like))
    return {name: to_torch(array) for name, array in arrays.items()}


def _other_strategy(path: Path) -> str | None:
    if path.is_file():
        return (
            f"{path}: a single-file Lightning checkpoint another strategy wrote (its optimizer state, if any, was "
            "gathered to or saved by rank 0); load its weights with LightningModule.load_from_checkpoint and fit "
            "without ckpt_path"
        )
    return None


ZeroShardStrategy.register_strategies(StrategyRegistry)
