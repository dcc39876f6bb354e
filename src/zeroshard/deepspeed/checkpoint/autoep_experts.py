"""AutoEP's per-expert files: ``layer_{L}_expert_{g}_mp_rank_00_model_states.pt``, one per MoE
layer ``L`` and global expert ``g``, each holding that expert's ``{prefix}.w1.{g}`` ``[I, H]``,
``{prefix}.w2.{g}`` ``[H, I]`` and ``{prefix}.w3.{g}`` ``[I, H]`` in the run's dtype
(docs/DEEPSPEED.md "AutoEP checkpoints"). :mod:`.autoep_files` parses the metadata that says
which files there must be.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ...io.budget import named, quoted
from ...io.dtypes import dtype_info
from ...layout import Layout
from ...layout.coordinates import GlobalRun, expert_location, locate_global
from . import fields
from .autoep_files import EXPERT_FILE, EXPERT_WEIGHTS, LAYERS_KEY, AutoEP, AutoEPLayer
from .pickled import DeepSpeedFormatError, load_checkpoint_file
from ...torchfile.torch_file import StoredTensor, TorchFileError

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


# ---- the expert files against the placement -------------------------------------------------------

SAMPLED = 64  # leading elements of each expert's w1 compared with its fp32 master


def check_placement(
    experts: ExpertWeights, autoep: AutoEP, layout: Layout, fp32: Sequence[StoredTensor], model: Path
) -> None:
    """Each expert file's w1 must be the fp32 master that ``model``'s placement gives its expert,
    rounded to the file's dtype (``layout``: the ZeRO files' layout, whose expert group has the
    placement as its expert map; ``fp32[rank]``: rank ``rank``'s fp32 partition of that group).

    The placement is metadata one edit can change (the affine maps that restate it can be left
    out), and a wrong one gives every expert another's masters in every output; the expert files
    are the one record of the experts by global id that does not come from it. The first
    ``SAMPLED`` elements of each are compared, read without checking their records' CRC-32 (that
    reads each record whole: the checkpoint's size, at open), a layer's in one comparison; a
    difference is read again, checked, before it is reported. DeepSpeedFormatError naming the
    expert file."""
    for layer in autoep.layers:
        group, slot = layout.param(layer.param_name("w1"))
        weights = experts.tensors[(layer.moe_layer_id, "w1")]
        runs, samples = [], []
        for expert, saved in enumerate(weights):
            count = min(SAMPLED, saved.numel())
            runs.append(locate_global(group, slot, expert * saved.numel(), count))
            masters = np.concatenate([fp32[run.rank].peek(*_span(run)) for run in runs[-1]])
            samples.append((_leading(saved, count, checked=False), masters))
        if not weights or _rounds_to(*map(np.concatenate, zip(*samples)), weights[0].dtype):
            continue
        for expert, (saved, sample) in enumerate(zip(weights, samples)):
            if _rounds_to(*sample, saved.dtype) or _agrees_when_checked(saved, runs[expert], fp32):
                continue
            ep_rank, local = expert_location(group, expert)
            raise DeepSpeedFormatError(
                f"{saved.path}: {layer.expert_key('w1', expert)} disagrees with the fp32 master where the "
                f"expert_placement of {model.name} puts expert {expert} (EP rank {ep_rank}, local expert {local}, "
                f"in {fp32[runs[expert][0].rank].path.name}): the placement or the expert files were changed"
            )


def _agrees_when_checked(saved: StoredTensor, runs: tuple[GlobalRun, ...], fp32: Sequence[StoredTensor]) -> bool:
    """:func:`check_placement`'s comparison of one expert whose sample differed, its bytes read
    again and checked: damaged bytes are named as such (DeepSpeedFormatError), not as a wrong
    placement."""
    try:
        masters = np.concatenate([fp32[run.rank].read(*_span(run)) for run in runs])
        return _rounds_to(_leading(saved, len(masters), checked=True), masters, saved.dtype)
    except TorchFileError as err:
        raise DeepSpeedFormatError(str(err)) from None


def _leading(tensor: StoredTensor, count: int, *, checked: bool) -> np.ndarray:
    """The first ``count`` elements of ``tensor`` in row-major order (a view that is not
    contiguous is read whole, checked)."""
    if not tensor.is_contiguous():
        return tensor.numpy().reshape(-1)[:count]
    return tensor.read(0, count) if checked else tensor.peek(0, count)


def _span(run: GlobalRun) -> tuple[int, int]:
    return run.partition_start, run.partition_start + run.length


def _rounds_to(saved: np.ndarray, master: np.ndarray, dtype: str) -> bool:
    """Whether ``saved`` (elements of ``dtype``) is ``master`` (fp32) rounded to ``dtype``, to
    nearest or toward zero: within one unit in the last place, NaN for NaN, an infinity for a
    master beyond the dtype's range."""
    info = ml_dtypes.finfo(dtype_info(dtype).numpy)
    found, master = saved.astype(np.float64), master.astype(np.float64)
    with np.errstate(invalid="ignore"):
        close = np.abs(found - master) <= float(info.eps) * np.abs(master) + float(info.smallest_subnormal)
        overflow = np.isinf(found) & (np.abs(master) >= float(info.max)) & (np.sign(found) == np.sign(master))
    return found.shape == master.shape and bool(np.all(close | overflow | (np.isnan(found) & np.isnan(master))))
