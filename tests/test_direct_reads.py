"""Reads past the page cache (zeroshard.io.direct_reads): big ranges the page cache lacks are
read with O_DIRECT on a thread a few slots ahead, and give the same checked bytes, counts and
errors as reads through the page cache; ranges it holds are read through it.

Slots, blocks and the size worth a direct read are shrunk here so that files of a few hundred
KiB take the direct path. Where the file system of the test's temp dir refuses O_DIRECT
(tmpfs), the tests of the direct path skip, saying so.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import mmap
import os
import threading

import numpy as np
import pytest
import torch

from zeroshard.checkpoint import ReadStats
from zeroshard.io import block_reader, direct_reads, host_memory
from zeroshard.io.block_reader import RangeReader
from zeroshard.io.checksum import BlockHasher
from zeroshard.io.damage import CheckpointDamagedError
from zeroshard.io.direct_reads import ReadAhead, SlotRing, cached_fraction
from zeroshard.io.host_memory import MappingAhead, new_zeros, populate
from zeroshard.io.libc import cached_pages, libc

BLOCK = 16 << 10
SLOT = 64 << 10
SIZE = 40 * BLOCK + 1234  # the last block ends off a page boundary


def evict(path) -> None:
    """Out of the page cache: written back, then dropped."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def reading_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "zeroshard-read-ahead"]


def mapping_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "zeroshard-map-ahead"]


@pytest.fixture
def small_slots(monkeypatch):
    monkeypatch.setattr(direct_reads, "SLOT_BYTES", SLOT)
    monkeypatch.setattr(direct_reads, "SLOTS", 2)
    monkeypatch.setattr(direct_reads, "DIRECT_MIN_BYTES", 2 * BLOCK)
    # Ranges from 4 blocks up have their pages mapped on a thread, 3 blocks a call.
    monkeypatch.setattr(host_memory, "MAP_AHEAD_BYTES", 4 * BLOCK)
    monkeypatch.setattr(host_memory, "MAP_AHEAD_PIECE", 3 * BLOCK)


@pytest.fixture
def cold_file(tmp_path, small_slots):
    path = tmp_path / "rank.bin"
    payload = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    if direct_reads.open_direct(path) is None:
        pytest.skip(f"{tmp_path}: the file system reads nothing past the page cache (O_DIRECT)")
    hasher = BlockHasher(BLOCK)
    hasher.update(payload)
    evict(path)
    return path, payload, hasher.record()


@pytest.fixture
def spans_read(monkeypatch):
    """The spans announced to each reader's read-ahead, a list per announcement."""
    announced: list[list[tuple[int, int]]] = []

    class Recording(ReadAhead):
        def announce(self, path, spans, into=()):
            announced.append(list(spans))
            super().announce(path, spans, into)

        def take(self, path, spans, into=()):
            pending = list(self._announced)
            arrived = super().take(path, spans, into)
            if arrived is None and pending and not self._announced:
                DROPPED.append((path, spans, pending))
            return arrived

    monkeypatch.setattr(block_reader, "ReadAhead", Recording)
    DROPPED.clear()
    return announced


DROPPED: list = []  # takes that dropped the spans announced before them


def stopped_reading_threads() -> bool:
    for thread in reading_threads():
        thread.join(timeout=10)
    return not reading_threads()


def read_into(reader: RangeReader, path, record, begin: int, end: int) -> bytes:
    out = new_zeros(end - begin, np.uint8, populated=False)
    out[:] = 0xAA  # anything the read leaves unwritten shows
    reader.read_into(path, record, begin, memoryview(out))
    return out.tobytes()


