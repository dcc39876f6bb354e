"""The transformers side of ``zeroshard demo --moe --hf``: an unmodified transformers v5
Qwen3-MoE (tiny, random weights, ``experts_implementation="grouped_mm"``) made
expert-parallel in one call, and the check that ``from_pretrained`` loads its export as it is
(the config the checkpoints recorded from the model included).

Needs transformers (``pip install -e '.[hf]'``); imported only when the demo runs with ``--hf``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..models import GPTConfig

# head_dim 10: each layer's q_norm + k_norm (20 elements, 40 bytes in bf16) would put a compact
# layout's next views off 16 bytes; widths are multiples of 8 so the native layout's views
# meet grouped_mm's 16-byte stride rule in bf16.
HF_MODEL: dict[str, Any] = dict(
    vocab_size=GPTConfig.vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=10, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=GPTConfig.block_size, decoder_sparse_step=1, mlp_only_layers=[],
    experts_implementation="grouped_mm",
)  # fmt: skip
NUM_EXPERTS = HF_MODEL["num_experts"]


def qwen3_moe_config():
    """The demo's transformers ``Qwen3MoeConfig`` (``HF_MODEL``: a tiny model, 8 experts,
    top-2); ImportError without transformers."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**HF_MODEL)


def qwen3_moe(seed: int) -> nn.Module:
    """The demo's Qwen3-MoE with every expert, the same on every rank for one seed."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(qwen3_moe_config())


class NextTokenLoss:
    """The demo's training call for a transformers causal LM: ``(inputs, targets)`` -> the mean
    next-token cross-entropy (the toy corpus gives targets already shifted), with the
    ``config`` the demo's data reads (vocab and block size)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = GPTConfig()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def from_pretrained_check(exported: Path, live: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Load the fp32 export with ``Qwen3MoeForCausalLM.from_pretrained`` as it is (the
    ``config.json`` the checkpoint recorded from the model, written by the export): ValueError
    if it has none, or if any key is missing, unexpected or mismatched. Returns (tensors
    bit-for-bit equal to ``live``, tensors in ``live``)."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging

    if not (exported / "config.json").is_file():
        raise ValueError(f"{exported}: no config.json: the checkpoint did not record the model's config")
    logging.disable_progress_bar()  # its loading bar would land in the middle of the report
    model, info = Qwen3MoeForCausalLM.from_pretrained(exported, output_loading_info=True)
    problems = {key: info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[key]}
    if problems:
        raise ValueError(f"from_pretrained({exported}) did not load the export cleanly: {problems}")
    params = dict(model.named_parameters())
    return sum(name in params and torch.equal(params[name], value) for name, value in live.items()), len(live)
