"""Save at one layout, load at another: values bit for bit against the synthetic pattern."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from zeroshard.checkpoint import ReadStats, load_sharded, open_checkpoint, run_ranks, save_sharded
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, pattern, synthesize_state
from zeroshard.layout import Layout, LayoutPolicy, ParamSpec, build_layout

SPECS = [
    [
        ParamSpec.of("embed", (13, 7), "bf16"),
        ParamSpec.of("proj", (7, 5), "bf16"),
        ParamSpec.of("experts", (4, 8, 3), "bf16"),
    ],
    [
        ParamSpec.of("norm.weight", (5,), "bf16"),
        ParamSpec.of("proj.bias", (9,), "bf16"),
        ParamSpec.of("head.bias", (13,), "bf16"),
    ],
]
NATIVE = LayoutPolicy.native()
COMPACT = LayoutPolicy.native(compact=True)


def save(root: Path, layout: Layout, tag: str = "step7", **kwargs) -> Path:
    def one_rank(coord):
        return save_sharded(
            root, tag, synthesize_state(layout, coord.rank), coordinator=coord, block_size=256, **kwargs
        )

    return run_ranks(layout.world_size, one_rank)[0]


def assert_matches_pattern(state, layout: Layout, rank: int, states=ADAM_STATES) -> None:
    for g in range(len(layout.groups)):
        expected = expected_partition(layout, rank, g, "fp32")
        assert torch.equal(state.fp32_partitions[g], expected), f"rank {rank} group {g} fp32"
        assert sorted(state.optimizer_states[g]) == sorted(states)
        for name in states:
            assert torch.equal(state.optimizer_states[g][name], expected_partition(layout, rank, g, name)), (
                rank,
                g,
                name,
            )
        assert state.optimizer_scalars[g]["step"].item() == 7.0


RESHARDS = [
    ((1, NATIVE), (4, NATIVE)),
    ((4, NATIVE), (3, NATIVE)),
    ((3, NATIVE), (2, NATIVE)),
    ((2, NATIVE), (1, NATIVE)),
    ((4, COMPACT), (4, NATIVE)),
    ((2, NATIVE), (3, COMPACT)),
    ((3, LayoutPolicy.native(bucket_numel=40)), (5, NATIVE)),
    ((2, NATIVE), (4, LayoutPolicy.native(bucket_numel=24))),
    ((4, LayoutPolicy.deepspeed()), (2, NATIVE)),
    ((3, LayoutPolicy.native(64)), (7, LayoutPolicy.deepspeed(parameter_alignment=True))),
]


@pytest.mark.parametrize(
    "before, after", RESHARDS, ids=lambda case: f"D{case[0]}-{case[1].kind}{'-compact' if case[1].compact else ''}"
)
def test_resharded_load_is_bit_exact(tmp_path, before, after):
    old = build_layout(SPECS, *before)
    new = build_layout(SPECS, *after)
    save(tmp_path, old)
    ckpt = open_checkpoint(tmp_path)
    for rank in range(new.world_size):
        state = load_sharded(ckpt, new, rank)
        assert state.layout == new and state.rank == rank
        assert_matches_pattern(state, new, rank)


def test_same_layout_reads_only_its_own_file(tmp_path):
    layout = build_layout(SPECS, 4)
    save(tmp_path, layout)
    for rank in range(4):
        stats = ReadStats()
        state = load_sharded(tmp_path, layout, rank, stats=stats)
        assert set(stats.bytes_by_file) == {"model.safetensors", f"rank-{rank:05d}-of-00004.safetensors"}
        assert_matches_pattern(state, layout, rank)


def test_large_world_size_both_ways(tmp_path):
    """D=768: most ranks hold padding only, and padding spans several ranks."""
    policy = LayoutPolicy.deepspeed()
    big = build_layout(SPECS, 768, policy)
    assert sum(1 for pad in big.groups[1].padding_per_rank() if pad == big.groups[1].partition_numel) > 700
    save(tmp_path / "wide", big)
    ckpt = open_checkpoint(tmp_path / "wide")
    small = build_layout(SPECS, 3, NATIVE)
    for rank in range(3):
        assert_matches_pattern(load_sharded(ckpt, small, rank), small, rank)

    save(tmp_path / "narrow", small)
    ckpt = open_checkpoint(tmp_path / "narrow")
    for rank in range(768):
        assert_matches_pattern(load_sharded(ckpt, big, rank), big, rank)


def test_bytes_read_per_rank_are_close_to_its_share(tmp_path):
    specs = [[ParamSpec.of(f"w{i}", (100, 97 + i), "bf16") for i in range(6)]]
    old, new = build_layout(specs, 4), build_layout(specs, 3, COMPACT)
    run_ranks(4, lambda c: save_sharded(tmp_path, "t", synthesize_state(old, c.rank), coordinator=c, block_size=4096))
    ckpt = open_checkpoint(tmp_path)
    share = new.groups[0].partition_numel * 4 * (1 + len(ADAM_STATES))
    for rank in range(3):
        stats = ReadStats()
        assert_matches_pattern(load_sharded(ckpt, new, rank, stats=stats), new, rank)
        rank_bytes = stats.total - stats.bytes_by_file["model.safetensors"]
        assert share * 0.95 < rank_bytes < share * 1.15, (rank, rank_bytes, share)


def test_without_optimizer_state_rebuilds_fp32_from_the_weights(tmp_path):
    old, new = build_layout(SPECS, 2), build_layout(SPECS, 3, COMPACT)
    save(tmp_path, old)
    for rank in range(3):
        state = load_sharded(tmp_path, new, rank, load_optimizer_states=False)
        for g, group in enumerate(new.groups):
            expected = torch.zeros(group.partition_numel)
            for f in group.fragments(rank):
                weight = pattern(f.name, "fp32", group.params[f.param_index].numel).to(torch.bfloat16).float()
                expected[f.partition_start : f.partition_start + f.length] = weight[
                    f.param_start : f.param_start + f.length
                ]
            assert torch.equal(state.fp32_partitions[g], expected)
            assert state.optimizer_states[g] == {} and state.optimizer_scalars[g] == {}
        assert state.extra["global_step"] == 7 and len(state.param_groups) == 2


def test_module_only(tmp_path):
    layout = build_layout(SPECS, 2)
    save(tmp_path, layout)
    state = load_sharded(tmp_path, layout, 1, load_module_only=True)
    assert state.param_groups == [] and state.optimizer_class == "" and state.extra == {}
    assert torch.equal(state.model_state["embed"], pattern("embed", "fp32", 91).to(torch.bfloat16).reshape(13, 7))


def test_model_state_round_trip_with_tied_names_and_buffers(tmp_path):
    layout = build_layout(SPECS, 2)
    save(tmp_path, layout, buffer_names={"positions"})
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.manifest.aliases == {"tied.alias": "embed"}
    kinds = {name: t.kind for name, t in ckpt.manifest.model_tensors.items()}
    assert kinds["positions"] == "buffer" and kinds["frozen.weight"] == "frozen" and kinds["embed"] == "trainable"
    model = load_sharded(ckpt, layout, 0).model_state
    original = synthesize_state(layout, 0).model_state
    assert model.keys() == original.keys()
    for name, tensor in original.items():
        assert model[name].dtype == tensor.dtype and torch.equal(model[name], tensor), name
    assert model["tied.alias"] is model["embed"]


def test_hyperparameters_and_extra_round_trip_exactly(tmp_path):
    layout = build_layout(SPECS, 1)
    state = synthesize_state(layout, 0)
    state.extra["scaler_tensor"] = torch.tensor([1.5, float("inf")], dtype=torch.bfloat16)
    state.extra["by_int"] = {3: (1, 2.5), "nan": float("nan")}
    save_sharded(tmp_path, "t", state)
    loaded = load_sharded(tmp_path, layout, 0)
    assert loaded.param_groups[0].hyperparameters == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    assert loaded.extra["lr_scheduler"] == state.extra["lr_scheduler"]
    assert torch.equal(loaded.extra["scaler_tensor"], state.extra["scaler_tensor"])
    assert loaded.extra["by_int"][3] == (1, 2.5) and loaded.extra["by_int"]["nan"] != loaded.extra["by_int"]["nan"]


def test_files_are_plain_safetensors(tmp_path):
    layout = build_layout(SPECS, 2)
    directory = save(tmp_path, layout)
    with safe_open(directory / "rank-00001-of-00002.safetensors", framework="pt") as handle:
        fp32 = handle.get_slice("group0.fp32")[3:40]
        assert torch.equal(fp32, expected_partition(layout, 1, 0, "fp32")[3:40])
        assert handle.get_tensor("group1.scalar.step").item() == 7.0


def data_offsets(path: Path) -> dict[str, int]:
    """Where each tensor's bytes start in a safetensors file."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    return {key: 8 + size + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"}


