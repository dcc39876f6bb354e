"""from_deepspeed_config: every key mapped, accepted as a no-op or refused; the runs it builds.

* The key table in docs/MIGRATING.md is the code's (zeroshard.deepspeed.keys.RULES).
* Every refused key is refused in one line naming it, before anything is built; its
  harmless values (off, null, 1) are accepted.
* Batch sizes resolve as DeepSpeed's own DeepSpeedConfig resolves them.
* With the DeepSpeed configs the fixtures (tests/deepspeed_fixtures.py) were made with, the
  run equals the hand-written engine bit for bit: the losses, learning rates and final fp32
  masters of 6 steps at D = 2, stages 1 and 2. Both compute the same sums in the same order
  (same layout, reduction dtype, clipping, optimizer and lr arithmetic), so nothing but
  equality is right.
* The worked example of docs/MIGRATING.md: a DeepSpeed run resumed through the config and
  ``Checkpointer.load(warm_start=...)`` carries on with DeepSpeed's schedule (the same lrs,
  exactly) and losses (the first step exactly at the same world size: the same weights and
  rows; later steps within test_deepspeed_resume's bound).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

import torch.distributed as dist
from deepspeed_fixtures import (
    BASE_LR,
    BETAS,
    CLIP,
    CONFIGS,
    CONTINUE_STEPS,
    NO_DECAY_LR,
    STEPS,
    _ds_config,
    build_model,
    global_batch,
    param_groups,
    rank_rows,
    warmup_cosine_lr,
)
from test_deepspeed_resume import LOSS_RELATIVE_TOLERANCE

from zeroshard import from_deepspeed_config
from zeroshard.deepspeed.config import resolve_batch_sizes
from zeroshard.deepspeed.keys import REFUSED, RULES, rule_for
from zeroshard.engine import DeepSpeedLossScaler, ZeroOptimizer
from zeroshard.launch import spawn
from zeroshard.deepspeed.lr_schedules import WarmupCosineLR

MIGRATING = Path(__file__).resolve().parents[1] / "docs" / "MIGRATING.md"
FIXTURE = {config.name: config for config in CONFIGS}
FRESH_STEPS = 6


def fixture_config(name: str = "w1_s2_align") -> dict:
    return copy.deepcopy(_ds_config(FIXTURE[name]))


def with_key(config: dict, key: str, value) -> dict:
    config = copy.deepcopy(config)
    *sections, last = key.split(".")
    node = config
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return config


def build(config: dict, **options):
    model = build_model(False)
    return model, from_deepspeed_config(model, config, param_groups=param_groups(model), **options)


# ---- the key table ----------------------------------------------------------------------------


def test_the_key_table_in_migrating_md_is_the_codes():
    rows = re.findall(r"^\| `([^`]+)` \| (mapped|no-op|refused) \|", MIGRATING.read_text(), re.MULTILINE)
    documented = dict(rows)
    assert len(documented) == len(rows), "each key once"
    assert documented == {rule.key: rule.kind for rule in RULES}


ON_VALUES = (True, {"enabled": True}, {"deepcompile": True}, {"device": "cpu"}, {"autotp_size": 2}, 2, 0.5, {"x": 1})


@pytest.mark.parametrize("rule", [rule for rule in RULES if rule.kind == REFUSED], ids=lambda rule: rule.key)
def test_every_refused_key_is_refused_in_one_line_naming_it(rule):
    value = next(v for v in ON_VALUES if rule.problem(v) is not None)
    model = build_model(False)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        from_deepspeed_config(model, with_key(fixture_config(), rule.key, value), param_groups=param_groups(model))
    message = str(error.value)
    assert "\n" not in message and f"{rule.key} = " in message and rule.what in message
    assert all(
        torch.equal(before[name], tensor) and tensor.dtype == before[name].dtype
        for name, tensor in model.state_dict().items()
    )


@pytest.mark.parametrize(
    "key, value",
    [
        ("fp16.auto_cast", False),
        ("bf16.bf16_master_weights_and_grads", False),
        ("pipeline", {}),
        ("tensor_parallel", {"autotp_size": 1}),
        ("zero_optimization.offload_param", {"device": "none"}),
        ("zero_optimization.offload_optimizer.ratio", 1.0),
        ("elasticity", {"enabled": False}),
        ("compile", {"deepcompile": False}),
        ("sequence_parallel_size", 1),
    ],
)
def test_values_that_leave_a_refused_feature_off_are_accepted(key, value):
    _, run = build(with_key(fixture_config(), key, value))
    assert key in run.ignored


def test_no_ops_are_listed_with_why_and_unknown_keys_refused():
    config = with_key(
        with_key(fixture_config(), "zero_optimization.overlap_comm", True), "tensorboard", {"enabled": True}
    )
    _, run = build(config)
    assert run.ignored["zero_optimization.overlap_comm"] == rule_for("zero_optimization.overlap_comm").what
    assert "tensorboard" in run.ignored and "steps_per_print" in run.ignored
    for key in ("zero_optimization.stagee", "trian_batch_size", "fp16.loss_scale_windw"):
        with pytest.raises(ValueError, match=re.escape(f"{key}: not a DeepSpeed 0.19 setting zeroshard knows")):
            build(with_key(fixture_config(), key, 1))
    with pytest.raises(ValueError, match="zero_optimization = True: must be a section"):
        build(with_key(fixture_config(), "zero_optimization", True))
    with pytest.raises(ValueError, match="train_batch_size = 'auto': the Hugging Face Trainer fills it in"):
        build(with_key(fixture_config(), "train_batch_size", "auto"))


@pytest.mark.parametrize(
    "stage, message",
    [(3, "ZeRO-3, which zeroshard does not have"), (0, "no ZeRO"), (None, "no ZeRO")],
)
def test_stages_other_than_1_and_2_are_refused(stage, message):
    config = fixture_config()
    if stage is None:
        del config["zero_optimization"]["stage"]
    else:
        config["zero_optimization"]["stage"] = stage
    with pytest.raises(ValueError, match=message):
        build(config)


# ---- batch sizes, as DeepSpeed resolves them ---------------------------------------------------------

BATCHES = [
    # train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, world size
    (32, 4, 2, 4), (32, 4, None, 4), (32, None, 2, 4), (None, 4, 2, 4), (32, None, None, 4), (None, 4, None, 4),
    (33, 4, None, 4), (32, 4, 3, 4), (8, 16, None, 1), (30, None, 4, 4), (None, None, 2, 2), (24, 12, 1, 2),
]  # fmt: skip


@pytest.mark.parametrize("train, micro, steps, world", BATCHES)
def test_batch_sizes_resolve_as_deepspeeds_config_does(train, micro, steps, world):
    from deepspeed.runtime.config import DeepSpeedConfig

    theirs = DeepSpeedConfig.__new__(DeepSpeedConfig)  # only the batch arithmetic: no process group needed
    theirs.world_size = world
    theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps = (
        train,
        micro,
        steps,
    )
    try:
        theirs._configure_train_batch_size()
        expected = (theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps)
    except AssertionError:
        expected = None
    values = {
        key: value
        for key, value in zip(
            ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), (train, micro, steps)
        )
        if value is not None
    }
    if expected is None:
        with pytest.raises(ValueError, match="DeepSpeed config refused: .*(train_batch_size|give)"):
            resolve_batch_sizes(values, world)
        return
    batch = resolve_batch_sizes(values, world)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected


# ---- what the keys map to (one process) ----------------------------------------------------------


def test_the_fixture_config_maps_to_the_engine_deepspeed_ran():
    model, run = build(fixture_config("w1_s2_align"))
    engine = run.engine
    assert (engine.stage, engine.world_size, engine.max_grad_norm, engine.gradient_accumulation_steps) == (
        2,
        1,
        CLIP,
        1,
    )
    assert (
        isinstance(engine.scaler, DeepSpeedLossScaler) and engine.scaler.checks_overflow and engine.scaler.scale == 1.0
    )
    assert type(engine.optimizer) is torch.optim.AdamW
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in engine.optimizer.param_groups] == [
        (0.0, BETAS, 0.1), (0.0, BETAS, 0.0)  # WarmupCosineLR starts at lr 0, as DeepSpeed's
    ]  # fmt: skip
    assert isinstance(run.scheduler, WarmupCosineLR) and run.scheduler.org_lrs == [BASE_LR, NO_DECAY_LR]
    assert model.frozen.weight.dtype == torch.bfloat16, "frozen parameters are cast, as DeepSpeed casts them"
    assert model.position_scale.dtype == torch.float32, "buffers keep their dtype"
    assert (run.batch.train_batch_size, run.batch.micro_batch_size) == (24, 24)
    assert run.checkpoint.keep_last is None and run.notes == []


def test_precision_reduction_offload_and_bucket_keys():
    fp16 = with_key(fixture_config(), "bf16", {"enabled": False})
    fp16["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 3,
                    "consecutive_hysteresis": True, "min_loss_scale": 2}  # fmt: skip
    scaler = build(fp16)[1].engine.scaler
    assert (scaler.scale, scaler.dynamic, scaler.growth_interval, scaler.hysteresis, scaler.consecutive_hysteresis, scaler.min_scale) == (
        256.0, True, 3, 3, True, 2.0
    )  # fmt: skip
    static = build(with_key(fp16, "fp16.loss_scale", 128))[1].engine.scaler
    assert (static.scale, static.dynamic) == (128.0, False)
    assert not build(with_key(fixture_config(), "bf16.check_grad_overflow", False))[1].engine.scaler.checks_overflow
    fp32 = build(with_key(fixture_config(), "bf16", {"enabled": False}))[1].engine
    assert not fp32.scaler.checks_overflow and fp32.buffers[0].data.dtype == torch.float32
    offloaded = build(
        with_key(fixture_config(), "zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": True})
    )[1]
    assert offloaded.engine.offload and "zero_optimization.offload_optimizer.pin_memory" in offloaded.ignored
    assert (
        build(with_key(fixture_config(), "zero_optimization.reduce_bucket_size", 40))[
            1
        ].engine.layout.policy.bucket_numel
        == 40
    )
    assert build(with_key(fixture_config(), "gradient_clipping", 0.0))[1].engine.max_grad_norm is None
    with pytest.raises(ValueError, match="offload_optimizer.device = 'nvme': offloading to NVMe is DeepSpeed's own"):
        build(with_key(fixture_config(), "zero_optimization.offload_optimizer", {"device": "nvme"}))
    with pytest.raises(ValueError, match="compute_grad_norm = False with gradient_clipping > 0"):
        build(with_key(fixture_config(), "zero_optimization.compute_grad_norm", False))


@pytest.mark.parametrize(
    "section, expected_class, expected_options, note",
    [
        ({"type": "Adam", "params": {"lr": 1e-3}}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0}, "FusedAdam"),
        (
            {"type": "adam", "params": {"adam_w_mode": False, "torch_adam": True}},
            torch.optim.Adam,
            {"weight_decay": 0.0},
            None,
        ),
        (
            {"type": "AdamW", "params": {"torch_adam": True, "eps": 1e-6}},
            torch.optim.AdamW,
            {"eps": 1e-6, "weight_decay": 0.01},
            None,
        ),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, None),
    ],
)
def test_optimizer_sections(section, expected_class, expected_options, note):
    model = build_model(False)
    run = from_deepspeed_config(model, with_key(fixture_config(), "optimizer", section))
    assert type(run.optimizer) is expected_class
    assert all(run.optimizer.defaults[key] == value for key, value in expected_options.items())
    assert (note is None) == (not run.notes) and all(note in text for text in run.notes)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"type": "Lamb", "params": {}}, "optimizer.type = 'Lamb': DeepSpeed's own optimizer"),
        ({"type": "OneBitAdam"}, "optimizer.type = 'OneBitAdam': DeepSpeed's own optimizer"),
        ({"type": "Sophia"}, "optimizer.type = 'Sophia': not a torch.optim optimizer"),
        ({"type": "AdamW", "params": {"nonsense": 1}}, "optimizer.params.nonsense: AdamW takes"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm: use gradient_clipping"),
        ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction = False"),
    ],
)
def test_optimizers_zeroshard_cannot_run_are_refused(section, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(with_key(fixture_config(), "optimizer", section))


def test_client_optimizer_and_torch_schedulers():
    config = fixture_config()
    del config["optimizer"]
    config["scheduler"] = {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}
    _, run = build(config, optimizer_class=torch.optim.SGD, lr=0.1)
    assert type(run.optimizer) is torch.optim.SGD and isinstance(run.scheduler, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="it has no optimizer section; pass optimizer_class="):
        build(config)
    with pytest.raises(ValueError, match="the config names one and optimizer_class= gives another"):
        build(fixture_config(), optimizer_class=torch.optim.SGD)
    for scheduler, message in (
        ({"type": "WarmupPolyLR", "params": {}}, "scheduler.type = 'WarmupPolyLR': neither DeepSpeed's nor torch's"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "scheduler.params.warmup_steps: WarmupLR takes"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            build(with_key(fixture_config(), "scheduler", scheduler))


def _tiny_fp32_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))


def test_fp16_overflows_skip_steps_and_the_schedule_as_deepspeed(monkeypatch):
    """Through the engine: the loss scale follows DeepSpeed's DynamicLossScaler fed the same
    overflows, a skipped step leaves the weights and the lr schedule alone."""
    from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler

    monkeypatch.setattr(ds_loss_scaler, "dist", type("Comm", (), {"get_rank": staticmethod(lambda: 0)}))
    config = {
        "train_batch_size": 2,
        "fp16": {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2, "hysteresis": 2},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }
    model = _tiny_fp32_model()
    run = from_deepspeed_config(model, config)
    theirs = ds_loss_scaler.DynamicLossScaler(2.0**6, 2, 1, 2, False)
    inputs = torch.randn(2, 4).half()
    for overflow in (False, True, False, True, True, False, False, False, True, False):
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(inputs).float().sum()
        run.engine.backward(loss * float("inf") if overflow else loss)
        iteration = run.scheduler.last_batch_iteration
        assert run.step() is (not overflow)
        theirs.update_scale(overflow)
        assert run.engine.scaler.scale == theirs.cur_scale
        assert run.scheduler.last_batch_iteration == iteration + (0 if overflow else 1), "DeepSpeed skips it too"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == overflow


@pytest.mark.parametrize("check", [True, False])
def test_bf16_check_grad_overflow_skips_non_finite_steps(check):
    config = {"train_batch_size": 2, "bf16": {"enabled": True, "check_grad_overflow": check}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}  # fmt: skip
    model = _tiny_fp32_model()
    run = from_deepspeed_config(model, config)
    run.engine.backward(model(torch.randn(2, 4).bfloat16()).float().sum() * float("inf"))
    assert run.step() is (not check)
    assert all(torch.isfinite(p).all() for p in model.parameters()) is check


# ---- the same run as the hand-written engine, and the worked example (D = 2, one spawn) -------------------


def hand_written(fixture_name: str) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """What docs/MIGRATING.md's table says the fixture's DeepSpeed config means, by hand."""
    model = build_model(FIXTURE[fixture_name].tiny_no_decay)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    engine = ZeroOptimizer(
        model, torch.optim.AdamW, param_groups(model), stage=FIXTURE[fixture_name].stage, param_dtype=torch.bfloat16,
        reduce_dtype=None, max_grad_norm=CLIP, lr=BASE_LR, betas=BETAS,
    )  # fmt: skip
    for group in engine.param_groups:
        group["lr"] = 0.0  # WarmupCosineLR's lr before its first step
    return model, engine


def from_config(fixture_name: str, config: dict | None = None):
    model = build_model(FIXTURE[fixture_name].tiny_no_decay)
    return model, from_deepspeed_config(
        model, config or _ds_config(FIXTURE[fixture_name]), param_groups=param_groups(model)
    )


def global_mean(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().double().reshape(1)
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / world_size


def masters(engine: ZeroOptimizer) -> dict[str, bytes]:
    return {name: engine.get_full_fp32_param(name).numpy().tobytes() for name in engine.layout.param_names}


def fresh_runs(rank: int, world_size: int, fixture_name: str) -> dict:
    """FRESH_STEPS steps from initialisation, through the config and by hand."""
    outcome = {}
    model, run = from_config(fixture_name)
    hand_model, hand = hand_written(fixture_name)
    for label, step_model, engine in (("config", model, run.engine), ("hand", hand_model, hand)):
        losses, lrs = [], []
        for step in range(FRESH_STEPS):
            lrs.append([group["lr"] for group in engine.param_groups])
            tokens, targets = rank_rows(global_batch(step), rank, world_size)
            loss = step_model(tokens, targets)
            engine.backward(loss)
            if label == "config":
                run.step()
            else:
                engine.step()
                engine.zero_grad()
                for group, base_lr in zip(engine.param_groups, (BASE_LR, NO_DECAY_LR)):
                    group["lr"] = warmup_cosine_lr(base_lr, step)  # DeepSpeed's iteration = steps taken - 1
            losses.append(global_mean(loss, world_size))
        outcome[label] = {"losses": losses, "lrs": lrs, "masters": masters(engine), "reduce": str(engine.reduce_dtypes)}
    return outcome


def worked_example(rank: int, world_size: int, fixture, root: str, config: dict | None = None) -> dict:
    """docs/MIGRATING.md: resume the DeepSpeed run through its config, carry on, save, resume again."""
    model, run = from_config(fixture.config.name, config)
    with run.checkpointer(root) as ckpt:
        start = ckpt.load(warm_start=fixture.save_dir)
        losses, lrs = [], []
        for step in range(start, start + CONTINUE_STEPS):
            lrs.append([group["lr"] for group in run.engine.param_groups])
            tokens, targets = rank_rows(global_batch(step), rank, world_size)
            loss = model(tokens, targets)
            run.engine.backward(loss)
            run.step()
            losses.append(global_mean(loss, world_size))
        ckpt.save(step)
    model, run = from_config(fixture.config.name, config)
    with run.checkpointer(root) as ckpt:
        again = ckpt.load(warm_start=fixture.save_dir)  # its own checkpoint now: the warm start is not used
        resumed_from = str(ckpt.resumed_from)
    return {"start": start, "losses": losses, "lrs": lrs, "again": again, "resumed_from": resumed_from}


def reduce_dtypes(rank: int, world_size: int) -> dict[str, str]:
    """communication_data_type, and an override of it (at world size 1 nothing is reduced)."""
    config = {**_ds_config(FIXTURE["w2_s2"]), "communication_data_type": "fp32"}
    return {
        "fp32 key": str(from_config("w2_s2", config)[1].engine.reduce_dtypes),
        "override": str(
            from_deepspeed_config(
                build_model(False), _ds_config(FIXTURE["w2_s2"]), reduce_dtype=torch.float32
            ).engine.reduce_dtypes
        ),
    }


def at_two_ranks(rank: int, world_size: int, runs: dict, root: str) -> dict:
    return {
        "fresh": {name: fresh_runs(rank, world_size, name) for name in ("w2_s2", "w2_s1_align")},
        "example": worked_example(rank, world_size, runs["w2_s2"], root),
        "reduce": reduce_dtypes(rank, world_size),
    }


@pytest.fixture(scope="module")
def two_ranks(deepspeed_runs, tmp_path_factory) -> dict:
    runs = {name: deepspeed_runs[name] for name in ("w2_s2", "w2_s1_align")}
    return spawn(at_two_ranks, 2, (runs, str(tmp_path_factory.mktemp("example"))), timeout_s=300)[0]


@pytest.mark.parametrize("name", ["w2_s2", "w2_s1_align"])
def test_the_fixture_configs_train_exactly_as_the_hand_written_engine(two_ranks, name):
    config, hand = two_ranks["fresh"][name]["config"], two_ranks["fresh"][name]["hand"]
    assert config["lrs"] == hand["lrs"]
    assert config["losses"] == hand["losses"]
    assert config["masters"] == hand["masters"]
    assert config["reduce"] == hand["reduce"] == str([torch.bfloat16] * 2), "DeepSpeed communicates in the param dtype"
    assert len(set(config["losses"])) == FRESH_STEPS, "it trains"


def test_communication_data_type_and_overrides(two_ranks):
    assert two_ranks["reduce"]["fp32 key"] == str([torch.float32] * 2)
    assert two_ranks["reduce"]["override"] == str([torch.float32]), "engine options override the config"


def check_worked_example(outcome: dict, fixture, world_size: int) -> None:
    continued = json.loads(fixture.continued.read_text())
    assert outcome["start"] == STEPS
    assert outcome["lrs"] == continued["lrs"], "DeepSpeed's schedule, carried on exactly"
    differences = [abs(ours - theirs) / theirs for ours, theirs in zip(outcome["losses"], continued["losses"])]
    if world_size == fixture.config.world_size:
        assert differences[0] == 0.0, "same weights, same rows per rank: the same loss"
    assert max(differences) < LOSS_RELATIVE_TOLERANCE, (outcome["losses"], continued["losses"])
    assert outcome["again"] == STEPS + CONTINUE_STEPS
    assert outcome["resumed_from"].endswith(f"step-{STEPS + CONTINUE_STEPS - 1:08d}")


def test_worked_example_resumes_a_deepspeed_run_with_its_schedule(two_ranks, deepspeed_runs):
    check_worked_example(two_ranks["example"], deepspeed_runs["w2_s2"], 2)


def test_worked_example_at_another_world_size(deepspeed_runs, tmp_path):
    fixture = deepspeed_runs["w2_s1_align"]
    config = {**_ds_config(fixture.config), "train_micro_batch_size_per_gpu": 24}  # the same global batch on one rank
    check_worked_example(worked_example(0, 1, fixture, str(tmp_path), config), fixture, 1)
