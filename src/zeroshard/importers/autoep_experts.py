"""AutoEP's per-expert files: ``layer_{L}_expert_{g}_mp_rank_00_model_states.pt``, one per MoE
layer ``L`` and global expert ``g``, each holding that expert's ``{prefix}.w1.{g}`` ``[I, H]``,
``{prefix}.w2.{g}`` ``[H, I]`` and ``{prefix}.w3.{g}`` ``[I, H]`` in the run's dtype
(docs/DEEPSPEED.md "AutoEP checkpoints"). :mod:`.autoep_files` parses the metadata that says
which files there must be.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.io.budget import named, quoted
from . import deepspeed_fields as fields
from .autoep_files import EXPERT_FILE, EXPERT_WEIGHTS, LAYERS_KEY, AutoEP, AutoEPLayer
from .deepspeed_pickle import DeepSpeedFormatError, load_checkpoint_file
from .torch_file import StoredTensor, TorchFileError

@dataclass(frozen=True)
class ExpertWeights:
    """The low-precision weights of every expert: ``tensors[(layer id, weight)][g]``."""

    tensors: dict[tuple[int, str], list[StoredTensor]]
    paths: list[Path]

    def read(self, layer: AutoEPLayer, weight: str, expert: int) -> np.ndarray:
        """One expert's weight in its own dtype and shape; damaged bytes (a CRC-32 mismatch, a
        file cut short since it was opened) are a DeepSpeedFormatError naming file and record."""
        try:
            return self.tensors[(layer.moe_layer_id, weight)][expert].numpy()
        except TorchFileError as err:
            raise DeepSpeedFormatError(str(err)) from None

    def unreadable(self, autoep: AutoEP) -> list[str]:
        """Read every tensor of every file: one line per one that cannot be read (damaged bytes)."""
        problems = []
        for layer in autoep.layers:
            for expert in range(layer.num_experts):
                for weight in EXPERT_WEIGHTS:
                    try:
                        self.read(layer, weight, expert)
                    except (OSError, ValueError) as err:
                        problems.append(str(err))
        return problems


def expert_file_names(tag_dir: Path) -> list[str]:
    """The names of the AutoEP per-expert files in ``tag_dir``, sorted (empty without AutoEP)."""
    return sorted(name for name in os.listdir(tag_dir) if EXPERT_FILE.match(name))


def read_expert_files(tag_dir: Path, autoep: AutoEP, shapes: dict[str, tuple[int, ...]], dtype: str) -> ExpertWeights:
    """Every per-expert file, each holding exactly its three weights in ``shapes`` (the stacked
    weights' shapes without the expert dimension) and ``dtype``; none missing, none extra."""
    expected = {layer.expert_file(g): (layer, g) for layer in autoep.layers for g in range(layer.num_experts)}
    found = set(expert_file_names(tag_dir))  # made once: it was made again for every name expected
    extra = sorted(found - set(expected))
    if extra:
        raise DeepSpeedFormatError(f"{tag_dir}: {extra[0]} belongs to no AutoEP layer and expert of {LAYERS_KEY}")
    missing = [name for name in expected if name not in found]
    if missing:
        raise DeepSpeedFormatError(f"{tag_dir}: {missing[0]} is missing ({len(missing)} AutoEP expert files in all)")
    tensors: dict[tuple[int, str], list[StoredTensor]] = {
        (layer.moe_layer_id, weight): [] for layer in autoep.layers for weight in EXPERT_WEIGHTS
    }
    paths = []
    for name, (layer, expert) in expected.items():
        path = tag_dir / name
        content, _, budget = load_checkpoint_file(path)
        keys = {layer.expert_key(weight, expert): weight for weight in EXPERT_WEIGHTS}
        if set(content) != set(keys):  # its keys named bounded: they may be long, or not strings (unsortable)
            shown = ", ".join(sorted(map(named, itertools.islice(content, 4)))) + (", ..." if len(content) > 4 else "")
            raise DeepSpeedFormatError(
                f"{path}: holds {len(content):,} keys ({shown}), expected exactly {sorted(keys)}"
            )
        for key, weight in keys.items():
            tensor = fields.tensor(content[key], key, path)
            want = shapes[layer.param_name(weight)]
            if tensor.shape != want or tensor.dtype != dtype:
                raise fields.field_error(
                    path,
                    key,
                    f"is a {tensor.dtype} tensor of shape {quoted(list(tensor.shape))}, expected {dtype} {list(want)}",
                )
            tensors[(layer.moe_layer_id, weight)].append(tensor)
        fields.charge_tensors([content[key] for key in keys], budget, "reading the expert weights")
        paths.append(path)
    return ExpertWeights(tensors, paths)
