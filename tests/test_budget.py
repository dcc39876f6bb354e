"""The per-file byte budget (zeroshard.io.budget) on its own, and the torch.save
reader charging it: pickles that re-use one memoised object to make the unpickler copy it
again and again, opcodes that declare more than the pickle holds, hostile names in errors.

Each bomb is scaled down so that the old reader allocated tens of MB (not GB) on it; the
assertion is the bound itself: refused, in a few tenths of a second of CPU time, having allocated
at most 64 times the file's size plus 2 MiB (tracemalloc's peak).
"""

from __future__ import annotations

import contextlib
import zipfile
from pathlib import Path

import pytest
from hostile_files import (
    PROTO,
    archive,
    distinct_ints,
    get,
    glob,
    integer,
    kept,
    cpu_seconds,
    measured,
    memoised_dict,
    memoised_list,
    put,
)

from zeroshard.io.budget import CONSTANT, FACTOR, Budget, BudgetExceeded, quoted
from zeroshard.torchfile import torch_unpickler
from zeroshard.deepspeed.checkpoint.pickled import ALLOWED_GLOBALS
from zeroshard.torchfile.torch_file import TorchFileError, load_torch_file
from zeroshard.torchfile.torch_records import fills_state

SLACK = 2 << 20  # what a refused load may allocate besides 64 bytes per byte of its file
CPU_SECONDS = 2.5  # 10x the costliest refusal here (0.24 CPU seconds, measured untraced)


# ---- the budget and quoted() on their own -------------------------------------------------------


def test_a_budget_is_its_file_size_times_the_factor_plus_the_constant(tmp_path):
    path = tmp_path / "f.pt"
    path.write_bytes(bytes(1000))
    budget = Budget(path, path.stat().st_size)
    assert (budget.file_bytes, budget.limit, budget.spent) == (1000, FACTOR * 1000 + CONSTANT, 0)
    budget.charge(budget.limit - 1, "most of it")
    budget.charge(1, "the rest")
    assert budget.spent == budget.limit
    with pytest.raises(BudgetExceeded) as caught:
        budget.charge(1, "one byte more")
    message = str(caught.value)
    assert message == (
        f"{path}: one byte more exceeds the budget of {budget.limit:,} bytes for a file of 1,000 bytes "
        f"({FACTOR} per byte, plus {CONSTANT:,})"
    )
    assert isinstance(caught.value, ValueError)
    assert budget.spent == budget.limit + 1  # spent stays spent: a second charge fails too
    with pytest.raises(BudgetExceeded):
        budget.charge(0, "nothing")
    with pytest.raises(ValueError):
        Budget(path, -1)
    lazy = Budget("x", 0)
    lazy.charge(CONSTANT, "{} is not formatted", Exploding())  # words are formatted when said
    with pytest.raises(BudgetExceeded, match="^x: 3 items of 'a' exceeds"):
        lazy.charge(1, "{:,} items of {!r}", 3, "a")


class Exploding:
    """Stands for a file-built object whose repr() would never finish."""

    def __repr__(self) -> str:
        raise AssertionError("quoted() called repr()")


def test_quoted_words_a_value_by_type_and_length_unless_it_is_short():
    assert quoted("fc1.weight") == "'fc1.weight'"
    assert quoted("x" * 4_194_304) == "a str of 4,194,304 characters"
    assert quoted(2**63) == str(2**63) and quoted(-(2**64) + 1) == str(-(2**64) + 1)
    assert quoted(10**5000) == f"an int of {(10**5000).bit_length():,} bits"  # str() would raise
    assert quoted(None) == "None" and quoted(True) == "True" and quoted(2.5) == "2.5"
    assert quoted([Exploding()] * 3) == "a list of 3 items"
    assert quoted([1, "a", None]) == "[1, 'a', None]" and quoted((2**70,)) == "(an int of 71 bits,)"
    assert quoted(list(range(9))) == "a list of 9 items"
    assert quoted((Exploding(),)) == "a tuple of 1 item"
    assert quoted({"a": Exploding()}) == "a dict of 1 item"
    assert quoted(b"ab") == "a bytes object of 2 bytes"
    assert quoted(Exploding()) == "an Exploding"


# ---- pickles that make the unpickler copy one object again and again ---------------------------


