"""Small checkers for the fields of a decoded DeepSpeed file.

A file is hostile until checked: its pickle can put any allowed value in any field (``None``
for ``zero_stage``, a list for ``module``, a dict that contains itself). Each checker takes
the value, the field's name and the file, and returns the value in the type the importer
uses or raises a one-line :class:`DeepSpeedFormatError` naming the file and the field, so no
later step meets a type it does not expect (and fails with a TypeError or RecursionError).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .deepspeed_pickle import DeepSpeedFormatError
from .torch_records import STORAGE_CLASSES, StoredTensor

# Bounds for free-form values (lr scheduler state, hyperparameters, config): deeper or
# bigger is not what DeepSpeed writes, and a self-containing dict is infinitely deep.
MAX_DEPTH = 32
MAX_ITEMS = 100_000
_SCALARS = (bool, int, float, str)  # and None


def field_error(path: Path, field: str, problem: str) -> DeepSpeedFormatError:
    return DeepSpeedFormatError(f"{path}: {field} {problem}")


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def integer(value: Any, field: str, path: Path, *, minimum: int | None = 0) -> int:
    """An int (an int enum member included, a bool not) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise field_error(path, field, f"is {_kind(value)}, expected an integer")
    if minimum is not None and value < minimum:
        raise field_error(path, field, f"is {value}, expected at least {minimum}")
    return int(value)


def text(value: Any, field: str, path: Path) -> str:
    if not isinstance(value, str):
        raise field_error(path, field, f"is {_kind(value)}, expected a string")
    return value


def optional_text(value: Any, field: str, path: Path) -> str | None:
    return None if value is None else text(value, field, path)


def sequence(value: Any, field: str, path: Path) -> list[Any]:
    """A list or tuple, as a list."""
    if not isinstance(value, (list, tuple)):
        raise field_error(path, field, f"is {_kind(value)}, expected a list")
    return list(value)


def is_mapping(value: Any) -> bool:
    """Whether ``value`` is a plain dict that :func:`mapping` takes as it is."""
    return type(value) is dict and set(map(type, value)) <= _STRINGS


_STRINGS = frozenset((str,))


def mapping(value: Any, field: str, path: Path) -> dict[str, Any]:
    """A dict whose keys are strings."""
    if not isinstance(value, dict):
        raise field_error(path, field, f"is {_kind(value)}, expected a dict")
    if not set(map(type, value)) <= _STRINGS:
        bad = next((key for key in value if not isinstance(key, str)), None)
        if bad is not None:
            raise field_error(path, field, f"has a key of type {type(bad).__name__}, expected strings")
    return dict(value)


def optional_dict(value: Any, field: str, path: Path) -> dict[Any, Any]:
    """A dict with keys of any type; None gives an empty one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise field_error(path, field, f"is {_kind(value)}, expected a dict")
    return dict(value)


def optional_mapping(value: Any, field: str, path: Path) -> dict[str, Any]:
    """A dict with string keys; None (DeepSpeed's "not saved") gives an empty one."""
    return {} if value is None else mapping(value, field, path)


def integers(value: Any, field: str, path: Path) -> list[int]:
    """Non-negative integers. Plain ints are checked in bulk (a rank file at large D holds
    thousands of paddings); anything else one by one, for the error naming the item."""
    items = sequence(value, field, path)
    if set(map(type, items)) <= {int} and min(items, default=0) >= 0:
        return items
    return [integer(item, f"{field}[{index}]", path) for index, item in enumerate(items)]


def texts(value: Any, field: str, path: Path) -> list[str]:
    return [text(item, f"{field}[{index}]", path) for index, item in enumerate(sequence(value, field, path))]


def shape(value: Any, field: str, path: Path) -> tuple[int, ...]:
    """A tensor shape (``torch.Size`` is read as a tuple)."""
    return tuple(integers(value, field, path))


def tensor(value: Any, field: str, path: Path) -> StoredTensor:
    if not isinstance(value, StoredTensor):
        raise field_error(path, field, f"is {_kind(value)}, expected a tensor")
    return value


def is_vector(value: Any) -> bool:
    """Whether :func:`vector` takes ``value`` (without the label its error would need)."""
    return (
        type(value) is StoredTensor
        and len(value.shape) == 1
        and (value.stride[0] == 1 or value.shape[0] <= 1)  # contiguous
        and value.dtype in _FLOATING
    )


_FLOATING = frozenset(name for name in STORAGE_CLASSES if name.startswith(("float", "bfloat")))


def vector(value: Any, field: str, path: Path) -> StoredTensor:
    """A contiguous 1-D floating-point tensor: a flat partition."""
    if is_vector(value):
        return value
    found = tensor(value, field, path)
    if len(found.shape) != 1 or not found.is_contiguous():
        raise field_error(path, field, f"is a tensor of shape {found.shape}, expected a contiguous 1-D tensor")
    if not found.dtype.startswith(("float", "bfloat")):
        raise field_error(path, field, f"is a {found.dtype} tensor, expected floating point")
    return found


def plain(value: Any, field: str, path: Path) -> Any:
    """Plain data as JSON holds it (None, bool, int, float, str, lists, tuples and dicts with
    string keys), bounded in depth and size; returned as it is. For the free-form values
    that end up in a manifest: the lr scheduler state, hyperparameters, the config."""
    budget = [MAX_ITEMS]

    def count(values: int) -> None:
        budget[0] -= values
        if budget[0] < 0:
            raise field_error(path, field, f"holds more than {MAX_ITEMS} values")

    def walk(item: Any, where: str, depth: int) -> None:
        """Check a counted container at ``depth``; its scalar children need no call of their own."""
        if isinstance(item, (list, tuple)):
            children: Any = item
            labels: Iterator[str] = (f"{where}[{index}]" for index in range(len(item)))
        elif isinstance(item, dict):
            bad = next((key for key in item if not isinstance(key, str)), None)
            if bad is not None:
                raise field_error(path, field, f"has a key of type {type(bad).__name__} at {where}")
            children = item.values()
            labels = (f"{where}[{key!r}]" for key in item)
        else:
            raise field_error(path, field, f"holds {_kind(item)} at {where}, expected plain values")
        count(len(children))
        if children and depth >= MAX_DEPTH:
            problem = f"is nested more than {MAX_DEPTH} deep (at {next(labels)}; does it contain itself?)"
            raise field_error(path, field, problem)
        for child, label in zip(children, labels):
            if child is not None and not isinstance(child, _SCALARS):
                walk(child, label, depth + 1)

    count(1)
    if value is not None and not isinstance(value, _SCALARS):
        walk(value, field, 0)
    return value
