"""A checkpoint that lacks one of the run's parameters, or holds one the run lacks, loads the
same way whatever its kind (native, universal, DeepSpeed): through the one loader.

* ``strict=True``: a one-line ValueError naming the parameter, and nothing changes;
* ``strict=False``: a warning; the run's parameter the checkpoint lacks keeps the run's own
  weight, fp32 master and Adam states bit for bit; the checkpoint's extra one is ignored;
  every other parameter is loaded exactly as a strict load of the matching model loads it.

The run is one rank (no processes); the checkpoints come from two ranks (DeepSpeed ZeRO-2,
and a zeroshard run), so every load reshards.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zeroshard.checkpoint.universal import to_universal
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
KINDS = ["native", "universal", pytest.param("deepspeed", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="no deepspeed"))]
LR, BETAS = 1e-3, (0.9, 0.95)
STATES = ("exp_avg", "exp_avg_sq")
EXTRA = "extra"  # the run's parameter no checkpoint has
DROPPED = "fc1.bias"  # the checkpoints' parameter a run without it lacks


def fixture_model(variant: str = "same") -> torch.nn.Module:
    """The DeepSpeed fixtures' model in bf16 (parameters only, as DeepSpeed runs it);
    "plus" adds a parameter, "minus" drops fc1's bias."""
    from deepspeed_fixtures import build_model

    model = build_model(tiny_no_decay=False)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    if variant == "plus":
        model.extra = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5).to(torch.bfloat16))
    elif variant == "minus":
        model.fc1.bias = None
    return model


def make_engine(model: torch.nn.Module) -> ZeroOptimizer:
    from deepspeed_fixtures import param_groups

    return ZeroOptimizer(model, torch.optim.AdamW, param_groups(model), stage=2, lr=LR, betas=BETAS)


def train_step(engine: ZeroOptimizer, step: int) -> None:
    from deepspeed_fixtures import global_batch

    tokens, targets = global_batch(step)
    loss = engine.model(tokens, targets)
    if hasattr(engine.model, EXTRA):  # give the extra parameter a gradient, so Adam state
        loss = loss + (engine.model.extra.float() ** 2).sum()
    engine.backward(loss)
    engine.step()
    engine.zero_grad()


def snapshot(engine: ZeroOptimizer, states: tuple[str, ...] = STATES) -> dict[str, torch.Tensor]:
    """Weight, fp32 master and Adam states of every trained parameter with elements."""
    found = {}
    weights = dict(engine.model.named_parameters())
    for group in engine.layout.groups:
        for slot in group.params:
            if slot.numel == 0:
                continue
            found[f"weight/{slot.name}"] = weights[slot.name].detach().clone()
            found[f"fp32/{slot.name}"] = engine.get_full_fp32_param(slot.name).clone()
            for key in states:
                found[f"{key}/{slot.name}"] = engine.get_full_optimizer_state(slot.name, key).clone()
    return found


