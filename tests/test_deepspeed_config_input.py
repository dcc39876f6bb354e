"""from_deepspeed_config on what a user gives it: odd values, odd files, batch sizes written
for another world size, and what it tells a user who configured no logging.

Each case of ODD is a config a user could write (or a file could hold) that zeroshard cannot
honour: non-finite or huge numbers, a value of the wrong JSON type at every level, a string
where a bool belongs, a stage that is not the integer 1 or 2, an optimizer or scheduler that
would build and then fail at the first step, a config nested 100,000 deep; and a FIFO for a
path. Each must be refused in one ``ValueError`` line that names the key (or the file), with
the model left as it was (no parameter cast, nothing built). The configs that do build train.
"""

from __future__ import annotations

import copy
import re
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_fixtures import CONFIGS, _ds_config, build_model, global_batch, param_groups

from zeroshard import from_deepspeed_config
from zeroshard.deepspeed.config import resolve_batch_sizes

BASE = _ds_config(next(config for config in CONFIGS if config.name == "w1_s2_align"))
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # a JSON integer Python reads exactly and no float holds


def changed(*edits: tuple[str, object]) -> dict:
    """BASE with each dotted key set (a value of DELETE removes it)."""
    config = copy.deepcopy(BASE)
    for key, value in edits:
        *sections, last = key.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return config


DELETE = object()
FP16 = (("bf16.enabled", False), ("fp16.enabled", True))
SGD = ("optimizer", {"type": "SGD", "params": {"lr": 0.1}})


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


