"""The model and data the trainer examples share: a one-layer GPT-2 of width 32 and a small
deterministic corpus. Replace them with yours."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, LENGTH = 96, 16


class ProgressionCorpus(Dataset):
    """Token sequences that step through the vocabulary by a fixed stride: learnable, deterministic."""

    def __init__(self, rows: int = 512) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, stride = (index * 37) % VOCAB, 1 + index % 7
        ids = (start + stride * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 of width 32, no dropout; the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's name does not say its loss: named, Trainer counts the tokens the loss
    # is taken over (the shifted labels) when it normalises by them, and the warning goes.
    model.loss_type = "ForCausalLM"
    return model


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """transformers Trainer's split: biases and LayerNorm parameters take no weight decay."""
    norms = {id(p) for module in model.modules() if isinstance(module, nn.LayerNorm) for p in module.parameters()}
    named = list(model.named_parameters())
    decay = [p for name, p in named if not name.endswith("bias") and id(p) not in norms]
    rest = [p for name, p in named if name.endswith("bias") or id(p) in norms]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
