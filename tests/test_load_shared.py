"""Loads that share the reading (issue 33), at the loader, on thread ranks.

A job loading together (``load_state(..., share=)``, as ``load_checkpoint`` does) reads no
weight: each rank's weights are its fp32 master partitions cast, attested piece by piece
against the weights the checkpoint's model file holds, bit for bit, in bf16 and fp16; each
buffer and frozen parameter is read by one rank (spread by bytes). tests/test_load_bytes.py
counts the bytes with spawned engines; this file checks values, the attestation and the
plan.
"""

from __future__ import annotations

import math

import pytest
import torch
from universal_helpers import save_synthetic

from zeroshard.checkpoint import run_ranks
from zeroshard.checkpoint.attest import attestation
from zeroshard.checkpoint.attest.attestation import AttestationError
from zeroshard.checkpoint.attest.attested import attested_load
from zeroshard.checkpoint.formats import open_source
from zeroshard.checkpoint.loader import load_state
from zeroshard.checkpoint.shared_module import BATCH_BYTES, share_checkpoint, share_module
from zeroshard.checkpoint.source import ModelEntry
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, local_pattern, pattern, synthesize_state
from zeroshard.io.dtypes import dtype_info, torch_dtype
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SCALE = 2.0**-20  # the pattern's integers (< 2**23) scaled into fp16's range, still 23 significant bits


def specs(dtype: str) -> list[list[ParamSpec]]:
    return [
        [ParamSpec.of("embed", (13, 7), dtype), ParamSpec.of("w1", (7, 11), dtype), ParamSpec.of("w2", (11, 7), dtype)],
        [ParamSpec.of("b1", (11,), dtype), ParamSpec.of("norm", (7,), dtype)],
    ]


def saved_run(root, layout, *, nudge: str | None = None):
    """A run whose fp32 masters are not representable in its dtype, saved with its weights
    as torch casts them (rank 0 writes model.safetensors); ``nudge``: that weight's first
    element one ulp off, as if changed outside the optimizer before the save."""
    states = []
    for rank in range(layout.world_size):
        state = synthesize_state(layout, rank, model_state={})
        state.fp32_partitions = [partition * SCALE for partition in state.fp32_partitions]
        states.append(state)
    weights = {}
    for group in layout.groups:
        for slot in group.params:
            master = local_pattern(layout, 0, slot.name, "fp32") * SCALE
            weights[slot.name] = master.to(torch_dtype(group.dtype))
    if nudge is not None:
        flat = weights[nudge].view(-1)
        flat[0] = torch.nextafter(flat[0].float(), torch.tensor(math.inf)).to(flat.dtype)
        if flat[0] == (local_pattern(layout, 0, nudge, "fp32") * SCALE).to(flat.dtype).view(-1)[0]:
            flat[0] = -flat[0]
    weights["frozen.weight"] = pattern("frozen.weight", "fp32", 6).reshape(2, 3).clone()
    weights["positions"] = torch.arange(5, dtype=torch.int64)
    weights["tied.alias"] = weights["embed"]
    states[0].model_state = weights
    return save_synthetic(root, layout, states=states)


