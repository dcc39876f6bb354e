"""The pieces: read planning, the thread coordinator, the manifest's JSON values, block checksums."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hostile_files import cpu_seconds

from zeroshard.checkpoint import RankFailedError, plan_reads, run_ranks
from zeroshard.io import checksum
from zeroshard.io.checksum import BlockHasher
from zeroshard.io.dtypes import to_torch
from zeroshard.io.jsonvalue import decode, encode
from zeroshard.checkpoint.reshard import Copy, coalesce
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SPECS = [[ParamSpec.of(f"p{i}", (i * 7 + 3,), "bf16") for i in range(6)]]


def test_equal_layouts_copy_each_partition_whole():
    layout = build_layout(SPECS, 4)
    (plan,) = plan_reads(layout, layout, 2)
    assert plan.copies == (Copy(2, 0, 0, 0, layout.groups[0].partition_numel),)


@pytest.mark.parametrize("old_world, new_world", [(4, 3), (3, 4), (1, 5), (7, 2)])
def test_plan_covers_every_parameter_element_once(old_world, new_world):
    old = build_layout(SPECS, old_world, LayoutPolicy.native(compact=True))
    new = build_layout(SPECS, new_world, LayoutPolicy.native(bucket_numel=20))
    for rank in range(new_world):
        (plan,) = plan_reads(old, new, rank)
        real = sum(f.length for f in new.groups[0].fragments(rank))
        assert plan.numel == real
        destinations = sorted((c.dest_start, c.dest_start + c.length) for c in plan.copies)
        assert all(a[1] <= b[0] for a, b in zip(destinations, destinations[1:]))
        assert all(0 <= c.source_rank < old_world for c in plan.copies)


def test_coalesce_merges_runs_contiguous_on_both_sides_only():
    copies = [Copy(0, 0, 10, 0, 5), Copy(0, 0, 15, 5, 5), Copy(0, 0, 20, 12, 3), Copy(1, 0, 0, 15, 4)]
    assert coalesce(copies[::-1]) == (Copy(0, 0, 10, 0, 10), Copy(0, 0, 20, 12, 3), Copy(1, 0, 0, 15, 4))


def test_thread_ranks_collectives():
    def body(coord):
        gathered = coord.all_gather_object(coord.rank * 10)
        coord.barrier()
        return gathered, coord.broadcast_object(f"from {coord.rank}", src=2)

    results = run_ranks(4, body)
    assert all(r == ([0, 10, 20, 30], "from 2") for r in results)


def test_a_failing_thread_rank_releases_the_others():
    def body(coord):
        if coord.rank == 1:
            raise KeyError("boom")
        coord.barrier()

    results = run_ranks(3, body, return_exceptions=True)
    assert isinstance(results[1], KeyError)
    assert isinstance(results[0], RankFailedError) and isinstance(results[2], RankFailedError)
    with pytest.raises(KeyError):
        run_ranks(3, body)


def test_json_values_round_trip_with_their_types():
    value = {
        "betas": (0.9, 0.999),
        "nested": [{"a": None, "b": True}, (1, (2, 3))],
        "inf": float("inf"),
        7: "int key",
        "tensor": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        "empty": torch.zeros(0, dtype=torch.int64),
    }
    back = decode(encode(value))
    assert back["betas"] == (0.9, 0.999) and back["nested"] == [{"a": None, "b": True}, (1, (2, 3))]
    assert math.isinf(back["inf"]) and back[7] == "int key"
    # tensors come back as numpy arrays (bfloat16 through ml_dtypes), bit for bit
    assert torch.equal(to_torch(back["tensor"]), value["tensor"]) and back["tensor"].dtype.name == "bfloat16"
    assert back["empty"].shape == (0,) and back["empty"].dtype == np.int64
    assert decode(encode({"array": back["tensor"]}))["array"].tobytes() == back["tensor"].tobytes()
    with pytest.raises(ValueError, match=r"value\['bad'\]: dtype complex64"):
        encode({"bad": np.zeros(2, dtype=np.complex64)})


def _tagged_dict(keys: list) -> dict:
    return {"__zeroshard__": "dict", "items": [[key, None] for key in keys]}


@pytest.mark.parametrize("alike", [16, 17, 20_000])
def test_a_manifest_dict_of_keys_of_one_hash_is_refused_before_it_is_built(alike):
    """A dict compares a new key with every stored key of its hash, and a file can choose
    ints' hashes (multiples of 2^61 - 1 share one): 20,000 such keys took seconds to build."""
    keys = [k * ((1 << 61) - 1) for k in range(1, alike + 1)]

    def check() -> None:
        if alike == 16:
            assert decode(_tagged_dict(keys)) == dict.fromkeys(keys)
        else:
            with pytest.raises(ValueError, match="more than 16 distinct keys of one hash"):
                decode(_tagged_dict(keys))

    assert cpu_seconds(check) < 0.5  # this thread's CPU seconds: 0.01 here; the old reader took 10 s
    pairs = [[i, i + 1] for i in range(20_000)]  # tuples of distinct hashes: built
    assert decode(_tagged_dict(pairs)) == {(i, i + 1): None for i in range(20_000)}


def test_block_hasher_is_independent_of_how_the_stream_is_cut():
    data = bytes(range(256)) * 5
    one = BlockHasher(100)
    one.update(data)
    many = BlockHasher(100)
    for start in range(0, len(data), 37):
        many.update(data[start : start + 37])
    assert one.record() == many.record() and len(one.record().crc32) == 13
    # the block CRCs are zlib's CRC-32, whichever implementation computes them
    assert list(one.record().crc32) == [zlib.crc32(data[i : i + 100]) for i in range(0, len(data), 100)]


def test_block_crc_is_zlibs_crc32():
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert checksum.crc32 is not zlib.crc32  # zlib-ng is a dependency: the fast one is in use
    for cut in (0, 1, 4095, 1 << 20, len(data)):
        assert checksum.block_crc(data[:cut]) == zlib.crc32(data[:cut])
