"""A DeepSpeed ZeRO-1/2 checkpoint at a large world size, synthesised from a real one at D=1.

Spawning thousands of DeepSpeed ranks is out of reach, so the benchmark trains the model at
D=1 with DeepSpeed itself and then writes what DeepSpeed would have saved at ``world_size``:
the same model-states file (with ``dp_world_size`` changed) and one optimizer file per rank
holding that rank's partition of each group's flat buffer (fp32 master without the group's
tail padding, Adam state with it), the paddings, partition counts and the rank's
``param_slice_mappings``, everything else copied from the D=1 file. The flat layout comes
from zeroshard's ``deepspeed`` layout policy, which the importer tests check against
DeepSpeed's live layout. Needs torch and DeepSpeed (run by the benchmark, not a converter).
"""

from __future__ import annotations

import copy
from pathlib import Path

MODEL_STATES = "mp_rank_00_model_states.pt"


def expand(source_tag: Path, target_tag: Path, world_size: int) -> None:
    """Write ``source_tag``'s D=1 checkpoint as saved at ``world_size`` to ``target_tag``."""
    import torch
    from deepspeed.utils.tensor_fragment import fragment_address

    from zeroshard.deepspeed.checkpoint import open_deepspeed

    with open_deepspeed(source_tag) as source:
        one = source.layout
    layout = one.with_world_size(world_size)
    (rank_file,) = sorted(source_tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    template = torch.load(rank_file, map_location="cpu", weights_only=False)
    state = template["optimizer_state_dict"]
    flats = [_flat_buffers(state, g1, g) for g1, g in zip(one.groups, layout.groups)]

    target_tag.mkdir(parents=True, exist_ok=False)
    model = torch.load(source_tag / MODEL_STATES, map_location="cpu", weights_only=False)
    model["dp_world_size"] = world_size
    torch.save(model, target_tag / MODEL_STATES)
    (target_tag.parent / "latest").write_text(target_tag.name)
    base = state["base_optimizer_state"]
    for rank in range(world_size):
        raw = dict(template)
        saved = dict(state)
        saved["single_partition_of_fp32_groups"] = []
        saved["group_paddings"] = []
        saved["partition_count"] = [world_size] * len(layout.groups)
        saved["param_slice_mappings"] = []
        saved_base = {"param_groups": copy.deepcopy(base["param_groups"]), "state": {}}
        for group, flat in zip(layout.groups, flats):
            size = group.partition_numel
            begin = rank * size
            stored = sum(piece.length for piece in group.logical_ranges(rank))
            saved["single_partition_of_fp32_groups"].append(flat["fp32"][begin : begin + stored].clone())
            saved["group_paddings"].append(size - stored)
            saved["param_slice_mappings"].append(
                {f.name: fragment_address(numel=f.length, start=f.partition_start) for f in group.fragments(rank)}
            )
            entry = dict(base["state"][group.index])
            for key, values in flat.items():
                if key != "fp32":
                    entry[key] = values[begin : begin + size].clone()
            saved_base["state"][group.index] = entry
        saved["base_optimizer_state"] = saved_base
        raw["optimizer_state_dict"] = saved
        torch.save(raw, target_tag / rank_file.name.replace("rank_0_", f"rank_{rank}_"))


def _flat_buffers(state: dict, one, group) -> dict:
    """The group's padded flat buffer at the target world size, for the fp32 master and
    every partition-shaped optimizer state, from the D=1 partition (which is the whole buffer)."""
    import torch

    sources = {"fp32": state["single_partition_of_fp32_groups"][one.index]}
    for key, value in state["base_optimizer_state"]["state"][one.index].items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == one.partition_numel:
            sources[key] = value
    flats = {}
    for key, values in sources.items():
        flat = torch.zeros(group.numel, dtype=values.dtype)
        for slot_one, slot in zip(one.params, group.params):
            flat[slot.offset : slot.end] = values[slot_one.offset : slot_one.end]
        flats[key] = flat
    return flats
