"""Mixture of experts with expert parallelism: EP x DP process groups, a routed feed-forward
layer whose stacked experts run on ``torch._grouped_mm``, and a small MoE GPT; the expert
contract of any model (:mod:`.contract`: transformers v5 experts recognised, a user's own
declared), expert parallelism for a transformers model in one call (:mod:`.parallel`),
pretrained weights in rank by rank (:mod:`.pretrained`), and grouped_mm's CUDA rules checked
on any device (:mod:`.recorder`).

The rank arithmetic (:class:`~zeroshard.layout.ExpertMesh`) and the stack descriptions
(:class:`~zeroshard.layout.ExpertStack`) are pure and live with the layout; this package
holds the torch side.

May import: ``zeroshard.layout``, ``zeroshard.io`` (pretrained weights are files read as
hostile) and ``zeroshard.models`` (MoEGPT builds on TinyGPT's attention); not the engine,
which trains an expert-parallel model through its param groups, nor the checkpoint layer.
"""

from ..layout import ExpertMesh, contiguous_expert_map
from .dispatch import Route, combine, dispatch
from .experts import GroupedExperts, per_expert_name, per_expert_state_dict
from .groups import ExpertGroups, new_expert_groups
from .contract import ExpertModule, declare_experts, expert_module, expert_modules, expert_stacks
from .layer import MoEFeedForward
from .parallel import expert_parallel
from .pretrained import LoadReport, load_pretrained
from .recorder import GroupedMMRecorder, grouped_mm_problems
from .model import MoEBlock, MoEConfig, MoEGPT, expert_param_names, layout_groups, moe_param_groups

__all__ = [
    "ExpertModule",
    "GroupedMMRecorder",
    "LoadReport",
    "expert_parallel",
    "grouped_mm_problems",
    "load_pretrained",
    "declare_experts",
    "expert_module",
    "expert_modules",
    "expert_stacks",
    "ExpertGroups",
    "ExpertMesh",
    "GroupedExperts",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "MoEGPT",
    "Route",
    "combine",
    "contiguous_expert_map",
    "dispatch",
    "expert_param_names",
    "layout_groups",
    "moe_param_groups",
    "new_expert_groups",
    "per_expert_name",
    "per_expert_state_dict",
]
