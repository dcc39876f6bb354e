"""The engine against a single-process reference, on gloo at world sizes 1 to 4.

Each world size is one spawn that trains every configuration listed for it, then compares
each run (the comparisons spread over the ranks) with ``dist_helpers.reference_run``: the
same model, the same micro-batches for every "rank", gradients accumulated and averaged as
the engine does, the same torch optimizer on fp32 masters. The reference takes every step
from the engine's own state before it, so the two runs see the same low-precision
parameters at every step, and each comparison measures one step's arithmetic (see
``dist_helpers.StepTolerance`` for the bounds and their derivation). At world size 1
everything is bit for bit; above, only the fp32 summation order and grouping differ, on any
CPU and any oneDNN instruction set."""

from __future__ import annotations

import pytest
from dist_helpers import RunConfig, run_equivalence

from zeroshard.launch import spawn

WORLD_SIZES = (1, 2, 3, 4)
STEPS = 10

def matrix() -> list[RunConfig]:
    """Stages 1 and 2 x bf16, fp16, fp32 x two models; stage 2 with several buckets."""
    configs = []
    for stage in (1, 2):
        for dtype in ("bfloat16", "float16", None):
            for model, stage2_bucket_numel in (("odd", 128), ("gpt", 2000)):
                configs.append(
                    RunConfig(
                        f"stage{stage}-{dtype or 'float32'}-{model}",
                        model=model,
                        stage=stage,
                        param_dtype=dtype,
                        steps=STEPS,
                        bucket_numel=stage2_bucket_numel if stage == 2 else None,
                    )
                )
    configs.append(RunConfig("stage2-bfloat16-odd-one-bucket", stage=2, steps=STEPS))
    return configs


def optimizer_configs() -> list[RunConfig]:
    """Adam and Adagrad hold a scalar 'step' tensor; SGD's momentum buffer starts from a grad."""
    adam = dict(optimizer="Adam", optimizer_options=(("betas", (0.9, 0.99)), ("eps", 1e-7)))
    sgd = dict(
        optimizer="SGD",
        optimizer_options=(("momentum", 0.9), ("nesterov", True)),
        decay_options=(("lr", 0.05), ("weight_decay", 1e-3)),
        no_decay_options=(("lr", 0.02), ("weight_decay", 0.0)),
        max_grad_norm=None,  # unclipped SGD's update scales with the gradient, so a wrong average shows
    )
    adagrad = dict(
        optimizer="Adagrad",
        optimizer_options=(("lr_decay", 0.01),),
        decay_options=(("lr", 0.02), ("weight_decay", 0.01)),
        no_decay_options=(("lr", 0.01), ("weight_decay", 0.0)),
    )
    return [
        RunConfig(f"{name}-stage{stage}", stage=stage, bucket_numel=128, steps=STEPS, **options)
        for stage in (1, 2)
        for name, options in (("adam", adam), ("sgd-momentum", sgd), ("adagrad", adagrad))
    ]


def schedule_configs() -> list[RunConfig]:
    return [
        RunConfig("lambda-lr", model="gpt", stage=2, lr_schedule="lambda", steps=STEPS),
        RunConfig("step-lr", stage=1, param_dtype=None, lr_schedule="step", steps=STEPS),
    ]


def reduce_dtype_configs() -> list[RunConfig]:
    """Gradients reduced in bf16; the reference rounds the same way (at world size 1 nothing
    is reduced, so nothing is rounded and the plain reference must match bit for bit)."""
    return [
        RunConfig("reduce-bf16-stage1", stage=1, reduce_dtype="bfloat16", steps=STEPS),
        RunConfig("reduce-bf16-stage2-gpt", model="gpt", reduce_dtype="bfloat16", bucket_numel=2000, steps=STEPS),
        RunConfig(
            "reduce-bf16-stage2-fp32-params", param_dtype=None, reduce_dtype="bfloat16", bucket_numel=128, steps=STEPS
        ),
    ]


# A 9-element no-decay group at D=4 with 64-byte alignment: rank 0 holds 9 real elements and
# 7 padding, ranks 1-3 hold only padding.
PADDING_ONLY = RunConfig("padding-only-ranks", model="nine", param_dtype=None, alignment_bytes=64, steps=STEPS)
OFFLOAD = RunConfig("offload-stage2", stage=2, bucket_numel=128, offload=True, steps=STEPS)

CONFIGS = {
    1: matrix() + optimizer_configs() + schedule_configs() + reduce_dtype_configs(),
    2: matrix() + optimizer_configs() + schedule_configs() + [OFFLOAD] + reduce_dtype_configs(),
    3: [config for config in matrix() if config.model == "gpt"],  # odd world size; halved to keep the suite short
    4: matrix() + [PADDING_ONLY] + reduce_dtype_configs(),
}
CONFIG_BY_NAME = {config.name: config for configs in CONFIGS.values() for config in configs}


@pytest.fixture(scope="module")
def reports():
    """reports(world_size)[name]: the comparison, one spawn per world size, on first use."""
    cache: dict[int, dict[str, dict]] = {}

    def at(world_size: int) -> dict[str, dict]:
        if world_size not in cache:
            per_rank = spawn(run_equivalence, world_size, (CONFIGS[world_size],), timeout_s=240)
            cache[world_size] = {report["name"]: report for reports in per_rank for report in reports}
        return cache[world_size]

    return at


