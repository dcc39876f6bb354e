"""Universal checkpoints: exact at any world size, policy and bucket size; streaming; atomic."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from universal_helpers import (
    PatternSource,
    bits,
    check_against_pattern,
    manifest_without_source,
    save_synthetic,
    universal_tensors,
)

from zeroshard.checkpoint import ReadStats, load_sharded, open_checkpoint, run_ranks, save_sharded
from zeroshard.io.dtypes import to_torch, torch_dtype
from zeroshard.checkpoint.formats import open_source
from zeroshard.checkpoint.loader import load_state
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.source import read_param
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, pattern, synthesize_state
from zeroshard.checkpoint.universal import load_from_source, load_universal, open_universal, to_universal
from zeroshard.checkpoint.universal.source import UniversalSource
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SPECS = [
    [ParamSpec.of("embed", (13, 7), "bf16"), ParamSpec.of("proj", (7, 5), "bf16"), ParamSpec.of("experts", (4, 8, 3), "bf16")],
    [ParamSpec.of("norm.weight", (5,), "bf16"), ParamSpec.of("proj.bias", (9,), "bf16"), ParamSpec.of("head.bias", (13,), "bf16")],
]
NATIVE = LayoutPolicy.native()
COMPACT = LayoutPolicy.native(compact=True)
BUCKETED = LayoutPolicy.native(bucket_numel=40)
DEEPSPEED = LayoutPolicy.deepspeed()
DEEPSPEED_ALIGNED = LayoutPolicy.deepspeed(parameter_alignment=True)

ROUND_TRIPS = [
    ((1, NATIVE), (4, NATIVE)),
    ((4, NATIVE), (3, COMPACT)),
    ((3, COMPACT), (2, BUCKETED)),
    ((2, BUCKETED), (1, NATIVE)),
    ((4, DEEPSPEED), (3, BUCKETED)),
    ((3, DEEPSPEED_ALIGNED), (2, NATIVE)),
    ((5, LayoutPolicy.native(bucket_numel=24)), (7, DEEPSPEED)),
]


def _id(case) -> str:
    (m, before), (n, after) = case
    def name(policy):
        return "compact" if policy.compact else (f"b{policy.bucket_numel}" if policy.bucket_numel else policy.kind)
    return f"D{m}-{name(before)}-to-D{n}-{name(after)}"


@pytest.mark.parametrize("case", ROUND_TRIPS, ids=_id)
def test_round_trip_is_bit_exact(tmp_path, case):
    (m, before), (n, after) = case
    old = build_layout(SPECS, m, before)
    first = to_universal(save_synthetic(tmp_path / "a", old), tmp_path / "u1", max_shard_size=400, progress=False)
    check_against_pattern(universal_tensors(first), old)

    ckpt = open_universal(first)
    new = ckpt.build_layout(n, after)
    states = [load_universal(ckpt, new, rank) for rank in range(n)]
    for rank, state in enumerate(states):
        for g in range(len(new.groups)):
            assert torch.equal(state.fp32_partitions[g], expected_partition(new, rank, g, "fp32"))
            for name in ADAM_STATES:
                assert torch.equal(state.optimizer_states[g][name], expected_partition(new, rank, g, name))
    second = to_universal(save_synthetic(tmp_path / "b", new, states=states), tmp_path / "u2", max_shard_size=400, progress=False)

    assert manifest_without_source(first) == manifest_without_source(second)
    a, b = universal_tensors(first), universal_tensors(second)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(bits(a[key]), bits(b[key])), key
    for shard in json.loads((first / "universal.json").read_text())["shards"]:
        assert (first / shard).read_bytes() == (second / shard).read_bytes()


def test_manifest_describes_the_run(tmp_path):
    layout = build_layout(SPECS, 3, DEEPSPEED)
    out = to_universal(save_synthetic(tmp_path / "a", layout), tmp_path / "u", progress=False)
    ckpt = open_universal(out)
    manifest = ckpt.manifest
    assert manifest.source["kind"] == "zeroshard.checkpoint" and manifest.source["world_size"] == 3
    assert manifest.source["policy"]["kind"] == "deepspeed"
    assert [g.params for g in manifest.param_groups] == [("embed", "proj", "experts"), ("norm.weight", "proj.bias", "head.bias")]
    assert manifest.param_groups[0].hyperparameters == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    assert ckpt.scalars(1)["step"].item() == 7.0
    assert manifest.params["experts"].shape == (4, 8, 3) and manifest.params["experts"].dtype == "bfloat16"
    assert manifest.params["experts"].states == ADAM_STATES
    assert {n: e.kind for n, e in manifest.model_entries.items()} == {"frozen.weight": "frozen", "positions": "buffer"}
    assert manifest.aliases == {"tied.alias": "embed"}
    assert manifest.extra["lr_scheduler"]["base_lrs"] == (1e-3, 1e-3)
    assert [p.name for p in out.iterdir()] and len(manifest.shards) == 1
    assert torch.equal(to_torch(ckpt.read_param("experts", "exp_avg_sq", 10, 50)), pattern("experts", "exp_avg_sq", 96)[10:50])
    assert torch.equal(to_torch(ckpt.model_tensor("positions")), torch.arange(5))
    assert torch.equal(to_torch(ckpt.model_tensor("frozen.weight")), pattern("frozen.weight", "fp32", 6).reshape(2, 3))


def test_shards_are_bounded_and_a_big_tensor_gets_its_own(tmp_path):
    layout = build_layout(SPECS, 2)
    out = to_universal(save_synthetic(tmp_path / "a", layout), tmp_path / "u", max_shard_size=200, progress=False)
    manifest = open_universal(out).manifest
    per_shard: dict[str, list[int]] = {}
    for key, shard in manifest.weight_map.items():
        dtype, shape = manifest.tensor_specs()[key]
        per_shard.setdefault(shard, []).append(torch.empty(shape, dtype=torch_dtype(dtype)).nbytes)
    assert all(sum(sizes) <= 200 or len(sizes) == 1 for sizes in per_shard.values())
    assert [4 * 96] in per_shard.values()  # experts in fp32 is bigger than a shard: alone
    assert sorted(per_shard) == [f"universal-{i:05d}-of-{len(per_shard):05d}.safetensors" for i in range(1, len(per_shard) + 1)]


def test_conversion_reads_each_input_byte_once(tmp_path):
    layout = build_layout(SPECS, 4, DEEPSPEED)
    ckpt = open_checkpoint(save_synthetic(tmp_path / "a", layout, block_size=64))
    stats = ReadStats()
    with NativeSource(ckpt, stats=stats) as source:
        to_universal(source, tmp_path / "u", progress=False)
    for name, record in ckpt.manifest.files.items():
        header = 8 + int.from_bytes((ckpt.directory / name).read_bytes()[:8], "little")
        assert stats.bytes_by_file.get(name, 0) <= record.size + header, name


@pytest.mark.parametrize("world", [1, 3])
def test_universal_load_reads_each_master_once(tmp_path, world):
    """The fp32 masters a load reads whole for the module weights also give the rank's fp32
    partition: no master byte is read twice (they were, by range, for the partition), and
    the partition is the one a native checkpoint of the same run gives."""
    old = build_layout(SPECS, 4, NATIVE)
    native = save_synthetic(tmp_path / "a", old)
    # One tensor per shard and small blocks: a second read of any range shows in its shard's count.
    block = 16
    path = to_universal(native, tmp_path / "u", max_shard_size=1, block_size=block, progress=False)
    manifest = open_universal(path).manifest
    new = build_layout(SPECS, world, COMPACT)
    stats = ReadStats()
    with UniversalSource(path, stats=stats) as source:
        loaded = load_state(source, new, 0)
    expected = load_sharded(native, new, 0)
    for g in range(len(new.groups)):
        assert torch.equal(loaded.fp32_partitions[g], expected.fp32_partitions[g])
    for key, shard in manifest.weight_map.items():
        if key.endswith("/fp32"):  # the header, then the data's blocks (the first holds the header's tail)
            assert stats.bytes_by_file[shard] <= (path / shard).stat().st_size + block, key


@pytest.mark.parametrize("new_policy", [NATIVE, BUCKETED, DEEPSPEED_ALIGNED])
def test_load_from_source_equals_resharded_load(tmp_path, new_policy):
    old = build_layout(SPECS, 4, COMPACT)
    path = save_synthetic(tmp_path, old)
    new = build_layout(SPECS, 3, new_policy)
    with open_source(path) as source:
        for rank in range(3):
            ours = load_from_source(source, new, rank)
            theirs = load_sharded(path, new, rank)
            for g in range(len(new.groups)):
                assert torch.equal(ours.fp32_partitions[g], theirs.fp32_partitions[g])
                assert ours.optimizer_states[g].keys() == theirs.optimizer_states[g].keys()
                for name in ours.optimizer_states[g]:
                    assert torch.equal(ours.optimizer_states[g][name], theirs.optimizer_states[g][name])
                assert ours.optimizer_scalars[g] == theirs.optimizer_scalars[g]
            assert ours.param_groups == theirs.param_groups and ours.extra == theirs.extra
            assert ours.model_state.keys() == theirs.model_state.keys()
            assert all(torch.equal(ours.model_state[k], theirs.model_state[k]) for k in ours.model_state)


def test_seeds_case_d768_deepspeed(tmp_path):
    """DeepSpeed's layout at D=768: a 266240-element bf16 group whose padding (1024) spans the
    last three ranks (348 elements each), next to a larger group."""
    specs = [
        [ParamSpec.of("layers.0.norm.weight", (4096,), "bf16"), ParamSpec.of("small.bias", (262144,), "bf16")],
        [ParamSpec.of("big.weight", (768, 1300), "bf16"), ParamSpec.of("big.bias", (1301,), "bf16")],
    ]
    layout = build_layout(specs, 768, DEEPSPEED)
    small = layout.groups[0]
    assert small.param_numel == 266240 and small.partition_numel == 348 and small.tail_padding == 1024
    assert small.padding_per_rank()[764:] == (0, 328, 348, 348)
    states = [synthesize_state(layout, rank) for rank in range(768)]
    path = save_synthetic(tmp_path / "ds768", layout, block_size=1 << 16, states=states)
    del states
    out = to_universal(path, tmp_path / "u", progress=False)
    check_against_pattern(universal_tensors(out), layout)
    # Native at D=768: partitions of 352 elements, so ranks 757..767 own nothing of group 0.
    new = open_universal(out).build_layout(768, NATIVE)
    assert new.groups[0].partition_numel == 352 and new.groups[0].fragments(767) == ()
    for rank in (0, 756, 757, 765, 767):
        state = load_universal(out, new, rank)
        for g in range(2):
            assert torch.equal(state.fp32_partitions[g], expected_partition(new, rank, g, "fp32"))
            assert sorted(state.optimizer_states[g]) == sorted(ADAM_STATES)
            for name in ADAM_STATES:
                assert torch.equal(state.optimizer_states[g][name], expected_partition(new, rank, g, name))
            assert state.optimizer_scalars[g]["step"].item() == 7.0
        assert [p.layout_groups for p in state.param_groups] == [[0], [1]]


def test_d4096_pattern_source_and_ranks_without_elements(tmp_path):
    specs = [
        [ParamSpec.of("a.weight", (300, 400), "bf16"), ParamSpec.of("a.bias", (17,), "bf16")],
        [ParamSpec.of("b.weight", (266240,), "bf16")],
    ]
    layout = build_layout(specs, 4096, NATIVE)
    source = PatternSource(layout)
    out = to_universal(source, tmp_path / "u", max_shard_size=1 << 20, progress=False)
    check_against_pattern(universal_tensors(out), layout)
    ckpt = open_universal(out)
    assert ckpt.manifest.source == {"kind": "pattern", "path": "<pattern>", "world_size": 4096, "policy": NATIVE.to_dict()}
    empty = [r for r in range(4096) if not layout.groups[1].fragments(r)]
    assert empty and empty[-1] == 4095
    new = build_layout(specs, 4096, DEEPSPEED_ALIGNED)
    for rank in (0, empty[0] - 1, empty[0], 4095):
        state = load_universal(ckpt, new, rank)
        for g in range(2):
            assert torch.equal(state.fp32_partitions[g], expected_partition(new, rank, g, "fp32"))
            assert torch.equal(state.optimizer_states[g]["exp_avg"], expected_partition(new, rank, g, "exp_avg"))
        assert state.param_groups[1].hyperparameters == {"lr": 1e-3, "group": 1}


def test_load_options(tmp_path):
    layout = build_layout(SPECS, 2)
    out = to_universal(save_synthetic(tmp_path / "a", layout), tmp_path / "u", progress=False)
    new = build_layout(SPECS, 3, BUCKETED)
    no_state = load_universal(out, new, 1, load_optimizer_states=False)
    assert no_state.optimizer_states == [{}, {}] and no_state.optimizer_scalars == [{}, {}]
    # No master is read: the fp32 partition is the weights (the masters cast to bf16), as the engine rebuilds it.
    weights = {s.name: pattern(s.name, "fp32", s.numel).to(torch.bfloat16).float() for s in new.groups[0].params}
    expected = torch.zeros(new.groups[0].partition_numel)
    for f in new.groups[0].fragments(1):
        expected[f.partition_start : f.partition_start + f.length] = weights[f.name][f.param_start : f.param_start + f.length]
    assert torch.equal(no_state.fp32_partitions[0], expected)
    assert no_state.param_groups and no_state.extra["global_step"] == 7
    module_only = load_universal(out, new, 1, load_module_only=True)
    assert module_only.param_groups == [] and module_only.optimizer_class == "" and module_only.extra == {}
    model = module_only.model_state
    assert model["embed"].dtype == torch.bfloat16 and model["tied.alias"] is model["embed"]
    assert torch.equal(model["embed"].reshape(-1), pattern("embed", "fp32", 91).to(torch.bfloat16))
    assert torch.equal(model["positions"], torch.arange(5))

    fewer = build_layout([SPECS[0], SPECS[1][:2] + [ParamSpec.of("new.bias", (3,), "bf16")]], 2)
    with pytest.raises(ValueError, match="1 missing from the checkpoint: new.bias; 1 not in the run: head.bias"):
        load_universal(out, fewer, 0)
    with pytest.warns(UserWarning, match="loading the rest"):
        state = load_universal(out, fewer, 0, strict=False)
    assert "head.bias" not in state.model_state and "new.bias" not in state.model_state
    with_empty = build_layout([SPECS[0], [*SPECS[1], ParamSpec.of("empty", (0, 4), "bf16")]], 2)
    state = load_universal(out, with_empty, 1)  # no elements: nothing to load, not a mismatch
    assert state.model_state["empty"].shape == (0, 4)
    assert torch.equal(state.fp32_partitions[1], expected_partition(with_empty, 1, 1, "fp32"))
    mixed = build_layout([[*SPECS[0], SPECS[1][0]], SPECS[1][1:]], 2)
    with pytest.raises(ValueError, match="holds parameters of saved param groups"):
        load_universal(out, mixed, 0)


def test_engine_resumes_from_universal_at_the_same_values(tmp_path):
    from zeroshard.engine import ZeroOptimizer
    from zeroshard.models import GPTConfig, TinyGPT

    config = GPTConfig(vocab_size=31, block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    engine = ZeroOptimizer(TinyGPT(config), torch.optim.AdamW, param_dtype=torch.bfloat16, lr=1e-2)
    data = torch.randint(0, 31, (4, 9))
    for _ in range(2):
        engine.backward(engine.model(data[:, :-1], data[:, 1:]))
        engine.step()
        engine.zero_grad()
    run_ranks(1, lambda c: save_sharded(tmp_path / "ck", "s", engine.export_state(), coordinator=c, buffer_names=["positions"]))
    out = to_universal(tmp_path / "ck" / "s", tmp_path / "u", progress=False)
    torch.manual_seed(1)
    resumed = ZeroOptimizer(TinyGPT(config), torch.optim.AdamW, param_dtype=torch.bfloat16, lr=1e-2)
    resumed.import_state(load_universal(out, resumed.layout, 0))
    for name in engine.layout.param_names:
        assert torch.equal(resumed.get_full_fp32_param(name), engine.get_full_fp32_param(name)), name
        assert torch.equal(resumed.get_full_optimizer_state(name, "exp_avg"), engine.get_full_optimizer_state(name, "exp_avg"))
    for live in (engine, resumed):
        live.backward(live.model(data[:, :-1], data[:, 1:]))
        live.step()
    for name in engine.layout.param_names:
        assert torch.equal(resumed.get_full_fp32_param(name), engine.get_full_fp32_param(name)), name


def test_read_param_on_a_native_source_matches_the_pattern(tmp_path):
    layout = build_layout(SPECS, 5, DEEPSPEED_ALIGNED)
    with NativeSource(save_synthetic(tmp_path, layout, block_size=32)) as source:
        for name, numel in (("experts", 96), ("head.bias", 13)):
            assert torch.equal(to_torch(read_param(source, name, "exp_avg")), pattern(name, "exp_avg", numel))
            assert torch.equal(to_torch(read_param(source, name, "fp32", 3, 11)), pattern(name, "fp32", numel)[3:11])
        assert source.scalars(1)["step"].item() == 7.0
        assert torch.equal(to_torch(source.model_tensor("tied.alias")), to_torch(source.model_tensor("embed")))
        with pytest.raises(KeyError, match="no optimizer state 'momentum'"):
            source.read(0, 0, "momentum", 0, 1)


def test_a_universal_load_reads_each_group_and_key_as_one_range(tmp_path, monkeypatch):
    """The shards hold each layout group's masters, then each state, its parameters back to
    back (a load's order), so a load reads each run of them with one read: with an edge cache
    of one block, no block is read twice, and the load reads at most the shard's bytes."""
    from zeroshard.checkpoint.attest.attestation import Evidence
    from zeroshard.checkpoint.shared_module import share_checkpoint
    from zeroshard.io import block_reader

    specs = [[ParamSpec.of(f"w{i}", (37 + 11 * i, 13), "bf16") for i in range(5)], [ParamSpec.of(f"b{i}", (29 + i,), "bf16") for i in range(4)]]
    block = 64
    native = save_synthetic(tmp_path / "a", build_layout(specs, 3), block_size=block)
    path = to_universal(native, tmp_path / "u", block_size=block, progress=False)
    (shard,) = path.glob("universal-*.safetensors")
    raw = shard.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    stored = sorted((entry["data_offsets"][0], key) for key, entry in header.items() if key.startswith("param/"))
    assert [key for _, key in stored] == [f"param/{p.name}/{key}" for group in specs for key in ("fp32", *ADAM_STATES) for p in group]

    monkeypatch.setattr(block_reader, "DEFAULT_CACHE_BYTES", block)  # edge blocks are not kept for later reads
    reads = []
    read_into = block_reader.RangeReader.read_into
    monkeypatch.setattr(block_reader.RangeReader, "read_into", lambda self, *args, **kw: reads.append(args[2]) or read_into(self, *args, **kw))
    new = build_layout(specs, 1, COMPACT)
    stats = ReadStats()
    with UniversalSource(path, stats=stats) as source:
        share = share_checkpoint(source.info.model_entries, new, 0)
        loaded = load_state(source, new, 0, share=share, evidence=Evidence())
    # Then the module tensors, a read each.
    assert len(reads) == len(specs) * (1 + len(ADAM_STATES)) + len(share.mine), f"{len(reads)} reads, at {reads}"
    reference = load_sharded(native, new, 0)
    for group in range(len(new.groups)):
        assert torch.equal(loaded.fp32_partitions[group], reference.fp32_partitions[group])
        for key in ADAM_STATES:
            assert torch.equal(loaded.optimizer_states[group][key], reference.optimizer_states[group][key])
    assert stats.data <= shard.stat().st_size, f"{stats.data} bytes read of the shard's {shard.stat().st_size}"


@pytest.mark.parametrize("world", [1, 3])
def test_a_universal_load_checks_and_digests_what_it_reads_in_one_crc_pass(tmp_path, monkeypatch, world):
    """The CRC a load computes to check a block's bytes also gives their digest terms for
    the attestation: over the job, the bytes CRC'd are those read plus the weights rebuilt
    from the masters (bf16, digested once), not twice the bytes read (2.2x at 45m before)."""
    from zeroshard.checkpoint.attest.attested import attested_load
    from zeroshard.checkpoint.shared_module import share_checkpoint
    from zeroshard.io import block_reader, checksum, digest, observe, safetensors_io

    crc_bytes = []
    for module in (block_reader, checksum, digest, observe, safetensors_io):
        monkeypatch.setattr(module, "crc32", lambda data, *start, crc=module.crc32: crc_bytes.append(memoryview(data).nbytes) or crc(data, *start))
    specs = [[ParamSpec.of("w", (64, 48), "bf16"), ParamSpec.of("v", (96, 33), "bf16")], [ParamSpec.of("b", (48,), "bf16"), ParamSpec.of("c", (33,), "bf16")]]
    native = save_synthetic(tmp_path / "a", build_layout(specs, 4, NATIVE), block_size=64)
    path = to_universal(native, tmp_path / "u", block_size=64, progress=False)
    new = build_layout(specs, world, COMPACT)
    stats = [ReadStats() for _ in range(world)]

    def one_rank(coord):
        def read(evidence):
            with UniversalSource(path, stats=stats[coord.rank]) as source:
                share = share_checkpoint(source.info.model_entries, new, coord.rank)
                return load_state(source, new, coord.rank, evidence=evidence, share=share)

        return attested_load(coord, str(path), read, new, {})

    crc_bytes.clear()
    loaded = run_ranks(world, one_rank)
    crc_total = sum(crc_bytes)
    read = sum(rank_stats.data for rank_stats in stats)
    rebuilt = 2 * sum(slot.numel for group in new.groups for slot in group.params)
    # Beyond those: the module tensors, digested apart, and the parts of edge blocks a range
    # holds (under 2 blocks of 64 bytes a range): under 5% of the bytes read here.
    assert crc_total <= 1.05 * (read + rebuilt), f"{crc_total} bytes CRC'd, {read} read, {rebuilt} rebuilt"
    for rank, (state, _) in enumerate(loaded):
        reference = load_sharded(native, new, rank)
        for group in range(len(new.groups)):
            assert torch.equal(state.fp32_partitions[group], reference.fp32_partitions[group])


def test_universal_source_reads_ranges_across_parameters_in_place(tmp_path):
    """Ranges of a universal source's compact partition that span parameters and the tail's
    padding: read() and read_into() (which fills the caller's array, padding as zeros) agree
    with the pattern."""
    path = to_universal(save_synthetic(tmp_path / "a", build_layout(SPECS, 3, NATIVE)), tmp_path / "u", progress=False)
    with UniversalSource(path) as source:
        for group in source.layout.groups:
            whole = expected_partition(source.layout, 0, group.index, "exp_avg").numpy()
            numel = group.partition_numel
            assert numel > group.params[-1].end  # tail padding, read as zeros
            for start, end in ((0, numel), (1, numel - 1), (group.params[0].end - 2, numel), (3, 3)):
                assert np.array_equal(source.read(0, group.index, "exp_avg", start, end), whole[start:end])
                out = np.full(end - start, 99.0, dtype=np.float32)
                source.read_into(0, group.index, "exp_avg", start, out)
                assert np.array_equal(out, whole[start:end])
        with pytest.raises(ValueError, match="outside group 0's partition"):
            source.read_into(0, 0, "exp_avg", 1, np.empty(source.layout.groups[0].partition_numel, dtype=np.float32))


# ---- bad input, atomic output, the command line ---------------------------------------------


@pytest.fixture
def small_checkpoint(tmp_path):
    return save_synthetic(tmp_path / "ck", build_layout(SPECS, 2), block_size=64)


def _assert_nothing_complete(out):
    assert not (out / "universal.json").exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "the staging directory must be removed"


def _cli(*argv) -> tuple[int, str]:
    import contextlib
    import io

    from zeroshard.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda ck: _truncate(ck / "rank-00001-of-00002.safetensors"), "truncated or altered"),
        (lambda ck: (ck / "rank-00001-of-00002.safetensors").unlink(), "rank-00001-of-00002.safetensors: missing"),
        (lambda ck: _edit_json(ck / "manifest.json", version=99), "format version 99 is newer"),
        (lambda ck: _flip_in_tensor(ck / "rank-00000-of-00002.safetensors", "group0.state.exp_avg"), "checksum mismatch"),
        (lambda ck: _flip_in_tensor(ck / "model.safetensors", "positions"), "checksum mismatch"),
    ],
    ids=["truncated", "missing-rank", "version", "corrupted-rank", "corrupted-model"],
)
def test_bad_checkpoint_one_line_error_and_no_output(small_checkpoint, tmp_path, damage, message):
    damage(small_checkpoint)
    out = tmp_path / "out"
    code, err = _cli("to-universal", small_checkpoint, out)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("zeroshard to-universal: error: ")
    _assert_nothing_complete(out)
    code, err = _cli("to-fp32", small_checkpoint, tmp_path / "fp32")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "fp32").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda u: _truncate(_shards(u)[1]), "truncated or altered"),
        (lambda u: _shards(u)[-1].unlink(), "missing; the manifest lists it"),
        (lambda u: _edit_json(u / "universal.json", version=6), "format version 6 is newer"),
        (lambda u: _edit_json(u / "universal.json", format="other"), "not a zeroshard universal checkpoint"),
        (lambda u: _flip_in_tensor(_shards(u)[0], "param/embed/fp32"), "checksum mismatch"),
        (lambda u: _edit_model_tensor(u, "positions", kind="weird"), "module tensor 'positions' has unknown kind 'weird'"),
        (
            lambda u: _edit_model_tensor(u, "embed", shape=[13, 7], dtype="bfloat16", kind="frozen"),
            "module tensor 'embed' is also a trained parameter",
        ),
    ],
    ids=["truncated", "missing-shard", "version", "format", "corrupted", "unknown-kind", "param-as-module-tensor"],
)
def test_bad_universal_checkpoint(small_checkpoint, tmp_path, damage, message):
    universal = to_universal(small_checkpoint, tmp_path / "u", max_shard_size=1000, progress=False)
    assert len(_shards(universal)) > 2
    damage(universal)
    layout = build_layout(SPECS, 3)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        for rank in range(3):
            load_universal(universal, layout, rank)
    assert message in str(info.value) and "\n" not in str(info.value)
    code, err = _cli("to-fp32", universal, tmp_path / "fp32")
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "fp32").exists()


