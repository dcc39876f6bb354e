"""Shared by the universal and fp32 export tests: saving synthetic runs, a file-less source, comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.checkpoint.source import ModelEntry, SourceInfo
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, pattern, synthesize_state
from zeroshard.layout import Layout
from zeroshard.state import ParamGroupState

BUFFERS = ("positions",)


def save_synthetic(root: Path, layout: Layout, tag: str = "t", block_size: int = 256, states=None) -> Path:
    """A native checkpoint of ``layout`` filled with the testing pattern, saved by thread ranks."""
    prepared = states or [synthesize_state(layout, rank) for rank in range(layout.world_size)]

    def one_rank(coord):
        return save_sharded(
            root, tag, prepared[coord.rank], coordinator=coord, block_size=block_size, buffer_names=BUFFERS
        )

    return run_ranks(layout.world_size, one_rank)[0]


class PatternSource:
    """A ShardSource with no files: every rank's partition computed from the testing pattern."""

    kind = "pattern"

    def __init__(self, layout: Layout) -> None:
        self.path = Path("<pattern>")
        self.info = SourceInfo(
            layout=layout,
            optimizer_class="torch.optim.adamw.AdamW",
            param_groups=[ParamGroupState({"lr": 1e-3, "group": g}, [g]) for g in range(len(layout.groups))],
            state_keys=[list(ADAM_STATES) for _ in layout.groups],
            model_entries=[ModelEntry("positions", (5,), "int64", "buffer")],
            aliases={"tied.alias": layout.groups[0].params[0].name},
            extra={"global_steps": 7},
        )
        self.reads = 0

    def read(self, rank: int, group: int, key: str, start: int, end: int) -> np.ndarray:
        self.reads += 1
        return expected_partition(self.info.layout, rank, group, key)[start:end].numpy().copy()

    def scalars(self, group: int) -> dict[str, np.ndarray]:
        return {"step": np.array(7.0, dtype=np.float32)}

    def model_tensor(self, name: str) -> np.ndarray:
        assert name == "positions"
        return np.arange(5, dtype=np.int64)

    def close(self) -> None:
        pass


def universal_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, read with the safetensors library."""
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def manifest_without_source(directory: Path) -> dict:
    data = json.loads((directory / "universal.json").read_text())
    data.pop("source")
    return data


def check_against_pattern(tensors: dict[str, torch.Tensor], layout: Layout, states=ADAM_STATES) -> None:
    """Universal tensors hold exactly the pattern of every parameter, in its own shape."""
    expected_keys = set()
    for group in layout.groups:
        for slot in group.params:
            for kind in ("fp32", *states):
                key = f"param/{slot.name}/{kind}"
                expected_keys.add(key)
                tensor = tensors[key]
                assert tensor.dtype == torch.float32 and tuple(tensor.shape) == slot.spec.shape, key
                assert torch.equal(tensor.reshape(-1), pattern(slot.name, kind, slot.numel)), key
    params = {key for key in tensors if key.startswith("param/")}
    assert params == expected_keys


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Compare floats bit for bit (also -0.0 and NaN payloads)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)
