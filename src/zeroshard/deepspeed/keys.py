"""Every DeepSpeed 0.19 config key, and what ``from_deepspeed_config`` does with it.

Each key (a dotted path: ``zero_optimization.stage``) is one :class:`KeyRule` of one kind:

* ``mapped``: turned into a zeroshard setting (``what`` names it); values zeroshard cannot
  honour are refused by :mod:`zeroshard.deepspeed.config` where the value is read;
* ``no-op``: accepted and changes nothing in zeroshard (``what`` says why); a few values of
  some are refused all the same (``refuse`` returns the reason);
* ``refused``: a feature zeroshard does not have; the config is refused, with ``what`` as
  the reason, unless the value leaves the feature off (``harmless``: disabled, null, 1, ...).

A key of no rule is refused too (DeepSpeed ignores unknown top-level keys; a typo here
would otherwise go unnoticed). A rule ending in ``.*`` covers every key under its section.
docs/MIGRATING.md holds the same table, and ``tests/test_deepspeed_config.py`` checks that
the two agree. Pure data and plain functions: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from .values import short

MAPPED, NOOP, REFUSED = "mapped", "no-op", "refused"


def _never(value: Any) -> str | None:
    return None


def _empty(value: Any) -> bool:
    """A section that is absent or empty (for features that a section's presence turns on)."""
    return value is None or (isinstance(value, Mapping) and not value)


def _off(value: Any) -> bool:
    """A feature left off: null, false, 0, an empty section or one with ``enabled`` false."""
    if isinstance(value, Mapping):
        return not value or value.get("enabled", False) is False
    return value is None or value is False or value == 0


@dataclass(frozen=True)
class KeyRule:
    """What happens to one config key (see the module docstring)."""

    key: str
    kind: str
    what: str
    refuse: Callable[[Any], str | None] = _never  # no-op keys: a value that must be refused, and why
    harmless: Callable[[Any], bool] = _off  # refused keys: values that leave the feature off

    def problem(self, value: Any) -> str | None:
        """Why ``value`` of this key is refused, or None when it is accepted."""
        if self.kind == REFUSED:
            return None if self.harmless(value) else self.what
        return self.refuse(value)


def _mapped(key: str, what: str) -> KeyRule:
    return KeyRule(key, MAPPED, what)


def _noop(key: str, why: str, refuse: Callable[[Any], str | None] = _never) -> KeyRule:
    return KeyRule(key, NOOP, why, refuse=refuse)


def _refused(key: str, why: str, harmless: Callable[[Any], bool] = _off) -> KeyRule:
    return KeyRule(key, REFUSED, why, harmless=harmless)


def _unless(accepted: Callable[[Any], bool], reason: str) -> Callable[[Any], str | None]:
    return lambda value: None if accepted(value) else reason


def _equals(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is not bool for v in values) or value is None


_LOGGING = "zeroshard logs nothing of its own: log from the training loop"
_ZERO3 = "a ZeRO-3 setting; DeepSpeed ignores it at stage 1 and 2 too"
_NVME = "an NVMe offload setting; zeroshard offloads to host memory only"
_MOE_MODEL = "how AutoEP rewrites the model's MoE layers: the model passed in is used as it is"

RULES: tuple[KeyRule, ...] = (
    # ---- batch and accumulation --------------------------------------------------------------
    _mapped(
        "train_batch_size", "DeepSpeedRun.batch.train_batch_size; must equal micro batch x accumulation x world size"
    ),
    _mapped(
        "train_micro_batch_size_per_gpu", "DeepSpeedRun.batch.micro_batch_size: the rows each rank feeds each backward"
    ),
    _mapped(
        "gradient_accumulation_steps", "ZeroOptimizer(gradient_accumulation_steps=): backward() divides the loss by it"
    ),
    _noop(
        "managed_gradient_accumulation",
        "zeroshard's loop calls engine.step() once per gradient_accumulation_steps backward() calls "
        "(DeepSpeed's default, true, lets every micro-batch call step())",
    ),
    # ---- precision and loss scaling ------------------------------------------------------------
    _mapped("bf16.enabled", "ZeroOptimizer(param_dtype=torch.bfloat16); frozen parameters are cast too, buffers kept"),
    _mapped(
        "bf16.check_grad_overflow", "DeepSpeedLossScaler(check_overflow=): skip steps whose gradients hold inf/nan"
    ),
    _noop("bf16.immediate_grad_update", "a setting of DeepSpeed's BF16_Optimizer, which ZeRO stage 1/2 does not use"),
    _refused("bf16.bf16_master_weights_and_grads", "zeroshard keeps fp32 master weights and gradients"),
    _refused("bf16.bf16_optimizer_states", "zeroshard keeps the optimizer state in fp32 (the masters' dtype)"),
    _mapped("bfloat16.enabled", "as bf16.enabled (DeepSpeed's old name of the section)"),
    _mapped("bfloat16.check_grad_overflow", "as bf16.check_grad_overflow"),
    _noop("bfloat16.immediate_grad_update", "as bf16.immediate_grad_update"),
    _refused("bfloat16.bf16_master_weights_and_grads", "zeroshard keeps fp32 master weights and gradients"),
    _refused("bfloat16.bf16_optimizer_states", "zeroshard keeps the optimizer state in fp32 (the masters' dtype)"),
    _mapped("fp16.enabled", "ZeroOptimizer(param_dtype=torch.float16) with a DeepSpeedLossScaler"),
    _mapped(
        "fp16.loss_scale", "0: dynamic scaling; else a static DeepSpeedLossScaler(scale=loss_scale, dynamic=False)"
    ),
    _mapped("fp16.initial_scale_power", "DeepSpeedLossScaler(scale=2**initial_scale_power)"),
    _mapped("fp16.loss_scale_window", "DeepSpeedLossScaler(growth_interval=)"),
    _mapped("fp16.hysteresis", "DeepSpeedLossScaler(hysteresis=): overflows tolerated before the scale backs off"),
    _mapped("fp16.consecutive_hysteresis", "DeepSpeedLossScaler(consecutive_hysteresis=)"),
    _mapped("fp16.min_loss_scale", "DeepSpeedLossScaler(min_scale=); an overflow there raises, as in DeepSpeed"),
    _refused("fp16.auto_cast", "zeroshard does not cast inputs: cast them to the parameter dtype in the loop"),
    _refused("fp16.fp16_master_weights_and_grads", "zeroshard keeps fp32 master weights and gradients"),
    _mapped("gradient_clipping", "ZeroOptimizer(max_grad_norm=); 0 (DeepSpeed's default) is no clipping"),
    _mapped("communication_data_type", "ZeroOptimizer(reduce_dtype=); absent: the parameter dtype, as in DeepSpeed"),
    _noop("seq_parallel_communication_data_type", "zeroshard has no sequence parallelism"),
    _refused("torch_autocast", "zeroshard trains in the parameter dtype, without torch.autocast"),
    _refused("amp", "apex AMP: zeroshard trains in the parameter dtype (bf16 or fp16) instead"),
    _noop(
        "data_types.grad_accum_dtype",
        "zeroshard accumulates gradients in fp32",
        _unless(_equals("fp32"), "zeroshard accumulates gradients in fp32 only"),
    ),
    _noop(
        "data_types.param_dtype",
        "the parameter dtype comes from bf16 / fp16 (DeepSpeed refuses a different one too)",
    ),
    _refused("data_types.buffer_dtype", "zeroshard leaves buffers in their dtype: cast them before calling", _equals()),
    _noop(
        "data_types.keep_in_fp32_modules",
        "zeroshard casts no buffers, so every buffer keeps its dtype",
        _unless(lambda v: v in (None, "auto", []), "zeroshard casts no buffers: the list would change nothing"),
    ),
    # ---- reduction -------------------------------------------------------------------------------
    _noop(
        "prescale_gradients",
        "where the gradient is divided by the world size is zeroshard's choice (README, reduce_dtype)",
    ),
    _noop(
        "gradient_predivide_factor",
        "1.0 only: zeroshard divides by the world size once",
        _unless(_equals(1, 1.0), "zeroshard divides by the world size once; a partial pre-division is not offered"),
    ),
    _noop(
        "gradient_allreduce_op",
        "'mean' only: zeroshard averages gradients over the ranks",
        _unless(_equals("mean"), "zeroshard averages gradients over the ranks ('sum' is not offered)"),
    ),
    _noop("disable_allgather", "a plain data-parallel setting: ZeRO always all-gathers the parameters"),
    _refused("sparse_gradients", "zeroshard reduces dense gradients only"),
    # ---- ZeRO ----------------------------------------------------------------------------------
    _mapped("zero_optimization.stage", "ZeroOptimizer(stage=): 1 or 2; 0 (no ZeRO) and 3 are refused"),
    _mapped(
        "zero_optimization.reduce_bucket_size",
        "stage 2: LayoutPolicy.native(bucket_numel=); stage 1 reduces each group once per step",
    ),
    _noop("zero_optimization.allgather_bucket_size", "zeroshard all-gathers each layout bucket in one call"),
    _noop("zero_optimization.overlap_comm", "zeroshard's stage 2 always reduces buckets during the backward"),
    _noop("zero_optimization.contiguous_gradients", "zeroshard's gradient partitions are always contiguous"),
    _noop("zero_optimization.reduce_scatter", "zeroshard always reduce-scatters (the same sums as an all-reduce)"),
    _noop("zero_optimization.allgather_partitions", "zeroshard always all-gathers partitions"),
    _noop("zero_optimization.use_multi_rank_bucket_allreduce", "zeroshard always reduce-scatters"),
    _noop(
        "zero_optimization.round_robin_gradients",
        "a DeepSpeed flat-buffer order; zeroshard reads it from DeepSpeed checkpoints",
    ),
    _noop("zero_optimization.parameter_alignment", "zeroshard aligns every parameter to 16 bytes always"),
    _noop("zero_optimization.elastic_checkpoint", "zeroshard checkpoints load at any world size"),
    _noop("zero_optimization.ignore_unused_parameters", "unused parameters get zero gradients in zeroshard"),
    _noop(
        "zero_optimization.compute_grad_norm",
        "zeroshard always computes the norm (engine.last_grad_norm); false with gradient_clipping > 0 is refused",
        _unless(lambda v: v is None or type(v) is bool, "must be true or false"),
    ),
    _noop(
        "zero_optimization.load_from_fp32_weights",
        "zeroshard loads the fp32 masters a checkpoint holds",
        _unless(
            lambda v: v is None or v is True,
            "zeroshard loads the fp32 masters a checkpoint holds; "
            "to rebuild them from the weights use load_checkpoint(load_optimizer_states=False)",
        ),
    ),
    _mapped(
        "zero_optimization.offload_optimizer.device",
        "'cpu': ZeroOptimizer(offload=True); 'none': no offload; 'nvme' refused",
    ),
    _noop(
        "zero_optimization.offload_optimizer.pin_memory",
        "the offloaded state is plain host memory; saves pin their own buffer",
    ),
    _noop("zero_optimization.offload_optimizer.fast_init", "zeroshard builds the host state directly"),
    _noop("zero_optimization.offload_optimizer.cpuadam_cores_perc", "zeroshard runs the torch optimizer on the host"),
    _refused(
        "zero_optimization.offload_optimizer.ratio",
        "zeroshard offloads all of the optimizer state or none",
        _equals(1, 1.0),
    ),
    _refused("zero_optimization.offload_optimizer.super_offload", "SuperOffload is DeepSpeed's own"),
    _noop("zero_optimization.offload_optimizer.nvme_path", _NVME),
    _noop("zero_optimization.offload_optimizer.buffer_count", _NVME),
    _noop("zero_optimization.offload_optimizer.pipeline_read", _NVME),
    _noop("zero_optimization.offload_optimizer.pipeline_write", _NVME),
    _mapped("zero_optimization.cpu_offload", "DeepSpeed's old name: true is ZeroOptimizer(offload=True)"),
    _noop("zero_optimization.cpu_offload_use_pin_memory", "as offload_optimizer.pin_memory"),
    _refused(
        "zero_optimization.offload_param",
        "offloading parameters is ZeRO-3; zeroshard keeps them on the device",
        lambda v: v is None or (isinstance(v, Mapping) and v.get("device", "none") in ("none", None)),
    ),
    _refused(
        "zero_optimization.cpu_offload_param", "offloading parameters is ZeRO-3; zeroshard keeps them on the device"
    ),
    _refused("zero_optimization.zenflow", "ZenFlow is DeepSpeed's own"),
    _refused("zero_optimization.legacy_stage1", "DeepSpeed's pre-0.5.9 stage 1"),
    _refused("zero_optimization.zero_hpz_partition_size", "ZeRO++ hpZ (a ZeRO-3 feature)", _equals(0, 1)),
    _refused("zero_optimization.zero_quantized_weights", "ZeRO++ qwZ: zeroshard gathers weights unquantised"),
    _refused("zero_optimization.zero_quantized_nontrainable_weights", "ZeRO++: zeroshard does not quantise weights"),
    _refused("zero_optimization.zero_quantized_gradients", "ZeRO++ qgZ: zeroshard reduces gradients unquantised"),
    _noop("zero_optimization.save_muon_momentum_buffer_in_memory", "a setting of DeepSpeed's Muon"),
    *(
        _noop(f"zero_optimization.{name}", _ZERO3)
        for name in (
            "sub_group_size",
            "prefetch_bucket_size",
            "stage3_prefetch_bucket_size",
            "param_persistence_threshold",
            "stage3_param_persistence_threshold",
            "model_persistence_threshold",
            "stage3_model_persistence_threshold",
            "max_live_parameters",
            "stage3_max_live_parameters",
            "max_reuse_distance",
            "stage3_max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "module_granularity_threshold",
            "stage3_module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "stage3_use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "stage3_allgather_sequential",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "leaf_module",
        )
    ),  # fmt: skip
    # ---- optimizer and scheduler ---------------------------------------------------------------
    _mapped(
        "optimizer.type",
        "the torch optimizer class: Adam/AdamW -> torch.optim.Adam/AdamW, Muon -> torch.optim.Muon on the matrices DeepSpeed tags and torch.optim.AdamW on the rest, any torch.optim name; DeepSpeed's own (Lamb, Lion, OneBitAdam, ...) refused",
    ),
    _mapped(
        "optimizer.params",
        "the optimizer's arguments (lr, betas, eps, weight_decay, ...); DeepSpeed's own ones are read (adam_w_mode, torch_adam, bias_correction)",
    ),
    _noop("optimizer.legacy_fusion", "a setting of DeepSpeed's fused fp16 optimizer"),
    _mapped(
        "scheduler.type",
        "zeroshard.deepspeed.lr_schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or any torch.optim.lr_scheduler name",
    ),
    _mapped("scheduler.params", "the scheduler's arguments, as DeepSpeed's"),
    _noop("zero_allow_untested_optimizer", "zeroshard wraps any torch optimizer"),
    _noop("zero_force_ds_cpu_optimizer", "with offload zeroshard runs the torch optimizer on the host"),
    # ---- checkpoints -----------------------------------------------------------------------------
    _noop("checkpoint.tag_validation", "every rank saves the same tag: zeroshard checks it on every save"),
    _noop("checkpoint.load_universal", "load_checkpoint and the Checkpointer read universal checkpoints as they are"),
    _refused("checkpoint.use_node_local_storage", "the Checkpointer writes every rank into one shared root"),
    _noop("checkpoint.parallel_write", "a pipeline-parallel setting; every rank writes its own files"),
    _noop("checkpoint.checkpoint_serialization", "zeroshard writes safetensors and JSON"),
    _noop("checkpoint.writer", "the Checkpointer writes in the background (async_save=True) with its own writer"),
    _refused("nebula", "Nebula is DeepSpeed's checkpoint service; the Checkpointer saves asynchronously itself"),
    _refused(
        "datastates",
        "DataStates is DeepSpeed's checkpoint engine; the Checkpointer saves asynchronously itself",
        _empty,
    ),
    # ---- parallelism zeroshard does not have --------------------------------------------------------------
    _refused("pipeline", "zeroshard has no pipeline parallelism", _empty),
    _refused(
        "tensor_parallel",
        "zeroshard has no tensor parallelism",
        lambda v: v is None or (isinstance(v, Mapping) and v.get("autotp_size", 1) in (0, 1)),
    ),
    _refused("sequence_parallel_size", "zeroshard has no sequence parallelism", _equals(1)),
    _mapped(
        "expert_parallel.enabled",
        "true: the model is an expert-parallel one; pass expert_process_group= and the expert param groups (zeroshard.moe)",
    ),
    _mapped(
        "expert_parallel.autoep_size", "checked: the expert_process_group given has world size / autoep_size ranks"
    ),
    _refused(
        "expert_parallel.expert_tensor_parallel_size", "zeroshard has no tensor parallelism for experts", _equals(0, 1)
    ),
    _noop("expert_parallel.*", _MOE_MODEL),
    _noop(
        "use_data_before_expert_parallelism", "DeepSpeed's rank order of its expert groups; zeroshard.moe makes its own"
    ),
    # ---- features zeroshard does not have ----------------------------------------------------------
    _refused(
        "compile",
        "DeepCompile is DeepSpeed's own; call torch.compile on the model yourself",
        lambda v: v is None or (isinstance(v, Mapping) and not v.get("deepcompile", False)),
    ),
    _refused("hybrid_engine", "DeepSpeed's RLHF hybrid engine"),
    _refused("elasticity", "elastic batch sizes: zeroshard takes the batch sizes given"),
    _refused("autotuning", "DeepSpeed's autotuner"),
    _refused("curriculum_learning", "a DeepSpeed data pipeline feature; feed the data from the loop"),
    _refused("data_efficiency", "a DeepSpeed data pipeline feature; feed the data from the loop"),
    _refused("compression_training", "DeepSpeed's compression library", _empty),
    _refused("sparse_attention", "DeepSpeed's sparse attention kernels replace model layers", _empty),
    _refused("weight_quantization", "DeepSpeed's weight quantisation", _empty),
    _refused("progressive_layer_drop", "a DeepSpeed training feature that changes the model's forward"),
    _refused("eigenvalue", "DeepSpeed's eigenvalue computation"),
    _refused("quantize_training", "DeepSpeed's quantised training"),
    _noop(
        "activation_checkpointing",
        "configures deepspeed.checkpointing, which keeps working in the model; zeroshard does not use it",
    ),
    _noop("aio", "asynchronous NVMe I/O settings: zeroshard uses no NVMe"),
    # ---- logging and diagnostics ---------------------------------------------------------------
    *(
        _noop(name, _LOGGING)
        for name in (
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "log_level",
            "flops_profiler",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "comms_logger",
            "timers",
        )
    ),  # fmt: skip
    _noop("vocabulary_size", "DeepSpeed only warns about it"),
    _noop("disable_python_gc", "zeroshard leaves Python's garbage collector alone while training"),
    _noop("dataloader_drop_last", "zeroshard builds no data loader: the loop feeds the batches"),
)

_BY_KEY = {rule.key: rule for rule in RULES}


@dataclass
class Classified:
    """A config's keys sorted by kind. ``values``: every mapped key's value by dotted key."""

    values: dict[str, Any] = field(default_factory=dict)
    noops: dict[str, str] = field(default_factory=dict)  # accepted no-op key -> why it changes nothing
    refusals: list[str] = field(default_factory=list)  # "key: why", one per refused key


def rule_for(key: str) -> KeyRule | None:
    """The rule of dotted ``key``: its own, or its section's ``.*`` rule; None if there is none."""
    rule = _BY_KEY.get(key)
    if rule is None and "." in key:
        rule = _BY_KEY.get(key.rsplit(".", 1)[0] + ".*")
    return rule


def classify(config: Mapping[str, Any]) -> Classified:
    """Every key of ``config`` (a DeepSpeed config dict), by rule. Sections with rules for
    their keys (``zero_optimization``, ``fp16``, ...) are walked into; any other value is
    judged whole."""
    result = Classified()
    for key, value in _leaves(config, ""):
        rule = rule_for(key)
        if rule is None and _has_rules_under(key):
            result.refusals.append(f"{key} = {short(value)}: must be a section (a JSON object of settings)")
            continue
        if rule is None:
            result.refusals.append(f"{key}: not a DeepSpeed 0.19 setting zeroshard knows (a typo?)")
            continue
        problem = rule.problem(value)
        if problem is not None:
            result.refusals.append(f"{key} = {short(value)}: {problem}")
        elif rule.kind == MAPPED:
            result.values[key] = value
        else:
            result.noops[key] = rule.what if rule.kind == NOOP else f"off ({rule.what})"
    return result


def _leaves(config: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and _has_rules_under(key):
            yield from _leaves(value, key + ".")
        else:
            yield key, value


def _has_rules_under(section: str) -> bool:
    return any(rule.key.startswith(section + ".") for rule in RULES)
