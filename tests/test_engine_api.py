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
