"""The load path's reads: checked bytes read straight into the caller's memory.

``RangeReader.read_into`` reads the checksum blocks wholly inside a range into the
destination and checks each there; blocks the range holds only part of go through a cache
of edge blocks. ``NativeSource.model_tensors`` reads neighbouring tensors in one read.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from zeroshard.checkpoint import ReadStats, load_sharded, run_ranks, save_sharded
from zeroshard.checkpoint.format import MODEL_FILE
from zeroshard.io import block_reader
from zeroshard.io.block_reader import RangeReader
from zeroshard.io.checksum import BlockHasher
from zeroshard.io.safetensors_io import TensorEntry
from zeroshard.checkpoint.native.source import NativeSource, _adjacent_runs
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.layout import ParamSpec, build_layout

BLOCK = 1000


def write_with_record(path, payload: bytes, block_size: int = BLOCK):
    path.write_bytes(payload)
    hasher = BlockHasher(block_size)
    hasher.update(payload)
    return hasher.record()


@pytest.fixture
def payload_file(tmp_path):
    payload = np.random.default_rng(3).integers(0, 256, 10_500, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    return path, payload, write_with_record(path, payload)


def read_into(reader, path, record, begin, end) -> bytes:
    out = np.empty(end - begin, dtype=np.uint8)
    out[:] = 0xAA  # anything the read leaves unwritten shows
    reader.read_into(path, record, begin, memoryview(out))
    return out.tobytes()


@pytest.mark.parametrize(
    "begin, end",
    [(0, 10_500), (0, 1000), (1000, 3000), (10, 20), (999, 1001), (500, 4500), (3000, 10_500), (2500, 2500)]
    + [(9999, 10_500)],
)
def test_read_into_gives_the_files_bytes(payload_file, begin, end):
    path, payload, record = payload_file
    assert read_into(RangeReader(), path, record, begin, end) == payload[begin:end]


def test_read_into_of_neighbouring_ranges_reads_each_block_once(payload_file, monkeypatch):
    """The block two ranges share is read once, kept, and its parts copied to each."""
    monkeypatch.setattr(block_reader, "READ_CHUNK", 3 * BLOCK)  # several blocks per pread
    path, payload, record = payload_file
    stats = ReadStats()
    reader = RangeReader(stats)
    cuts = [0, 7, 1500, 1800, 6000, 6001, 10_500]
    for begin, end in itertools.pairwise(cuts):
        assert read_into(reader, path, record, begin, end) == payload[begin:end]
    assert stats.total == len(payload)


@pytest.mark.parametrize("where", [4321, 7999, 500])  # inside a whole block; a chunk's last block; an edge block
def test_read_into_finds_a_flipped_byte(payload_file, monkeypatch, where):
    monkeypatch.setattr(block_reader, "READ_CHUNK", 3 * BLOCK)
    path, payload, record = payload_file
    path.write_bytes(payload[:where] + bytes([payload[where] ^ 0x10]) + payload[where + 1 :])
    with pytest.raises(ValueError) as error:
        read_into(RangeReader(), path, record, 200, 9000)
    message = str(error.value)
    assert message == (
        f"{path}: checksum mismatch in block {where // BLOCK} "
        f"(bytes {where // BLOCK * BLOCK}-{where // BLOCK * BLOCK + BLOCK}): the file is corrupted"
    )


def test_read_into_stops_at_a_short_file(payload_file):
    """A file cut after it was opened and checked: the pread comes back short."""
    path, payload, record = payload_file
    path.write_bytes(payload[:5500])
    with pytest.raises(ValueError, match=r"truncated: expected 9000 bytes, the file ends at 5500$"):
        read_into(RangeReader(), path, record, 3000, 9000)
    with pytest.raises(ValueError, match="truncated: expected 10000 bytes, the file ends at 5500"):
        read_into(RangeReader(), path, record, 9000, 9500)  # an edge block wholly past the end


def test_read_into_reads_the_edge_blocks_after_the_inner_ones(payload_file, monkeypatch):
    """A range's partial blocks at its ends are read after its whole blocks (the kernel,
    told of them by announce, reads them meanwhile), and the bytes are still the file's."""
    path, payload, record = payload_file
    reads = []
    reader = RangeReader()
    inner = reader._read_checked

    def spy(path, record, first, last, *args, **options):
        reads.append((first, last))
        return inner(path, record, first, last, *args, **options)

    monkeypatch.setattr(reader, "_read_checked", spy)
    assert read_into(reader, path, record, 1500, 8500) == payload[1500:8500]
    assert reads == [(2, 7), (1, 1), (8, 8)], reads  # blocks 2..7 whole, then edge blocks 1 and 8