@pytest.mark.parametrize("begin, end", [(0, SIZE), (5, SIZE - 7), (BLOCK, 9 * BLOCK), (3 * BLOCK + 1, 30 * BLOCK)])
def test_a_cold_range_is_read_direct_with_the_same_bytes_and_counts(cold_file, spans_read, monkeypatch, begin, end):
    path, payload, record = cold_file
    assert cached_fraction(os.open(path, os.O_RDONLY), 0, SIZE) < 0.5
    direct = ReadStats()
    assert read_into(RangeReader(stats=direct), path, record, begin, end) == payload[begin:end]
    assert spans_read, "a cold range of several slots was read through the page cache"
    first_inner = -(-begin // BLOCK) * BLOCK
    assert spans_read[0][0][0] == first_inner and all(stop - start <= SLOT for start, stop in spans_read[0])

    evict(path)
    monkeypatch.setattr(direct_reads, "ENABLED", False)
    cached = ReadStats()
    assert read_into(RangeReader(stats=cached), path, record, begin, end) == payload[begin:end]
    assert len(spans_read) == 1
    assert (direct.data, direct.bytes_by_file) == (cached.data, cached.bytes_by_file)
    assert stopped_reading_threads() and mapping_threads() == []


def at_phase(nbytes: int, phase: int) -> np.ndarray:
    """New bytes starting ``phase`` bytes into a page (new_zeros does so for arrays of a MiB up)."""
    return np.frombuffer(mmap.mmap(-1, nbytes + phase), dtype=np.uint8, count=nbytes, offset=phase)


@pytest.fixture
def landed(monkeypatch):
    """How the chunks of direct reads reached the loader's array: "in place" (read straight
    into it) or "copied" (from a slot)."""
    found: list[str] = []
    same_memory = direct_reads.same_memory

    def recording(data, target):
        result = same_memory(data, target)
        found.append("in place" if result else "copied")
        return result

    monkeypatch.setattr(block_reader, "same_memory", recording)
    return found


@pytest.mark.parametrize("begin, end", [(0, SIZE), (5, SIZE - 7), (BLOCK, 9 * BLOCK), (3 * BLOCK + 1, 30 * BLOCK)])
@pytest.mark.parametrize("phase", ["the file's", "another"])
def test_memory_with_the_files_alignment_is_read_into_with_no_slot(cold_file, landed, begin, end, phase):
    """Direct reads land straight in an array that starts where the range does within a
    page (no copy); in one that does not, in slots, copied in. The same bytes either way."""
    path, payload, record = cold_file
    offset = begin % mmap.PAGESIZE if phase == "the file's" else (begin + 64) % mmap.PAGESIZE
    out = at_phase(end - begin, offset)
    out[:] = 0xAA  # anything the read leaves unwritten shows
    RangeReader().read_into(path, record, begin, memoryview(out))  # its threads end with it
    assert out.tobytes() == payload[begin:end]
    if phase == "the file's":
        # All but a last read that ends with the file, off a page boundary: into a slot.
        last = "copied" if end == SIZE else "in place"
        assert landed and set(landed[:-1]) <= {"in place"} and landed[-1] == last, landed
    else:
        assert landed and set(landed) == {"copied"}, landed
    assert stopped_reading_threads()


def test_announced_memory_is_read_into_and_a_mismatched_take_reads_anew(cold_file):
    """ReadAhead: spans announced with aligned memory arrive in it; announced with other
    memory (or none) than the take names, they are not taken; a span whose memory is not
    aligned, not its length or read-only goes to a slot."""
    path, payload, _ = cold_file
    spans = [(0, SLOT), (SLOT, 2 * SLOT)]
    out = at_phase(2 * SLOT, 0)
    into = [memoryview(out)[:SLOT], memoryview(out)[SLOT:]]
    ahead = ReadAhead()
    ahead.announce(path, spans, into)
    arrived = [direct_reads.address_of(view) for view in ahead.take(path, spans, into)]
    assert arrived == [direct_reads.address_of(view) for view in into]
    assert out.tobytes() == payload[: 2 * SLOT]

    ahead.announce(path, spans, into)
    assert ahead.take(path, spans) is None  # announced into memory: not the spans a take into slots names
    ahead.close()  # as a RangeReader does then, before it reads them anew
    shifted = memoryview(at_phase(SLOT, 64))
    assert not direct_reads.lands_in_place(shifted[:SLOT], 0, SLOT)
    assert not direct_reads.lands_in_place(into[0][: SLOT - 4096], 0, SLOT)
    assert not direct_reads.lands_in_place(into[0].toreadonly(), 0, SLOT)
    ahead.announce(path, spans, [shifted[:SLOT], None])
    got = [bytes(view) for view in ahead.take(path, spans, [shifted[:SLOT], None])]
    assert got == [payload[:SLOT], payload[SLOT : 2 * SLOT]] and not shifted.tobytes().strip(b"\0")
    with pytest.raises(ValueError, match="2 spans"):
        ahead.announce(path, spans, into[:1])
    ahead.close()
    assert stopped_reading_threads()


def test_a_range_the_page_cache_holds_is_read_through_it(cold_file, spans_read):
    path, payload, record = cold_file
    path.read_bytes()  # now cached
    fd = os.open(path, os.O_RDONLY)
    try:
        assert cached_fraction(fd, 0, SIZE) == 1.0
    finally:
        os.close(fd)
    assert read_into(RangeReader(), path, record, 0, SIZE) == payload
    assert spans_read == []


def test_announce_hints_the_edge_blocks_of_a_range_read_direct(cold_file, spans_read, monkeypatch):
    """A range read direct starts and ends inside blocks, which its read reads on its own
    first: announced, those two blocks are hinted into the page cache (whole: the read
    checks them whole, or reads their parts and gaps) while the inner ones are read ahead
    past it; a range starting on a block boundary hints only its last block."""
    path, payload, record = cold_file
    hinted = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, begin, length, advice: hinted.append((begin, length)))
    reader = RangeReader()
    reader.announce(path, record, 3 * BLOCK + 5, 30 * BLOCK - 7)
    assert hinted == [(3 * BLOCK, BLOCK), (29 * BLOCK, BLOCK)] and len(spans_read) == 1
    assert spans_read[0][0][0] == 4 * BLOCK and spans_read[0][-1][1] == 29 * BLOCK
    reader.clear()
    hinted.clear()
    reader.announce(path, record, 2 * BLOCK, 30 * BLOCK + 9)
    assert hinted == [(30 * BLOCK, BLOCK)]
    reader.clear()