def cases(configs_of) -> list:
    return [
        pytest.param(world, config.name, id=f"D{world}-{config.name}")
        for world in WORLD_SIZES
        for config in configs_of(world)
    ]


def assert_matches_reference(report: dict, config: RunConfig) -> None:
    """Bit for bit at world size 1, within the fp32 bounds of ``StepTolerance`` above it."""
    assert report["stepped"] == report["reference_stepped"]
    assert report["scales"] == report["reference_scales"]
    assert report["lrs"] == report["reference_lrs"]
    assert report["state_keys_match"], report["state_keys"]
    assert report["padding_zero_on_every_rank"]
    # The same parameters give the same losses: the engine's low-precision views hold
    # exactly its masters cast, at every step.
    assert report["losses_equal"]
    tolerance = report["tolerance"]
    # The run must actually train, or matching the reference would say nothing.
    assert report["masters_moved"] > 1000 * tolerance.masters
    if report["world_size"] == 1:
        assert report["masters_equal"], report["masters_max_error"]
        assert report["state_equal"], report["state_max_relative_error"]
        assert report["grad_norms"] == report["reference_grad_norms"]
    else:
        assert report["masters_max_error"] <= tolerance.masters, (report["masters_max_error"], tolerance)
        assert report["state_max_relative_error"] <= tolerance.state_relative, (report["state_max_relative_error"], tolerance)
        # The pre-clip norm is compared too: clipping plus Adam would hide a wrong gradient scale.
        assert report["grad_norm_max_relative_error"] <= tolerance.grad_norm_relative, (
            report["grad_norm_max_relative_error"],
            tolerance,
        )


@pytest.mark.parametrize("world_size, name", cases(lambda world: [c for c in CONFIGS[world] if c in matrix()]))
def test_stage_and_precision_matrix_matches_reference(reports, world_size, name):
    config = CONFIG_BY_NAME[name]
    report = reports(world_size)[name]
    assert_matches_reference(report, config)
    assert report["layout_names"] and len(report["partition_numel"]) == 2  # decay and no-decay groups
    # Clipping is active in every step taken, so the clip path is part of the comparison.
    assert all(norm > config.max_grad_norm for norm in report["reference_grad_norms"] if norm is not None)
    if config.bucket_numel is not None:
        assert max(report["num_buckets"]) > 1


@pytest.mark.parametrize("world_size, name", cases(lambda world: [c for c in CONFIGS[world] if c.optimizer != "AdamW"]))
def test_other_optimizers_match_reference(reports, world_size, name):
    config = CONFIG_BY_NAME[name]
    report = reports(world_size)[name]
    assert_matches_reference(report, config)
    expected_keys = {"Adam": ["exp_avg", "exp_avg_sq", "step"], "SGD": ["momentum_buffer"], "Adagrad": ["step", "sum"]}
    assert report["state_keys"] == expected_keys[config.optimizer]
    # Scalar state ('step' tensors) advances in step on every rank.
    for per_group in report["scalar_state_per_rank"]:
        assert per_group == report["scalar_state_per_rank"][0]
        assert all(state.get("step", STEPS) == STEPS for state in per_group)


@pytest.mark.parametrize("world_size, name", cases(lambda world: [c for c in CONFIGS[world] if c.lr_schedule]))
def test_lr_scheduler_on_engine_param_groups_changes_effective_lr(reports, world_size, name):
    config = CONFIG_BY_NAME[name]
    report = reports(world_size)[name]
    # lrs were read from engine.param_groups before each step; the scheduler drove them.
    decay_lrs = [lrs[0] for lrs in report["lrs"]]
    assert decay_lrs[0] == dict(config.decay_options)["lr"]
    assert len(set(decay_lrs)) > 2 and decay_lrs == sorted(decay_lrs, reverse=True)
    assert_matches_reference(report, config)


def bf16_reduction(world: int) -> list[RunConfig]:
    return [config for config in CONFIGS[world] if config.reduce_dtype == "bfloat16"]


@pytest.mark.parametrize("world_size, name", cases(bf16_reduction))
def test_bf16_reduction_matches_the_reference_that_rounds_the_same_way(reports, world_size, name):
    assert_matches_reference(reports(world_size)[name], CONFIG_BY_NAME[name])


def test_offloaded_masters_match_reference(reports):
    assert_matches_reference(reports(2)[OFFLOAD.name], OFFLOAD)


def test_rank_with_only_padding_trains_like_the_others(reports):
    report = reports(4)[PADDING_ONLY.name]
    no_decay = 1
    partition = report["partition_numel"][no_decay]
    padding = report["padding_per_rank"][no_decay]
    assert padding[0] < partition and padding[1:] == [partition] * 3  # ranks 1-3: padding only
    assert_matches_reference(report, PADDING_ONLY)
    # The padding-only ranks keep AdamW's step count in line with rank 0.
    steps = [per_group[no_decay]["step"] for per_group in report["scalar_state_per_rank"]]
    assert steps == [float(STEPS)] * 4
