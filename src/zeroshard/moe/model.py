"""MoEGPT: TinyGPT with a mixture-of-experts feed-forward in every block (demo and tests),
and the split of its parameters into dense ones and expert ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..layout import ExpertMesh, GroupSpec, ParamSpec
from ..models import CausalSelfAttention, GPTConfig
from .contract import expert_stacks
from .layer import MoEFeedForward


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """TinyGPT's shape with experts. Widths are multiples of 8, so a bf16 expert row is a
    multiple of 16 bytes, as CUDA's grouped GEMM needs."""

    n_head: int = 4
    n_embd: int = 32
    num_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 48


class MoEBlock(nn.Module):
    """TinyGPT's pre-norm block with an :class:`~.layer.MoEFeedForward` as its MLP."""

    def __init__(self, config: MoEConfig, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.moe = MoEFeedForward(config.n_embd, config.expert_hidden, config.num_experts, config.top_k, ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [batch, time, n_embd] -> the same shape. Collective over the EP group when
        EP > 1 (the MoE layer's all-to-alls)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoEGPT(nn.Module):
    """A GPT-2 style decoder with tied embeddings whose blocks' MLPs are MoE layers.

    With ``ep_group`` each rank holds E / EP of every layer's experts (by the contiguous
    expert map); all other parameters are the same on every rank, and forward and backward
    are collective over ``ep_group`` (EP > 1).
    """

    def __init__(self, config: MoEConfig = MoEConfig(), ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(MoEBlock(config, ep_group) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(config.block_size), persistent=True)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, time, vocab] of ``idx`` [batch, time], or with ``targets`` the mean
        cross-entropy (fp32), as TinyGPT's. Collective over ``ep_group`` when EP > 1: every
        rank of it runs forward and backward together, each with its own batch."""
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def expert_param_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of (dense, expert) trainable parameters, each shared parameter once.

    Expert parameters are the stacks of the model's experts modules (the contract,
    :mod:`.contract`: ``GroupedExperts``, transformers v5 experts, declared modules): they
    differ between EP ranks and are reduced over the expert-data-parallel group; all others
    over all ranks.
    """
    stacks = expert_stacks(model)
    dense, expert, seen = [], [], set()
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            (expert if name in stacks else dense).append(name)
    return dense, expert


def moe_param_groups(model: nn.Module, **expert_options: object) -> list[dict]:
    """Param groups for ``ZeroOptimizer``: the dense parameters, and the expert stacks
    flagged ``"expert": True`` with their placement (``"expert_map"``) and descriptions
    (``"expert_stacks"``), one group per placement, with ``expert_options`` (e.g. another
    lr), so they are sharded and reduced over the expert-data-parallel group."""
    params = dict(model.named_parameters())
    dense, expert = expert_param_names(model)
    stacks = expert_stacks(model)
    by_map: dict[tuple, list[str]] = {}
    for name in expert:
        by_map.setdefault(stacks[name][1].expert_map, []).append(name)
    return [{"params": [params[name] for name in dense]}] + [
        {
            "params": [params[name] for name in names],
            "expert": True,
            "expert_map": expert_map,
            "expert_stacks": {name: stacks[name][0] for name in names},
            **expert_options,
        }
        for expert_map, names in by_map.items()
    ]


def layout_groups(model: nn.Module, mesh: ExpertMesh, dtype: object | None = None) -> list[list[ParamSpec] | GroupSpec]:
    """Layout groups of a model with experts modules: the dense parameters over all ranks,
    the expert stacks over the expert-data-parallel group (one dtype each), as the engine
    forms them from :func:`moe_param_groups` on ``mesh``.

    Raises:
        ValueError: the MoE layers place their experts differently, or the placement does
            not fit ``mesh``.
    """
    params = dict(model.named_parameters())
    dense, expert = expert_param_names(model)
    stacks = expert_stacks(model)
    maps = {stacks[name][1].expert_map for name in expert}
    if len(maps) != 1:
        counts = sorted({sum(map(len, m)) for m in maps})
        raise ValueError(f"expected one expert placement across the model's MoE layers, got {len(maps)} ({counts} experts)")
    expert_map = maps.pop()
    num_experts = sum(map(len, expert_map))

    def specs(names: list[str]) -> list[ParamSpec]:
        return [ParamSpec.of(name, tuple(params[name].shape), dtype or params[name].dtype) for name in names]

    placement = expert_map if len(expert_map) == mesh.ep_size else None  # a model at another EP: contiguous
    group = mesh.expert_group(specs(expert), num_experts, expert_map=placement, stacks=[stacks[n][0] for n in expert])
    return [specs(dense), group]
