"""A DeepSpeed Muon checkpoint (``MuonWithAuxAdam``, ZeRO-1 and ZeRO-2, D = 2) loaded whole into
zeroshard's Muon engine (torch.optim.Muon for DeepSpeed's use_muon matrices, torch.optim.AdamW
for the rest), at D = 1, 2 and 3, attested: every fp32 master, Muon momentum, Adam moment and
step count is what DeepSpeed held in memory before it saved, bit for bit, and the
hyperparameters are the checkpoint's. Training then goes on: the first step is torch's Muon
and AdamW applied, in one process, to the loaded state and the engine's gradient, bit for bit.

The refusals stay: a DeepSpeed AdamW checkpoint into the Muon engine (grouped as it saved)
fails in one line on every rank and changes nothing (the reverse is tests/test_deepspeed_muon_engine.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_fixtures import CONFIGS as ADAMW_CONFIGS
from deepspeed_fixtures import build_model as build_adamw_model
from deepspeed_fixtures import generate as generate_adamw
from deepspeed_fixtures import param_groups as adamw_param_groups
from deepspeed_muon_fixtures import ADAM_LR, ADAM_PARAMS, BETAS, MOMENTUM, MUON_LR, MUON_PARAMS, STEPS, WEIGHT_DECAY
from deepspeed_muon_fixtures import build_model
from safetensors.torch import load_file
from test_deepspeed_resume import as_bytes, from_bytes

from zeroshard.checkpoint.engine_io import load_checkpoint, load_checkpoint_attested
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn

SPAWN_TIMEOUT_S = 300
ADAMW_RUN = "w1_s1"  # one DeepSpeed AdamW run: its fixture's D = 1 launch alone
MUON_RUNS = ("muon_w2_s1", "muon_w2_s2")  # DeepSpeed's stages 1 and 2, saved at D = 2
DEEPSPEEDS_ADAM_EPS = 1e-10  # MuonWithAuxAdam's default for its Adam groups (torch's AdamW: 1e-8)


def bf16(model: torch.nn.Module) -> torch.nn.Module:
    """The model in bf16, as DeepSpeed ran it."""
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model


def muon_engine(model: torch.nn.Module, muon_names, adam_names) -> ZeroOptimizer:
    """torch.optim.Muon for ``muon_names``, torch.optim.AdamW for ``adam_names``, ZeRO-2."""
    named = dict(model.named_parameters())
    groups = [
        {"params": [named[name] for name in muon_names]},
        {"params": [named[name] for name in adam_names], "optimizer": torch.optim.AdamW},
    ]
    return ZeroOptimizer(model, torch.optim.Muon, groups, stage=2)


def full_state(engine: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Collective: every parameter's fp32 master and optimizer states, whole."""
    found = {}
    for name in (*MUON_PARAMS, *ADAM_PARAMS):
        found[f"fp32/{name}"] = engine.get_full_fp32_param(name).clone()
        for key in ("momentum_buffer",) if name in MUON_PARAMS else ("exp_avg", "exp_avg_sq"):
            found[f"{key}/{name}"] = engine.get_full_optimizer_state(name, key).clone()
    return found


def reference_step(engine: ZeroOptimizer, before: dict, grads: dict) -> dict[str, torch.Tensor]:
    """torch.optim.Muon and torch.optim.AdamW, with the engine's param groups' hyperparameters,
    on fp32 copies of the loaded state and the engine's gradient: the state after one step."""
    muon_params = {name: torch.nn.Parameter(before[f"fp32/{name}"].clone()) for name in MUON_PARAMS}
    adam_params = {name: torch.nn.Parameter(before[f"fp32/{name}"].clone()) for name in ADAM_PARAMS}
    for name, param in (*muon_params.items(), *adam_params.items()):
        param.grad = grads[name].clone()
    muon = torch.optim.Muon(list(muon_params.values()))
    adam = torch.optim.AdamW(list(adam_params.values()))
    for optimizer, group in zip((muon, adam), engine.param_groups):
        optimizer.param_groups[0].update({key: value for key, value in group.items() if key != "params"})
    for name, param in muon_params.items():
        muon.state[param]["momentum_buffer"] = before[f"momentum_buffer/{name}"].clone()
    for name, param in adam_params.items():
        adam.state[param] = {
            "step": torch.tensor(float(STEPS)),
            "exp_avg": before[f"exp_avg/{name}"].clone(),
            "exp_avg_sq": before[f"exp_avg_sq/{name}"].clone(),
        }
    muon.step()
    adam.step()
    after = {f"fp32/{name}": param.detach() for name, param in (*muon_params.items(), *adam_params.items())}
    after.update({f"momentum_buffer/{name}": muon.state[param]["momentum_buffer"] for name, param in muon_params.items()})
    for name, param in adam_params.items():
        after.update({f"{key}/{name}": adam.state[param][key] for key in ("exp_avg", "exp_avg_sq")})
    return after


