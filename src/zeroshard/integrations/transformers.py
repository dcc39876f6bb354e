"""``ZeroShardTrainer``: transformers' Trainer with a ZeroOptimizer, used as Trainer is.

    trainer = ZeroShardTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=data)
    trainer.train()                                  # ZeRO-2 from the TrainingArguments
    trainer.train(resume_from_checkpoint=True)       # at any world size (and EP), attested
    trainer.save_model()                             # fp32 weights + config.json: from_pretrained-ready

What changes from Trainer, and why:

* The optimizer is a ZeroOptimizer built from the TrainingArguments (``optim``'s torch class,
  ``learning_rate``, betas, eps, ``weight_decay`` with Trainer's decay / no-decay split,
  ``max_grad_norm``, bf16 / fp16 as the parameter dtype with fp32 masters), or from
  ``zeroshard=``: a DeepSpeed-style config (``TrainingArguments(deepspeed=cfg)``'s dict,
  ``"auto"`` filled from the arguments) or ZeroOptimizer arguments. Trainer's lr schedulers
  drive it; a config's ``scheduler`` section replaces them, as with DeepSpeed.
* The model is never wrapped in DistributedDataParallel (it would all-reduce every gradient
  before the engine reduce-scatters it) nor autocast: the engine owns precision and reduction.
  Trainer still divides the loss for gradient accumulation; the engine does not divide again.
* The logged ``grad_norm`` is the engine's global norm over every rank (Trainer would read
  the model's ``.grad``, which the engine has already taken).
* ``checkpoint-N/`` holds, beside Trainer's own files (trainer_state.json, the RNG states,
  config.json), the engine's state as a zeroshard sharded checkpoint ``checkpoint-N/zeroshard``
  written by every rank, asynchronously, with the lr scheduler's state: no ``optimizer.pt``
  (which holds rank 0's state alone), no ``scheduler.pt``, no ``model.safetensors`` (the
  sharded checkpoint holds the weights; ``zeroshard to-fp32 checkpoint-N OUT`` writes them).
* ``resume_from_checkpoint`` loads that at the current world size and EP, attested; a folder
  a stock Trainer wrote is refused in one line before anything loads.
* ``save_model`` writes the fp32 master weights (every expert, in the model's own names) and
  config.json, so ``from_pretrained`` loads the folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..engine import ZeroOptimizer
from ..moe import ExpertGroups, expert_modules, expert_parallel, moe_param_groups, new_expert_groups
from .accelerate import EngineLossScale, ZeroShardAcceleratedOptimizer
from .building import BuiltEngine, Setting, build_engine, param_dtype_for, refuse_wrapped, split_settings
from .saves import TAG, FolderSaves, check_resumable, export_fp32, newest_committed

log = logging.getLogger(__name__)

OWNER = "ZeroShardTrainer"


class ZeroShardTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with a ZeroOptimizer (ZeRO stage 1/2).

    Takes every argument ``Trainer`` takes, and:

    Args:
        zeroshard: None (everything from the TrainingArguments); a DeepSpeed-style config, a
            dict or a JSON file's path, as ``TrainingArguments(deepspeed=...)`` takes it
            (``"auto"`` values filled from the arguments, contradictions refused); or a dict
            of ZeroOptimizer arguments (``{"stage": 1, "reduce_dtype": torch.bfloat16}``).
        expert_parallel: for a transformers MoE model: the EP size (the model is made
            expert-parallel here; default 1), or the ``ExpertGroups`` it was made
            expert-parallel with. A MoE model's experts always train as expert groups, so its
            checkpoints load at any world size and EP.
        async_save: checkpoints are written in the background (default) or before the
            training goes on.

    ``optimizers=(optimizer, scheduler)`` may hand it a fresh torch optimizer over the
    model's parameters (adopted, with its groups and options) or a ZeroOptimizer built over
    the model. ``engine`` is the ZeroOptimizer once training has started.

    Raises:
        ValueError: at construction, in one line: ``TrainingArguments(deepspeed=...)`` or
            ``fsdp=...`` is set, the model is already wrapped (DDP, FSDP, ...), or
            ``zeroshard=`` is neither a config nor engine arguments; at ``train``: a config
            that contradicts the arguments or is refused (ZeRO-3, a batch size the world size
            does not divide), or a resume folder that holds no zeroshard checkpoint (one a
            stock Trainer wrote) — on every rank, before anything is loaded.
    """

    def __init__(
        self,
        *args: Any,
        zeroshard: Any = None,
        expert_parallel: int | ExpertGroups | None = None,
        async_save: bool = True,
        **kwargs: Any,
    ) -> None:
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_other_engines(training_args)
        if model is not None:
            refuse_wrapped(model, OWNER)
        self._config, self._engine_options = split_settings(zeroshard, OWNER)
        self._async_save = async_save
        self.engine: ZeroOptimizer | None = None
        self._built: BuiltEngine | None = None
        self._saves: FolderSaves | None = None
        super().__init__(*args, **kwargs)
        self._moe = expert_parallel is not None or bool(expert_modules(self.model))
        self._expert_groups = self._make_expert_parallel(expert_parallel) if self._moe else None

    # ---- the engine -------------------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"  # the engine casts the parameters; no autocast on top
        accelerator_args["deepspeed_plugin"] = None
        return accelerator_args

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the ZeroOptimizer (collective) and hand Trainer its Accelerate-prepared form."""
        if isinstance(self.optimizer, ZeroShardAcceleratedOptimizer):
            return self.optimizer
        model = self.model if model is None else model
        if isinstance(self.optimizer, ZeroOptimizer):
            self._built = BuiltEngine(self.optimizer)
        else:
            self._built = self._build(model)
        self.engine = self._built.engine
        if self.engine.model is not model:
            raise ValueError(f"{OWNER}: the ZeroOptimizer given in optimizers= was built over another model")
        model._is_accelerate_prepared = True  # Accelerate leaves it as it is: no DDP, no autocast
        if self.engine.scaler.scale != 1.0:
            self.accelerator.scaler = EngineLossScale(self.engine)
        self.optimizer = ZeroShardAcceleratedOptimizer(self.engine)
        self._saves = FolderSaves(self.engine, async_save=self._async_save)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Trainer's scheduler over the engine, or the one the zeroshard config's ``scheduler`` names."""
        if self.lr_scheduler is None and self._built is not None and self._built.scheduler is not None:
            self.lr_scheduler = self._built.scheduler
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _build(self, model: nn.Module) -> BuiltEngine:
        if self.optimizer is not None:  # a torch optimizer given in optimizers=: adopted
            optimizer, groups, options = self.optimizer, None, {}
        else:
            optimizer, options = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
            _check_optimizer_class(self.args, optimizer, options)
            groups = self._param_groups(model)
        engine_options = dict(self._engine_options)
        if self._expert_groups is not None:
            engine_options.setdefault("expert_process_group", self._expert_groups.expert_dp)
        clip = self.args.max_grad_norm
        return build_engine(
            model,
            optimizer,
            groups,
            owner=OWNER,
            framework="TrainingArguments",
            config=self._config,
            settings=self._settings(),
            optimizer_options=options,
            engine_defaults={
                "param_dtype": param_dtype_for(self.args.mixed_precision, OWNER),
                "max_grad_norm": clip if clip and clip > 0 else None,
            },
            engine_options=engine_options,
        )

    def _param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Trainer's weight-decay split (decay / no decay); expert stacks in groups of their own."""
        decay = set(self.get_decay_parameter_names(model))
        named = {id(param): name for name, param in model.named_parameters()}
        if not self._moe:
            dense, experts = [p for p in model.parameters() if p.requires_grad], []
        else:
            dense_group, *experts = moe_param_groups(model)
            dense = [p for p in dense_group["params"] if p.requires_grad]
        groups = [
            {"params": [p for p in dense if named[id(p)] in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for p in dense if named[id(p)] not in decay], "weight_decay": 0.0},
            *({**group, "weight_decay": self.args.weight_decay} for group in experts),
        ]
        return [group for group in groups if group["params"]]

    def _settings(self) -> list[Setting]:
        """What the TrainingArguments decide of a DeepSpeed-style config, as HF's DeepSpeed
        integration fills and checks them."""
        args = self.args
        micro, steps, world = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size
        from_args = "drop the key (or set it to 'auto'): the TrainingArguments set it"
        max_steps = max(self.state.max_steps, 0)
        return [
            Setting("train_micro_batch_size_per_gpu", micro, f"per_device_train_batch_size = {micro}", fix=from_args),
            Setting("gradient_accumulation_steps", steps, f"gradient_accumulation_steps = {steps}", fix=from_args),
            Setting(
                "train_batch_size",
                micro * steps * world,
                f"per_device_train_batch_size {micro} x gradient_accumulation_steps {steps} x world size {world} "
                f"= {micro * steps * world}",
                fix="drop train_batch_size (or set it to 'auto'): the TrainingArguments and the world size set it",
            ),
            Setting("gradient_clipping", args.max_grad_norm, f"max_grad_norm = {args.max_grad_norm}"),
            Setting("bf16.enabled", bool(args.bf16), f"bf16 = {args.bf16}"),
            Setting("fp16.enabled", bool(args.fp16), f"fp16 = {args.fp16}"),
            Setting("optimizer.params.lr", args.learning_rate, f"learning_rate = {args.learning_rate}", False),
            Setting("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2", False),
            Setting("optimizer.params.eps", args.adam_epsilon, f"adam_epsilon = {args.adam_epsilon}", False),
            Setting("optimizer.params.weight_decay", args.weight_decay, f"weight_decay = {args.weight_decay}", False),
            Setting("scheduler.params.warmup_min_lr", 0, "Trainer's warmup from 0", False),
            Setting("scheduler.params.warmup_max_lr", args.learning_rate, f"learning_rate = {args.learning_rate}", False),
            Setting("scheduler.params.warmup_num_steps", args.get_warmup_steps(max_steps), "the warmup steps", False),
            Setting("scheduler.params.total_num_steps", max_steps, f"max_steps = {max_steps}", False),
        ]

    def _make_expert_parallel(self, expert_parallel_size: int | ExpertGroups | None) -> ExpertGroups | None:
        """The expert groups of a MoE model: the given ones, or EP of the given size (1 when
        none is given: the experts still train as expert groups, so checkpoints load at any EP)."""
        if isinstance(expert_parallel_size, ExpertGroups):
            return expert_parallel_size
        size = 1 if expert_parallel_size is None else expert_parallel_size
        groups = new_expert_groups(size) if self.args.world_size > 1 or size > 1 else None
        expert_parallel(self.model, groups, device=self.args.device)
        return groups

    # ---- what Trainer does with the gradients -------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips by the global norm in its step

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # the model has no .grad to read: the engine took it

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        norm = self.engine.last_grad_norm if self.engine is not None else grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; ``resume_from_checkpoint`` must name a folder with a zeroshard
        checkpoint (``True``: the newest such ``checkpoint-N`` under ``output_dir``), checked on
        every rank before anything loads. Returns once the last checkpoint is written."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_committed(Path(self.args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-")
            if resume_from_checkpoint is None:
                raise ValueError(f"{OWNER}: no checkpoint with a zeroshard save in {self.args.output_dir}")
        if resume_from_checkpoint:
            check_resumable(Path(resume_from_checkpoint), _stock_trainer_files)
            resume_from_checkpoint = str(resume_from_checkpoint)
        output = super().train(resume_from_checkpoint or None, *args, **kwargs)
        if self._saves is not None:
            self._saves.close()
        return output

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        assert self._saves is not None
        self._saves.lr_scheduler = self.lr_scheduler
        self._saves.save(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        return None  # the engine's loss scaler is in the sharded checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        return None  # the weights come back with the engine's state (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        assert self._saves is not None
        self._saves.lr_scheduler = self.lr_scheduler
        _, attestation = self._saves.load(checkpoint)
        if self.engine is not None and self.engine.rank == 0:
            log.info("%s: resumed from %s: %s", OWNER, Path(checkpoint) / TAG, attestation.line())

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or self._saves is None:
            return super()._load_best_model()
        self._saves.load(best, load_optimizer_states=False)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective once training has started: write the fp32 master weights (every rank's
        partition, every expert) and config.json to ``output_dir`` (default ``output_dir``),
        ready for ``from_pretrained``. In a checkpoint (``_internal_call``) only config.json:
        the sharded checkpoint holds the weights, unless ``save_only_model`` is set."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        if not _internal_call or self.args.save_only_model:
            export_fp32(self.engine, folder)
        if self.args.should_save:
            self._save_configs(folder)

    def _save_configs(self, folder: Path) -> None:
        config = getattr(self.model, "config", None)
        if config is not None:
            config.save_pretrained(folder)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and getattr(self.model, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)


def _refuse_other_engines(training_args: Any) -> None:
    if training_args is None:
        return
    if getattr(training_args, "deepspeed", None):
        raise ValueError(
            f"{OWNER}: TrainingArguments(deepspeed=...) would make Trainer run DeepSpeed; drop it from the "
            "TrainingArguments and pass the same config as ZeroShardTrainer(..., zeroshard=config)"
        )
    if getattr(training_args, "fsdp", None):
        raise ValueError(
            f"{OWNER}: TrainingArguments(fsdp=...) would wrap the model in FSDP; drop it: zeroshard shards "
            "the optimizer state and gradients itself"
        )


def _check_optimizer_class(training_args: Any, optimizer_class: Any, options: dict[str, Any]) -> None:
    wraps = isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    special = sorted(set(options) & {"params", "model", "optimizer_dict"})
    if not wraps or special:
        raise ValueError(
            f"{OWNER}: optim={training_args.optim!r} gives {getattr(optimizer_class, '__name__', optimizer_class)}, "
            "which ZeroOptimizer cannot wrap (it needs a torch.optim.Optimizer class over plain param groups); "
            "use adamw_torch, adamw_torch_fused, sgd or another torch optimizer"
        )


def _stock_trainer_files(folder: Path) -> str | None:
    """What a stock Trainer (or one with DeepSpeed) left in a checkpoint folder, in one line."""
    if (folder / "optimizer.pt").is_file() or (folder / "optimizer.bin").is_file():
        return (
            f"{folder}: written by a stock transformers Trainer: its optimizer.pt is one optimizer state saved by "
            "rank 0 alone (with a ZeroOptimizer, rank 0's shard only), so a resume could only be wrong; start from "
            f"its weights instead (from_pretrained({str(folder)!r})) without resume_from_checkpoint"
        )
    if any(folder.glob("global_step*")):
        return (
            f"{folder}: a DeepSpeed checkpoint written by Trainer(deepspeed=...), not by ZeroShardTrainer; "
            f"`zeroshard to-fp32 {folder} OUT` exports its weights to start from"
        )
    return None
