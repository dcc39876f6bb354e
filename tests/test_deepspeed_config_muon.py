"""from_deepspeed_config with DeepSpeed's ``"optimizer": {"type": "Muon"}`` (MuonWithAuxAdam).

The config moves one to one: the run puts torch.optim.Muon on the parameters DeepSpeed
tagged ``use_muon`` and torch's AdamW on the rest, each group with the hyperparameters
DeepSpeed gave it (compared with the groups DeepSpeed saved in its checkpoint of the same
config), and that checkpoint then loads into the run whole. What zeroshard cannot do as
DeepSpeed does is refused in one line naming the key.
"""

from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_muon_fixtures import ADAM_PARAMS, CONFIGS, MUON_PARAMS, build_model, ds_config
from safetensors.torch import load_file
from test_deepspeed_muon_load import full_state

from zeroshard import from_deepspeed_config
from zeroshard.checkpoint.engine_io import load_checkpoint
from zeroshard.deepspeed.checkpoint import open_deepspeed

COMPARED = {True: ("lr", "momentum", "weight_decay"), False: ("lr", "betas", "eps", "weight_decay")}


def config_without_clipping(name: str = "muon_w1_s2") -> dict:
    """The fixture run's DeepSpeed config, but for gradient_clipping (refused with Muon)."""
    config = ds_config(next(config for config in CONFIGS if config.name == name))
    del config["gradient_clipping"]
    return config


def group_names(run) -> list[list[str]]:
    """The parameters of each of the run's param groups, by name."""
    groups = run.engine.layout.groups
    return [[slot.name for g in user.layout_groups for slot in groups[g].params] for user in run.engine.grouping.user_groups]


def params(config: dict) -> dict:
    return config["optimizer"]["params"]


def test_the_run_groups_and_sets_hyperparameters_as_deepspeed_did(deepspeed_muon_runs):
    model = build_model()
    run = from_deepspeed_config(model, config_without_clipping(), device=None)
    assert [type(inner) for inner in run.optimizer.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    assert [sorted(names) for names in group_names(run)] == [sorted(MUON_PARAMS), sorted(ADAM_PARAMS)]
    with open_deepspeed(deepspeed_muon_runs["muon_w1_s2"].save_dir) as source:
        saved = [group.hyperparameters for group in source.info.param_groups]
    for group, hyper in zip(run.engine.param_groups, saved):
        keys = COMPARED[hyper["use_muon"]]
        as_saved = {key: tuple(hyper[key]) if key == "betas" else hyper[key] for key in keys}
        assert {key: group[key] for key in keys} == as_saved
    assert any("rounded differently" in note for note in run.notes)


def test_deepspeeds_checkpoint_of_the_config_loads_whole_into_the_run(deepspeed_muon_runs):
    model = build_model()
    run = from_deepspeed_config(model, config_without_clipping(), device=None)
    fixture = deepspeed_muon_runs["muon_w2_s2"]  # saved at D = 2: resharded to this one rank
    load_checkpoint(run.engine, fixture.save_dir)
    expected = load_file(str(fixture.accessors))
    for key, value in full_state(run.engine).items():
        saved = expected[key].float().reshape(value.shape)
        assert torch.equal(value.view(torch.int32), saved.view(torch.int32)), key
    assert run.step()


def test_user_param_groups_are_split_into_muon_and_adam_halves_in_deepspeeds_order():
    model = build_model()
    named = dict(model.named_parameters())
    decay = [named[name] for name in (*MUON_PARAMS, "embed.weight")]
    no_decay = [param for name, param in named.items() if name not in MUON_PARAMS and name != "embed.weight"]
    groups = [{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]
    config = config_without_clipping()
    config["optimizer"]["params"]["eps"] = 1e-8
    run = from_deepspeed_config(model, config, param_groups=groups, device=None)
    names = group_names(run)
    assert [sorted(group) for group in names] == [
        sorted(MUON_PARAMS), ["embed.weight"], sorted(name for name in ADAM_PARAMS if name != "embed.weight")
    ]
    settings = [(group["lr"], group["weight_decay"], group.get("betas")) for group in run.engine.param_groups]
    muon_lr, adam_lr = (config["optimizer"]["params"][key] for key in ("muon_lr", "adam_lr"))
    assert settings[0][:2] == (muon_lr, 0.2)  # the group's own weight decay over the config's
    assert settings[1] == (adam_lr, 0.2, (0.9, 0.95))
    assert settings[2] == (5e-4, 0.0, (0.9, 0.95))  # the group's own lr over adam_lr
    assert [group["eps"] for group in run.engine.param_groups[1:]] == [1e-8, 1e-8]


def test_muon_defaults_are_deepspeeds_not_torchs():
    model = build_model()
    config = config_without_clipping()
    config["optimizer"]["params"] = {}
    run = from_deepspeed_config(model, config, device=None)
    muon, adam = run.engine.param_groups
    assert (muon["lr"], muon["momentum"], muon["weight_decay"]) == (0.02, 0.95, 0.0)
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-10, 0.0)
    assert any("FusedAdam" in note for note in run.notes)  # torch_adam absent


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(gradient_clipping=1.0), "gradient_clipping = 1.0: with Muon DeepSpeed clips the orthogonalised"),
        (lambda c: params(c).update(per_head_muon=True), "optimizer.params.per_head_muon = True"),
        (lambda c: params(c).update(ns_method="svd"), "optimizer.params.ns_method = 'svd'"),
        (lambda c: params(c).update(nesterov=False), "optimizer.params.nesterov = False: DeepSpeed's Muon does not take it"),
        (lambda c: params(c).update(muon_lr="fast"), "optimizer.params.muon_lr = 'fast': must be"),
        (lambda c: params(c).update(torch_adam="yes"), "optimizer.params.torch_adam = 'yes': must be true or false"),
    ],
)
def test_what_zeroshard_cannot_do_as_deepspeed_is_refused_in_one_line(change, message):
    config = copy.deepcopy(config_without_clipping())
    change(config)
    model = build_model()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        from_deepspeed_config(model, config, device=None)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(before[name], param) for name, param in model.named_parameters()), "the model is untouched"


def test_a_client_optimizer_beside_a_muon_config_is_refused():
    with pytest.raises(ValueError, match="the config names one and optimizer_class= gives another"):
        from_deepspeed_config(build_model(), config_without_clipping(), optimizer_class=torch.optim.SGD, device=None)