def adamw_refusal(fixture) -> tuple[str, bool]:
    """A DeepSpeed AdamW checkpoint into the Muon engine, grouped as it saved (its decay group,
    every matrix, on Muon): the error, and whether the model is as it was."""
    model = bf16(build_adamw_model(False))
    named = {id(param): name for name, param in model.named_parameters()}
    decay, no_decay = ([named[id(p)] for p in group["params"]] for group in adamw_param_groups(model))
    engine = muon_engine(model, decay, no_decay)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        load_checkpoint(engine, fixture.save_dir)
    except ValueError as err:
        return str(err), all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    return "", False


def on_rank(rank: int, world_size: int, muon_fixture, adamw_fixture) -> dict:
    """Spawn target: the load, the state it gives, one step and torch's step beside it."""
    outcome: dict = {"adamw_refusal": adamw_refusal(adamw_fixture)}
    model = bf16(build_model())
    engine = muon_engine(model, MUON_PARAMS, ADAM_PARAMS)
    try:
        extra, attestation = load_checkpoint_attested(engine, muon_fixture.save_dir)
    except ValueError as err:
        outcome["refused"] = str(err)
        return outcome
    outcome["attestation"] = (attestation.ok, attestation.line())
    outcome["hyperparameters"] = [{k: v for k, v in group.items() if k != "params"} for group in engine.param_groups]
    outcome["steps"] = (engine.global_steps, [float(s["step"]) for s in engine.state_views().optimizer_scalars if s])
    loaded = full_state(engine)
    tokens = torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(model(tokens, tokens))
    grads = {name: engine.get_full_grad(name).clone() for name in (*MUON_PARAMS, *ADAM_PARAMS)}
    engine.step()
    stepped = full_state(engine)
    expected = reference_step(engine, loaded, grads)
    if rank == 0:
        outcome["loaded"] = {key: as_bytes(value) for key, value in loaded.items()}
        outcome["stepped"] = {key: as_bytes(value) for key, value in stepped.items()}
        outcome["expected"] = {key: as_bytes(value) for key, value in expected.items()}
    return outcome


@pytest.fixture(scope="module", params=MUON_RUNS)
def muon_run(request, deepspeed_muon_runs):
    """One DeepSpeed Muon checkpoint: each test runs on each stage's."""
    return deepspeed_muon_runs[request.param]


@pytest.fixture(scope="module")
def outcomes(muon_run, tmp_path_factory) -> dict[int, list[dict]]:
    muon = muon_run
    adamw_config = next(config for config in ADAMW_CONFIGS if config.name == ADAMW_RUN)
    adamw = generate_adamw(tmp_path_factory.mktemp("deepspeed_adamw"), (adamw_config,))[ADAMW_RUN]
    found = {1: [on_rank(0, 1, muon, adamw)]}  # no process group: a world of one
    for world_size in (2, 3):
        found[world_size] = spawn(on_rank, world_size, (muon, adamw), timeout_s=SPAWN_TIMEOUT_S)
    return found


