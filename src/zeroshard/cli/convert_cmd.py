"""``zeroshard to-universal`` and ``zeroshard to-fp32``: convert a saved run, streaming.

Any failure is one line on stderr and exit status 2 (see :mod:`.main`), and leaves nothing
under OUT that looks complete.
"""

from __future__ import annotations

import argparse
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Callable

from ..checkpoint.export.fp32 import to_fp32
from ..checkpoint.model_config import CONFIG_FILE
from ..checkpoint.universal.format import DEFAULT_MAX_SHARD_SIZE
from ..checkpoint.universal.write import to_universal
from ..collector import collector_paused
from .errors import describe_error, name_output

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_MAX_SIZE = 2**63 - 1
_MAX_SIZE_TEXT = 64  # echoed whole in an error up to this length
_EXPERT_FORMS = {"own": None, "stacked": "stacked", "per-expert": "per_expert"}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit, "500MB", "2GB" (powers of 10) or "2GiB";
    at least one byte, at most 2**63 - 1 (the most a safetensors file can address)."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    shown = repr(text) if len(text) <= _MAX_SIZE_TEXT else f"{text[:_MAX_SIZE_TEXT]!r}... ({len(text)} characters)"
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {shown} (examples: 500MB, 2GB, 1GiB, 1048576)")
    amount = Decimal(match.group(1)) * _UNITS[unit]  # exact: no float to overflow or round
    if amount > _MAX_SIZE:
        raise argparse.ArgumentTypeError(f"size {shown} is more than 2**63 - 1 bytes")
    size = int(amount)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be at least one byte, got {text!r}")
    return size


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``to-universal`` and ``to-fp32`` subcommands and their arguments to ``commands``."""
    universal = commands.add_parser(
        "to-universal", help="convert a checkpoint (native or DeepSpeed) to a universal, world-size-free checkpoint"
    )
    _common(universal)
    universal.add_argument(
        "--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE, help="bytes of tensors per shard (default 2GiB)"
    )
    universal.set_defaults(run=run_to_universal)

    fp32 = commands.add_parser("to-fp32", help="export the consolidated model state_dict as Hugging Face safetensors")
    _common(fp32)
    fp32.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of trained (and frozen) parameters")
    fp32.add_argument("--max-shard-size", type=parse_size, default=None, help="shard the output, e.g. 5GB (default: one file)")
    fp32.add_argument(
        "--experts",
        choices=sorted(_EXPERT_FORMS),
        default="own",
        help="expert stacks: each in its own form (default), all as one global stack under its own name, or per expert",
    )
    fp32.set_defaults(run=run_to_fp32)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (or a root with 'latest')")
    parser.add_argument("out", type=Path, help="the output directory (created; must not hold anything else)")
    parser.add_argument("--overwrite", action="store_true", help="replace a complete output already at OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")


def run_to_universal(args: argparse.Namespace) -> int:
    """``zeroshard to-universal``: convert ``args.checkpoint`` into ``args.out``, print what it
    wrote; returns 0. Not collective (one process).

    Raises:
        ValueError: the checkpoint cannot be converted (damaged, of an unsupported kind, or
            naming a tensor it lacks; CheckpointDamagedError and DeepSpeedFormatError are
            ValueErrors); one line.
        OSError: OUT cannot be written, or holds something else (named); WriterLockedError
            when another conversion writes it.
    """
    return _run(
        args,
        lambda: to_universal(
            args.checkpoint,
            args.out,
            max_shard_size=args.max_shard_size,
            progress=False if args.no_progress else None,
            overwrite=args.overwrite,
        ),
    )


def run_to_fp32(args: argparse.Namespace) -> int:
    """``zeroshard to-fp32``: export ``args.checkpoint``'s consolidated state_dict into
    ``args.out`` as safetensors, print what it wrote; returns 0. Not collective (one process).
    Raises as :func:`run_to_universal`."""
    return _run(
        args,
        lambda: to_fp32(
            args.checkpoint,
            args.out,
            dtype=_DTYPES[args.dtype],
            max_shard_size=args.max_shard_size,
            progress=False if args.no_progress else None,
            overwrite=args.overwrite,
            experts=_EXPERT_FORMS[args.experts],
        ),
        _config_note,
    )


def _config_note(out: Path) -> str | None:
    """What to add for ``from_pretrained(OUT)`` when the checkpoint recorded no model config."""
    if (out / CONFIG_FILE).exists():
        return None
    return (
        f"note: no {CONFIG_FILE}: the checkpoint records no model config (a DeepSpeed checkpoint, or a model without a "
        f"transformers config); for from_pretrained({out}) save the model's config there (config.save_pretrained)"
    )


def _run(args: argparse.Namespace, convert, note: Callable[[Path], str | None] | None = None) -> int:
    started = time.perf_counter()
    try:
        # A conversion makes no cycles; at large D the collector would walk its records again and again.
        with collector_paused():
            out = convert()
    except OSError as err:
        named = name_output(err, args.out)
        if named is err:
            raise
        raise named from err
    except KeyError as err:  # a tensor or state the checkpoint's own description promised
        raise ValueError(describe_error(err)) from err
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"wrote {out}: {len(files)} files, {size:,} bytes in {time.perf_counter() - started:.1f} s")
    line = note(out) if note is not None else None
    if line:
        print(line)
    return 0