def shared_load_everywhere(path, layout, **options) -> list:
    """Every rank of ``layout`` loads ``path`` as one job (thread ranks); (state, share, attestation) or errors."""

    def one_rank(coord):
        def read(evidence):
            with open_source(path) as source:
                share = share_checkpoint(source.info.model_entries, layout, coord.rank)
                return load_state(source, layout, coord.rank, evidence=evidence, share=share, **options), share

        (state, share), verdict = attested_load(coord, str(path), read, layout, agree_also=lambda r: r[1].fingerprint())
        return state, share, verdict

    return run_ranks(layout.world_size, one_rank, return_exceptions=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("options", [{}, {"load_optimizer_states": False}, {"load_module_only": True}], ids=["full", "no_states", "module"])
def test_weights_rebuilt_from_the_masters_are_attested_bit_for_bit(tmp_path, monkeypatch, dtype, options):
    """Resharded 2 -> 3: each rank's partition as saved (full) or as the engine rebuilds it
    from the weights (without states), and the weights' pieces of all three ranks together
    give the digests of the saved model file: the cast rounds exactly as torch's. The masters
    are cast 7 elements at a time, so pieces of weights span several casts."""
    monkeypatch.setattr(attestation, "_CAST_CHUNK", 7)
    old, new = build_layout(specs(dtype), 2), build_layout(specs(dtype), 3, LayoutPolicy.native(compact=True))
    path = saved_run(tmp_path, old)
    results = shared_load_everywhere(path, new, **options)
    full = not options
    for rank, (state, share, verdict) in enumerate(results):
        assert verdict.ok and verdict.line().startswith("attested"), verdict.line()
        for g, group in enumerate(new.groups):
            master = expected_partition(new, rank, g, "fp32") * SCALE
            expected = master if full else master.to(torch_dtype(dtype)).float()
            assert torch.equal(state.fp32_partitions[g], expected)
            assert set(state.optimizer_states[g]) == (set(ADAM_STATES) if full else set())
        assert set(state.model_state) == set(share.mine)  # no weight, only its share of the rest
    readers = {name: rank for rank, (_, share, _) in enumerate(results) for name in share.mine}
    assert sorted(readers) == ["frozen.weight", "positions"] and len(set(readers.values())) == 2


def test_a_weight_that_is_not_its_master_cast_is_refused_on_every_rank(tmp_path, monkeypatch):
    """model.safetensors holds a weight one ulp away from its fp32 master cast: the weights
    the engine would rebuild are not what the checkpoint saved, and every rank says so."""
    monkeypatch.setattr(attestation, "_CAST_CHUNK", 7)
    layout = build_layout(specs("bfloat16"), 2)
    path = saved_run(tmp_path, layout, nudge="w2")
    results = shared_load_everywhere(path, build_layout(specs("bfloat16"), 3))
    assert all(isinstance(r, AttestationError) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1
    message = messages.pop()
    assert "'w2' weights cast from its fp32 master" in message and str(path) in message and "\n" not in message
    assert "'w1'" not in message and "'embed'" not in message


def test_a_rank_whose_share_differs_fails_every_rank(tmp_path):
    """The ranks must decide alike who reads what: a rank that did not (here: told another
    world size) makes every rank raise before anything would be broadcast."""
    layout = build_layout(specs("bfloat16"), 2)
    path = saved_run(tmp_path, layout)

    def one_rank(coord):
        def read(evidence):
            with open_source(path) as source:
                world = layout.world_size + (coord.rank == 1)
                share = share_module(source.info.model_entries, world, coord.rank)
                return share

        return attested_load(coord, str(path), read, layout, agree_also=lambda share: share.fingerprint())

    results = run_ranks(2, one_rank, return_exceptions=True)
    assert all(isinstance(r, ValueError) and "options differ" in str(r) for r in results), results


def entry(name: str, numel: int, dtype: str = "float32") -> ModelEntry:
    return ModelEntry(name, (numel,), dtype, "buffer")


def test_shared_tensors_are_spread_over_the_ranks_by_bytes():
    entries = [entry("a", 1000), entry("b", 10), entry("c", 600), entry("d", 500), entry("e", 100, "int8")]
    shares = [share_module(entries, 3, rank) for rank in range(3)]
    assert len({share.fingerprint() for share in shares}) == 1 and shares[0].tensors == shares[2].tensors
    by_rank = [sorted(share.mine) for share in shares]
    assert by_rank == [["a"], ["c"], ["b", "d", "e"]]  # largest first (bytes: a 4000, c 2400, d 2000), each to the least loaded rank
    assert sorted(name for names in by_rank for name in names) == list("abcde")  # each read once
    assert share_module(entries, 2, 0).fingerprint() != shares[0].fingerprint()


def test_shared_tensors_are_broadcast_a_few_mib_at_a_time():
    entries = [entry(f"t{i}", (1 << 20) // 4 - 7) for i in range(9)] + [entry("big", 3 * BATCH_BYTES // 4)]
    batches = share_module(entries, 2, 0).batches()
    assert sum(len(batch) for batch in batches) == 10
    for batch in batches:
        assert len({tensor.reader for tensor in batch}) == 1
        assert len(batch) == 1 or sum(tensor.nbytes for tensor in batch) <= BATCH_BYTES
    assert len(batches) < 10  # batched, not one broadcast per tensor
    assert any(len(batch) == 1 and batch[0].name == "big" for batch in batches)



def test_a_job_shares_what_no_trained_parameter_gives_and_the_run_keeps():
    """Of a checkpoint's module tensors, the run's trained parameters are rebuilt, not read;
    with ``keep_only`` (strict=False) a tensor the run lacks is not read either."""
    layout = build_layout(specs("bfloat16"), 2)
    entries = [entry("w1", 77, "bfloat16"), entry("frozen.weight", 6), entry("positions", 5), entry("gone", 9)]
    assert sorted(share_checkpoint(entries, layout, 0).mine + share_checkpoint(entries, layout, 1).mine) == [
        "frozen.weight",
        "gone",
        "positions",
    ]
    kept = [share_checkpoint(entries, layout, rank, {"frozen.weight", "positions", "w1"}) for rank in range(2)]
    assert sorted(kept[0].mine + kept[1].mine) == ["frozen.weight", "positions"]


def test_the_attestation_digests_the_weights_the_caller_made(tmp_path):
    """A caller of a shared load that makes the weights itself (the engine, casting each
    group's masters into its parameter buffer) hands them back from ``on_masters``: the
    attestation digests those, not a cast of its own. Handed the right cast, the load is
    attested; handed a cast one element off (a bug in the engine's cast), it is refused,
    naming the weight."""
    layout = build_layout(specs("bfloat16"), 2)
    path = saved_run(tmp_path, layout)
    new = build_layout(specs("bfloat16"), 3)

    def load_with(nudged: bool) -> list:
        def one_rank(coord):
            def made(group, masters):
                weights = masters.astype(dtype_info("bfloat16").numpy)
                if nudged and group == 0 and coord.rank == 1:
                    at = new.groups[0].fragments(1)[0].partition_start  # an element of a weight, not padding
                    weights[at] = -weights[at] if weights[at] else 1
                return [(0, weights[:4]), (4, weights[4:])]  # two pieces, as buckets give them

            def read(evidence):
                with open_source(path) as source:
                    share = share_checkpoint(source.info.model_entries, new, coord.rank)
                    return load_state(source, new, coord.rank, evidence=evidence, share=share, on_masters=made)

            return attested_load(coord, str(path), read, new)[1]

        return run_ranks(new.world_size, one_rank, return_exceptions=True)

    assert all(verdict.ok for verdict in load_with(nudged=False))
    refused = load_with(nudged=True)
    assert all(isinstance(r, AttestationError) for r in refused), refused
    assert "weights cast from its fp32 master hold digest" in str(refused[0])


def test_an_engine_whose_cast_goes_wrong_is_refused_and_keeps_its_weights(tmp_path, monkeypatch):
    """load_checkpoint at D=1: the engine casts each group's loaded masters into its
    parameter buffer, and the attestation digests that buffer. A cast that gets one element
    wrong (simulated after the engine's own) is refused, and the run keeps its weights."""
    from load_bytes_workers import train_and_save

    from zeroshard.checkpoint.engine_io import load_checkpoint
    from zeroshard.engine import ZeroOptimizer

    engine = train_and_save(0, tmp_path, "t")
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    load_checkpoint(engine, tmp_path / "t")  # the engine's own cast: attested
    original = ZeroOptimizer.start_params_gather

    def wrong_cast(self, group_index, partition=None):
        handles = original(self, group_index, partition)
        if partition is not None:  # a load's masters (None: the run's own, gathered back after a failure)
            _, own = self.own_params(group_index)[0]
            own[0] = -own[0] if own[0] != 0 else 1.0
        return handles

    monkeypatch.setattr(ZeroOptimizer, "start_params_gather", wrong_cast)
    with pytest.raises(AttestationError, match="weights cast from its fp32 master hold digest"):
        load_checkpoint(engine, tmp_path / "t")
    after = engine.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
