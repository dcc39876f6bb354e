"""One value of a DeepSpeed config, read and checked where it is read.

A config is a JSON file or a dict, so any key may hold any JSON value: a string where a bool
belongs (``"true"``), a float where an integer does, ``NaN``, ``Infinity`` or an integer no
float holds. Each reader here takes the value of one key and returns it as the type it is
used as, or raises a one-line ``ValueError`` naming the key, the value and what it must be;
nothing is coerced (``bool("false")`` is True). :func:`arguments` does the same for the
``params`` of an optimizer or scheduler, by the annotations of the class it configures.
Pure Python: no torch.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import types
import typing
from typing import Any, Callable, Mapping

_MAX_INT = 2**63 - 1  # counts and sizes end up in int64 tensors and numpy arrays
_SEQUENCES = (list, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)
_SIMPLE = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", type(None): "null"}
# Names the annotations of torch's schedulers use without importing them at run time.
_ANNOTATION_NAMES = {
    **{name: getattr(collections.abc, name) for name in collections.abc.__all__},
    **{name: getattr(typing, name) for name in ("Any", "Literal", "Optional", "Union")},
}


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refusal(key: str, value: Any, why: str) -> ValueError:
    """The one-line error refusing ``value`` of config ``key``."""
    return ValueError(f"DeepSpeed config refused: {key} = {short(value)}: {why}")


def setting(values: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value of ``key``, or ``default`` when it is absent or null."""
    value = values.get(key)
    return default if value is None else value


def flag(values: Mapping[str, Any], key: str, default: bool) -> bool:
    """A JSON ``true`` / ``false`` (not a string, not a number)."""
    value = setting(values, key, default)
    if type(value) is not bool:
        raise refusal(key, value, "must be true or false")
    return value


def number(values: Mapping[str, Any], key: str, default: float) -> float:
    """A finite number >= 0."""
    value = setting(values, key, default)
    as_float = _finite(value)
    if as_float is None or as_float < 0:
        raise refusal(key, value, "must be a finite number >= 0")
    return as_float


def positive(value: Any, key: str) -> int:
    """``value`` of config ``key`` as a positive integer (an integral float too) that fits
    int64; ValueError naming the key otherwise."""
    whole = type(value) is int or (type(value) is float and value.is_integer())
    if not whole or not 1 <= value <= _MAX_INT:
        raise refusal(key, value, "must be a positive integer (below 2**63)")
    return int(value)


def integer(value: Any, key: str, low: int, high: int) -> int:
    """A JSON integer from ``low`` to ``high``."""
    if type(value) is not int or not low <= value <= high:
        raise refusal(key, value, f"must be an integer from {low} to {high}")
    return value


def arguments(target: Callable, params: Any, section: str, skip: tuple[str, ...]) -> dict[str, Any]:
    """``params`` (config ``section``) as the keyword arguments of ``target`` (a class),
    checked by its signature: each a name it takes (except ``skip``), each value of the
    annotated type (lists become tuples where a tuple is annotated, integral floats become
    ints where an int is), every argument without a default given. An argument no JSON
    value can be (a function, a scheduler) is refused.

    Raises:
        ValueError: one line naming the first key of ``section`` that is wrong.
    """
    owner = target.__name__
    if not isinstance(params, Mapping):
        raise refusal(section, params, f"must be a JSON object of {owner}'s arguments")
    taken = {
        name: parameter
        for name, parameter in _signature(target).parameters.items()
        if name not in skip and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    unknown = sorted(str(name) for name in params if name not in taken)
    if unknown:
        raise ValueError(f"DeepSpeed config refused: {section}.{unknown[0]}: {owner} takes {', '.join(sorted(taken))}")
    checked = {}
    for name, parameter in taken.items():
        expected = describe(parameter.annotation)
        required = parameter.default is parameter.empty
        if expected is None and (required or name in params):
            raise ValueError(
                f"DeepSpeed config refused: {section}.{name}: {owner} takes {_text(parameter.annotation)}, which a "
                f"JSON config cannot hold; build {owner} in Python instead"
            )
        if name not in params:
            if required:
                raise ValueError(f"DeepSpeed config refused: {section}.{name}: {owner} needs it ({expected})")
            continue
        try:
            checked[name] = _convert(params[name], parameter.annotation)
        except _Mismatch:
            raise refusal(f"{section}.{name}", params[name], f"{owner} takes {expected}") from None
    return checked


def required_arguments(function: Callable, skip: tuple[str, ...] = ("self",)) -> list[str]:
    """The arguments of ``function`` without a default (``skip`` aside)."""
    return [
        name
        for name, parameter in _signature(function).parameters.items()
        if name not in skip
        and parameter.default is parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]


def describe(annotation: Any) -> str | None:
    """What a JSON value of ``annotation`` is, in words; None when no JSON value is one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _unknown(annotation):
        return "any value"
    if origin in (typing.Union, types.UnionType):
        arms = [text for text in map(describe, args) if text is not None]
        return " or ".join(dict.fromkeys(arms)) or None
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    if origin is tuple and args and args[-1] is not Ellipsis:
        items = [describe(arg) for arg in args]
        if None in items:
            return None
        each = f", each {items[0]}" if len(set(items)) == 1 else f" ({'; '.join(items)})"
        return f"a list of {len(items)}{each}"
    if origin is tuple or origin in _SEQUENCES or annotation in (list, tuple):
        item = describe(args[0]) if args else "any value"
        return None if item is None else f"a list, each {item}"
    return None


class _Mismatch(Exception):
    pass


def _convert(value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` takes it; _Mismatch when it is not one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _unknown(annotation):
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return _convert(value, arm)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is typing.Literal:
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise _Mismatch
    if annotation is int and type(value) is float and value.is_integer() and abs(value) <= _MAX_INT:
        return int(value)
    if annotation is float and _finite(value) is not None:
        return value
    if annotation in (bool, int, str, type(None)) and type(value) is annotation:
        return value
    if isinstance(value, (list, tuple)):
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch
            return tuple(_convert(item, arg) for item, arg in zip(value, args))
        if origin is tuple or origin in _SEQUENCES or annotation in (list, tuple):
            items = [_convert(item, args[0]) if args else item for item in value]
            return tuple(items) if tuple in (origin, annotation) else items
    raise _Mismatch


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is no number or no finite one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:  # an integer of more than 308 digits
        return None
    return as_float if math.isfinite(as_float) else None


def _unknown(annotation: Any) -> bool:
    """No annotation, ``Any``, or one left a string (see :func:`_signature`): any value goes."""
    return isinstance(annotation, str) or annotation in (typing.Any, inspect.Parameter.empty)


def _signature(target: Callable) -> inspect.Signature:
    """``target``'s signature, string annotations resolved (torch's schedulers name types
    they import only for type checkers); left as strings where that fails."""
    try:
        return inspect.signature(target, locals=_ANNOTATION_NAMES, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        return inspect.signature(target)


def _text(annotation: Any) -> str:
    return inspect.formatannotation(annotation)
