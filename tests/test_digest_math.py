"""The digest math: any split of a tensor into pieces, digested anywhere in any order, combines
to zlib.crc32 of the whole; and what one rank holds of any layout tiles the logical state."""

from __future__ import annotations

import math
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint.attest.digests import (
    HeldPiece,
    JointDigester,
    PartitionDigester,
    Terms,
    array_digest,
    digests_from_terms,
    held_pieces,
    partition_terms,
)
from zeroshard.io import digest as math_
from zeroshard.io.safetensors_io import write_safetensors
from zeroshard.layout import ExpertMesh, LayoutPolicy, ParamSpec, build_layout, global_shape

SETTINGS = settings(max_examples=60, deadline=None)


def combined(data: bytes, cuts: list[int], order: list[int]) -> int:
    """The digest of ``data`` from its pieces between ``cuts``, combined in ``order``."""
    bounds = [0, *cuts, len(data)]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    terms = 0
    for index in order:
        begin, end = pieces[index]
        terms ^= math_.piece_term(math_.raw_crc(data[begin:end]), len(data) - end)
    return math_.finish(terms, len(data))


@SETTINGS
@given(st.binary(min_size=0, max_size=3000), st.data())
def test_any_split_in_any_order_combines_to_the_crc_of_the_whole(data, draw):
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(data)), max_size=12)))
    order = draw.draw(st.permutations(range(len(cuts) + 1)))
    assert combined(data, cuts, list(order)) == zlib.crc32(data)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**45))
def test_the_python_shift_is_zlib_ngs(value, count):
    assert math_.shift_python(value, count) == math_.shift(value, count)
    assert math_.shift(value, count) == zlib_combine(value, count)


def zlib_combine(value: int, count: int) -> int:
    """x^(8 count) * value mod P, the slow way for small counts: feed zero bytes to a raw CRC."""
    if count > 4096:
        return math_.shift(value, count)  # checked against the Python version above
    return math_.raw_crc(bytes(count), value)


@SETTINGS
@given(st.binary(min_size=1, max_size=2000), st.lists(st.integers(1, 700), min_size=1, max_size=8))
def test_a_running_crc_across_chunks_is_the_crc_of_the_piece(data, chunk_sizes):
    running, position, index = None, 0, 0
    while position < len(data):
        size = chunk_sizes[index % len(chunk_sizes)]
        running = math_.raw_crc(data[position : position + size], running)
        position, index = position + size, index + 1
    assert math_.finish(math_.piece_term(running, 0), len(data)) == zlib.crc32(data)


# ---- what the digest tells apart ----------------------------------------------------------