@pytest.mark.skipif(libc() is None, reason="no C library to ask the page cache")
def test_cachestat_and_mincore_count_the_same_cached_pages(cold_file, monkeypatch):
    path, _, _ = cold_file
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: only the pages read are cached
        for page in (0, 3, 4, 17):
            os.pread(fd, 1, page * mmap.PAGESIZE)
        if cached_pages(fd, 0, SIZE) is None:
            pytest.skip("the kernel has no cachestat")
        ranges = [(0, SIZE), (0, mmap.PAGESIZE), (mmap.PAGESIZE, 5 * mmap.PAGESIZE), (2 * mmap.PAGESIZE + 9, SIZE - 3)]
        by_cachestat = [cached_fraction(fd, begin, end) for begin, end in ranges]
        monkeypatch.setattr(direct_reads, "cached_pages", lambda *_: None)
        by_mincore = [cached_fraction(fd, begin, end) for begin, end in ranges]
    finally:
        os.close(fd)
    assert by_cachestat == by_mincore
    assert 0 < by_cachestat[0] < 0.5 and by_cachestat[1] == 1.0


def test_small_ranges_are_read_through_the_page_cache(cold_file, spans_read):
    path, payload, record = cold_file
    assert read_into(RangeReader(), path, record, BLOCK, 2 * BLOCK + 10) == payload[BLOCK : 2 * BLOCK + 10]
    assert spans_read == []


def test_corrupted_bytes_read_direct_name_the_file_and_block(cold_file, spans_read):
    path, payload, record = cold_file
    damaged = bytearray(payload)
    damaged[7 * BLOCK + 3] ^= 0x10
    path.write_bytes(bytes(damaged))
    evict(path)
    with pytest.raises(CheckpointDamagedError, match=rf"{path}: checksum mismatch in block 7 "):
        read_into(RangeReader(), path, record, 0, SIZE)
    assert spans_read and stopped_reading_threads()


def test_a_file_truncated_under_a_direct_read_says_where_it_ends(cold_file, spans_read):
    path, payload, record = cold_file
    path.write_bytes(payload[: 20 * BLOCK + 100])
    evict(path)
    with pytest.raises(CheckpointDamagedError, match=rf"{path}: truncated: expected \d+ bytes, the file ends at {20 * BLOCK + 100}"):
        read_into(RangeReader(), path, record, 0, SIZE)
    assert spans_read and stopped_reading_threads()


def test_read_ahead_stays_a_ring_ahead_and_stops_when_the_loop_does(cold_file):
    path, payload, _ = cold_file
    spans = [(start, min(start + SLOT, SIZE)) for start in range(0, SIZE, SLOT)]
    calls = []
    real = direct_reads._read_until_end

    def counted(fd, view, offset):
        calls.append(offset)
        return real(fd, view, offset)

    try:
        direct_reads._read_until_end = counted
        ahead = ReadAhead(SlotRing(slots=2, slot_bytes=SLOT))
        ahead.announce(path, spans)
        arrived = ahead.take(path, spans)
        assert bytes(next(arrived)) == payload[:SLOT]
        arrived.close()  # the loader stops early: what was announced is dropped
        assert stopped_reading_threads()
        assert len(calls) <= 3 < len(spans)  # the slot handed back, the one free, nothing past them
        assert ahead.take(path, spans[1:]) is None
    finally:
        direct_reads._read_until_end = real


