"""The torch.distributed coordinator: two gloo processes save together, then reshard on load."""

from __future__ import annotations

from pathlib import Path

import torch

from zeroshard.checkpoint import TorchDistributedCoordinator, default_coordinator, load_sharded, save_sharded
from zeroshard.checkpoint.testing import expected_partition, synthesize_state
from zeroshard.launch import spawn
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SPECS = [[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")], [ParamSpec.of("c", (9,), "bf16")]]


def save_then_load(rank: int, world_size: int, root: str) -> dict:
    coordinator = default_coordinator()
    assert isinstance(coordinator, TorchDistributedCoordinator) and coordinator.rank == rank
    layout = build_layout(SPECS, world_size)
    directory = save_sharded(root, "step7", synthesize_state(layout, rank), block_size=128)
    gathered = coordinator.all_gather_object(str(directory))
    # Every rank loads its share of a 3-way compact layout from the 2-way checkpoint.
    new = build_layout(SPECS, 3, LayoutPolicy.native(compact=True))
    state = load_sharded(root, new, rank)
    matches = all(
        torch.equal(state.fp32_partitions[g], expected_partition(new, rank, g, "fp32"))
        and torch.equal(state.optimizer_states[g]["exp_avg"], expected_partition(new, rank, g, "exp_avg"))
        for g in range(len(new.groups))
    )
    return {"directories": gathered, "matches": matches, "step": state.optimizer_scalars[0]["step"].item()}


def test_two_gloo_ranks_save_together(tmp_path: Path):
    results = spawn(save_then_load, 2, (str(tmp_path),), backend="gloo", timeout_s=120)
    assert [r["matches"] for r in results] == [True, True]
    assert results[0]["directories"] == [str(tmp_path / "step7")] * 2
    assert (tmp_path / "latest").read_text().strip() == "step7"
    assert sorted(p.name for p in (tmp_path / "step7").iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
