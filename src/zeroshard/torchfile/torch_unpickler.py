"""The restricted unpickler for torch.save pickles: an allowlist of globals, nothing else.

A pickle names globals and calls them, so unpickling an arbitrary file runs code the file
chooses. This unpickler resolves only an explicit allowlist of names, to our own torch-free
rebuild functions and markers and to the caller's data-only stand-in classes, and refuses
every other global by name, as ``torch.load(weights_only=True)`` does. Before unpickling,
the opcodes are checked against the set a torch.save pickle uses
(:func:`~.pickle_scan.check_opcodes`).

A pickle's memo lets a few bytes hand one object to a constructor again and again, so what
the allowed globals copy is charged to the load's budget: ``torch.Size`` and ``set`` are
wrappers charging the items they copy, ``OrderedDict`` takes no arguments (torch.save passes
none) and charges the state a BUILD gives it, a stand-in charges the arguments it is called
with and the state it is filled with (:func:`~.torch_records.fills_state`); the scan
charges the containers the pickle creates.
"""

from __future__ import annotations

import enum
import io
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..io.budget import (
    DICT_ITEM_BYTES,
    REFERENCE_BYTES,
    SET_ITEM_BYTES,
    UNCHARGED_BYTES,
    Budget,
    BudgetExceeded,
    named,
    quoted,
)
from ..io.dtypes import dtype_info
from .pickle_hashing import charge_hashing
from .pickle_scan import check_opcodes
from .torch_records import (
    LOADING,
    STORAGE_CLASSES,
    FileProblem,
    StorageRecord,
    StoredTensor,
    charge_load,
    check_attribute_names,
    one_line,
    span,
    unbuildable,
)


class _SealedGlobal(type):
    """The type of what find_class hands out for an allowed stand-in class. Calling it calls the
    target (REDUCE) and NEWOBJ gets ``target.__new__(target, *args)``, as with the target
    itself, but a BUILD on the global fails: the targets are shared by every load, and a file
    must not set their attributes (torch's weights-only unpickler refuses that too)."""

    def __call__(cls, *args: Any) -> Any:
        if len(args) > _FEW_ARGUMENTS:
            _charge_arguments(cls, args)
        return cls.target(*args)  # type: ignore[attr-defined]

    def __setattr__(cls, name: str, value: Any) -> None:
        raise FileProblem(f"refused to unpickle data.pkl: it sets attribute {name!r} of global {cls.__name__!r}")


class _SealedEnum(_SealedGlobal):
    """:class:`_SealedGlobal` of an Enum: called with its value only, a plain int or str (the
    Enum's own error message would hold the repr() of anything else). An Enum's ``__new__``
    looks its value up too, so NEWOBJ does the same."""

    def __call__(cls, *args: Any) -> Any:
        if len(args) != 1 or type(args[0]) not in (int, str):
            raise FileProblem(f"corrupt pickle data.pkl: {cls.__name__} called with {quoted(args)}, not a value")
        try:
            return cls.target(args[0])  # type: ignore[attr-defined]
        except ValueError:
            raise FileProblem(f"corrupt pickle data.pkl: {quoted(args[0])} is not a {cls.__name__}") from None


def seal(qualname: str, target: Callable[..., Any]) -> Any:
    """What find_class hands out for ``target``: a built-in type as it is (nothing of it can be
    set), anything else wrapped in a :class:`_SealedGlobal` (a :class:`_SealedEnum` for an Enum)."""
    if isinstance(target, type) and target.__flags__ & _IMMUTABLE_TYPE:
        return target
    sealed = _SealedEnum if isinstance(target, enum.EnumMeta) else _SealedGlobal

    def new(cls: type, *args: Any) -> Any:
        if len(args) > _FEW_ARGUMENTS:
            _charge_arguments(cls, args)
        if not isinstance(target, type):
            raise FileProblem(f"refused to unpickle data.pkl: NEWOBJ of {qualname!r}, which is not a class")
        if sealed is _SealedEnum:
            return cls(*args)
        return target.__new__(target, *args)

    return sealed(qualname, (), {"__slots__": (), "target": target, "__new__": new})


def _charge_arguments(cls: type, args: tuple[Any, ...]) -> None:
    """A call unpacks its arguments: charged, as a memoised tuple of them may be passed again
    and again (a few cost less than the opcodes passing them, and are not charged)."""
    charge_load(len(args) * REFERENCE_BYTES, "calling {} with {:,} arguments", cls.__name__, len(args))


_FEW_ARGUMENTS = 8


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: built-in types, whose attributes cannot be set


def _refuses_state(function: Callable[..., Any]) -> Callable[..., Any]:
    """Make a pickle's BUILD opcode on ``function`` (a global the unpickler hands out as it is,
    to spare every call a wrapper) an error: the functions are shared by every load, and a file
    must not set their attributes (``__defaults__``, ``__code__``)."""

    def __setstate__(state: Any) -> None:
        raise FileProblem(f"refused to unpickle data.pkl: it sets the state of global {function.__qualname__!r}")

    function.__setstate__ = __setstate__  # type: ignore[attr-defined]
    return function