def test_read_unchecked_reads_the_bytes_and_refuses_what_the_file_lacks(payload_file):
    path, payload, record = payload_file
    assert bytes(RangeReader().read_unchecked(path, record, 1234, 1240)) == payload[1234:1240]
    with pytest.raises(ValueError, match=r"byte range \[10000, 10600\) is outside its 10500 bytes"):
        RangeReader().read_unchecked(path, record, 10_000, 10_600)
    path.write_bytes(payload[:5500])
    with pytest.raises(ValueError, match=r"f: truncated"):
        RangeReader().read_unchecked(path, record, 5000, 6000)


def test_read_into_refuses_a_range_outside_the_file(payload_file):
    path, _, record = payload_file
    with pytest.raises(ValueError, match=r"byte range \[10000, 10600\) is outside its 10500 bytes"):
        read_into(RangeReader(), path, record, 10_000, 10_600)


# ---- the native source -------------------------------------------------------------------------


def odd_specs():
    """bf16 weights of odd sizes (fp32 offsets that are not multiples of 4 in the file) and one
    fp32 parameter right after an odd-sized bf16 one."""
    return [
        [ParamSpec("a", (33, 7), "bfloat16"), ParamSpec("b", (5,), "bfloat16"), ParamSpec("c", (300, 41), "bfloat16")],
        [ParamSpec("d", (3,), "bfloat16")],
        [ParamSpec("e", (17,), "float32")],
    ]


@pytest.fixture
def saved(tmp_path):
    layout = build_layout(odd_specs(), 2)
    states = [synthesize_state(layout, rank) for rank in range(2)]
    run_ranks(2, lambda coord: save_sharded(tmp_path, "t", states[coord.rank], coordinator=coord, block_size=4096))
    return tmp_path / "t", layout, states


def test_model_tensors_are_the_files_own_aligned_and_writable(saved):
    path, _, _ = saved
    reference = load_file(str(path / MODEL_FILE))
    with NativeSource(path) as source:
        assert source._header(MODEL_FILE)["e"].begin % 4 != 0  # fp32 at an offset it cannot be viewed at
        names = list(source.checkpoint.manifest.model_tensors)
        found = source.model_tensors(names)
        lone = source.model_tensor("c")
    assert set(found) == set(reference)
    for name, array in found.items():
        assert array.tobytes() == reference[name].tobytes() and array.shape == reference[name].shape, name
        assert array.flags.writeable and array.ctypes.data % array.dtype.itemsize == 0, name
    assert lone.tobytes() == reference["c"].tobytes()


def test_model_tensors_reads_neighbours_into_one_buffer(saved):
    path, _, _ = saved
    with NativeSource(path) as source:
        header = source._header(MODEL_FILE)
        assert header["a"].end == header["b"].begin
        together = source.model_tensors(["b", "a"])
    assert together["b"].ctypes.data - together["a"].ctypes.data == header["b"].begin - header["a"].begin


