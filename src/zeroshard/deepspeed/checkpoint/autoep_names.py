"""An AutoEP checkpoint's parameters under the transformers model's own names and layout.

AutoEP replaces each MoE block of a transformers model (``model.layers.L.mlp``) with its own
layer, so its checkpoint names what that layer holds: the router as ``mlp.router.gate.weight``
(and the same tensor again under ``mlp.gate.gate.weight``, an alias AutoEP keeps for
transformers' output recorders), and the experts as ``mlp.experts.w1`` / ``w2`` / ``w3``, each
``[E / EP, ...]`` (gate ``[I, H]``, down ``[H, I]``, up ``[I, H]`` per expert). The model
itself (transformers v5, ``Qwen3MoeSparseMoeBlock``) holds ``mlp.gate.weight [E, H]`` and two
expert stacks in its own orientation ``[E, out, in]``: ``mlp.experts.gate_up_proj [E, 2I, H]``
and ``mlp.experts.down_proj [E, H, I]``. AutoEP's preset splits ``gate_up_proj`` as rows
``[:I]`` -> w1 (gate) and ``[I:]`` -> w3 (up) (``deepspeed/moe/ep_repack.py``, the
"gate_up_first" layout), so ``gate_up_proj = cat(w1, w3)`` along dimension 1 and
``down_proj = w2``.

:func:`transformers_names` is the one place that mapping is made: the expert stacks' names,
shapes and which rows of which AutoEP weight each holds. It is what the transformers-named
view (:mod:`.autoep`) presents and exports, and where each stack's
:class:`~zeroshard.layout.ExpertStack` (orientation, export form, per-expert parts) is given,
the one the model's experts module declares (:mod:`zeroshard.moe.contract`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...io.budget import quoted
from ...layout import ExpertStack
from .autoep_files import AutoEP
from .pickled import DeepSpeedFormatError


@dataclass(frozen=True)
class Preset:
    """What an AutoEP preset replaces in the transformers model, by attribute name."""

    router: str  # the model's router module under the MoE block ("gate")
    experts: str  # the model's experts module ("experts")
    gate_up: str  # the fused gate-and-up stack ("gate_up_proj", [E, 2I, H])
    down: str  # the down stack ("down_proj", [E, H, I])
    gate_up_parts: tuple[str, str]  # its rows' per-expert names in save_pretrained's files


# Presets whose checkpoints were read from real DeepSpeed runs (tests/autoep_fixtures.py).
PRESETS = {
    "qwen3_moe": Preset(
        router="gate",
        experts="experts",
        gate_up="gate_up_proj",
        down="down_proj",
        gate_up_parts=("gate_proj", "up_proj"),
    )
}


# The model's down_proj as its experts module declares it: [out, in] per expert, exported
# whole; save_pretrained's per-expert name is the leaf's own (no parts).
DOWN_STACK = ExpertStack("out_in", "stacked")


@dataclass(frozen=True)
class StackPart:
    """Rows of one AutoEP weight inside each expert's matrix of a stack."""

    source: str  # the AutoEP stacked weight, "model.layers.0.mlp.experts.w1"
    rows: int  # how many rows of each expert's matrix it fills (in order)


@dataclass(frozen=True)
class ModelStack:
    """One expert stack of the model, ``[E, rows, columns]``: per expert, its parts' rows in
    order. ``contract`` describes it as the model's experts module declares it
    (:class:`~zeroshard.layout.ExpertStack`: each expert an ``[out, in]`` matrix, exported
    whole, and the per-expert names transformers' ``save_pretrained`` gives its rows), so the
    layout, the exports and a load into the model made expert-parallel read the same facts."""

    name: str  # "model.layers.0.mlp.experts.gate_up_proj"
    num_experts: int
    columns: int
    parts: tuple[StackPart, ...]
    contract: ExpertStack  # ExpertStack("out_in", "stacked", ("gate_proj", "up_proj")) for gate_up_proj

    @property
    def rows(self) -> int:
        """Rows of each expert's matrix: the sum of its parts' rows."""
        return sum(part.rows for part in self.parts)

    def shape(self, experts: int | None = None) -> tuple[int, int, int]:
        """``(experts, rows, columns)``, with all ``num_experts`` experts when ``experts`` is None."""
        return (self.num_experts if experts is None else experts, self.rows, self.columns)

    def source_ranges(self, start: int, end: int) -> list[tuple[str, int, int]]:
        """Elements [start, end) of the flattened stack, as ranges ``(source, first, stop)`` of
        the flattened AutoEP weights (all experts stacked by global id), in order."""
        per_expert = self.rows * self.columns
        ranges: list[tuple[str, int, int]] = []
        position = start
        while position < end:
            expert, within = divmod(position, per_expert)
            row = within // self.columns
            first_row = 0
            for part in self.parts:
                if row < first_row + part.rows:
                    break
                first_row += part.rows
            part_start = first_row * self.columns  # where the part begins in the expert's matrix
            run = min(end - position, (first_row + part.rows) * self.columns - within)
            source_start = expert * part.rows * self.columns + within - part_start
            ranges.append((part.source, source_start, source_start + run))
            position += run
        return ranges