@pytest.mark.parametrize("block_size", [256, 4096, 8192, 12288, 1 << 20])
def test_a_rank_files_partitions_start_on_a_page_boundary_inside_a_block(tmp_path, block_size):
    """The header is padded so that the first partition (after the scalars) starts a page: a
    load reads the partitions past the page cache straight into memory of that alignment.
    Never on a checksum block's boundary, so the header's blocks hold partition bytes too,
    which a load reads and checks: where blocks divide a page, not aligned at all."""
    layout = build_layout([[ParamSpec.of("w", (512, 300), "bf16")], SPECS[1]], 2)
    directory = run_ranks(
        2, lambda coord: save_sharded(tmp_path, "t", synthesize_state(layout, coord.rank), coordinator=coord, block_size=block_size)
    )[0]
    for rank in range(2):
        path = directory / f"rank-0000{rank}-of-00002.safetensors"
        blocks = open_checkpoint(directory).manifest.files[path.name].block_size  # at most the one asked
        start = data_offsets(path)["group0.fp32"]
        assert (start % 4096 == 0) == (4096 % blocks != 0) and (start % 4096 or start % blocks), (start, blocks)
        with safe_open(path, framework="pt") as handle:
            assert torch.equal(handle.get_tensor("group0.fp32"), expected_partition(layout, rank, 0, "fp32"))
            assert torch.equal(handle.get_tensor("group1.state.exp_avg"), expected_partition(layout, rank, 1, "exp_avg"))