def expect_refused_within_budget(path: Path, *words: str, allowed=None) -> str:
    outcome, peak, _ = measured(lambda: load_torch_file(path, allowed))
    cpu = _untraced_cpu_seconds(path, allowed)
    size = path.stat().st_size
    refused = isinstance(outcome, TorchFileError)
    assert refused, f"{type(outcome).__name__} from {size} bytes, {peak:,} bytes allocated"
    message = str(outcome)
    one_short_line = message.startswith(f"{path}: ") and "\n" not in message and len(message) < 400
    assert one_short_line, f"{message[:300]}... ({len(message):,} characters)"
    for word in words:
        assert word in message, message
    cheap = peak < 64 * size + SLACK and cpu < CPU_SECONDS
    assert cheap, f"{size:,} bytes: {peak:,} bytes allocated, {cpu:.2f} CPU seconds"
    return message


def _untraced_cpu_seconds(path: Path, allowed) -> float:
    """The CPU seconds loading ``path`` takes untraced: tracing slows code allocating small objects tenfold."""

    def load() -> None:
        with contextlib.suppress(TorchFileError):
            load_torch_file(path, allowed)

    return cpu_seconds(load)


COPIES = {  # what a 7-byte "get the global, get the memoised list, TUPLE1, REDUCE" copies
    "set": ("builtins.set", distinct_ints(2000), 500, "copying 2,000 items into a set exceeds the budget"),
    "torch.Size": ("torch.Size", distinct_ints(2000), 2000, "copying 2,000 items into a torch.Size exceeds"),
    "OrderedDict": (  # torch.save calls OrderedDict without arguments, and it takes none now
        "collections.OrderedDict",
        b"".join(b"(" + integer(i) + b"Nt" for i in range(2000)),
        200,
        "corrupt pickle data.pkl: LoadedOrderedDict.copy() takes no arguments",
    ),
}


@pytest.mark.parametrize("case", list(COPIES))
def test_an_allowed_constructor_is_charged_for_what_it_copies(tmp_path, case):
    """set(L), torch.Size(L), OrderedDict(L) of one memoised list L, hundreds of times: the
    old reader took 9 KB to 66 MB (set), a quadratic cost; each copy is charged now."""
    qualname, items, copies, words = COPIES[case]
    data = PROTO + memoised_list(0, items) + glob(qualname) + put(1) + b"0" + kept(get(1) + get(0) + b"\x85R", copies)
    path = archive(tmp_path / "copies.pt", data + b".")
    expect_refused_within_budget(path, words)


BUILDS = {  # BUILD with one memoised dict of 2,000 entries as the state of a new object each time
    "OrderedDict": (glob("collections.OrderedDict"), b")R" + get(0) + b"b", "exceeds the budget"),
    "OrderedDict, slot state": (glob("collections.OrderedDict"), b")RN" + get(0) + b"\x86b", "is not a dict"),
    "fragment_address": (
        glob("deepspeed.utils.tensor_fragment.fragment_address"),
        b")\x81" + get(0) + b"b",
        "exceeds the budget",
    ),
    "LossScaler": (
        glob("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        b")\x81" + get(0) + b"b",
        "exceeds the budget",
    ),
}


@pytest.mark.parametrize("case", list(BUILDS))
def test_the_state_a_pickle_builds_an_object_with_is_charged(tmp_path, case):
    """BUILD copies its state into the object's __dict__: one memoised state for 500 objects
    took the old reader from 25 KB to 26 MB."""
    cls, build, words = BUILDS[case]
    data = PROTO + memoised_dict(0, 2000) + cls + put(1) + b"0" + kept(get(1) + build, 500) + b"."
    path = archive(tmp_path / "build.pt", data)
    expect_refused_within_budget(path, words, allowed=ALLOWED_GLOBALS)


@fills_state
class Collects:
    """A stand-in that keeps the arguments it is called with."""

    def __init__(self, *args):
        self.args = args


def test_the_arguments_a_pickle_calls_a_stand_in_with_are_charged(tmp_path):
    """Calling a stand-in with a memoised tuple of 20,000 arguments unpacks them each time:
    500 calls took the old reader from 30 KB to 80 MB."""
    arguments = b"(" + b"N" * 20_000 + b"t" + put(0) + b"0"
    call = get(1) + get(0) + b"R"
    data = PROTO + arguments + glob("x.Collects") + put(1) + b"0" + kept(call, 500)
    path = archive(tmp_path / "calls.pt", data + b".")
    expect_refused_within_budget(path, "exceeds the budget", "calling x.Collects", allowed={"x.Collects": Collects})


def test_the_containers_a_pickle_creates_are_charged(tmp_path):
    """EMPTY_SET is one byte for 216 bytes of set: 300,000 of them kept in a list."""
    path = archive(tmp_path / "sets.pt", PROTO + kept(b"\x8f", 300_000) + b".")
    expect_refused_within_budget(path, "exceeds the budget", "creating the containers of data.pkl")


