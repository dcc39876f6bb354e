"""The engine's torch.optim surface, in a single process (world size 1, no process group)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.engine import ZeroOptimizer
from zeroshard.models import OddSizedModel


def _batches(count: int):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 13, (4, 8), generator=generator) for _ in range(count)]


def test_lr_scheduler_takes_the_engine_itself():
    model = OddSizedModel()
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    assert isinstance(engine, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine, lambda step: 0.5**step)
    seen = []
    for tokens in _batches(3):
        engine.backward(model(tokens, tokens))
        engine.step()
        engine.zero_grad()
        scheduler.step()
        seen.append(engine.optimizer.param_groups[0]["lr"])
    assert seen == [1e-2 * 0.5, 1e-2 * 0.25, 1e-2 * 0.125]


def test_torch_state_dict_is_refused_with_a_pointer_to_checkpoints():
    engine = ZeroOptimizer(OddSizedModel(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(NotImplementedError, match="save_checkpoint"):
        engine.state_dict()
    with pytest.raises(NotImplementedError, match="load_checkpoint"):
        engine.load_state_dict({})


def test_a_bad_fragment_call_raises_its_own_error_in_a_single_process():
    engine = ZeroOptimizer(OddSizedModel(), torch.optim.AdamW, lr=1e-2)
    name = engine.layout.param_names[0]
    with pytest.raises(KeyError, match="optimizer has no state 'exp_avg'"):
        engine.get_full_optimizer_state(name, "exp_avg")
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.set_full_fp32_param("nope", torch.zeros(1))
    with pytest.raises(ValueError, match=f"parameter {name!r} has shape"):
        engine.set_full_fp32_param(name, torch.zeros(10**4))
