"""ZeroOptimizer with torch.optim.Muon in one process (issue 32): the issue's reproduction."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zeroshard.engine import ZeroOptimizer


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 640, bias=False), nn.ReLU(), nn.Linear(640, 64, bias=False))


def test_muon_alone_on_an_all_matrix_model_needs_no_other_argument_and_is_torchs_muon():
    """The engine handed Muon 1-D partitions (``ValueError: Muon only supports 2D
    parameters``); now it picks owner groups itself, and at D = 1 its steps are torch's
    Muon's on the same model bit for bit (the same operations on the same fp32 tensors)."""
    model = _mlp()
    reference = copy.deepcopy(model)
    engine = ZeroOptimizer(model, torch.optim.Muon, model.parameters(), stage=2, lr=0.02)
    torch_muon = torch.optim.Muon(reference.parameters(), lr=0.02)
    assert [group.owner for group in engine.layout.groups] == [True]
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        engine.backward(model(x).pow(2).mean())
        engine.step()
        engine.zero_grad()
        reference(x).pow(2).mean().backward()
        torch_muon.step()
        torch_muon.zero_grad()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.detach(), expected.detach()), name
        assert torch.equal(engine.get_full_optimizer_state(name, "momentum_buffer"), torch_muon.state[expected]["momentum_buffer"])


def _three_groups(last_class: type) -> tuple[nn.Module, ZeroOptimizer]:
    """Muon for the first matrix, AdamW for the bias, ``last_class`` for the last matrix:
    the run's classes are "Muon+AdamW" either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4))
    groups = [
        {"params": [model[0].weight]},
        {"params": [model[1].bias], "optimizer": torch.optim.AdamW, "lr": 1e-3},
        {"params": [model[1].weight], **({} if last_class is torch.optim.Muon else {"optimizer": last_class, "lr": 1e-3})},
    ]
    return model, ZeroOptimizer(model, torch.optim.Muon, groups, lr=0.02)


def test_each_param_group_holds_its_own_optimizers_options_only():
    """Each group's dict holds the options its class takes, as torch's own optimizer of that
    class would: an AdamW group got Muon's ``momentum``, ``nesterov`` and ``ns_*`` from the
    first class's defaults, and kept them in every checkpoint."""
    _, engine = _three_groups(torch.optim.AdamW)
    for group, cls in zip(engine.param_groups, (torch.optim.Muon, torch.optim.AdamW, torch.optim.AdamW)):
        tensor = torch.zeros(2, 2, requires_grad=True)
        expected = set(cls([tensor]).param_groups[0]) - {"optimizer"}
        assert set(group) - {"optimizer"} == expected, cls.__name__
    assert set(engine.defaults) == set(torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)]).defaults)


def test_a_param_group_trained_by_another_optimizer_is_refused_and_nothing_changes(tmp_path):
    from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint

    model, engine = _three_groups(torch.optim.Muon)
    engine.backward(model(torch.ones(2, 8)).sum())
    engine.step()
    saved = save_checkpoint(engine, tmp_path)
    other_model, other = _three_groups(torch.optim.AdamW)
    before = [master.detach().clone() for master in other.masters]
    with pytest.raises(ValueError, match=r"param group 2: the checkpoint's optimizer is torch\.optim\.Muon, this run's is torch\.optim\.adamw\.AdamW"):
        load_checkpoint(other, saved)
    assert all(torch.equal(a, b) for a, b in zip(before, other.masters))
    load_checkpoint(other, saved, load_module_only=True)
    assert torch.equal(other_model[1].weight.detach(), model[1].weight.detach())


def test_an_lr_scheduler_reaches_both_optimizers_and_offload_keeps_the_step():
    """The usual param-group API on a Muon + AdamW engine: a scheduler's lr reaches the inner
    torch optimizers; with the masters offloaded the steps are still torch's Muon's."""
    model = _mlp()
    reference = copy.deepcopy(model)
    matrices, rest = [model[0].weight], [model[2].weight]
    groups = [{"params": matrices}, {"params": rest, "optimizer": torch.optim.AdamW, "lr": 1e-3}]
    engine = ZeroOptimizer(model, torch.optim.Muon, groups, stage=1, lr=0.02, offload=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine, lambda step: 0.5**step)
    torch_muon = torch.optim.Muon([reference[0].weight], lr=0.02)
    torch_adamw = torch.optim.AdamW([reference[2].weight], lr=1e-3)
    reference_scheduler = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step) for o in (torch_muon, torch_adamw)]
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        engine.backward(model(x).pow(2).mean())
        engine.step()
        engine.zero_grad()
        scheduler.step()
        reference(x).pow(2).mean().backward()
        for optimizer, schedule in zip((torch_muon, torch_adamw), reference_scheduler):
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    inner = [group["lr"] for optimizer in engine.optimizer.optimizers for group in optimizer.param_groups]
    assert inner == [0.02 * 0.125, 1e-3 * 0.125]
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.detach(), expected.detach()), name