def test_adjacent_runs_cut_where_a_tensor_is_left_out():
    spans = {"a": (8, 12), "b": (12, 14), "c": (14, 18), "d": (18, 18), "e": (22, 26)}  # d is empty; e comes later
    entries = {name: TensorEntry("BF16", ((end - begin) // 2,), begin, end) for name, (begin, end) in spans.items()}
    assert _adjacent_runs(["a", "b", "c", "d", "e"], entries.__getitem__) == [["a", "b", "c", "d"], ["e"]]
    assert _adjacent_runs(["a", "c", "d"], entries.__getitem__) == [["a"], ["c", "d"]]


def test_read_into_casts_into_another_dtype(saved):
    """``out`` in another dtype than the stored one: read and cast, same values as ``read``."""
    path, layout, _ = saved
    with NativeSource(path) as source:
        numel = layout.groups[0].partition_numel
        expected = source.read(1, 0, "exp_avg", 3, numel)
        as_fp64 = np.empty(numel - 3, dtype=np.float64)
        source.read_into(1, 0, "exp_avg", 3, as_fp64)
        direct = np.empty(numel - 3, dtype=np.float32)
        source.read_into(1, 0, "exp_avg", 3, direct)
    assert np.array_equal(as_fp64, expected.astype(np.float64)) and np.array_equal(direct, expected)


@pytest.mark.parametrize("world", [2, 3, 1])
def test_loaded_state_equals_the_saved_one_and_owns_writable_memory(saved, world):
    """Same D and resharded: every tensor bit-equal to the saved run's, none read-only."""
    path, _, states = saved
    new_layout = build_layout(odd_specs(), world)
    for rank in range(world):
        loaded = load_sharded(path, new_layout, rank)
        expected = synthesize_state(new_layout, rank, model_state=states[0].model_state)
        for got, want in zip(loaded.fp32_partitions, expected.fp32_partitions):
            assert torch.equal(got, want)
        for got, want in zip(loaded.optimizer_states, expected.optimizer_states):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert loaded.model_state.keys() == states[0].model_state.keys()
        for name, tensor in loaded.model_state.items():
            assert torch.equal(tensor, states[0].model_state[name]), name
            assert tensor.is_contiguous() and tensor.data_ptr() % tensor.element_size() == 0, name
        tensor = loaded.model_state["e"]
        tensor.add_(1)  # writable: torch would warn on a read-only buffer


def counted_crcs(monkeypatch) -> list[int]:
    """The lengths of every CRC the reader, the blocks' checks and the observers take from now on."""
    from zeroshard.io import checksum, digest, observe

    crcd: list[int] = []
    for module in (block_reader, checksum, observe, digest):
        original = module.crc32
        counting = lambda data, *more, crc32=original: crcd.append(len(memoryview(data))) or crc32(data, *more)  # noqa: E731
        monkeypatch.setattr(module, "crc32", counting)
    return crcd


def range_digester(length: int):
    """A digester of one piece of ``length`` bytes, and the terms it fills."""
    from zeroshard.checkpoint.attest.digests import HeldPiece, PartitionDigester, Terms

    terms = Terms()
    return PartitionDigester([HeldPiece("r", None, 0, 0, length, length)], "fp32", 1, terms), terms


@pytest.mark.parametrize("begin, end", [(500, 4500), (10, 20), (2500, 2600), (3000, 10_500)])
def test_an_edge_block_read_now_gives_its_parts_crcs_from_its_check(payload_file, monkeypatch, begin, end):
    """A range's digests come from the CRCs of its blocks' checks: an edge block read whole
    (the range holds part of it) is cut at the part's ends, not CRC'd again for the part; a
    second read of a neighbouring range, its edge block from the cache, CRCs just its part.
    The digester's terms combine to the CRC of the range either way."""
    from zeroshard.io import digest as digest_math

    path, payload, record = payload_file
    crcd = counted_crcs(monkeypatch)
    blocks = record.blocks_covering(begin, end)
    read_bytes = record.block_range(blocks[-1])[1] - record.block_range(blocks[0])[0]
    reader = RangeReader()
    for lo, hi in ((begin, end), (end, min(end + 300, len(payload)))):
        if hi <= lo:
            continue
        observe, terms = range_digester(hi - lo)
        crcd.clear()
        out = np.empty(hi - lo, dtype=np.uint8)
        reader.read_into(path, record, lo, memoryview(out), observe)
        assert out.tobytes() == payload[lo:hi]
        (term, nbytes), = terms.values.values()
        assert digest_math.finish(term, nbytes) == zlib.crc32(payload[lo:hi])
        if lo == begin:
            assert sum(crcd) == read_bytes, (crcd, read_bytes)  # each block's bytes CRC'd once
        else:
            first = record.block_range(record.blocks_covering(lo, hi)[0])
            assert sum(crcd) <= (hi - lo) + (first[1] - first[0]), crcd  # the cached edge's part again, at most


@pytest.mark.parametrize("begin, end", [(500, 4500), (10, 20), (2500, 2600), (3000, 10_500), (1000, 3000)])
def test_an_edge_part_checked_with_the_other_ranks_is_crcd_once(payload_file, monkeypatch, begin, end):
    """In a load whose ranks check edge blocks together, a range's edge parts are read alone:
    one CRC of each part gives both the load's record terms and the range's digests. Every
    byte of the file is needed by some rank (no gaps to read), so the reader CRCs exactly the
    range: fails with the part CRC'd twice (once for each)."""
    from zeroshard.io import digest as digest_math
    from zeroshard.io.shared_checks import RecordTerms, SharedRecordChecks, record_problems

    path, payload, record = payload_file
    crcd = counted_crcs(monkeypatch)
    reader, checks = RangeReader(), SharedRecordChecks(RecordTerms())
    reader.check_with_others(checks, lambda _: [(0, len(payload))])
    observe, terms = range_digester(end - begin)
    out = np.empty(end - begin, dtype=np.uint8)
    reader.read_into(path, record, begin, memoryview(out), observe)
    assert out.tobytes() == payload[begin:end]
    (term, nbytes), = terms.values.values()
    assert digest_math.finish(term, nbytes) == zlib.crc32(payload[begin:end])
    assert sum(crcd) == end - begin, crcd
    # The other ranks' parts: the rest of the file, their terms combined with this rank's.
    others = SharedRecordChecks(RecordTerms())
    for lo, hi in ((0, begin), (end, len(payload))):
        for index in record.blocks_covering(lo, hi) if hi > lo else ():
            block_start, block_end = record.block_range(index)
            part_lo, part_hi = max(lo, block_start), min(hi, block_end)
            if (part_lo, part_hi) != (block_start, block_end):
                key = (str(path), f"checksum block {index}")
                crc = digest_math.raw_crc(payload[part_lo:part_hi])
                others.terms.add(key, block_end - block_start, record.crc32[index], part_lo - block_start, part_hi - block_start, crc)
    assert record_problems([checks.terms, others.terms]) == []