def test_existing_output_is_kept_unless_overwrite(small_checkpoint, tmp_path):
    out = to_universal(small_checkpoint, tmp_path / "u", progress=False)
    before = (out / "universal.json").read_text()
    with pytest.raises(FileExistsError, match="already holds a complete universal checkpoint"):
        to_universal(small_checkpoint, out, progress=False)
    code, err = _cli("to-universal", small_checkpoint, out, "--max-shard-size", "500B")
    assert code == 2 and "--overwrite" in err
    code, _ = _cli("to-universal", small_checkpoint, out, "--max-shard-size", "500B", "--overwrite")
    assert code == 0 and (out / "universal.json").read_text() != before
    assert len(_shards(out)) > 1 and not list(tmp_path.glob(".u.*"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty and is not a universal checkpoint"):
        to_universal(small_checkpoint, foreign, overwrite=True, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_failure_mid_write_leaves_nothing(small_checkpoint, tmp_path, monkeypatch):
    from zeroshard.checkpoint.native import source as native_source

    calls = {"n": 0}
    original = native_source.NativeSource.read

    def failing_read(self, *args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk gone")
        return original(self, *args)

    monkeypatch.setattr(native_source.NativeSource, "read", failing_read)
    out = tmp_path / "u"
    with pytest.raises(OSError, match="disk gone"):
        to_universal(small_checkpoint, out, progress=False)
    assert not out.exists()
    _assert_nothing_complete(out)


def test_universal_input_is_refused_by_to_universal(small_checkpoint, tmp_path):
    universal = to_universal(small_checkpoint, tmp_path / "u", progress=False)
    with pytest.raises(ValueError, match="already a universal checkpoint"):
        to_universal(universal, tmp_path / "again", progress=False)
    assert not (tmp_path / "again").exists()
    code, err = _cli("to-universal", universal, tmp_path / "again")
    assert code == 2 and "already a universal checkpoint" in err


def test_size_arguments():
    import argparse

    from zeroshard.cli.convert_cmd import parse_size

    assert parse_size("500MB") == 500 * 10**6 and parse_size("2GB") == 2 * 10**9
    assert parse_size("1GiB") == 2**30 and parse_size("1.5kb") == 1500 and parse_size("4096") == 4096
    for bad in ("lots", "5XB", "0", "-3MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _shards(directory):
    return sorted(directory.glob("universal-*.safetensors"))


def _flip_in_tensor(path, key):
    from zeroshard.io.safetensors_io import read_header

    entry = read_header(path, path.stat().st_size)[key]
    data = bytearray(path.read_bytes())
    data[entry.begin + 1] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_model_tensor(universal, name, **fields):
    path = universal / "universal.json"
    data = json.loads(path.read_text())
    data["model"]["tensors"].setdefault(name, {}).update(fields)
    path.write_text(json.dumps(data))


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ---- streaming pieces ---------------------------------------------------------------------------


def test_streaming_writer_checks_the_plan_and_writes_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    from zeroshard.io.safetensors_io import PlannedTensor, SafetensorsWriter, write_safetensors

    a, b = torch.arange(6, dtype=torch.float32), torch.ones(2, 2, dtype=torch.bfloat16)
    plan = [PlannedTensor("a", "float32", (2, 3)), PlannedTensor("b", "bfloat16", (2, 2))]
    with SafetensorsWriter(tmp_path / "s.safetensors", plan, block_size=16) as writer:
        with pytest.raises(ValueError, match="expected 'a'"):
            writer.write("b", b)
        writer.write("a", a)  # flat values, planned shape
        writer.write("b", b)
        record = writer.close()
    loaded = load_file(tmp_path / "s.safetensors")
    assert torch.equal(loaded["a"], a.reshape(2, 3)) and torch.equal(loaded["b"], b)
    assert write_safetensors(tmp_path / "t.safetensors", [("a", a.reshape(2, 3)), ("b", b)], 16) == record
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "t.safetensors").read_bytes()
    with pytest.raises(ValueError, match="1 planned tensors were never written"):
        with SafetensorsWriter(tmp_path / "u.safetensors", plan, block_size=16) as writer:
            writer.write("a", a)


def test_writer_starts_writeback_as_it_goes(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from zeroshard.io import safetensors_io

    hinted = []
    monkeypatch.setattr(safetensors_io, "_WRITEBACK_CHUNK", 3 << 20)
    monkeypatch.setattr(safetensors_io.os, "posix_fadvise", lambda fd, offset, length, advice: hinted.append((offset, length, advice)))
    values = np.arange(5 << 20, dtype=np.float32)  # 20 MiB, written in 1 MiB pieces
    record = safetensors_io.write_safetensors(tmp_path / "big.safetensors", [("v", values)], block_size=1 << 20)
    assert [advice for _, _, advice in hinted] == [os.POSIX_FADV_DONTNEED] * len(hinted) and len(hinted) >= 5
    assert [offset for offset, _, _ in hinted[1:]] == [o + n for o, n, _ in hinted[:-1]]  # consecutive ranges
    assert hinted[-1][0] + hinted[-1][1] <= record.size
    assert np.array_equal(load_file(tmp_path / "big.safetensors")["v"], values)


def write_with_record(path, payload: bytes, block_size: int):
    """Write ``payload`` to ``path``; its FileRecord with ``block_size``-byte blocks."""
    from zeroshard.io.checksum import BlockHasher

    path.write_bytes(payload)
    hasher = BlockHasher(block_size)
    hasher.update(payload)
    return hasher.record()


def test_range_reader_reads_a_shared_block_once(tmp_path):
    from zeroshard.io.block_reader import RangeReader

    path, payload = tmp_path / "f", bytes(range(256)) * 4
    record = write_with_record(path, payload, 100)
    stats = ReadStats()
    reader = RangeReader(stats)
    assert bytes(reader.read(path, record, 10, 250)) == payload[10:250]
    assert bytes(reader.read(path, record, 250, 420)) == payload[250:420]  # block 2 comes from the cache
    assert stats.total == 500
    within = reader.read(path, record, 405, 415)  # inside cached block 4: a view of it, nothing read
    assert bytes(within) == payload[405:415] and within.readonly and stats.total == 500
    path.write_bytes(payload[:700] + b"x" + payload[701:])
    with pytest.raises(ValueError, match="checksum mismatch in block 7"):
        reader.read(path, record, 650, 720)


def test_range_reader_maps_big_ranges(tmp_path, monkeypatch):
    """Ranges of MAP_BYTES or more come from a mapping: same bytes and checks, no copy."""
    from zeroshard.io import block_reader
    from zeroshard.io.block_reader import RangeReader

    monkeypatch.setattr(block_reader, "MAP_BYTES", 3000)
    path, payload = tmp_path / "f", np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    record = write_with_record(path, payload, 1000)
    stats = ReadStats()
    reader = RangeReader(stats)
    small = reader.read(path, record, 100, 1500)  # copied; keeps its edge block 1
    big = reader.read(path, record, 1500, 8200)  # mapped; block 1 was checked already
    assert bytes(small) == payload[100:1500] and bytes(big) == payload[1500:8200]
    assert big.readonly and not small.readonly
    assert bytes(reader.read(path, record, 8200, 9000)) == payload[8200:9000]  # block 8 from the cache
    assert stats.total == 10_000 - 1000  # every block read and checked once; block 9 never
    array = np.frombuffer(reader.read(path, record, 0, 10_000), dtype=np.uint8)
    del reader
    assert array.tobytes() == payload  # the mapping outlives the reader while a view holds it

    flipped = payload[:5000] + bytes([payload[5000] ^ 1]) + payload[5001:]
    path.write_bytes(flipped)
    with pytest.raises(ValueError, match="checksum mismatch in block 5"):
        RangeReader().read(path, record, 0, 9000)
    path.write_bytes(payload[:6000])
    with pytest.raises(ValueError, match="truncated: expected 9000 bytes, the file ends at 6000"):
        RangeReader().read(path, record, 0, 8500)
