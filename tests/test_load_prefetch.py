"""A load hints the ranges it reads next (NativeSource.prefetch, posix_fadvise WILLNEED), so
the storage keeps reading while the loader maps memory and checks what has arrived; each hint
names the memory its read fills, where a direct read can land with no copy."""

from __future__ import annotations

import os

import numpy as np
import pytest
from universal_helpers import save_synthetic

from zeroshard.checkpoint import loader
from zeroshard.checkpoint.loader import load_state
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.io import block_reader, direct_reads
from zeroshard.io.dtypes import dtype_info
from zeroshard.layout import ParamSpec, build_layout

SPECS = [[ParamSpec.of("w1", (13, 7), "bf16"), ParamSpec.of("w2", (7, 11), "bf16")], [ParamSpec.of("b", (11,), "bf16")]]


class Recording(NativeSource):
    """A native source that logs every hint and every partition read, in order."""

    def __init__(self, path, events):
        super().__init__(path)
        self.events = events

    def prefetch(self, rank, group, key, start, end, into=None):
        # With the memory the hint names: the read must fill that same memory.
        self.events.append(("hint", rank, group, key, start, end, None if into is None else into.ctypes.data))
        super().prefetch(rank, group, key, start, end, into)

    def read_into(self, rank, group, key, start, out, observe=None):
        self.events.append(("read", rank, group, key, start, start + out.size, out.ctypes.data))
        super().read_into(rank, group, key, start, out, observe)


def _events(path, layout, rank):
    events = []
    with Recording(path, events) as source:
        load_state(source, layout, rank)
    return events


@pytest.mark.parametrize("new_world", [2, 3, 1])
def test_every_range_read_was_hinted_before(tmp_path, new_world):
    path = save_synthetic(tmp_path, build_layout(SPECS, 2))
    layout = build_layout(SPECS, new_world)
    for rank in range(new_world):
        events = _events(path, layout, rank)
        reads = [event[1:] for event in events if event[0] == "read"]
        hints = [event[1:] for event in events if event[0] == "hint"]
        assert reads and sorted(reads) == sorted(hints), (rank, reads, hints)  # within the budget: all of them, once
        for at, event in enumerate(events):
            if event[0] == "read":
                assert ("hint", *event[1:]) in events[:at], (rank, event)


def test_hints_stop_at_the_budget(tmp_path, monkeypatch):
    path = save_synthetic(tmp_path, build_layout(SPECS, 2))
    layout = build_layout(SPECS, 3)
    monkeypatch.setattr(loader, "PREFETCH_BYTES", 40)
    events = _events(path, layout, 1)
    hints = [event for event in events if event[0] == "hint"]
    assert hints
    by_group: dict[int, int] = {}
    for _, _, group, _, start, end, _ in hints:
        by_group[group] = by_group.get(group, 0) + (end - start) * 4  # fp32 masters and Adam states
    assert all(0 < hinted <= 40 for hinted in by_group.values()), by_group
    first_read = next(event for event in events if event[0] == "read")
    assert hints[0][1:5] == first_read[1:5] and hints[0][5] <= first_read[5]  # the first range, cut short


def test_a_hint_names_the_bytes_the_read_returns(tmp_path, monkeypatch):
    path = save_synthetic(tmp_path, build_layout(SPECS, 2))
    advised = []
    monkeypatch.setattr(block_reader, "advise", lambda file, begin, length: advised.append((file, begin, length)))
    with NativeSource(path) as source:
        for group, key, start, end in ((0, "fp32", 3, 40), (0, "exp_avg_sq", 0, 17), (1, "exp_avg", 2, 5)):
            source.prefetch(1, group, key, start, end)
            file, begin, length = advised[-1]
            out = np.zeros(end - start, dtype=dtype_info("float32").numpy)
            source.read_into(1, group, key, start, out)
            with open(file, "rb") as handle:
                handle.seek(begin)
                assert handle.read(length) == out.tobytes(), (group, key)
        with pytest.raises(KeyError, match="no optimizer state 'nope'"):
            source.prefetch(0, 0, "nope", 0, 1)
        with pytest.raises(ValueError, match="outside group 1"):
            source.prefetch(0, 1, "fp32", 0, 10**6)


def test_advise_is_only_a_hint(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, begin, length, advice: calls.append((begin, length, advice)))
    real = tmp_path / "data"
    real.write_bytes(bytes(100))
    (tmp_path / "link").symlink_to(real)
    direct_reads.advise(real, 10, 20)
    assert calls == [(10, 20, os.POSIX_FADV_WILLNEED)]
    direct_reads.advise(tmp_path / "link", 0, 10)  # never followed
    direct_reads.advise(tmp_path / "missing", 0, 10)  # its read will say so
    direct_reads.advise(real, 0, 0)
    assert len(calls) == 1
