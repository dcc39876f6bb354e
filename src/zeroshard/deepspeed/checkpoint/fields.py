"""Small checkers for the fields of a decoded DeepSpeed file.

A file is hostile until checked: its pickle can put any allowed value in any field (``None``
for ``zero_stage``, a list for ``module``, a dict that contains itself). Each checker takes
the value, the field's name and the file, and returns the value in the type the importer
uses or raises a one-line :class:`DeepSpeedFormatError` naming the file and the field, so no
later step meets a type it does not expect (and fails with a TypeError or RecursionError).
Values the importer copies into its outputs (:func:`plain`), tensors it keeps
(:func:`charge_tensors`) and the lists and dicts it copies from a field a file may share
(``budget`` of :func:`sequence`, :func:`mapping`, :func:`integers`, :func:`shape`) are charged
to the file's budget, each before it is walked or copied: the checks bound one value, the
budget the total a file makes of values it shares (a pickle's memo).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...io.budget import DICT_ITEM_BYTES, REFERENCE_BYTES, Budget, named, quoted
from .pickled import DeepSpeedFormatError
from ...torchfile.torch_records import STORAGE_CLASSES, StoredTensor
from ...torchfile.torch_unpickler import ITEMSIZES

# Bounds for free-form values (lr scheduler state, hyperparameters, config): deeper or
# bigger is not what DeepSpeed writes, and a self-containing dict is infinitely deep.
MAX_DEPTH = 32
MAX_ITEMS = 100_000
_SCALARS = (bool, int, float, str)  # and None
_SCALAR_BYTES = 24  # what a float, a bool or null costs in a JSON manifest, at most


def field_error(path: Path, field: str, problem: str) -> DeepSpeedFormatError:
    """The one-line error ``<path>: <field> <problem>``, for the caller to raise."""
    return DeepSpeedFormatError(f"{path}: {field} {problem}")


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def integer(value: Any, field: str, path: Path, *, minimum: int | None = 0) -> int:
    """An int (an int enum member included, a bool not) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise field_error(path, field, f"is {_kind(value)}, expected an integer")
    if minimum is not None and value < minimum:
        raise field_error(path, field, f"is {quoted(int(value))}, expected at least {minimum}")
    return int(value)


def text(value: Any, field: str, path: Path) -> str:
    """A string."""
    if not isinstance(value, str):
        raise field_error(path, field, f"is {_kind(value)}, expected a string")
    return value


def optional_text(value: Any, field: str, path: Path) -> str | None:
    """A string, or None."""
    return None if value is None else text(value, field, path)


def sequence(value: Any, field: str, path: Path, budget: Budget | None = None) -> list[Any]:
    """A list or tuple, as a list; its copy charged to ``budget`` first, where one is given
    (a field the pickle may share: each reference is copied again)."""
    if not isinstance(value, (list, tuple)):
        raise field_error(path, field, f"is {_kind(value)}, expected a list")
    if budget is not None:
        budget.charge(REFERENCE_BYTES * len(value), "copying {}", field)
    return list(value)


def is_mapping(value: Any) -> bool:
    """Whether ``value`` is a plain dict that :func:`mapping` takes as it is."""
    return type(value) is dict and set(map(type, value)) <= _STRINGS


_STRINGS = frozenset((str,))


def mapping(value: Any, field: str, path: Path, budget: Budget | None = None) -> dict[str, Any]:
    """A dict whose keys are strings; its copy charged to ``budget`` first, where one is given."""
    if not isinstance(value, dict):
        raise field_error(path, field, f"is {_kind(value)}, expected a dict")
    if budget is not None:
        budget.charge(DICT_ITEM_BYTES * len(value), "copying {}", field)
    if not set(map(type, value)) <= _STRINGS:
        bad = next((key for key in value if not isinstance(key, str)), None)
        if bad is not None:
            raise field_error(path, field, f"has a key of type {type(bad).__name__}, expected strings")
    return dict(value)