def test_reads_finishing_out_of_order_arrive_in_order_and_an_error_in_its_turn(cold_file, monkeypatch):
    """Two threads read: the second span's read ends first, the fourth fails; the loader
    still gets spans 0, 1, 2 in order with their bytes, then the error."""
    path, payload, _ = cold_file
    spans = [(start, start + SLOT) for start in range(0, 6 * SLOT, SLOT)]
    real = direct_reads._read_until_end
    finished = []
    second_done = threading.Event()

    def uneven(fd, view, offset):
        if offset == 0:
            assert second_done.wait(timeout=60)  # span 1, on the other thread, ends first
        if offset == 3 * SLOT:
            raise OSError(5, "the disk failed")
        got = real(fd, view, offset)
        finished.append(offset)
        if offset == SLOT:
            second_done.set()
        return got

    monkeypatch.setattr(direct_reads, "_read_until_end", uneven)
    ahead = ReadAhead(SlotRing(slots=4, slot_bytes=SLOT))
    ahead.announce(path, spans)
    arrived, delivered = ahead.take(path, spans), []
    with pytest.raises(OSError, match="the disk failed"):
        for data in arrived:
            delivered.append(bytes(data))
    assert finished.index(SLOT) < finished.index(0)  # out of order on the disk
    assert delivered == [payload[begin:end] for begin, end in spans[:3]]
    assert stopped_reading_threads()


def test_a_file_system_refusing_the_alignment_is_read_through_the_page_cache(cold_file, monkeypatch):
    path, payload, _ = cold_file
    spans = [(start, min(start + SLOT, SIZE)) for start in range(0, SIZE, SLOT)]
    real = direct_reads._read_until_end

    def picky(fd, view, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, view, offset)

    monkeypatch.setattr(direct_reads, "_read_until_end", picky)
    ahead = ReadAhead(SlotRing(slots=2, slot_bytes=SLOT))
    ahead.announce(path, spans)
    assert b"".join(bytes(data) for data in ahead.take(path, spans)) == payload
    ahead.close()
    assert stopped_reading_threads()


def test_read_ahead_raises_the_threads_error_and_refuses_bad_spans(tmp_path):
    ahead = ReadAhead(SlotRing(slots=1, slot_bytes=SLOT))
    missing = tmp_path / "missing"
    ahead.announce(missing, [(0, SLOT)])
    with pytest.raises(FileNotFoundError):
        list(ahead.take(missing, [(0, SLOT)]))
    assert stopped_reading_threads()
    for spans, problem in (([(100, 200)], "unaligned"), ([(0, 2 * SLOT)], "longer than a slot"), ([(0, 0)], "empty")):
        with pytest.raises(ValueError, match=problem):
            ahead.announce(missing, spans)


def test_announced_ranges_are_read_ahead_across_reads_and_out_of_order_reads_still_right(cold_file, spans_read):
    path, payload, record = cold_file
    first, second = (2 * BLOCK + 5, 12 * BLOCK), (12 * BLOCK, 30 * BLOCK + 3)
    reader = RangeReader()
    for begin, end in (first, second):
        reader.announce(path, record, begin, end)
    assert len(spans_read) == 2 and spans_read[0][0][0] == 3 * BLOCK and spans_read[1][-1][1] == 30 * BLOCK
    assert read_into(reader, path, record, *first) == payload[slice(*first)]
    assert read_into(reader, path, record, *second) == payload[slice(*second)]
    assert len(spans_read) == 2  # both came from the read-ahead: nothing announced again
    reader.clear()
    assert stopped_reading_threads()

    evict(path)
    reader = RangeReader()
    for begin, end in (first, second):
        reader.announce(path, record, begin, end)
    assert read_into(reader, path, record, *second) == payload[slice(*second)]  # not the next announced
    assert read_into(reader, path, record, *first) == payload[slice(*first)]
    assert len(spans_read) == 6  # dropped, each then read on its own
    del reader
    gc.collect()
    assert stopped_reading_threads()  # a reader's thread ends with it


def test_a_cached_range_read_between_announced_ones_drops_nothing(cold_file, spans_read, tmp_path):
    path, payload, record = cold_file
    cached = tmp_path / "cached.bin"
    cached.write_bytes(payload)  # just written: in the page cache
    first, second = (0, 12 * BLOCK), (12 * BLOCK, 30 * BLOCK)
    reader = RangeReader()
    for begin, end in (first, second):
        reader.announce(path, record, begin, end)
    assert read_into(reader, path, record, *first) == payload[slice(*first)]
    assert read_into(reader, cached, record, 0, SIZE) == payload  # big, never announced
    assert read_into(reader, path, record, *second) == payload[slice(*second)]
    assert DROPPED == [] and len(spans_read) == 2
    reader.clear()
    assert stopped_reading_threads()