@pytest.mark.parametrize("before", [0, 1, 2, 3])
@pytest.mark.parametrize("note", [0, 5000])
def test_write_safetensors_puts_a_tensor_on_a_page_boundary_where_alignment_allows(tmp_path, before, note):
    """Behind ``before`` 4-byte scalars: on a page boundary where the scalars end 8-byte
    aligned (the header is padded with spaces), else where it falls; a plain file either way.
    Never on a block boundary: a header of over a page (a ``note`` in the metadata) would put
    it on the second page, which ends the first 8 KiB block; it goes a page further."""
    from zeroshard.io.safetensors_io import write_safetensors

    tensors = [(f"s{i}", torch.tensor([float(i)])) for i in range(before)] + [("big", torch.arange(3000.0)), ("tail", torch.ones(3))]
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, 8192, {"format": "test", "note": "x" * note}, page_aligned="big")
    start = data_offsets(path)["big"]
    assert (start % 4096 == 0) == (before % 2 == 0) and int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0
    assert start % 8192, start
    assert start < 8 + len(json.dumps({"note": "x" * note})) + 100 + 2 * 4096  # padded by less than two pages
    with safe_open(path, framework="pt") as handle:
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in tensors)


def test_non_strict_load_keeps_the_base_values_of_new_parameters(tmp_path):
    old = build_layout(SPECS, 2)
    save(tmp_path, old)
    renamed = [[ParamSpec.of("brand_new", (6,), "bf16"), *SPECS[0][1:]], SPECS[1]]
    new = build_layout(renamed, 3)
    base = synthesize_state(new, 1)
    base.fp32_partitions[0].fill_(0.0)
    for fragment in new.groups[0].fragments(1):
        if fragment.name == "brand_new":
            base.fp32_partitions[0][fragment.partition_start : fragment.partition_start + fragment.length] = -1.0
    with pytest.warns(UserWarning, match="1 missing from the checkpoint: brand_new; 1 not in the run: embed"):
        state = load_sharded(tmp_path, new, 1, strict=False, base=base)
    loaded = {slot.name for slot in new.groups[0].params} - {"brand_new"}
    expected = expected_partition(new, 1, 0, "fp32", params=loaded)
    for fragment in new.groups[0].fragments(1):
        if fragment.name == "brand_new":
            expected[fragment.partition_start : fragment.partition_start + fragment.length] = -1.0
    assert torch.equal(state.fp32_partitions[0], expected)
