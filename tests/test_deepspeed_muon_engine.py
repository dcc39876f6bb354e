"""A DeepSpeed Muon checkpoint and zeroshard's AdamW engine: module only loads, the rest is refused.

The Muon run's optimizer state (momentum_buffer for the matrices) is no AdamW state, so loading
it whole into a ZeroOptimizer running AdamW fails in one line on every rank and changes
nothing, whichever way the run groups its parameters; ``load_module_only`` loads its weights,
however the run groups them, at another world size too (DeepSpeed saved at D = 2, stage 1 or 2).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_muon_fixtures import ADAM_PARAMS, MUON_PARAMS, MuonFixture, build_model
from test_deepspeed_resume import as_bytes, from_bytes

from zeroshard.checkpoint.engine_io import load_checkpoint
from zeroshard.engine import ZeroOptimizer
from zeroshard.launch import spawn

SPAWN_TIMEOUT_S = 240
GROUPINGS = ("as_saved", "one_group")
MUON_RUNS = ("muon_w2_s1", "muon_w2_s2")  # DeepSpeed's stages 1 and 2, saved at D = 2


def adamw_engine(grouping: str) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """The fixture's model in bf16 (as DeepSpeed ran it) under zeroshard's AdamW, its
    parameters grouped as the checkpoint's (Muon's matrices, Adam's rest) or in one group."""
    model = build_model()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    named = dict(model.named_parameters())
    if grouping == "as_saved":
        groups = [{"params": [named[n] for n in MUON_PARAMS]}, {"params": [named[n] for n in ADAM_PARAMS]}]
    else:
        groups = [{"params": list(named.values())}]
    return model, ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, lr=1e-3)


def refusal(engine: ZeroOptimizer, model: torch.nn.Module, fixture: MuonFixture) -> tuple[str, bool]:
    """The error a full load raises, and whether the model is as it was."""
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        load_checkpoint(engine, fixture.save_dir)
    except ValueError as err:
        unchanged = all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
        return str(err), unchanged
    return "", False


def on_rank(rank: int, world_size: int, fixture: MuonFixture) -> dict:
    """Spawn target: the refusals for both groupings, then a module-only load into one group."""
    outcome = {}
    for grouping in GROUPINGS:
        model, engine = adamw_engine(grouping)
        outcome[grouping] = refusal(engine, model, fixture)
    load_checkpoint(engine, fixture.save_dir, load_module_only=True)
    outcome["weights"] = {name: as_bytes(t.float()) for name, t in model.state_dict().items()}
    outcome["masters"] = {name: as_bytes(engine.get_full_fp32_param(name)) for name in (*MUON_PARAMS, *ADAM_PARAMS)}
    tokens = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(model(tokens, tokens))
    engine.step()  # the engine trains on from the loaded weights
    return outcome


@pytest.fixture(scope="module", params=MUON_RUNS)
def muon_run(request, deepspeed_muon_runs) -> MuonFixture:
    """One DeepSpeed Muon checkpoint: each test runs on each stage's."""
    return deepspeed_muon_runs[request.param]


@pytest.fixture(scope="module")
def outcomes(muon_run) -> dict[int, list[dict]]:
    fixture = muon_run
    return {
        1: [on_rank(0, 1, fixture)],  # no process group: a world of one
        3: spawn(on_rank, 3, (fixture,), timeout_s=SPAWN_TIMEOUT_S),
    }


def saved_module(fixture: MuonFixture) -> dict[str, torch.Tensor]:
    states = torch.load(fixture.tag_dir / "mp_rank_00_model_states.pt", weights_only=True, map_location="cpu")
    return states["module"]


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_full_load_into_adamw_is_refused_in_one_line_on_every_rank(outcomes, muon_run, world_size):
    path = muon_run.save_dir
    for grouping in GROUPINGS:
        messages = {outcome[grouping][0] for outcome in outcomes[world_size]}
        assert len(messages) == 1, f"every rank raises the same error: {messages}"
        message = messages.pop()
        assert message and "\n" not in message, message
        assert all(outcome[grouping][1] for outcome in outcomes[world_size]), "the model is as it was"
    # Grouped as saved, the state reads; the engine's import_state then refuses the optimizer.
    as_saved = outcomes[world_size][0]["as_saved"][0]
    assert (
        "the checkpoint's optimizer is torch.optim.Muon+torch.optim.adamw.AdamW, this run uses torch.optim.adamw.AdamW"
    ) in as_saved
    # Grouped otherwise, the loader refuses before anything is read, naming a Muon matrix.
    one_group = outcomes[world_size][0]["one_group"][0]
    assert f"checkpoint {path} not loaded (nothing changed)" in one_group
    assert (
        "layout group 0 holds parameters of saved param groups [0, 1]: "
        "'fc1.weight' of saved param group 0 (optimizer torch.optim.Muon, use_muon true, states ['momentum_buffer']); "
        "'embed.weight' of saved param group 1 (optimizer torch.optim.adamw.AdamW, use_muon false, states ['exp_avg', 'exp_avg_sq']); "
        "group the run's parameters as the checkpoint does, or load with load_module_only"
    ) in one_group


@pytest.mark.parametrize("world_size", [1, 3])
def test_load_module_only_into_adamw_grouped_its_own_way(outcomes, muon_run, world_size):
    saved = saved_module(muon_run)
    for outcome in outcomes[world_size]:
        assert sorted(outcome["weights"]) == sorted(saved)
        for name, tensor in saved.items():
            assert torch.equal(from_bytes(outcome["weights"][name]), tensor.float()), name
        for name, master in outcome["masters"].items():
            assert torch.equal(from_bytes(master), saved[name].float()), f"{name}: the master is the weight"
