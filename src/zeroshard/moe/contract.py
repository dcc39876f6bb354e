"""The expert contract on the module side: which parameters of a model are expert stacks, how
each is oriented, and which global experts this rank holds.

transformers v5 experts modules (every class its ``use_experts_implementation`` decorator
made: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...) are recognised from the attributes the
decorator sets (``is_transposed``, ``has_bias``, ``has_gate``) and their class name (the
per-expert checkpoint names of the known families); ``GroupedExperts`` (MoEGPT) declares
itself; a user's own module declares its stacks in one call, :func:`declare_experts`.
docs/DESIGN.md, "Expert stacks", has the contract; the pure half is
:mod:`zeroshard.layout.stacks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from ..layout import ExpertStack, check_expert_map, contiguous_expert_map
from ..layout.stacks import per_expert_name_clash

_ATTRIBUTE = "_zeroshard_experts"

# Per-expert checkpoint names of the stacks of known transformers families (what their
# save_pretrained writes): the parts each stack concatenates along an expert's output rows.
_GATE_UP_DOWN = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",)}
_W1_W3_W2 = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",), "up_proj": ("w3",)}
KNOWN_PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "Qwen3MoeExperts": _GATE_UP_DOWN,
    "Qwen2MoeExperts": _GATE_UP_DOWN,
    "OlmoeExperts": _GATE_UP_DOWN,
    "DeepseekV2Experts": _GATE_UP_DOWN,
    "DeepseekV3Experts": _GATE_UP_DOWN,
    "MixtralExperts": _W1_W3_W2,
    "GptOssExperts": {},  # stored stacked (gate and up interleaved), no per-expert form
}


@dataclass(frozen=True)
class ExpertModule:
    """What the contract knows of one experts module: its stacks (parameter leaf name ->
    description), the placement of all ``num_experts`` global experts on EP ranks, and which
    EP rank this module is, so it holds experts ``expert_map[ep_rank]`` in that order."""

    stacks: Mapping[str, ExpertStack]
    expert_map: tuple[tuple[int, ...], ...]
    ep_rank: int = 0

    @property
    def num_experts(self) -> int:
        """E: the global experts the map places, on all EP ranks."""
        return sum(len(experts) for experts in self.expert_map)

    @property
    def expert_ids(self) -> tuple[int, ...]:
        """The global ids of the experts this module holds, in stack order."""
        return self.expert_map[self.ep_rank]

    @property
    def ep_size(self) -> int:
        """EP: the expert-parallel ranks the map places experts on."""
        return len(self.expert_map)


def declare_experts(
    module: nn.Module,
    stacks: Mapping[str, ExpertStack | str],
    *,
    expert_map: Sequence[Sequence[int]] | None = None,
    ep_rank: int = 0,
) -> ExpertModule:
    """Declare ``module``'s expert stacks: parameter leaf name -> an :class:`ExpertStack`,
    or an orientation (``"out_in"``, ``"in_out"``, ``"none"``) for a stack exported whole.

    ``expert_map`` places the global experts on EP ranks and ``ep_rank`` says which of them
    this module is (default: one rank holding all of its experts). Every named parameter
    must stack ``len(expert_map[ep_rank])`` experts in dimension 0. Returns the declaration.
    Not collective.

    Raises:
        ValueError: naming the parameter for anything that does not fit (no stack declared,
            a name that is not one of the module's own parameters, a malformed expert map
            or ``ep_rank``, a dimension 0 that is not this rank's expert count, an oriented
            stack that is not 3-d, two stacks naming one per-expert tensor or one naming
            another tensor of the module: per-expert exports write each name once).
    """
    described = {name: ExpertStack(stack) if isinstance(stack, str) else stack for name, stack in stacks.items()}
    if not described:
        raise ValueError(f"{type(module).__name__}: declare at least one expert stack")
    params = dict(module.named_parameters(recurse=False))
    for name, stack in described.items():
        if name not in params:
            raise ValueError(f"{type(module).__name__} has no parameter {name!r} of its own to declare an expert stack")
        if not isinstance(stack, ExpertStack):
            raise ValueError(f"expert stack {name!r}: expected an ExpertStack or an orientation, got {stack!r}")
    local = {name: params[name].shape[0] if params[name].dim() else 0 for name in described}
    if expert_map is None:
        expert_map = (tuple(range(max(local.values()))),)
    placement = check_expert_map(expert_map)
    if not 0 <= ep_rank < len(placement):
        raise ValueError(f"ep_rank {ep_rank!r} is outside the expert map's {len(placement)} expert-parallel ranks")
    held = len(placement[ep_rank])
    for name, stack in described.items():
        if local[name] != held:
            raise ValueError(
                f"expert stack {name!r} has shape {list(params[name].shape)}: its dimension 0 must hold "
                f"this rank's {held} experts"
            )
        if stack.is_matrix and params[name].dim() != 3:
            raise ValueError(f"expert stack {name!r} has shape {list(params[name].shape)}: {stack.orientation} needs [experts, rows, columns]")
    experts = sum(map(len, placement))
    stacked = [(name, stack, experts) for name, stack in described.items()]
    clash = per_expert_name_clash(stacked, module.state_dict(keep_vars=True))
    if clash:
        raise ValueError(
            f"{type(module).__name__}: {clash} (names relative to the module); "
            "a per-expert export would write two tensors under it"
        )
    declaration = ExpertModule(dict(described), placement, ep_rank)
    setattr(module, _ATTRIBUTE, declaration)
    return declaration


def expert_module(module: nn.Module) -> ExpertModule | None:
    """The contract of ``module`` if it is an experts module (declared or recognised)."""
    declared = getattr(module, _ATTRIBUTE, None)
    if declared is not None:
        return declared
    return _recognised(module)


def expert_modules(model: nn.Module) -> dict[str, ExpertModule]:
    """Every experts module of ``model`` by its module name, in module order."""
    found = {}
    for name, module in model.named_modules():
        contract = expert_module(module)
        if contract is not None:
            found[name] = contract
    return found


def expert_stacks(model: nn.Module) -> dict[str, tuple[ExpertStack, ExpertModule]]:
    """Every expert stack of ``model`` by its full parameter name, with its module's contract."""
    return {
        f"{prefix}.{leaf}" if prefix else leaf: (stack, contract)
        for prefix, contract in expert_modules(model).items()
        for leaf, stack in contract.stacks.items()
    }


def is_transformers_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts class transformers' ``use_experts_implementation``
    decorated (its forward dispatches on ``config._experts_implementation``)."""
    return all(hasattr(module, flag) for flag in ("is_transposed", "has_bias", "has_gate", "num_experts")) and isinstance(
        getattr(module, "down_proj", None), nn.Parameter
    )


def _recognised(module: nn.Module) -> ExpertModule | None:
    if not is_transformers_experts(module):
        return None
    parts = KNOWN_PARTS.get(type(module).__name__, {})
    orientation = "in_out" if module.is_transposed else "out_in"
    leaves = ["gate_up_proj" if module.has_gate else "up_proj", "down_proj"]
    stacks = {leaf: ExpertStack(orientation, "stacked", parts.get(leaf, ())) for leaf in leaves}
    if module.has_bias:
        stacks.update({f"{leaf}_bias": ExpertStack("none", "stacked") for leaf in leaves})
    params = dict(module.named_parameters(recurse=False))
    experts = int(module.num_experts)
    if any(leaf not in params or params[leaf].shape[0] != experts for leaf in stacks):
        return None  # not laid out as the decorator's contract says; leave it dense
    return ExpertModule(stacks, contiguous_expert_map(experts, 1))
