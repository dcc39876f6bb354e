"""Element sizes of the dtypes a flat buffer may hold, by canonical name.

The layout is pure integer arithmetic and never imports torch; dtypes are named by strings
("bfloat16", "float16", "float32"). ``torch.bfloat16`` and short names like "bf16" are
accepted and canonicalised.
"""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name of ``dtype`` (a string or a torch.dtype).

    Raises ValueError for a dtype a flat buffer cannot hold.
    """
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")
    return name


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (any name :func:`canonical_dtype` takes; ValueError otherwise)."""
    return ITEMSIZE[canonical_dtype(dtype)]