WORLD_SIZES = [1, 2, 3]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_deepspeed_muon_checkpoint_loads_into_the_muon_engine_attested(outcomes, world_size):
    for outcome in outcomes[world_size]:
        assert "refused" not in outcome, outcome["refused"]
        ok, line = outcome["attestation"]
        assert ok, line


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_loaded_state_is_deepspeeds_in_memory_state_bit_for_bit(outcomes, muon_run, world_size):
    outcome = outcomes[world_size][0]
    assert "refused" not in outcome, outcome["refused"]
    expected = load_file(str(muon_run.accessors))
    assert sorted(outcome["loaded"]) == sorted(expected)
    for key, tensor in expected.items():
        loaded = from_bytes(outcome["loaded"][key]).reshape(tensor.shape)
        assert torch.equal(loaded.view(torch.int32), tensor.float().view(torch.int32)), key


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hyperparameters_and_step_counts_are_the_checkpoints(outcomes, world_size):
    for outcome in outcomes[world_size]:
        assert "refused" not in outcome, outcome["refused"]
        muon, adam = outcome["hyperparameters"]
        assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["use_muon"]) == (
            MUON_LR, MOMENTUM, WEIGHT_DECAY, True
        )
        assert (adam["lr"], tuple(adam["betas"]), adam["weight_decay"], adam["use_muon"]) == (
            ADAM_LR, BETAS, WEIGHT_DECAY, False
        )
        assert adam["eps"] == DEEPSPEEDS_ADAM_EPS, "DeepSpeed's eps, not torch's default"
        global_steps, adam_steps = outcome["steps"]
        assert global_steps == STEPS
        assert adam_steps and set(adam_steps) == {float(STEPS)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_next_step_is_torch_muon_and_adamw_on_the_loaded_state(outcomes, world_size):
    outcome = outcomes[world_size][0]
    assert "refused" not in outcome, outcome["refused"]
    assert sorted(outcome["stepped"]) == sorted(outcome["expected"])
    for key in outcome["expected"]:
        stepped, expected = from_bytes(outcome["stepped"][key]), from_bytes(outcome["expected"][key])
        assert torch.equal(stepped.view(torch.int32), expected.view(torch.int32)), key
    stepped, loaded = outcome["stepped"], outcome["loaded"]
    moved = [key for key in stepped if not torch.equal(from_bytes(stepped[key]), from_bytes(loaded[key]))]
    assert sorted(moved) == sorted(outcome["stepped"]), "every master and state took the step"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_deepspeed_adamw_checkpoint_into_the_muon_engine_is_refused_on_every_rank(outcomes, world_size):
    messages = {outcome["adamw_refusal"][0] for outcome in outcomes[world_size]}
    assert len(messages) == 1, f"every rank raises the same error: {messages}"
    message = messages.pop()
    assert message and "\n" not in message, message
    assert (
        "the checkpoint's optimizer is torch.optim.adamw.AdamW, this run uses torch.optim.Muon+torch.optim.adamw.AdamW"
    ) in message
    assert all(outcome["adamw_refusal"][1] for outcome in outcomes[world_size]), "the model is as it was"


def test_the_run_may_list_adamw_first(muon_run):
    """The run's groups pair with the checkpoint's by the parameters they hold: AdamW's group
    listed first (the engine's class names read "AdamW+Muon") loads as well, each group with
    its own hyperparameters and state (D = 1)."""
    fixture = muon_run
    model = bf16(build_model())
    named = dict(model.named_parameters())
    groups = [
        {"params": [named[name] for name in ADAM_PARAMS]},
        {"params": [named[name] for name in MUON_PARAMS], "optimizer": torch.optim.Muon},
    ]
    engine = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2)
    load_checkpoint(engine, fixture.save_dir)
    adam, muon = engine.param_groups
    assert (adam["lr"], adam["use_muon"], muon["lr"], muon["use_muon"]) == (ADAM_LR, False, MUON_LR, True)
    expected = load_file(str(fixture.accessors))
    for key, value in full_state(engine).items():
        saved = expected[key].float().reshape(value.shape)
        assert torch.equal(value.view(torch.int32), saved.view(torch.int32)), key


def test_through_universal_too(muon_run, tmp_path):
    """Converted to universal first (the per-group optimizers travel with it), the checkpoint
    loads into the Muon engine with the same values (D = 1)."""
    from zeroshard.checkpoint.universal import to_universal

    fixture = muon_run
    universal = to_universal(fixture.save_dir, tmp_path / "universal", progress=False)
    model = bf16(build_model())
    engine = muon_engine(model, MUON_PARAMS, ADAM_PARAMS)
    load_checkpoint(engine, universal)
    assert [group["lr"] for group in engine.param_groups] == [MUON_LR, ADAM_LR]
    expected = load_file(str(fixture.accessors))
    for key, value in full_state(engine).items():
        saved = expected[key].float().reshape(value.shape)
        assert torch.equal(value.view(torch.int32), saved.view(torch.int32)), key