@unbuildable
@dataclass(frozen=True, slots=True)
class StorageType:
    """What a storage class global (``torch.FloatStorage``) unpickles to."""

    dtype: str


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, globals_: Mapping[str, Any], storage: Callable[[Any], StorageRecord]) -> None:
        super().__init__(_peekable(data))
        self._globals = globals_
        self.persistent_load = storage  # called by the C unpickler, not through a method of ours

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{'builtins' if module == '__builtin__' else module}.{name}"
        if qualname not in self._globals:
            raise FileProblem(f"refused to unpickle data.pkl: global {quoted(qualname)} is not allowed")
        return self._globals[qualname]


def _peekable(data: bytes) -> io.BufferedReader:
    """``data`` as a stream the C unpickler can ``peek`` into: it then reads opcodes out of
    the peeked bytes, where from a plain BytesIO it calls ``read`` for every opcode and every
    argument (2.5x the cost of unpickling a small pickle). The scan has bounded every
    argument by the pickle's size, so no read asks for more than ``data`` holds."""
    return io.BufferedReader(io.BytesIO(data), max(1, min(len(data), _PEEK_BYTES)))


_PEEK_BYTES = 1 << 20  # bigger pickles are peeked into a megabyte at a time


def unpickle(
    data: bytes, globals_: Mapping[str, Any], storage: Callable[[Any], StorageRecord], budget: Budget
) -> Any:
    """The object the pickle ``data`` describes, what it creates and copies charged to
    ``budget`` (BudgetExceeded); FileProblem for anything else wrong with it."""
    created = check_opcodes(data)
    if created > UNCHARGED_BYTES:
        budget.charge(created, "creating the containers of data.pkl")
    previous = getattr(LOADING, "budget", None)
    LOADING.budget = budget  # for the callbacks, which have no other way to it
    try:
        return _Unpickler(data, globals_, storage).load()
    except (FileProblem, BudgetExceeded):
        raise
    except MemoryError:
        raise FileProblem("unpickling data.pkl ran out of memory") from None
    except Exception as err:  # noqa: BLE001 - whatever a malformed stream makes the unpickler or a stand-in raise
        raise FileProblem(f"corrupt pickle data.pkl: {one_line(err)}") from None
    finally:
        LOADING.budget = previous


# The rebuild functions take what the file passes, anything: _tensor checks it. Hooks are
# ignored (torch.save writes an empty OrderedDict; a pickle cannot make a callable hook).
@_refuses_state
def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks, metadata=None):
    dtype = storage.dtype if isinstance(storage, StorageRecord) else None
    return _tensor(storage, dtype, storage_offset, size, stride, requires_grad, metadata)


@_refuses_state
def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if type(dtype) is not str:  # a dtype global's name; anything else may cost more to hash
        raise FileProblem("corrupt pickle data.pkl: malformed tensor")
    return _tensor(storage, dtype, storage_offset, size, stride, requires_grad, metadata)


@_refuses_state
def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> StoredTensor:
    if not isinstance(data, StoredTensor) or type(requires_grad) is not bool:
        raise FileProblem("corrupt pickle data.pkl: malformed parameter")
    return replace(data, requires_grad=requires_grad)


def _tensor(
    storage: Any, dtype: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, metadata: Any
) -> StoredTensor:
    """A StoredTensor from rebuild arguments, once they are checked to describe a view that
    lies inside its storage and holds no more elements than it."""
    if (  # a vector or a scalar, all a DeepSpeed rank file holds: checked inline (32,000 at D=4096)
        type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride) <= 1
        and type(storage) is StorageRecord
        and type(storage_offset) is int
        and type(requires_grad) is bool
        and metadata is None
        and dtype in ITEMSIZES
    ):
        numel, step = (size[0], stride[0]) if size else (1, 1)
        if (
            type(numel) is int
            and type(step) is int
            and 0 < numel
            and 0 <= step < _INT64_LIMIT
            and 0 <= storage_offset
            and (storage_offset + (numel - 1) * step + 1) * ITEMSIZES[dtype] <= storage.nbytes
            and numel * ITEMSIZES[dtype] <= storage.nbytes
        ):
            return StoredTensor(storage, dtype, size, stride, storage_offset, requires_grad)
    return _checked_tensor(storage, dtype, storage_offset, size, stride, requires_grad, metadata)


def _checked_tensor(
    storage: Any, dtype: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, metadata: Any
) -> StoredTensor:
    """:func:`_tensor` for any view, and the error naming what is wrong with one."""
    shape, steps = _sizes(size), _sizes(stride)
    if (
        not isinstance(storage, StorageRecord)
        or dtype not in STORAGE_CLASSES
        or shape is None
        or steps is None
        or len(shape) != len(steps)
        or type(storage_offset) is not int
        or not 0 <= storage_offset < _INT64_LIMIT
        or type(requires_grad) is not bool
    ):
        raise FileProblem("corrupt pickle data.pkl: malformed tensor")
    if metadata:  # the conjugate or negative bit: values would need a transformation
        raise FileProblem(f"tensor metadata {quoted(metadata)} is unsupported")
    _check_view_fits(storage, dtype, storage_offset, shape, steps)
    return StoredTensor(storage, dtype, shape, steps, storage_offset, requires_grad)