def optional_dict(value: Any, field: str, path: Path, budget: Budget | None = None) -> dict[Any, Any]:
    """A dict with keys of any type; None gives an empty one. Its copy is charged to
    ``budget`` first, where one is given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise field_error(path, field, f"is {_kind(value)}, expected a dict")
    if budget is not None:
        budget.charge(DICT_ITEM_BYTES * len(value), "copying {}", field)
    return dict(value)


def optional_mapping(value: Any, field: str, path: Path, budget: Budget | None = None) -> dict[str, Any]:
    """A dict with string keys; None (DeepSpeed's "not saved") gives an empty one."""
    return {} if value is None else mapping(value, field, path, budget)


def integers(value: Any, field: str, path: Path, budget: Budget | None = None) -> list[int]:
    """Non-negative integers (their copy charged to ``budget`` first, where one is given).
    Plain ints are checked in bulk (a rank file at large D holds thousands of paddings);
    anything else one by one, for the error naming the item."""
    items = sequence(value, field, path, budget)
    if set(map(type, items)) <= {int} and min(items, default=0) >= 0:
        return items
    return [integer(item, f"{field}[{index}]", path) for index, item in enumerate(items)]


def texts(value: Any, field: str, path: Path) -> list[str]:
    """A list or tuple of strings, as a list."""
    return [text(item, f"{field}[{index}]", path) for index, item in enumerate(sequence(value, field, path))]


def shape(value: Any, field: str, path: Path, budget: Budget | None = None) -> tuple[int, ...]:
    """A tensor shape (``torch.Size`` is read as a tuple); the list and the tuple it is copied
    into charged to ``budget`` first, where one is given."""
    if budget is not None and isinstance(value, (list, tuple)):
        budget.charge(REFERENCE_BYTES * len(value), "copying {}", field)
    return tuple(integers(value, field, path, budget))


def tensor(value: Any, field: str, path: Path) -> StoredTensor:
    """A tensor of the file (any shape and dtype)."""
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


def plain(value: Any, field: str, path: Path, budget: Budget) -> Any:
    """Plain data as JSON holds it (None, bool, int, float, str, lists, tuples and dicts with
    string keys), bounded in depth and size; returned as it is (the opcode scan bounds an
    integer's width: each is short enough for JSON's decimal text). For the
    free-form values that end up in a manifest: the lr scheduler state, hyperparameters, the
    config. What copying it into a manifest costs (its JSON size, every reference to a shared
    value again) is charged to ``budget``."""
    items = [MAX_ITEMS]
    field_name = named(field)

    def count(values: int) -> None:
        items[0] -= values
        if items[0] < 0:
            raise field_error(path, field, f"holds more than {MAX_ITEMS} values")

    def problem(keys: tuple[Any, ...], words: str) -> DeepSpeedFormatError:
        where = field + "".join(f"[{quoted(key)}]" for key in keys)
        return field_error(path, field, words.format(where=where))

    def scalar_bytes(item: Any) -> int:
        if type(item) is str:
            return len(item) + 2
        if type(item) is int:  # its decimal digits: 0.302 per bit (the scan bounds it at 8,192 bits)
            return item.bit_length() * 77 // 256 + 2
        return _SCALAR_BYTES

    def walk(item: Any, keys: tuple[Any, ...], depth: int) -> None:
        """Check and charge a container at ``depth``; its scalar children need no call of their own."""
        if isinstance(item, (list, tuple)):
            children: Iterable[tuple[Any, Any]] = enumerate(item)
            size = REFERENCE_BYTES * len(item)
        elif isinstance(item, dict):
            bad = next((key for key in item if not isinstance(key, str)), None)
            if bad is not None:
                raise problem(keys, f"has a key of type {type(bad).__name__} at {{where}}")
            children = item.items()
            size = sum(map(len, item)) + REFERENCE_BYTES * len(item)
        else:
            raise problem(keys, f"holds {_kind(item)} at {{where}}, expected plain values")
        count(len(item))
        if item and depth >= MAX_DEPTH:
            first = next(iter(item)) if isinstance(item, dict) else 0
            words = f"is nested more than {MAX_DEPTH} deep (at {{where}}; does it contain itself?)"
            raise problem((*keys, first), words)
        nested = []
        for key, child in children:
            if child is None or isinstance(child, _SCALARS):
                size += scalar_bytes(child)
            else:
                nested.append((key, child))
        budget.charge(size, "copying {}", field_name)
        for key, child in nested:
            walk(child, (*keys, key), depth + 1)

    count(1)
    if value is None or isinstance(value, _SCALARS):
        budget.charge(scalar_bytes(value), "copying {}", named(field))
    else:
        walk(value, (), 0)
    return value


def charge_tensors(tensors: Iterable[StoredTensor], budget: Budget, what: str) -> int:
    """Charge ``budget`` the bytes of every tensor the importer keeps (one storage viewed by
    many tensors is read once per view); the bytes charged."""
    total = 0
    for tensor in tensors:
        shape = tensor.shape
        total += (shape[0] if len(shape) == 1 else tensor.numel()) * ITEMSIZES[tensor.dtype]
    budget.charge(total, what)
    return total