# (id, config, the key the one-line message must name)
ODD = [
    # ---- non-finite numbers -----------------------------------------------------------------
    ("clip-nan", changed(("gradient_clipping", NAN)), "gradient_clipping"),
    ("clip-inf", changed(("gradient_clipping", INF)), "gradient_clipping"),
    ("clip-minus-inf", changed(("gradient_clipping", -INF)), "gradient_clipping"),
    ("train-batch-inf", changed(("train_batch_size", INF)), "train_batch_size"),
    ("micro-batch-nan", changed(("train_micro_batch_size_per_gpu", NAN)), "train_micro_batch_size_per_gpu"),
    ("accumulation-inf", changed(("gradient_accumulation_steps", INF)), "gradient_accumulation_steps"),
    ("loss-scale-nan", changed(*FP16, ("fp16.loss_scale", NAN)), "fp16.loss_scale"),
    ("loss-scale-inf", changed(*FP16, ("fp16.loss_scale", INF)), "fp16.loss_scale"),
    ("scale-power-nan", changed(*FP16, ("fp16.initial_scale_power", NAN)), "fp16.initial_scale_power"),
    ("scale-window-nan", changed(*FP16, ("fp16.loss_scale_window", NAN)), "fp16.loss_scale_window"),
    ("min-scale-inf", changed(*FP16, ("fp16.min_loss_scale", INF)), "fp16.min_loss_scale"),
    ("bucket-inf", changed(("zero_optimization.reduce_bucket_size", INF)), "zero_optimization.reduce_bucket_size"),
    ("lr-inf", changed(("optimizer.params.lr", INF)), "optimizer.params.lr"),
    ("lr-nan", changed(("optimizer.params.lr", NAN)), "optimizer.params.lr"),
    ("eps-nan", changed(("optimizer.params.eps", NAN)), "optimizer.params.eps"),
    ("beta-nan", changed(("optimizer.params.betas", [0.9, NAN])), "optimizer.params.betas"),
    ("decay-inf", changed(("optimizer.params.weight_decay", INF)), "optimizer.params.weight_decay"),
    ("warmup-steps-inf", changed(("scheduler.params.warmup_num_steps", INF)), "scheduler.params.warmup_num_steps"),
    ("cos-ratio-nan", changed(("scheduler.params.cos_min_ratio", NAN)), "scheduler.params.cos_min_ratio"),
    # ---- huge numbers ---------------------------------------------------------------------------
    ("scale-power-10000", changed(*FP16, ("fp16.initial_scale_power", 10000)), "fp16.initial_scale_power"),
    ("scale-power-minus-10000", changed(*FP16, ("fp16.initial_scale_power", -10000)), "fp16.initial_scale_power"),
    ("clip-huge", changed(("gradient_clipping", HUGE)), "gradient_clipping"),
    ("loss-scale-huge", changed(*FP16, ("fp16.loss_scale", HUGE)), "fp16.loss_scale"),
    ("min-scale-huge", changed(*FP16, ("fp16.min_loss_scale", HUGE)), "fp16.min_loss_scale"),
    ("lr-huge", changed(("optimizer.params.lr", HUGE)), "optimizer.params.lr"),
    ("total-steps-huge", changed(("scheduler.params.warmup_min_ratio", HUGE)), "scheduler.params.warmup_min_ratio"),
    # ---- the scheduler section --------------------------------------------------------------------
    ("scheduler-type-list", changed(("scheduler.type", ["WarmupLR"])), "scheduler.type"),
    ("scheduler-type-dict", changed(("scheduler.type", {"name": "WarmupLR"})), "scheduler.type"),
    ("scheduler-type-number", changed(("scheduler.type", 5)), "scheduler.type"),
    ("scheduler-abstract", changed(("scheduler", {"type": "LRScheduler"})), "scheduler.type"),
    ("scheduler-abstract-old-name", changed(("scheduler", {"type": "_LRScheduler"})), "scheduler.type"),
    ("scheduler-plateau", changed(("scheduler", {"type": "ReduceLROnPlateau", "params": {}})), "scheduler.type"),
    (
        "scheduler-lambda",
        changed(("scheduler", {"type": "LambdaLR", "params": {"lr_lambda": "lambda s: 1"}})),
        "scheduler.params.lr_lambda",
    ),
    (
        "scheduler-sequential",
        changed(("scheduler", {"type": "SequentialLR", "params": {}})),
        "scheduler.params.schedulers",
    ),
    ("scheduler-chained", changed(("scheduler", {"type": "ChainedScheduler"})), "scheduler.params.schedulers"),
    ("scheduler-missing-argument", changed(("scheduler", {"type": "StepLR"})), "scheduler.params.step_size"),
    ("scheduler-params-list", changed(("scheduler.params", [20, 2])), "scheduler.params"),
    ("scheduler-params-string", changed(("scheduler.params", "warmup")), "scheduler.params"),
    ("warmup-steps-string", changed(("scheduler.params.warmup_num_steps", "2")), "scheduler.params.warmup_num_steps"),
    ("total-steps-bool", changed(("scheduler.params.total_num_steps", True)), "scheduler.params.total_num_steps"),
    ("warmup-type-number", changed(("scheduler.params.warmup_type", 3)), "scheduler.params.warmup_type"),
    ("cos-ratio-list", changed(("scheduler.params.cos_min_ratio", [0.1])), "scheduler.params.cos_min_ratio"),
    ("step-size-float", changed(("scheduler", {"type": "StepLR", "params": {"step_size": 2.5}})), "step_size"),
    # ---- the optimizer section ----------------------------------------------------------------
    ("optimizer-type-list", changed(("optimizer.type", ["AdamW"])), "optimizer.type"),
    ("optimizer-params-list", changed(("optimizer.params", [0.001])), "optimizer.params"),
    ("optimizer-params-string", changed(("optimizer.params", "lr=1e-3")), "optimizer.params"),
    ("lr-string", changed(("optimizer.params.lr", "1e-3")), "optimizer.params.lr"),
    ("lr-bool", changed(("optimizer.params.lr", True)), "optimizer.params.lr"),
    ("lr-null", changed(("optimizer.params.lr", None)), "optimizer.params.lr"),
    ("betas-string", changed(("optimizer.params.betas", "0.9,0.999")), "optimizer.params.betas"),
    ("three-betas", changed(("optimizer.params.betas", [0.9, 0.99, 0.999])), "optimizer.params.betas"),
    ("one-beta", changed(("optimizer.params.betas", [0.9])), "optimizer.params.betas"),
    ("betas-nested", changed(("optimizer.params.betas", [[0.9], [0.99]])), "optimizer.params.betas"),
    ("eps-bool", changed(("optimizer.params.eps", True)), "optimizer.params.eps"),
    ("amsgrad-string", changed(("optimizer.params.amsgrad", "false")), "optimizer.params.amsgrad"),
    ("foreach-string", changed(("optimizer.params.foreach", "yes")), "optimizer.params.foreach"),
    ("torch-adam-string", changed(("optimizer.params.torch_adam", "false")), "optimizer.params.torch_adam"),
    (
        "adam-w-mode-string",
        changed(("optimizer", {"type": "Adam", "params": {"adam_w_mode": "false"}})),
        "optimizer.params.adam_w_mode",
    ),
    (
        "bias-correction-string",
        changed(("optimizer", {"type": "Adam", "params": {"bias_correction": "true"}})),
        "optimizer.params.bias_correction",
    ),
    ("lbfgs", changed(("optimizer", {"type": "LBFGS", "params": {"lr": 1}})), "optimizer.type"),
    ("abstract-optimizer", changed(("optimizer", {"type": "Optimizer", "params": {}})), "optimizer.type"),
    ("sparse-adam", changed(("optimizer", {"type": "SparseAdam", "params": {}})), "optimizer.type"),
    (
        "momentum-string",
        changed(("optimizer", {"type": "SGD", "params": {"lr": 0.1, "momentum": "0.9"}})),
        "optimizer.params.momentum",
    ),
    # ---- a string or a number where a bool belongs ---------------------------------------------------
    ("bf16-string-true", changed(("bf16.enabled", "true")), "bf16.enabled"),
    ("bf16-string-false", changed(("bf16.enabled", "false")), "bf16.enabled"),
    ("bf16-one", changed(("bf16.enabled", 1)), "bf16.enabled"),
    ("bfloat16-string", changed(("bf16", DELETE), ("bfloat16.enabled", "true")), "bfloat16.enabled"),
    ("fp16-string", changed(("bf16.enabled", False), ("fp16.enabled", "true")), "fp16.enabled"),
    ("overflow-check-string", changed(("bf16.check_grad_overflow", "false")), "bf16.check_grad_overflow"),
    ("hysteresis-flag-string", changed(*FP16, ("fp16.consecutive_hysteresis", "false")), "fp16.consecutive_hysteresis"),
    ("cpu-offload-string", changed(("zero_optimization.cpu_offload", "true")), "zero_optimization.cpu_offload"),
    ("expert-parallel-string", changed(("expert_parallel.enabled", "true")), "expert_parallel.enabled"),
    (
        "grad-norm-string",
        changed(("zero_optimization.compute_grad_norm", "false")),
        "zero_optimization.compute_grad_norm",
    ),
    # ---- the stage -------------------------------------------------------------------------------------
    ("stage-string", changed(("zero_optimization.stage", "2")), "zero_optimization.stage"),
    ("stage-true", changed(("zero_optimization.stage", True)), "zero_optimization.stage"),
    ("stage-false", changed(("zero_optimization.stage", False)), "zero_optimization.stage"),
    ("stage-float", changed(("zero_optimization.stage", 2.0)), "zero_optimization.stage"),
    ("stage-three-float", changed(("zero_optimization.stage", 3.0)), "zero_optimization.stage"),
    ("stage-minus-one", changed(("zero_optimization.stage", -1)), "zero_optimization.stage"),
    ("stage-list", changed(("zero_optimization.stage", [2])), "zero_optimization.stage"),
    # ---- other wrong types -------------------------------------------------------------------------
    ("comm-dtype-number", changed(("communication_data_type", 16)), "communication_data_type"),
    ("param-dtype-list", changed(("data_types.param_dtype", ["bf16"])), "data_types.param_dtype"),
    (
        "offload-device-list",
        changed(("zero_optimization.offload_optimizer.device", ["cpu"])),
        "zero_optimization.offload_optimizer.device",
    ),
    ("scale-power-string", changed(*FP16, ("fp16.initial_scale_power", "16")), "fp16.initial_scale_power"),
    ("hysteresis-string", changed(*FP16, ("fp16.hysteresis", "2")), "fp16.hysteresis"),
    ("train-batch-string", changed(("train_batch_size", "24")), "train_batch_size"),
    ("clip-string", changed(("gradient_clipping", "1.0")), "gradient_clipping"),
    ("clip-bool", changed(("gradient_clipping", True)), "gradient_clipping"),
    ("bucket-string", changed(("zero_optimization.reduce_bucket_size", "5e8")), "zero_optimization.reduce_bucket_size"),
    ("deep-dict", changed(("tensorboard", nested(100_000))), "nested more than"),
]