def test_the_budget_does_not_refuse_what_torch_save_writes(tmp_path):
    """Big legitimate values: a set, shapes, OrderedDicts with state, stand-ins."""
    import torch

    values = {
        "set": set(range(20_000)),
        "sizes": [torch.Size([i, 3]) for i in range(5_000)],
        "state_dict": torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(200)]).state_dict(),
    }
    path = tmp_path / "ok.pt"
    torch.save(values, path)
    loaded = load_torch_file(path)
    assert loaded["set"] == values["set"] and loaded["sizes"][-1] == (4999, 3)
    assert list(loaded["state_dict"]) == list(values["state_dict"])
    assert loaded["state_dict"]._metadata == values["state_dict"]._metadata


# ---- opcodes that declare more than the pickle holds ---------------------------------------------


def test_a_frame_longer_than_the_pickle_is_refused_before_the_unpickler_allocates_it(tmp_path):
    """FRAME declares its length in 8 bytes; the C unpickler allocated 64 MiB for this one."""
    data = b"\x80\x04\x95" + (64 << 20).to_bytes(8, "little") + b"N."
    path = archive(tmp_path / "frame.pt", data)
    message = expect_refused_within_budget(path, "FRAME")
    assert message.endswith("runs past the end")
    fine = archive(tmp_path / "fine.pt", b"\x80\x04\x95" + (2).to_bytes(8, "little") + b"N.")
    assert load_torch_file(fine) is None


def test_running_out_of_memory_is_not_called_a_corrupt_pickle(tmp_path, monkeypatch):
    def load(self):
        raise MemoryError

    monkeypatch.setattr(torch_unpickler._Unpickler, "load", load)
    path = archive(tmp_path / "any.pt", PROTO + b"N.")
    with pytest.raises(TorchFileError) as caught:
        load_torch_file(path)
    message = str(caught.value)
    assert "corrupt" not in message and "out of memory" in message, message


# ---- hostile names and records ---------------------------------------------------------------------


def test_an_error_quotes_a_long_global_name_by_its_length(tmp_path):
    name = "a" * (1 << 20)
    path = archive(tmp_path / "name.pt", PROTO + b"c" + name.encode() + b"\nb\n.")
    message = expect_refused_within_budget(path, "refused to unpickle data.pkl")
    assert f"of {len(name) + 2:,} characters" in message and "is not allowed" in message


def write_twice(path: Path, record: str) -> None:
    """A torch.save-like zip holding two records named ``record`` (zipfile warns)."""
    pickles = record.endswith("pkl")
    with zipfile.ZipFile(path, "w") as zipped:
        zipped.writestr("archive/data.pkl", PROTO + b"N.")
        zipped.writestr("archive/byteorder", b"little")
        zipped.writestr(record, PROTO + b"K\x01." if pickles else b"abcd")
        if not pickles:
            zipped.writestr(record, b"efgh")


@pytest.mark.parametrize("record", ["archive/data.pkl", "archive/data/0"])
def test_a_record_named_twice_is_refused(tmp_path, record):
    """torch.load reads the first of two records of one name, zipfile (and so we) the last."""
    path = tmp_path / "twice.pt"
    with pytest.warns(UserWarning, match="Duplicate name"):
        write_twice(path, record)
    with pytest.raises(TorchFileError) as caught:
        load_torch_file(path)
    assert str(caught.value) == f"{path}: the zip archive holds two records named {record!r}"


def test_a_small_range_of_a_record_is_not_read_with_all_of_it(tmp_path, monkeypatch):
    """A record of up to 256 KiB was read whole (and its CRC computed) at every read: a layout
    of many one-element parameters read it again for each of them. A range that is a small
    part of it is read alone, the record checked once."""
    import os

    import torch

    path = tmp_path / "vector.pt"
    torch.save({"v": torch.arange(65536, dtype=torch.float32)}, path)  # one 256 KiB record
    vector = load_torch_file(path)["v"]
    read = []
    original = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, size, offset: read.append(size) or original(fd, size, offset))
    starts = range(0, 65536, 1024)
    assert [float(vector.read(start, start + 1)[0]) for start in starts] == [float(start) for start in starts]
    assert sum(read) < 64 << 10, sum(read)  # the old reader: 64 reads of the whole record, 16 MiB
    assert vector.read(0, 16384).tobytes() == torch.arange(16384, dtype=torch.float32).numpy().tobytes()