def _muon_and_adamw_mlp() -> tuple[nn.Module, ZeroOptimizer]:
    """The MLP with Muon on its first matrix and AdamW on its last, stage 2."""
    model = _mlp()
    groups = [{"params": [model[0].weight]}, {"params": [model[2].weight], "optimizer": torch.optim.AdamW, "lr": 1e-3}]
    return model, ZeroOptimizer(model, torch.optim.Muon, groups, stage=2, lr=0.02)


def _train(model: nn.Module, engine: ZeroOptimizer, step: int) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
    engine.backward(model(x).pow(2).mean())
    engine.step()
    engine.zero_grad()


def test_a_rank_shard_state_dict_round_trips_a_muon_and_adamw_engine():
    """``state_dict()`` / ``load_state_dict()`` (this rank's shard) of a Muon + AdamW engine:
    a fresh engine that loads it takes the same next step as the one that saved it."""
    model, engine = _muon_and_adamw_mlp()
    for step in range(2):
        _train(model, engine, step)
    shard = copy.deepcopy(engine.state_dict())
    other_model, other = _muon_and_adamw_mlp()
    other.load_state_dict(shard)
    assert torch.equal(other.get_full_optimizer_state("0.weight", "momentum_buffer"), engine.get_full_optimizer_state("0.weight", "momentum_buffer"))
    _train(model, engine, 2)
    _train(other_model, other, 2)
    for (name, param), loaded in zip(model.named_parameters(), other_model.parameters()):
        assert torch.equal(param.detach(), loaded.detach()), name


def test_an_asynchronous_checkpointer_resumes_a_muon_run_exactly(tmp_path):
    """The Checkpointer's snapshot reads the owner groups' momentum buffers like AdamW's
    states: a run resumed from its save takes the saving run's next steps bit for bit, and
    the audit of the first resumed step finds nothing different."""
    from zeroshard.checkpoint import Checkpointer

    model, engine = _muon_and_adamw_mlp()
    with Checkpointer(engine, tmp_path) as checkpointer:
        for step in range(2):
            _train(model, engine, step)
        checkpointer.save(1)
        checkpointer.wait()
        for step in range(2, 4):
            _train(model, engine, step)
    resumed_model, resumed = _muon_and_adamw_mlp()
    with Checkpointer(resumed, tmp_path) as checkpointer:
        start = checkpointer.load()
        assert start == 2
        for step in range(start, 4):
            _train(resumed_model, resumed, step)
        verdict = checkpointer.audit_verdict
        assert verdict is not None and not verdict.causes, verdict
    for (name, param), loaded in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(param.detach(), loaded.detach()), name


@pytest.mark.parametrize("kind", ["native", "universal"])
@pytest.mark.parametrize("recorded", ["torch.optim.Muon\nInjected line", 7, "x" * 5000], ids=["newline", "number", "too-long"])
def test_a_recorded_optimizer_that_is_no_class_name_is_refused_in_one_line(tmp_path, kind, recorded):
    import json

    from zeroshard.checkpoint import open_checkpoint
    from zeroshard.checkpoint.engine_io import load_checkpoint, save_checkpoint
    from zeroshard.checkpoint.universal import open_universal, to_universal

    model, engine = _three_groups(torch.optim.Muon)
    engine.backward(model(torch.ones(2, 8)).sum())
    engine.step()
    path = save_checkpoint(engine, tmp_path / "native")
    if kind == "universal":
        path = to_universal(path, tmp_path / "universal", progress=False)
    manifest = path / ("manifest.json" if kind == "native" else "universal.json")
    data = json.loads(manifest.read_text())
    assert data["optimizer"]["param_groups"][1]["optimizer"] == "torch.optim.adamw.AdamW"
    data["optimizer"]["param_groups"][1]["optimizer"] = recorded
    manifest.write_text(json.dumps(data))
    with pytest.raises(ValueError) as refused:
        (open_checkpoint if kind == "native" else open_universal)(path)
    message = str(refused.value)
    assert "\n" not in message and "param group 1's optimizer" in message and len(message) < 1000, message
    with pytest.raises(ValueError):
        load_checkpoint(engine, path)