def values(seed: int, numel: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(numel).astype(np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_swapped_experts_a_shifted_range_and_a_leaked_padding_zero_change_the_digest(seed):
    stack = values(seed, 8 * 48).reshape(8, 48)
    swapped = stack.copy()
    swapped[[2, 5]] = swapped[[5, 2]]
    assert array_digest(swapped) != array_digest(stack)  # the stack as a whole
    assert array_digest(swapped[2]) != array_digest(stack[2])  # and per expert
    flat = stack.reshape(-1)
    shifted = np.concatenate([flat[1:], np.zeros(1, np.float32)])  # off by one element
    assert array_digest(shifted) != array_digest(flat)
    leaked = np.concatenate([np.zeros(1, np.float32), flat[:-1]])  # a padding zero read first
    assert array_digest(leaked) != array_digest(flat)


def test_zeros_count_where_they_are():
    """A sum of value * f(index) ignores zeros; the CRC does not: moving zeros, or a tensor of
    zeros one element longer, changes the digest."""
    data = np.array([0, 0, 1, 0], dtype=np.float32)
    assert array_digest(data) != array_digest(np.array([0, 1, 0, 0], dtype=np.float32))
    assert array_digest(np.zeros(4, np.float32)) != array_digest(np.zeros(5, np.float32))
    assert array_digest(np.array([0.0], np.float32)) != array_digest(np.array([-0.0], np.float32))  # bits, not values


@SETTINGS
@given(st.integers(0, 50), st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_one_wrong_element_is_always_caught(seed, numel, bits):
    data = values(seed, numel)
    changed = data.copy()
    index = bits % numel
    changed.view(np.uint32)[index] ^= (bits >> 1) | 1  # any nonzero change of one element
    assert array_digest(changed) != array_digest(data)


# ---- layouts: what each rank holds tiles the logical state ----------------------------------


@st.composite
def layouts(draw):
    """A dense group and an expert group at a random (W, EP), alignment and bucket size."""
    ep = draw(st.sampled_from([1, 2, 4]))
    world_size = ep * draw(st.integers(1, 5))
    experts = ep * draw(st.integers(1, 3))
    alignment = draw(st.sampled_from([16, 64, 256]))
    bucket = draw(st.one_of(st.none(), st.integers(8, 200)))
    dense = [ParamSpec.of(f"d{i}", (draw(st.integers(0, 30)),), "bfloat16") for i in range(draw(st.integers(1, 4)))]
    local = experts // ep
    stacks = [ParamSpec.of(f"e{i}", (local, draw(st.integers(1, 6)), draw(st.integers(1, 5))), "bfloat16") for i in range(2)]
    mesh = ExpertMesh(world_size, ep)
    policy = LayoutPolicy.native(alignment, bucket_numel=bucket)
    return build_layout([dense, mesh.expert_group(stacks, experts)], world_size, policy)


def logical_tensors(layout, kind: str) -> dict[tuple, np.ndarray]:
    """Every logical tensor's values (seeded by name and kind), by (name, expert)."""
    found = {}
    for group in layout.groups:
        for slot in group.params:
            whole = values(zlib.crc32(f"{kind}{slot.name}".encode()), math.prod(global_shape(group, slot)))
            if group.is_expert_group:
                count = sum(len(ids) for ids in group.expert_map)
                per = whole.size // count
                found.update({(slot.name, e): whole[e * per : (e + 1) * per] for e in range(count)})
            else:
                found[(slot.name, None)] = whole
    return found


def partition_of(layout, group, rank: int, tensors) -> np.ndarray:
    """Rank ``rank``'s partition of ``group`` filled from ``tensors``, padding a marker value."""
    partition = np.full(group.partition_numel, 7.0, dtype=np.float32)  # padding that must not count
    for piece in held_pieces(group, rank):
        source = tensors[(piece.name, piece.expert)]
        partition[piece.partition_start : piece.partition_start + piece.length] = source[piece.position : piece.position + piece.length]
    return partition


@settings(max_examples=30, deadline=None)
@given(layouts(), st.integers(1, 3), st.sampled_from([16, 52, 4096]))
def test_every_rank_digesting_its_partitions_gives_the_digests_of_the_logical_state(layout, chunk, block_size):
    """Rank by rank: digested in memory, fed to the digester in chunks of any size, or written
    by the real writer (whose one CRC pass, cut at blocks and pieces, serves both)."""
    tensors = logical_tensors(layout, "fp32")
    terms = Terms()
    for rank in range(layout.world_size):
        for group in layout.groups:
            partition = partition_of(layout, group, rank, tensors)
            digester = PartitionDigester(held_pieces(group, rank), "fp32", 4, terms)
            if rank % 3 == 1:  # chunks that cut elements apart
                raw = memoryview(partition.view(np.uint8))
                size = 4 * chunk + 1
                for start in range(0, len(raw), size):
                    digester(start, raw[start : start + size])
            elif rank % 3 == 2:
                with tempfile.TemporaryDirectory() as directory:
                    path = Path(directory) / "f.safetensors"
                    record = write_safetensors(path, [("p", partition)], block_size, observers={"p": digester})
                    data = path.read_bytes()
                blocks = [zlib.crc32(data[i : i + block_size]) for i in range(0, len(data), block_size)]
                assert list(record.crc32) == blocks  # the block checksums are still right
            else:
                partition_terms(held_pieces(group, rank), "fp32", partition, terms)
    kinds = {group.index: ("fp32",) for group in layout.groups}
    sizes = {(group.index, "fp32"): 4 for group in layout.groups}
    params, problems = digests_from_terms(layout, terms, kinds, sizes)
    assert problems == []
    for (name, expert), tensor in tensors.items():
        found = params[name]["fp32"] if expert is None else params[name]["fp32"][expert]
        assert found == zlib.crc32(tensor.tobytes()), (name, expert)


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from([16, 52, 4096]), st.data())
def test_one_pass_digests_what_it_reads_where_it_lands_and_where_it_lay(layout, block_size, draw):
    """A load from a source without digests: one reader pass over each range feeds both the
    digester of the partition the bytes lay in (the source's pieces) and one of where they
    land (here: tensors cut anywhere else, at an offset), each getting exactly the terms a
    pass of its own would give."""
    from zeroshard.io.block_reader import RangeReader
    from zeroshard.io.safetensors_io import read_header

    tensors = logical_tensors(layout, "fp32")
    group = layout.groups[0]
    rank = draw.draw(st.integers(0, layout.world_size - 1))
    partition = partition_of(layout, group, rank, tensors)
    cuts = sorted(draw.draw(st.lists(st.integers(0, partition.size), max_size=5)))
    ranges = [(a, b) for a, b in zip([0, *cuts], [*cuts, partition.size]) if a < b]
    landing = draw.draw(st.integers(0, 7))  # where the stream lands in the other partition
    splits = sorted(set(draw.draw(st.lists(st.integers(0, partition.size), max_size=6))) | {0, partition.size})
    bounds = [(a, b) for a, b in zip(splits, splits[1:]) if a < b]  # each a tensor of its own
    pieces = [HeldPiece(f"t{a}", None, landing + a, 0, b - a, b - a) for a, b in bounds]
    lay, land = Terms(), Terms()
    source = PartitionDigester(held_pieces(group, rank), "fp32", 4, lay)
    dest = PartitionDigester(pieces, "fp32", 4, land)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "partition.safetensors"
        record = write_safetensors(path, [("p", partition)], block_size)
        entry = read_header(path, record.size)["p"]
        placed = np.zeros_like(partition)
        reader = RangeReader(cache_bytes=block_size * 2)
        for start, end in draw.draw(st.permutations(ranges)):
            both = JointDigester(source.at(4 * start), dest.at(4 * (landing + start)))
            reader.read_into(path, record, entry.begin + 4 * start, memoryview(placed[start:end].view(np.uint8)), both)
    assert placed.tobytes() == partition.tobytes()
    alone = Terms()
    partition_terms(held_pieces(group, rank), "fp32", partition, alone)
    assert lay.values == alone.values
    found = {name: math_.finish(term, nbytes) for (name, _, _), (term, nbytes) in land.values.items()}
    assert found == {f"t{a}": zlib.crc32(partition[a:b].tobytes()) for a, b in bounds}


def test_a_piece_missing_or_counted_twice_is_named():
    layout = build_layout([[ParamSpec.of("w", (10,), "float32")]], 2)
    tensors = logical_tensors(layout, "fp32")
    terms = Terms()
    group = layout.groups[0]
    partition_terms(held_pieces(group, 0), "fp32", partition_of(layout, group, 0, tensors), terms)
    held = [4 * sum(piece.length for piece in held_pieces(group, rank)) for rank in (0, 1)]
    assert held[0] and held[1] and sum(held) == 40
    params, problems = digests_from_terms(layout, terms, {0: ("fp32",)}, {(0, "fp32"): 4})
    assert problems == [f"'w' fp32: the ranks hold {held[0]} of its 40 bytes"]
    for rank in (1, 1):  # rank 1's piece twice: the XOR cancels it, the byte count does not
        partition_terms(held_pieces(group, rank), "fp32", partition_of(layout, group, rank, tensors), terms)
    twice = held[0] + 2 * held[1]
    assert digests_from_terms(layout, terms, {0: ("fp32",)}, {(0, "fp32"): 4})[1] == [f"'w' fp32: the ranks hold {twice} of its 40 bytes"]


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from([16, 52, 4096]), st.data())
def test_a_reader_digests_what_it_reads_into_place_in_any_ranges(layout, block_size, draw):
    """What a load does: each rank's partitions read back range by range (in any order, cut
    anywhere) into place, the reader handing each checked segment's CRC to the digester."""
    from zeroshard.io.block_reader import RangeReader
    from zeroshard.io.safetensors_io import read_header

    tensors = logical_tensors(layout, "fp32")
    terms = Terms()
    with tempfile.TemporaryDirectory() as directory:
        for rank in range(layout.world_size):
            for group in layout.groups:
                partition = partition_of(layout, group, rank, tensors)
                path = Path(directory) / f"r{rank}g{group.index}.safetensors"
                record = write_safetensors(path, [("p", partition)], block_size)
                entry = read_header(path, record.size)["p"]
                cuts = sorted(draw.draw(st.lists(st.integers(0, partition.size), max_size=5)))
                ranges = [(a, b) for a, b in zip([0, *cuts], [*cuts, partition.size]) if a < b]
                digester = PartitionDigester(held_pieces(group, rank), "fp32", 4, terms)
                placed = np.zeros_like(partition)
                reader = RangeReader(cache_bytes=block_size * 2)
                for start, end in draw.draw(st.permutations(ranges)):
                    out = memoryview(placed[start:end].view(np.uint8))
                    reader.read_into(path, record, entry.begin + 4 * start, out, digester.at(4 * start))
                assert placed.tobytes() == partition.tobytes()
    kinds = {group.index: ("fp32",) for group in layout.groups}
    params, problems = digests_from_terms(layout, terms, kinds, {(group.index, "fp32"): 4 for group in layout.groups})
    assert problems == []
    for (name, expert), tensor in tensors.items():
        found = params[name]["fp32"] if expert is None else params[name]["fp32"][expert]
        assert found == zlib.crc32(tensor.tobytes()), (name, expert)