def assert_refused_untouched(config, key: str) -> str:
    model = build_model(False)
    before = {name: (tensor.dtype, tensor.clone()) for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        from_deepspeed_config(model, config, param_groups=param_groups(model))
    message = str(error.value)
    assert "\n" not in message and key in message, message
    for name, tensor in model.state_dict().items():
        dtype, values = before[name]
        assert tensor.dtype == dtype and torch.equal(tensor, values), f"{name} changed before the refusal"
    return message


@pytest.mark.parametrize("config, key", [case[1:] for case in ODD], ids=[case[0] for case in ODD])
def test_an_odd_config_is_refused_in_one_line_naming_the_key(config, key):
    assert_refused_untouched(config, key)


def test_a_bool_stage_or_a_string_stage_is_not_called_zero_3():
    for stage in ("2", True, 3.0, "3"):
        message = assert_refused_untouched(changed(("zero_optimization.stage", stage)), "zero_optimization.stage")
        assert "ZeRO-3" not in message and "must be the integer 1 or 2" in message, message
    assert "ZeRO-3" in assert_refused_untouched(changed(("zero_optimization.stage", 3)), "zero_optimization.stage")


def test_a_deep_config_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"tensorboard": ' + "[" * 100_000 + "]" * 100_000 + "}")
    message = assert_refused_untouched(path, str(path))
    assert "nested more than 100 levels" in message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literals_in_a_config_file_are_refused_naming_the_key(tmp_path, literal):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BASE).replace('"gradient_clipping": 1.0', f'"gradient_clipping": {literal}'))
    assert literal in path.read_text()
    assert_refused_untouched(path, "gradient_clipping")