def test_announce_reads_cold_big_ranges_ahead_and_hints_the_rest(cold_file, spans_read, monkeypatch):
    path, _, record = cold_file
    hinted = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, begin, length, advice: hinted.append((begin, length)))
    reader = RangeReader()
    reader.announce(path, record, 0, SIZE)
    reader.announce(path, record, BLOCK, 2 * BLOCK)  # too small to read direct
    assert hinted == [(BLOCK, BLOCK)] and len(spans_read) == 1
    reader.clear()
    monkeypatch.setattr(direct_reads, "ENABLED", False)
    reader.announce(path, record, 0, SIZE)
    assert hinted[-1] == (0, SIZE) and len(spans_read) == 1


@pytest.mark.skipif(libc() is None, reason="no C library to ask the page cache")
def test_a_header_and_a_block_read_alone_bring_only_their_pages_into_the_page_cache(tmp_path):
    """The kernel's read-ahead after a header or an edge block would read from the disk what
    the ranges beside them read direct (a second time)."""
    from safetensors.numpy import save_file

    from zeroshard.io.members import open_member
    from zeroshard.io.safetensors_io import read_header

    path = tmp_path / "rank.safetensors"
    save_file({"x": np.arange(2 << 20, dtype=np.float32)}, str(path))  # 8 MiB
    direct = direct_reads.open_direct(path)
    if direct is None:
        pytest.skip(f"{tmp_path}: a file system whose files live in the page cache (no O_DIRECT)")
    os.close(direct)
    size = path.stat().st_size
    evict(path)
    read_header(path, size)
    fd = open_member(path, read_ahead=False)
    try:
        os.pread(fd, 16 << 10, 0)  # the first block, read alone
        cached = cached_fraction(fd, 0, size) * size
    finally:
        os.close(fd)
    assert cached <= (16 << 10) + mmap.PAGESIZE, f"{cached} bytes cached after reading 16 KiB"


