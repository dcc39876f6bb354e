"""Small models for the demo, the layout report, tests and benchmarks.

``TinyGPT`` is a GPT-style decoder whose width (36) makes its norm and bias vectors 72 bytes
in bf16, so a compact flat buffer would start the following parameters off 16-byte
boundaries. ``OddSizedModel`` is the test fixture: every parameter has an awkward size, and
it routes tokens through a 3-D expert weight with ``torch._grouped_mm``, the kernel that
needs aligned operands on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .layout import ParamSpec


@dataclass(frozen=True)
class GPTConfig:
    """TinyGPT's shape: vocabulary, context length, layers, heads and width."""

    vocab_size: int = 97
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 3
    n_embd: int = 36


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused qkv projection, torch's scaled_dot_product_attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [batch, time, n_embd] -> the same shape."""
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a GELU MLP four times as wide, each residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [batch, time, n_embd] -> the same shape."""
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2 style decoder with tied input and output embeddings."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two names
        self.register_buffer("positions", torch.arange(config.block_size), persistent=True)
        self.apply(_gpt2_init)


    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, time, vocab] of token ids ``idx`` [batch, time]; with ``targets``
        (the same shape), the mean cross-entropy instead, computed in fp32."""
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _gpt2_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class OddSizedModel(nn.Module):
    """Test fixture: odd parameter sizes, and a 3-D expert weight used by torch._grouped_mm."""

    num_experts = 4

    def __init__(self, vocab_size: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 7)  # 91 elements
        self.proj = nn.Linear(7, 5)  # 35 + 5
        self.norm = nn.LayerNorm(5)  # 5 + 5
        self.router_in = nn.Linear(5, 8, bias=False)  # 40
        self.experts = nn.Parameter(torch.randn(self.num_experts, 8, 16) * 0.1)  # 512
        self.head = nn.Linear(16, vocab_size)  # 208 + 13

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of the routed tokens of ``idx`` (a whole number of rows per
        expert); with ``targets``, their mean cross-entropy instead, computed in fp32."""
        tokens = self.router_in(self.norm(self.proj(self.embed(idx.view(-1)))))
        # Equal contiguous slices of tokens go to each expert (a fixed routing keeps it simple).
        per_expert = tokens.shape[0] // self.num_experts
        offsets = torch.arange(1, self.num_experts + 1, dtype=torch.int32, device=idx.device) * per_expert
        routed = torch._grouped_mm(tokens[: offsets[-1]], self.experts, offs=offsets)
        logits = self.head(F.gelu(routed))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float(), targets.view(-1)[: logits.shape[0]])


def param_specs(model: nn.Module, dtype: object | None = None) -> list[ParamSpec]:
    """The model's trainable parameters as layout specs, each shared parameter once."""
    seen: set[int] = set()
    specs = []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        specs.append(ParamSpec.of(name, tuple(param.shape), dtype or param.dtype))
    return specs


def gpt_param_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of (decayed, not decayed) parameters: matrices decay, norms and biases don't."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.dim() >= 2 else no_decay).append(name)
    return decay, no_decay