_FIFO_SCRIPT = """
import sys
import torch
from zeroshard import from_deepspeed_config
try:
    from_deepspeed_config(torch.nn.Linear(2, 2), sys.argv[1], device=None)
except ValueError as err:
    print("refused:", err)
"""


def _run_python(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter on these sources, bounded: a hang fails the test."""
    import zeroshard

    src = Path(zeroshard.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_a_fifo_config_path_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    done = _run_python(_FIFO_SCRIPT, str(fifo))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"refused: {fifo}: not a regular file", done.stdout


# ---- configs that build train their first step --------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        changed(("optimizer", {"type": "Rprop", "params": {"lr": 0.01, "etas": [0.4, 1.3]}})),
        changed(("optimizer", {"type": "Adagrad", "params": {"lr": 0.01}})),
        changed(("optimizer", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}})),
        changed(("optimizer.params.lr", 1)),  # an integer where a float is annotated
        changed(SGD, ("scheduler", {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}})),
        changed(SGD, ("scheduler", {"type": "CyclicLR", "params": {"base_lr": 0.01, "max_lr": [0.1, 0.2]}})),
        changed(SGD, ("scheduler", {"type": "MultiStepLR", "params": {"milestones": [2, 4]}})),
        changed(("scheduler", {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}})),
        changed(("scheduler", {"type": "WarmupLR", "params": {"warmup_max_lr": [0.01, 0.02], "warmup_num_steps": 3}})),
        changed(*FP16, ("fp16.initial_scale_power", 0), ("fp16.loss_scale", 0)),
        changed(("bf16.enabled", False), ("gradient_clipping", 0)),
    ],
)
def test_a_config_that_builds_trains_its_first_step(config):
    model = build_model(False)
    run = from_deepspeed_config(model, config, param_groups=param_groups(model))
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    for step in range(3):  # a schedule may start at lr 0 for two steps (WarmupLR's log warmup does)
        tokens, targets = global_batch(step)
        run.engine.backward(model(tokens, targets))
        assert run.step()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the steps changed the weights"
    assert all(torch.isfinite(p).all() for p in after)


# ---- batch sizes written for another world size -------------------------------------------------------


def test_all_three_batch_sizes_at_another_world_size_say_to_drop_the_accumulation_steps():
    written_for_two = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError) as error:
        resolve_batch_sizes(written_for_two, 1)
    message = str(error.value)
    assert "\n" not in message and message.endswith(
        "to keep train_batch_size 24 at world size 1, drop gradient_accumulation_steps and it is derived (2)"
    ), message
    without = {key: value for key, value in written_for_two.items() if key != "gradient_accumulation_steps"}
    assert resolve_batch_sizes(without, 1).gradient_accumulation_steps == 2, "the fix it names works"
    no_fit = "no gradient_accumulation_steps fits: train_batch_size must be a multiple of 12 x 4"
    with pytest.raises(ValueError, match=re.escape(no_fit)):
        resolve_batch_sizes(written_for_two, 4)
    with pytest.raises(ValueError) as error:  # two of the three given: nothing to drop
        resolve_batch_sizes(without, 5)
    assert "drop" not in str(error.value) and "fits" not in str(error.value)


# ---- the ignored keys reach a user who configured no logging ----------------------------------------------

_IGNORED_SCRIPT = """
import torch
from zeroshard import from_deepspeed_config
config = {"train_batch_size": 2, "zero_optimization": {"stage": 1, "overlap_comm": True}, "steps_per_print": 10,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
from_deepspeed_config(torch.nn.Linear(2, 2), config, device=None)
"""


def test_the_ignored_keys_line_reaches_a_user_without_logging_configured():
    done = _run_python(_IGNORED_SCRIPT)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "change nothing in zeroshard" in line]
    assert len(lines) == 1 and "zero_optimization.overlap_comm, steps_per_print" in lines[0], done.stderr
