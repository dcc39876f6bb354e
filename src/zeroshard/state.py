"""ShardedState: what one rank hands to the checkpoint layer, and gets back from it.

The engine exports its state as this plain value and imports it back; the checkpoint layer
never reaches into the engine. Tensors are on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .layout import Layout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
EXPORTED_CONFIGS = (CONFIG_FILE, GENERATION_CONFIG_FILE)  # what from_pretrained reads, in this order
_ATTRIBUTES = {CONFIG_FILE: "config", GENERATION_CONFIG_FILE: "generation_config"}


@dataclass
class ParamGroupState:
    """One optimizer param group: its hyperparameters and the layout groups it owns."""

    hyperparameters: dict[str, Any]  # lr, betas, weight_decay, ... (JSON-able)
    layout_groups: list[int]  # indices into Layout.groups (one per dtype in the group)


@dataclass
class ResumeState:
    """What one rank needs, besides its shard, to resume exactly (format version 4): its
    random state (copies, as :func:`zeroshard.checkpoint.rng.capture_rng` takes it) and the
    training script's own states (a data loader's position, ...), already encoded as JSON-able
    values (:func:`zeroshard.checkpoint.io.jsonvalue.encode`: a copy taken at the save)."""

    rng: dict[str, Any] | None  # the rank's random state; None: not saved (rng=False)
    states: dict[str, Any] = field(default_factory=dict)  # per rank: name -> its state_dict
    global_states: dict[str, Any] = field(default_factory=dict)  # the same on every rank: name -> state_dict

    def scopes(self) -> dict[str, str]:
        """Every state's name and scope: "rank" or "global"."""
        return {**{name: "rank" for name in self.states}, **{name: "global" for name in self.global_states}}


@dataclass
class ShardedState:
    """One rank's share of a ZeRO run, in layout terms.

    ``fp32_partitions[g]`` and every tensor in ``optimizer_states[g]`` have shape
    ``[layout.groups[g].partition_numel]`` (this rank's partition, padding included, zeros
    in the padding); for an expert group, the partition of the rank's place in its
    expert-data-parallel group of the experts of its EP rank (``zeroshard.layout.coordinates``),
    so every rank's share is its own. ``optimizer_scalars[g]`` holds state that is not partition-shaped
    (such as ``step``), the same on every rank, carried as is when resharding.
    """

    layout: Layout
    rank: int
    fp32_partitions: list[torch.Tensor]
    optimizer_states: list[dict[str, torch.Tensor]]
    optimizer_scalars: list[dict[str, torch.Tensor]]
    param_groups: list[ParamGroupState]
    optimizer_class: str  # e.g. "torch.optim.adamw.AdamW"
    model_state: dict[str, torch.Tensor]  # the module's full state_dict (frozen params, buffers)
    extra: dict[str, Any] = field(default_factory=dict)  # step counters, loss scaler, lr scheduler
    resume: ResumeState | None = None  # random state and user states (a Checkpointer's saves)
    # the module's config files as JSON text ("config.json", "generation_config.json"), for a
    # model with a transformers-style config (zeroshard.checkpoint.model_config); rank 0's are saved
    model_configs: dict[str, str] = field(default_factory=dict)


def model_config_files(model: Any) -> dict[str, str]:
    """``config.json`` and ``generation_config.json`` of ``model`` as JSON text (file name ->
    text): its ``config`` and ``generation_config`` where each is transformers-style (has
    ``to_json_string()``, else ``to_dict()``, else ``to_json_file(path)``; transformers is
    never imported), ``architectures`` filled in as ``save_pretrained`` does. Empty for a
    model without one. A config that does not give a JSON object is left out with a
    warning: checkpoints are still saved, without it."""
    files: dict[str, str] = {}
    for name, attribute in _ATTRIBUTES.items():
        config = getattr(model, attribute, None)
        if config is None or (name != CONFIG_FILE and CONFIG_FILE not in files):
            continue
        try:
            value = _config_object(config)
        except Exception as err:  # noqa: BLE001 - a user's config object: anything may fail
            owner, kind = type(model).__name__, type(err).__name__
            log.warning("%s.%s is not recorded in checkpoints: %s: %s", owner, attribute, kind, err)
            continue
        if value is None:
            continue
        if name == CONFIG_FILE and not value.get("architectures"):
            value["architectures"] = [type(model).__name__]  # as save_pretrained writes it
        files[name] = json.dumps(value, indent=2, sort_keys=True) + "\n"
    return files


def _config_object(config: Any) -> dict[str, Any] | None:
    """The JSON object of a transformers-style config, or None for an object that is none."""
    if callable(getattr(config, "to_json_string", None)):
        text = config.to_json_string()
    elif callable(getattr(config, "to_dict", None)):
        text = json.dumps(config.to_dict())
    elif callable(getattr(config, "to_json_file", None)):
        with tempfile.TemporaryDirectory() as scratch:
            config.to_json_file(os.path.join(scratch, CONFIG_FILE))
            text = Path(scratch, CONFIG_FILE).read_text(encoding="utf-8")
    else:
        return None
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"it gives a JSON {type(value).__name__}, not an object")
    return value