def _check_view_fits(
    storage: StorageRecord, dtype: str, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]
) -> None:
    """Refuse a view that reaches past its storage, or that has more elements than the
    storage holds: reading one (a stride-0 ``expand`` of a 2-byte storage, say) would
    allocate far more than the file holds. Checked before anything is read."""
    itemsize = ITEMSIZES[dtype]
    numel = math.prod(shape)
    nonzero = numel or math.prod(size for size in shape if size)  # numpy refuses a huge shape even when empty
    if nonzero * itemsize >= _INT64_LIMIT:
        raise FileProblem(f"corrupt pickle data.pkl: a tensor of shape {shape} is too big for any memory")
    if not numel:
        return
    needed = (offset + span(shape, stride)) * itemsize
    if needed > storage.nbytes:
        what = f"a {dtype} tensor of shape {shape}, stride {stride}, offset {offset}"
        raise FileProblem(f"{what} needs {needed} bytes of storage {named(storage.key)}, which has {storage.nbytes}")
    if numel * itemsize > storage.nbytes:
        what = f"a {dtype} tensor of shape {shape}, stride {stride}, offset {offset}"
        raise FileProblem(
            f"{what} has {numel} elements, storage {named(storage.key)} holds {storage.nbytes // itemsize}: "
            "an expanded view is refused (reading it would allocate more than the file holds)"
        )


_INT64_LIMIT = 1 << 63  # torch's sizes, strides and offsets are int64
ITEMSIZES = {name: dtype_info(name).itemsize for name in STORAGE_CLASSES}


def _sizes(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of at most 64 int64s that are not negative; None if it is not one."""
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        return None
    for item in value:
        if type(item) is not int or not 0 <= item < _INT64_LIMIT:
            return None
    return tuple(value)


# The built-in constructors a torch.save pickle calls, as wrappers that charge what they
# copy (a function, not a type, so NEWOBJ on one is refused as for the rebuild functions).
@_refuses_state
def _size(*args: Any) -> tuple[Any, ...]:
    """``torch.Size``, read as a tuple of ints (so that no tuple a list hides is copied out
    into one, to be hashed as a key again and again)."""
    _charge_copy(args, REFERENCE_BYTES, "a torch.Size")
    size = tuple(*args)
    for item in size:
        if type(item) is not int:
            raise FileProblem(f"corrupt pickle data.pkl: a torch.Size holds {quoted(item)}, not an int")
    return size


@_refuses_state
def _set(*args: Any) -> set[Any]:
    _charge_copy(args, SET_ITEM_BYTES, "a set")
    if len(args) == 1 and type(args[0]) in _SETS_OF:  # hashing a tuple hashes its items; keys may collide
        charge_hashing(args[0], "a set")
    return set(*args)


_SETS_OF = (list, tuple, dict, set, frozenset)


def _charge_copy(args: tuple[Any, ...], item_bytes: int, what: str) -> None:
    try:
        count = len(args[0]) if len(args) == 1 else 0  # anything else: the constructor refuses it
    except TypeError:  # no length: not iterable, so nothing is copied
        return
    charge_load(count * item_bytes, "copying {:,} items into {}", count, what)


class LoadedOrderedDict(OrderedDict):  # type: ignore[type-arg]
    """What an ``OrderedDict`` of a pickle unpickles to: an OrderedDict whose BUILD state (the
    ``_metadata`` of a module's state_dict) is charged to the load's budget, as C would copy
    it uncharged into every OrderedDict a memoised state is given to."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict:
            raise FileProblem("corrupt pickle data.pkl: the state of an OrderedDict is not a dict")
        charge_load(len(state) * DICT_ITEM_BYTES, "setting {:,} attributes of an OrderedDict", len(state))
        check_attribute_names(state, "OrderedDict")
        self.__dict__.update(state)


# torch.save writes an OrderedDict as a call without arguments, then its items: the copy
# method of an empty one makes a new empty one in C (no Python call per OrderedDict, one per
# tensor of a file) and refuses arguments, so nothing is copied into it but its items.
_ordered_dict = LoadedOrderedDict().copy


ALLOWED_GLOBALS: dict[str, Any] = {
    **{f"torch.{storage}": StorageType(name) for name, storage in STORAGE_CLASSES.items() if storage},
    "torch.storage.UntypedStorage": StorageType("uint8"),
    **{f"torch.{name}": name for name in STORAGE_CLASSES},  # dtypes (_rebuild_tensor_v3's argument)
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch.Size": _size,
    "collections.OrderedDict": _ordered_dict,  # type: ignore[dict-item]
    "builtins.set": _set,
}