def save_native(rank: int, world_size: int, out: str) -> None:
    """Spawned on two ranks: train the fixture model three steps (the whole batch on each
    rank), save."""
    engine = make_engine(fixture_model())
    for step in range(3):
        train_step(engine, step)
    save_checkpoint(engine, out, "step3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("mismatch")
    spawn(save_native, 2, (str(root / "native"),), timeout_s=240)
    found = {"native": root / "native", "universal": to_universal(root / "native", root / "universal", progress=False)}
    if HAS_DEEPSPEED:
        found["deepspeed"] = request.getfixturevalue("deepspeed_runs")["w2_s2"].save_dir
    return found


@pytest.fixture(scope="module")
def reference(checkpoints):
    """What a strict load of the matching model gives, per kind."""
    loaded = {}
    for kind, path in checkpoints.items():
        engine = make_engine(fixture_model())
        load_checkpoint(engine, path)
        loaded[kind] = snapshot(engine)
    return loaded


def trained_run(variant: str) -> ZeroOptimizer:
    """A run of the variant model with its own values and Adam state (one step of its own)."""
    torch.manual_seed(1)
    engine = make_engine(fixture_model(variant))
    train_step(engine, 5)
    return engine


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant, name", [("plus", EXTRA), ("minus", DROPPED)])
def test_strict_load_names_the_parameter_and_changes_nothing(checkpoints, kind, variant, name):
    engine = trained_run(variant)
    before = snapshot(engine)
    with pytest.raises(ValueError) as error:
        load_checkpoint(engine, checkpoints[kind])
    message = str(error.value)
    assert "\n" not in message and "nothing changed" in message
    side = "missing from the checkpoint" if variant == "plus" else "not in the run"
    assert f"1 {side}: {name}" in message
    after = snapshot(engine)
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize("kind", KINDS)
def test_non_strict_load_keeps_the_runs_values_of_what_the_checkpoint_lacks(checkpoints, reference, kind):
    engine = trained_run("plus")
    before = snapshot(engine)
    assert torch.count_nonzero(before[f"exp_avg/{EXTRA}"]) == 5  # the run has state of its own to keep
    with pytest.warns(UserWarning, match=f"1 missing from the checkpoint: {EXTRA}; loading the rest"):
        load_checkpoint(engine, checkpoints[kind], strict=False)
    after = snapshot(engine)
    for key in ("weight", "fp32", *STATES):
        assert torch.equal(after[f"{key}/{EXTRA}"], before[f"{key}/{EXTRA}"]), key
    loaded = {key: value for key, value in after.items() if not key.endswith(f"/{EXTRA}")}
    assert loaded.keys() == reference[kind].keys()
    assert all(torch.equal(loaded[key], reference[kind][key]) for key in loaded), kind


@pytest.mark.parametrize("kind", KINDS)
def test_non_strict_load_ignores_what_the_run_lacks(checkpoints, reference, kind):
    engine = trained_run("minus")
    with pytest.warns(UserWarning, match=f"1 not in the run: {DROPPED}; loading the rest"):
        load_checkpoint(engine, checkpoints[kind], strict=False)
    after = snapshot(engine)
    expected = {key: value for key, value in reference[kind].items() if not key.endswith(f"/{DROPPED}")}
    assert after.keys() == expected.keys()
    assert all(torch.equal(after[key], expected[key]) for key in after), kind


@pytest.mark.parametrize("kind", KINDS)
def test_non_strict_module_only_and_weights_only_loads_keep_the_runs_values(checkpoints, reference, kind):
    for options in ({"load_module_only": True}, {"load_optimizer_states": False}):
        engine = trained_run("plus")
        before = snapshot(engine)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            load_checkpoint(engine, checkpoints[kind], strict=False, **options)
        after = snapshot(engine, states=())
        assert torch.equal(after[f"weight/{EXTRA}"], before[f"weight/{EXTRA}"]), options
        assert torch.equal(after[f"fp32/{EXTRA}"], before[f"weight/{EXTRA}"].float()), options
        name = "fc2.weight"
        assert torch.equal(after[f"weight/{name}"], reference[kind][f"weight/{name}"]), options


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_listing_its_param_groups_in_another_order_gets_each_groups_own_hyperparameters(checkpoints, reference, kind):
    """The checkpoint's param groups pair with the run's by the parameters they hold, not by
    position: listed the other way round, the no-decay group keeps its weight decay of 0."""
    from deepspeed_fixtures import param_groups

    def hyperparameters(engine: ZeroOptimizer) -> list[dict]:
        return [{key: value for key, value in group.items() if key != "params"} for group in engine.param_groups]

    in_order = make_engine(fixture_model())
    load_checkpoint(in_order, checkpoints[kind])
    decay, no_decay = hyperparameters(in_order)
    assert decay["weight_decay"] != no_decay["weight_decay"], "groups that differ, so that a swap shows"
    model = fixture_model()
    reordered = ZeroOptimizer(model, torch.optim.AdamW, param_groups(model)[::-1], stage=2, lr=LR, betas=BETAS)
    load_checkpoint(reordered, checkpoints[kind])
    assert hyperparameters(reordered) == [no_decay, decay]
    after = snapshot(reordered)
    assert after.keys() == reference[kind].keys()
    assert all(torch.equal(after[key], reference[kind][key]) for key in after), kind