def resident_pages(array: np.ndarray) -> list[int]:
    pages = -(-array.nbytes // mmap.PAGESIZE)
    flags = (ctypes.c_ubyte * pages)()
    assert libc().mincore(ctypes.c_void_p(array.ctypes.data), array.nbytes, flags) == 0
    return [flag & 1 for flag in bytes(flags)]


@pytest.mark.skipif(libc() is None, reason="no C library to ask mincore")
def test_populate_maps_the_pages_under_a_view_and_keeps_their_bytes():
    pages = 512  # above host_memory.SMALL: a mapping of its own
    array = new_zeros(pages * mmap.PAGESIZE, np.uint8, populated=False)
    assert sum(resident_pages(array)) == 0
    populate(memoryview(array)[10 * mmap.PAGESIZE + 5 : 20 * mmap.PAGESIZE - 5])
    resident = resident_pages(array)
    if sum(resident) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident == [0] * 10 + [1] * 10 + [0] * (pages - 20)
    assert not array.any()
    array[:] = 9
    populate(memoryview(array))
    assert (array == 9).all() and sum(resident_pages(array)) == pages
    assert sum(resident_pages(new_zeros(pages * mmap.PAGESIZE, np.uint8))) == pages  # populated by default
    other = new_zeros(pages * mmap.PAGESIZE, np.uint8, populated=False)
    populate(memoryview(other)[::2])  # not one run of memory: left alone
    populate(memoryview(other).toreadonly())
    assert sum(resident_pages(other)) == 0


@pytest.mark.skipif(libc() is None, reason="no C library to ask mincore")
def test_mapping_ahead_maps_the_views_in_order_keeps_their_bytes_and_stops_between_two():
    pages, piece = 512, 16
    array = new_zeros(pages * mmap.PAGESIZE, np.uint8, populated=False)
    array[-1] = 7  # the last page mapped, and a byte to keep
    views = [memoryview(array)[start : start + piece * mmap.PAGESIZE] for start in range(0, array.nbytes, piece * mmap.PAGESIZE)]
    mapping = MappingAhead(views)
    mapping._thread.join(timeout=60)
    mapping.close()
    if sum(resident_pages(array)) == 1:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert sum(resident_pages(array)) == pages and not array[:-1].any() and array[-1] == 7

    other = new_zeros(pages * mmap.PAGESIZE, np.uint8, populated=False)
    views = [memoryview(other)[start : start + piece * mmap.PAGESIZE] for start in range(0, other.nbytes, piece * mmap.PAGESIZE)]
    with MappingAhead(views):
        pass  # left at once: it stops after the view it is mapping
    assert mapping_threads() == []
    resident = resident_pages(other)
    mapped = sum(resident)
    assert mapped % piece == 0 and resident == [1] * mapped + [0] * (pages - mapped), "mapped out of order, or a view in part"


@pytest.mark.parametrize("kind", ["native", "native, weights read", "universal"])
@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_a_cold_load_reads_direct_and_holds_what_a_cached_load_holds(
    tmp_path, small_slots, spans_read, landed, monkeypatch, new_world, kind
):
    """Saved at D=2 (and converted to a universal checkpoint), loaded at D = 1, 2, 3 from a
    cold checkpoint (direct reads) and from a cached one: the same tensors bit for bit, the
    same bytes counted. A load that rebuilds the weights from the masters (as load_checkpoint
    with several ranks) has its direct reads land in its partitions with no copy (all of them
    at the saved layout); every partition starts 16-byte aligned."""
    monkeypatch.setattr(host_memory, "SMALL", 4096)  # the partitions here are mapped memory, as big ones are
    from universal_helpers import save_synthetic

    from zeroshard.checkpoint.loader import load_state
    from zeroshard.checkpoint.native.source import NativeSource
    from zeroshard.checkpoint.attest.attestation import Evidence
    from zeroshard.checkpoint.shared_module import share_checkpoint
    from zeroshard.checkpoint.universal import UniversalSource, to_universal
    from zeroshard.layout import ParamSpec, build_layout

    specs = [[ParamSpec.of("w", (512, 300), "bf16"), ParamSpec.of("v", (300, 97), "bf16")], [ParamSpec.of("b", (300,), "bf16")]]
    path = save_synthetic(tmp_path, build_layout(specs, 2), block_size=BLOCK)
    if kind == "universal":
        path = to_universal(path, tmp_path / "universal", block_size=BLOCK, progress=False)
    opened = UniversalSource if kind == "universal" else NativeSource
    if direct_reads.open_direct(next(path.glob("*.safetensors"))) is None:
        pytest.skip(f"{tmp_path}: the file system reads nothing past the page cache (O_DIRECT)")
    layout = build_layout(specs, new_world)

    def load(rank, cold):
        if cold:
            for file in path.iterdir():
                evict(file)
        stats = ReadStats()
        with opened(path, stats=stats) as source:
            # As load_checkpoint loads with several ranks: the weights rebuilt from the
            # masters the partitions hold (a share), not read whole beforehand.
            shared = {"share": share_checkpoint(source.info.model_entries, layout, rank), "evidence": Evidence()}
            if kind == "native, weights read":  # as a load alone without optimizer state: model.safetensors read
                shared = {}
            state = load_state(source, layout, rank, **shared)
        tensors = [*state.fp32_partitions, *(t for group in state.optimizer_states for _, t in sorted(group.items()))]
        return tensors, (stats.data, stats.bytes_by_file)

    for rank in range(new_world):
        landed.clear()
        direct, direct_counts = load(rank, cold=True)
        assert spans_read, f"rank {rank}: nothing read direct"
        assert all(tensor.data_ptr() % 16 == 0 for tensor in direct)
        if kind != "native, weights read":
            assert "in place" in landed and (new_world != 2 or set(landed) == {"in place"}), (rank, landed)
        assert DROPPED == [], f"rank {rank}: the loader read other ranges than it announced"
        spans_read.clear()
        monkeypatch.setattr(direct_reads, "ENABLED", False)
        cached, cached_counts = load(rank, cold=False)
        monkeypatch.setattr(direct_reads, "ENABLED", True)
        assert spans_read == [] and direct_counts == cached_counts
        assert len(direct) == len(cached) == 6
        assert all(a.dtype == b.dtype and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8)) for a, b in zip(direct, cached))


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", hasattr(os, "O_DIRECT")), (None, hasattr(os, "O_DIRECT"))])
def test_the_environment_turns_direct_reads_off(value, enabled):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_DIRECT_READS"}
    if value is not None:
        env["ZEROSHARD_DIRECT_READS"] = value
    code = "from zeroshard.io import direct_reads; print(direct_reads.ENABLED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str(enabled)
