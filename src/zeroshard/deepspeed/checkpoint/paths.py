"""Where a DeepSpeed ZeRO-1/2 checkpoint's files are, from file names alone: the tag folder
(or the one ``latest`` names), the model-states file, the rank files in rank order, and the
checkpoints refused by their file names (ZeRO-3, pipeline and tensor parallel, DeepSpeed MoE
other than AutoEP, DeepSpeed's own universal format). :mod:`.files` reads them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...checkpoint.formats import UnsupportedCheckpointError
from ...io.budget import quoted
from .pickled import DeepSpeedFormatError

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
LATEST_FILE = "latest"
UNIVERSAL_LATEST_FILE = "latest_universal"  # ds_to_universal writes it beside its output folder
_UNIVERSAL_DIR = "zero"  # in ds_to_universal's output: zero/<parameter>/fp32.pt, exp_avg.pt, ...
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_UNSUPPORTED_FILES = (
    (re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$"), "ZeRO stage 3 checkpoints are not supported"),
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline-parallel checkpoints are not supported"),
    (
        re.compile(r"^mp_rank_(0[1-9]|[1-9]\d*)_model_states\.pt$"),
        "tensor/model-parallel checkpoints are not supported",
    ),
    (
        # AutoEP's per-expert files are read (with ds_autoep_layers); DeepSpeed MoE's other files are not.
        re.compile(
            r"^(bf16_)?expp?_rank_\d+_mp_rank_\d+_optim_states\.pt$"
            r"|^(?!layer_\d+_expert_\d+_mp_rank_00_model_states\.pt$).*expert_\d+.*\.pt$"
        ),
        "MoE checkpoints are not supported (only AutoEP's)",
    ),
)
_LATEST_BYTES = 4096  # a longer latest file names no folder (names are at most 255 bytes)
_ANY_UNSUPPORTED = re.compile("|".join(f"(?:{pattern.pattern})" for pattern, _ in _UNSUPPORTED_FILES))


def find_tag_dir(path: str | Path) -> Path:
    """The tag folder of a DeepSpeed checkpoint: ``path`` itself, or the folder its
    ``latest`` file names. Raises FileNotFoundError or DeepSpeedFormatError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise DeepSpeedFormatError(f"{path}: not a directory")
    if (path / MODEL_STATES_FILE).is_file() or _rank_files(path):
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        with latest.open("rb") as file:
            text = file.read(_LATEST_BYTES + 1)
        try:
            tag = text.decode().strip()
        except UnicodeDecodeError:
            raise DeepSpeedFormatError(f"{latest}: is not text (it should name the tag folder)") from None
        if len(text) > _LATEST_BYTES or not tag or "/" in tag or tag in (".", "..") or "\0" in tag:
            raise DeepSpeedFormatError(f"{latest}: does not name a tag folder ({quoted(tag)})")
        if not (path / tag).is_dir():
            raise DeepSpeedFormatError(f"{latest}: names tag {quoted(tag)}, but {path / tag} does not exist")
        return path / tag
    raise DeepSpeedFormatError(f"{path}: not a DeepSpeed checkpoint (no {MODEL_STATES_FILE} and no {LATEST_FILE} file)")


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint (tag folder or its parent).
    Only file names are looked at; :func:`open_deepspeed` checks the content."""
    try:
        tag_dir = find_tag_dir(path)
    except (OSError, ValueError):
        return False
    return (tag_dir / MODEL_STATES_FILE).is_file() or any(
        p.name.endswith("_model_states.pt") for p in tag_dir.iterdir()
    )


def recognise_deepspeed(path: str | Path) -> bool:
    """What the DeepSpeed format claims, from file names alone: a ZeRO checkpoint, a tag folder
    holding optimizer files only (opening it names the missing model-states file), and
    DeepSpeed's own universal format (opening it refuses it by name)."""
    if is_deepspeed_universal(path) or is_deepspeed_checkpoint(path):
        return True
    try:
        return any(_RANK_FILE.match(p.name) for p in find_tag_dir(path).iterdir())
    except (OSError, ValueError):
        return False


def is_deepspeed_universal(path: str | Path) -> bool:
    """Whether ``path`` is a ``ds_to_universal`` output folder (``zero/<parameter>/fp32.pt``,
    ...), or the root whose ``latest_universal`` names one and that has no ``latest``. It also
    holds a model-states file, so it would otherwise be misread as a DeepSpeed ZeRO checkpoint
    with its optimizer files missing."""
    path = Path(path)
    zero = path / _UNIVERSAL_DIR
    try:
        if zero.is_dir():
            return (zero / "optimizer_state.pt").is_file() or any((p / "fp32.pt").is_file() for p in zero.iterdir())
        return (path / UNIVERSAL_LATEST_FILE).is_file() and not (path / LATEST_FILE).exists()
    except OSError:
        return False


def refuse_deepspeed_universal(path: str | Path) -> None:
    """UnsupportedCheckpointError in one line when ``path`` is DeepSpeed's universal format."""
    if is_deepspeed_universal(path):
        raise UnsupportedCheckpointError(
            f"{path}: a DeepSpeed universal checkpoint (ds_to_universal output), which zeroshard does not read; "
            "use the DeepSpeed ZeRO checkpoint it was made from (the folder with *zero_pp_rank_*_optim_states.pt)"
        )


def refuse_unsupported(tag_dir: Path) -> None:
    """DeepSpeedFormatError naming the kind and a file when ``tag_dir`` holds files of a
    checkpoint this importer does not read (ZeRO-3, pipeline or tensor parallel, DeepSpeed
    MoE other than AutoEP)."""
    names = os.listdir(tag_dir)
    if not any(map(_ANY_UNSUPPORTED.match, names)):  # one pass over thousands of names, not four
        return
    for pattern, message in _UNSUPPORTED_FILES:
        found = next((n for n in names if pattern.match(n)), None)
        if found:
            raise DeepSpeedFormatError(f"{tag_dir}: {message} (found {found})")


def model_states_path(tag_dir: Path) -> Path:
    """``tag_dir``'s model-states file; DeepSpeedFormatError when it is missing."""
    path = tag_dir / MODEL_STATES_FILE
    if not path.is_file():
        raise DeepSpeedFormatError(f"{tag_dir}: {MODEL_STATES_FILE} is missing")
    return path


def _rank_files(tag_dir: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = _RANK_FILE.match(path.name)
        if match:
            rank = int(match.group(2))
            if rank in found:
                raise DeepSpeedFormatError(
                    f"{tag_dir}: two optimizer files for rank {rank}: {found[rank].name}, {path.name}"
                )
            found[rank] = path
    return found


def rank_file_paths(tag_dir: Path) -> list[Path]:
    """Rank files in rank order; a gap is a missing file, named."""
    found = _rank_files(tag_dir)
    if not found:
        raise DeepSpeedFormatError(f"{tag_dir}: no *zero_pp_rank_*_mp_rank_00_optim_states.pt files")
    prefix = "bf16_" if found[min(found)].name.startswith("bf16_") else ""
    for rank in range(max(found) + 1):
        if rank not in found:
            raise DeepSpeedFormatError(f"{tag_dir}: {prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt is missing")
    return [found[rank] for rank in range(len(found))]
