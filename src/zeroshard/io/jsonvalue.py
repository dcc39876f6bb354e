"""Exact JSON encoding of the small Python values a manifest carries (no pickle).

Hyperparameters, step counters, loss-scaler and lr-scheduler state are mostly JSON already;
the rest are tuples, dicts with non-string keys, non-finite floats and small tensors. Each of
those gets a tagged object, so ``decode(encode(x))`` gives ``x`` back with its types, and
tensors bit for bit (torch tensors and numpy arrays are stored alike and come back as numpy
arrays: see :mod:`.dtypes`). Anything else (functions, arbitrary objects) is refused with the path
to the value, because storing it would need pickle.
"""

from __future__ import annotations

import base64
import json
import math
import re
import sys
from typing import Any

import numpy as np

from .budget import quoted
from .dtypes import as_array, dtype_of, dtype_of_code
from .hashes import MAX_ALIKE, crowded

_TAG = "__zeroshard__"
_MAX_TENSOR_BYTES = 1 << 20  # bigger tensors belong in a safetensors file, not in JSON
MAX_DEPTH = 100  # nesting a file may have: ours stay under 20; deeper would exhaust the stack
MAX_VALUE_DEPTH = MAX_DEPTH - 10  # a stored value's own nesting, so the file holding it stays readable


def loads(text: str | bytes, where: object) -> Any:
    """``json.loads(text)``, refusing nesting deeper than :data:`MAX_DEPTH` (json.loads
    itself, :func:`decode` and the manifest parsers recurse) and an object holding a key
    twice (``json.loads`` keeps the last silently: an index or header would hide a tensor)
    with a ValueError naming ``where``. JSONDecodeError and UnicodeDecodeError pass through."""
    if _text_depth(text) > MAX_DEPTH:
        raise ValueError(f"{where}: corrupted: JSON nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(text, object_pairs_hook=_object_of_unique_keys)
    except RecursionError:
        raise ValueError(f"{where}: corrupted: JSON nested too deeply to parse (the limit is {MAX_DEPTH})") from None
    except _RepeatedKey as err:
        raise ValueError(f"{where}: corrupted: key {quoted(err.key)} appears twice in one JSON object") from None
    except (json.JSONDecodeError, UnicodeDecodeError):  # ValueErrors too: the callers say what they mean
        raise
    except ValueError:  # the only other one: an integer longer than Python converts from text
        digits = sys.get_int_max_str_digits()
        raise ValueError(f"{where}: corrupted: it holds an integer of more than {digits:,} digits") from None


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_of_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made = dict(pairs)
    if len(made) != len(pairs):
        seen: set[str] = set()
        raise _RepeatedKey(next(key for key, _ in pairs if key in seen or seen.add(key)))  # type: ignore[func-returns-value]
    return made


def read_int(value: Any, what: str, name: Any = None, minimum: int = 0) -> int:
    """``value`` if it is a JSON integer (not a bool, a float or a string of digits) of at
    least ``minimum``; else ValueError saying what ``what`` (a template of ``name``, formatted
    only then: a manifest holds thousands) is."""
    if type(value) is not int or value < minimum:
        expected = "an integer" if type(value) is not int else f"at least {minimum}"
        raise ValueError(f"{what.format(quoted(name))} is {quoted(value)}, expected {expected}")
    return value


def read_shape(value: Any, what: str, name: Any = None) -> tuple[int, ...]:
    """A JSON list of integers of at least 0 (a tensor shape, a pair of offsets; ``what`` as
    for :func:`read_int`)."""
    if type(value) is not list:
        raise ValueError(f"{what.format(quoted(name))} is {quoted(value)}, expected a list of integers")
    for dim in value:
        read_int(dim, what + " has a dimension that", name)
    return tuple(value)


_CLASS_NAMES = re.compile(r"[A-Za-z_][\w.]*(\+[A-Za-z_][\w.]*)*")
CLASS_NAME_LIMIT = 1000  # characters: a few qualified class names


def read_class_name(value: Any, what: str) -> str:
    """A recorded optimizer class: ``module.QualName``, or several joined by ``+``, at most
    ``CLASS_NAME_LIMIT`` characters (what a message may repeat on one line); else ValueError
    saying what ``what`` is."""
    if type(value) is not str or len(value) > CLASS_NAME_LIMIT or not _CLASS_NAMES.fullmatch(value):
        shown = quoted(value[:80] + "..." if type(value) is str and len(value) > 80 else value)
        raise ValueError(f"{what} is {shown}, expected a class name (module.QualName)")
    return value


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def _text_depth(text: str | bytes) -> int:
    """The deepest nesting of brackets in JSON ``text``, outside strings: the nesting of the
    value it parses to. Regular expressions and numpy, so a large manifest costs
    milliseconds, not a walk over every value in Python."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = np.frombuffer(_NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", data)), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1)).max())


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` deep (without recursing)."""
    pending = [(value, 1)] if isinstance(value, (list, dict)) else []
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item
        nested = [child for child in children if isinstance(child, (list, dict))]
        if nested and depth >= limit:
            return True
        pending.extend((child, depth + 1) for child in nested)
    return False


def encode(value: Any, path: str = "value") -> Any:
    """A JSON-able form of ``value``; ValueError names the first value that cannot be stored,
    or ``path`` when the value nests so deeply that its file could not be read back."""
    encoded = _encode(value, path)
    if deeper_than(encoded, MAX_VALUE_DEPTH):
        raise ValueError(f"{path}: nested more than {MAX_VALUE_DEPTH} levels deep (a tuple or tagged value counts two)")
    return encoded


def _encode(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "repr": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return items if isinstance(value, list) else {_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and _TAG not in value:
            return {key: _encode(item, f"{path}[{key!r}]") for key, item in value.items()}
        return {
            _TAG: "dict",
            "items": [[_encode(k, f"{path} key"), _encode(v, f"{path}[{k!r}]")] for k, v in value.items()],
        }
    if isinstance(value, np.ndarray) or _is_torch_tensor(value):
        return _encode_tensor(as_array(value), path)
    raise ValueError(f"{path}: cannot store a {type(value).__name__} in a checkpoint manifest (no pickle)")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {key: decode(item) for key, item in value.items()}
    if kind == "float":
        return float(value["repr"])
    if kind == "tuple":
        return tuple(decode(item) for item in value["items"])
    if kind == "dict":
        items = [(_hashable(decode(k)), decode(v)) for k, v in value["items"]]
        if crowded(key for key, _ in items):
            raise ValueError(f"a dict in the manifest holds more than {MAX_ALIKE} distinct keys of one hash")
        return dict(items)
    if kind == "tensor":
        return _decode_tensor(value)
    raise ValueError(f"unknown tagged value {quoted(kind)} in the manifest")


def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def _encode_tensor(array: np.ndarray, path: str) -> dict[str, Any]:
    if array.nbytes > _MAX_TENSOR_BYTES:
        raise ValueError(f"{path}: tensor of {array.nbytes} bytes is too large for the manifest")
    try:
        code = dtype_of(array).code
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return {
        _TAG: "tensor",
        "dtype": code,
        "shape": list(array.shape),
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
    }


def _decode_tensor(value: dict[str, Any]) -> np.ndarray:
    raw = bytearray(base64.b64decode(value["data"]))
    return np.frombuffer(raw, dtype=dtype_of_code(value["dtype"]).numpy).reshape(value["shape"])


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