@dataclass(frozen=True)
class TransformersNames:
    """How the AutoEP checkpoint's names become the model's."""

    renamed: dict[str, str]  # AutoEP name -> the model's, for dense parameters and module tensors
    router_aliases: dict[str, str]  # AutoEP's alias of a router tensor -> its name; the model has no alias
    stacks: tuple[ModelStack, ...]  # in layer order; each layer's gate_up then down

    def name(self, autoep_name: str) -> str:
        """The model's name for AutoEP's ``autoep_name`` (the same name when not renamed)."""
        return self.renamed.get(autoep_name, autoep_name)


def transformers_names(
    autoep: AutoEP, local_shapes: dict[str, tuple[int, ...]], module_names: list[str], path: Path
) -> TransformersNames:
    """The mapping for ``autoep``'s preset. ``local_shapes``: the stacked expert weights'
    shapes in the ZeRO files; ``module_names``: every other name (trained parameters and module
    tensors). Anything under an MoE block that the preset does not account for is refused in
    one line: a name the model would not load is not guessed at."""
    preset = PRESETS.get(autoep.preset or "")
    if preset is None:
        raise DeepSpeedFormatError(
            f"{path}: AutoEP preset {quoted(autoep.preset)} has no transformers names here "
            f"(read: {', '.join(sorted(PRESETS))})"
        )
    renamed: dict[str, str] = {}
    aliases: dict[str, str] = {}
    stacks: list[ModelStack] = []
    for layer in autoep.layers:
        block = layer.module_path
        if layer.expert_key_prefix != f"{block}.{preset.experts}":
            raise DeepSpeedFormatError(
                f"{path}: expert_key_prefix {quoted(layer.expert_key_prefix)} is not {block}.{preset.experts}"
            )
        gate, down, up = (local_shapes[layer.param_name(weight)] for weight in ("w1", "w2", "w3"))
        experts = layer.expert_key_prefix
        gate_up = (StackPart(layer.param_name("w1"), gate[1]), StackPart(layer.param_name("w3"), up[1]))
        down_part = (StackPart(layer.param_name("w2"), down[1]),)
        gate_up_stack = ExpertStack("out_in", "stacked", preset.gate_up_parts)
        stacks.append(ModelStack(f"{experts}.{preset.gate_up}", layer.num_experts, gate[2], gate_up, gate_up_stack))
        stacks.append(ModelStack(f"{experts}.{preset.down}", layer.num_experts, down[2], down_part, DOWN_STACK))
    blocks = {layer.module_path for layer in autoep.layers}
    for name in module_names:  # each once: its MoE block is the longest module path it starts with
        block = _block_of(name, blocks)
        if block is None:
            continue
        inner = name[len(block) + 1 :]
        if inner.startswith("router.gate."):  # AutoEP's router: the model's gate
            renamed[name] = f"{block}.{preset.router}.{inner.removeprefix('router.gate.')}"
        elif inner.startswith(f"{preset.router}.gate."):  # AutoEP's alias of its router
            aliases[name] = f"{block}.router.{inner.removeprefix(preset.router + '.')}"
        else:
            raise DeepSpeedFormatError(
                f"{path}: {quoted(name)} has no name in the transformers model (preset {quoted(autoep.preset)})"
            )
    strays = sorted(alias for alias, target in aliases.items() if target not in renamed)
    if strays:
        raise DeepSpeedFormatError(
            f"{path}: {quoted(strays[0])} looks like AutoEP's router alias, "
            f"but {quoted(aliases[strays[0]])} is not saved"
        )
    targets = set(renamed.values()) | {stack.name for stack in stacks}
    clash = sorted(targets & (set(module_names) - set(renamed) - set(aliases)))
    if clash:
        raise DeepSpeedFormatError(f"{path}: {quoted(clash[0])} is both a saved name and the model's name of another")
    return TransformersNames(renamed, aliases, tuple(stacks))


def _block_of(name: str, blocks: set[str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in blocks:
            return prefix
    return None
