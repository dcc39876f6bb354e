"""Attestation: every load proves each rank holds what was saved, or every rank refuses it.

Mutation tests: each injects one bug into the load path (monkeypatch) and shows it twice:
with attestation switched off the load succeeds on every rank and some rank holds values
the checkpoint never saved (the bug is real and silent); with attestation every rank raises
the same one-line AttestationError naming the parameter (and expert) and the checkpoint.
Thread ranks and synthetic states (the testing pattern names every element by its global
expert id), as tests/test_moe_checkpoint.py; tests/test_attestation_engine.py shows the
every-rank refusal with a spawned gloo engine.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import warnings
import zlib

import pytest
import torch
from test_moe_checkpoint import DENSE, STACKED, assert_state_matches, moe_layout
from universal_helpers import save_synthetic

from zeroshard.checkpoint import loader, run_ranks
from zeroshard.checkpoint.attest import attestation
from zeroshard.checkpoint.attest.attestation import AttestationError, UnattestedCheckpointWarning
from zeroshard.io.damage import CheckpointDamagedError
from zeroshard.checkpoint.attest.attested import load_attested
from zeroshard.checkpoint.native.load import load_sharded
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.testing import ADAM_STATES, expected_partition, synthesize_state
from zeroshard.layout import ExpertMesh, LayoutPolicy, ParamSpec, build_layout, coordinates
from zeroshard.layout.coordinates import shard_rank

EXPERTS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A synthetic MoE run saved at (W, EP) = (4, 2), 8 experts."""
    return save_synthetic(tmp_path_factory.mktemp("attest"), moe_layout(4, 2, num_experts=EXPERTS))


def load_everywhere(path, layout, **options) -> list:
    """Every rank of ``layout`` loads ``path`` together (thread ranks); states or errors."""

    def one_rank(coord):
        return load_sharded(path, layout, coord.rank, coordinator=coord, **options)

    return run_ranks(layout.world_size, one_rank, return_exceptions=True)


def refused_everywhere(results, error=AttestationError) -> str:
    """Every rank raised the same one-line ``error``; its message."""
    assert all(isinstance(r, error) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "\n" not in message and "not loaded (nothing changed)" in message
    return message


def holds_what_was_saved(state, layout, rank) -> bool:
    """Masters, Adam states and scalars as the testing pattern saved them (any layout)."""
    for group in layout.groups:
        g = group.index
        if not torch.equal(state.fp32_partitions[g], expected_partition(layout, rank, g, "fp32")):
            return False
        if any(not torch.equal(state.optimizer_states[g][n], expected_partition(layout, rank, g, n)) for n in ADAM_STATES):
            return False
        if state.optimizer_scalars[g]["step"].item() != 7.0:
            return False
    return True


def caught(monkeypatch, path, layout, mutate, **options) -> str:
    """Apply ``mutate``; show that without attestation the load is silently wrong on some rank,
    and that with it every rank refuses the load with one line. That line."""
    mutate(monkeypatch)
    with monkeypatch.context() as unattested:  # what a load did before attestation: no verdict
        unattested.setattr(attestation, "judge", lambda evidences, layout, *args, **kw: attestation.Attestation("", "", 0, 0, 0))
        states = load_everywhere(path, layout, **options)
        assert not any(isinstance(s, BaseException) for s in states), states
        assert not all(holds_what_was_saved(s, layout, rank) for rank, s in enumerate(states))
    message = refused_everywhere(load_everywhere(path, layout, **options))
    assert str(path) in message
    return message


# ---- the mutations ----------------------------------------------------------------------


def _shift_first_copy(monkeypatch, by: int, wanted):
    """plan_reads, with the first copy ``wanted(old_layout, copy)`` selects moved ``by`` elements
    along the old partition (on every loading rank)."""
    original = loader.plan_reads

    def mutated(old, new, rank, params=None):
        plans = list(original(old, new, rank, params))
        for index, plan in enumerate(plans):
            for position, copy in enumerate(plan.copies):
                if wanted(old, copy):
                    copies = list(plan.copies)
                    copies[position] = dataclasses.replace(copy, source_start=copy.source_start + by)
                    plans[index] = dataclasses.replace(plan, copies=tuple(copies))
                    return tuple(plans)
        return tuple(plans)

    monkeypatch.setattr(loader, "plan_reads", mutated)


def off_by_one(monkeypatch):
    def fits(old, copy):
        return copy.source_start + copy.length < old.groups[copy.source_group].partition_numel

    _shift_first_copy(monkeypatch, +1, fits)


def experts_swapped(monkeypatch):
    """Global experts 1 and 2 found at each other's place when reading."""
    original = coordinates.expert_location
    monkeypatch.setattr(coordinates, "expert_location", lambda group, expert: original(group, {1: 2, 2: 1}.get(expert, expert)))


def stale_exp_avg(monkeypatch):
    """exp_avg is never read: the partitions keep what they started with."""
    original = loader._fill
    monkeypatch.setattr(loader, "_fill", lambda source, plan, key, dest, evidence: dest if key == "exp_avg" else original(source, plan, key, dest, evidence))


def scalar_of_another_rank(monkeypatch):
    """Loading rank 1 takes its step from a rank file that holds another one."""
    original = NativeSource.scalars

    def scalars(self, group):
        found = original(self, group)
        if threading.current_thread().name == "rank-1":
            found["step"] = found["step"] - 1
        return found

    monkeypatch.setattr(NativeSource, "scalars", scalars)


def test_a_correct_load_attests_on_every_rank(saved):
    new = moe_layout(2, 1, num_experts=EXPERTS)
    results = run_ranks(
        2, lambda c: load_attested(lambda: NativeSource(saved), str(saved), new, c.rank, c), return_exceptions=True
    )
    for rank, (state, attestation) in enumerate(results):
        assert_state_matches(state, new, rank)
        # 6 parameters in 3 kinds, each expert of the 3 stacks on its own: 3 * (3 + 3 * 8) partition digests
        assert attestation.ok and attestation.params == 6 and attestation.experts == 3 * EXPERTS
        assert attestation.line().startswith("attested: ") and f"match the digests saved in {saved}" in attestation.line()


def test_a_range_resharded_off_by_one_element_is_caught(saved, monkeypatch):
    message = caught(monkeypatch, saved, moe_layout(2, 1, num_experts=EXPERTS), off_by_one)
    assert "attestation failed: 'wte' fp32" in message


def test_two_swapped_experts_are_caught_naming_them(saved, monkeypatch):
    message = caught(monkeypatch, saved, moe_layout(4, 4, num_experts=EXPERTS), experts_swapped)
    assert "'moe.experts.w1' expert 1 fp32" in message and "expert 2" in message


def test_a_stale_exp_avg_is_caught(saved, monkeypatch):
    message = caught(monkeypatch, saved, moe_layout(2, 2, num_experts=EXPERTS), stale_exp_avg)
    assert "'wte' exp_avg holds digest" in message


def test_a_scalar_taken_from_the_wrong_rank_is_caught(saved, monkeypatch):
    message = caught(monkeypatch, saved, moe_layout(2, 1, num_experts=EXPERTS), scalar_of_another_rank)
    assert "group 0 scalar 'step' on rank 1 holds digest" in message


def test_a_padding_element_loaded_into_a_parameter_is_caught(tmp_path, monkeypatch):
    """Odd sizes, so padding sits between parameters; a copy that starts one element early
    takes the padding before it into the parameter."""
    specs = [ParamSpec.of("a", (13, 7), "bfloat16"), ParamSpec.of("b", (5,), "bfloat16"), ParamSpec.of("c", (3, 3), "bfloat16")]
    old = build_layout([specs], 2)
    path = save_synthetic(tmp_path, old)

    def after_padding(layout, copy):
        group = layout.groups[copy.source_group]
        padding = group.padding_ranges(shard_rank(group, copy.source_rank))
        return any(begin <= copy.source_start - 1 < end for begin, end in padding)

    def mutate(mp):
        _shift_first_copy(mp, -1, after_padding)

    new = build_layout([specs], 3, LayoutPolicy.native(compact=True))
    assert any(after_padding(old, c) for r in range(3) for p in loader.plan_reads(old, new, r) for c in p.copies)
    message = caught(monkeypatch, path, new, mutate)
    assert "attestation failed: 'b' fp32" in message or "attestation failed: 'c' fp32" in message


# ---- every load option, every kind of source -------------------------------------------------


def test_module_only_and_weights_only_loads_attest_what_they_load(saved, monkeypatch):
    """A weights-only load takes dense weights from the model file and expert weights from
    their masters: a bad dense weight and swapped experts are both caught."""
    new = moe_layout(2, 1, num_experts=EXPERTS)
    original = NativeSource.model_tensors

    def bad_wte(self, names, digests=None):
        found = original(self, names, digests)  # the digests are of the bytes read, not of this copy
        if "wte" in found:
            found["wte"] = found["wte"].copy()
            found["wte"].reshape(-1)[5] *= -1  # a sign flip: exact in bf16
        return found

    with monkeypatch.context() as mp:
        mp.setattr(NativeSource, "model_tensors", bad_wte)
        message = refused_everywhere(load_everywhere(saved, new, load_module_only=True))
        assert "module tensor 'wte' on rank" in message
    with monkeypatch.context() as mp:
        experts_swapped(mp)
        message = refused_everywhere(load_everywhere(saved, new, load_optimizer_states=False))
        assert "'moe.experts.w1' expert 1 fp32" in message
    for rank, state in enumerate(load_everywhere(saved, new, load_module_only=True)):
        assert state.optimizer_states == [{}, {}], rank


def test_a_non_strict_load_attests_what_it_loads_and_keeps_the_rest(saved, monkeypatch):
    """The run has a parameter the checkpoint lacks: it keeps the base's values, unattested;
    everything loaded is attested, so a stale exp_avg is still caught."""
    dense = [ParamSpec.of(n, s, "bfloat16") for n, s in [*DENSE, ("extra", (4,))]]
    stacks = [ParamSpec.of(n, (EXPERTS // 2, *s), "bfloat16") for n, s in STACKED]
    new = build_layout([dense, ExpertMesh(2, 2).expert_group(stacks, EXPERTS)], 2)

    def one_rank(coord):
        base = synthesize_state(new, coord.rank)  # the run's own state: the pattern negated
        for group in base.optimizer_states:
            for tensor in group.values():
                tensor.neg_()
        return load_sharded(saved, new, coord.rank, coordinator=coord, strict=False, base=base)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "does not match the run's parameters"
        states = run_ranks(2, one_rank)
        for rank, state in enumerate(states):
            loaded = expected_partition(new, rank, 0, "exp_avg", params={"wte", "ln.weight", "router"})
            kept = expected_partition(new, rank, 0, "exp_avg", params={"extra"})
            assert torch.equal(state.optimizer_states[0]["exp_avg"], loaded - kept)
        stale_exp_avg(monkeypatch)
        message = refused_everywhere(run_ranks(2, one_rank, return_exceptions=True))
    assert "exp_avg holds digest" in message


def test_a_universal_checkpoint_carries_the_digests_and_its_loads_attest(saved, tmp_path, monkeypatch):
    from zeroshard.checkpoint import open_checkpoint
    from zeroshard.checkpoint.universal import load_universal, open_universal, to_universal

    universal = to_universal(saved, tmp_path / "universal", progress=False)
    native = open_checkpoint(saved).manifest.digests
    carried = open_universal(universal).manifest.digests
    assert carried.params == native.params  # the run's names and orientation, experts by global id
    assert carried.scalars == native.scalars  # one param group per layout group here
    assert carried.model == {name: native.model[name] for name in ("frozen.weight", "positions")}
    new = moe_layout(2, 2, num_experts=EXPERTS)

    def one_rank(coord):
        return load_universal(universal, new, coord.rank, coordinator=coord)

    for rank, state in enumerate(run_ranks(2, one_rank)):
        assert_state_matches(state, new, rank)
    experts_swapped(monkeypatch)
    message = refused_everywhere(run_ranks(2, one_rank, return_exceptions=True))
    assert "'moe.experts.w1' expert 1 fp32" in message and str(universal) in message


def legacy_save(tmp_path):
    """The run as format version 1 wrote it: no digests in the manifest, no bindings in the
    rank files (a version 1 manifest over rank files with bindings is refused: see
    test_attestation_versions.py)."""
    from zeroshard.checkpoint.native import save as save_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(save_module, "_combined_digests", lambda *args: None)
        patch.setattr(save_module, "binding_metadata", lambda *args: {})
        legacy = save_synthetic(tmp_path / "legacy", moe_layout(4, 2, num_experts=EXPERTS))
    assert json.loads((legacy / "manifest.json").read_text())["version"] == 1
    return legacy


def test_a_legacy_checkpoint_loads_says_so_once_and_is_attested_against_what_was_read(tmp_path, monkeypatch):
    legacy = legacy_save(tmp_path)
    new = moe_layout(2, 1, num_experts=EXPERTS)
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        states = load_everywhere(legacy, new)
    for rank, state in enumerate(states):
        assert_state_matches(state, new, rank)
    notices = [w for w in caught_warnings if issubclass(w.category, UnattestedCheckpointWarning)]
    assert len(notices) == 1 and "\n" not in str(notices[0].message)
    assert "saved without digests (format version 1)" in str(notices[0].message)
    off_by_one(monkeypatch)  # a resharding bug is still caught: placed values against values read
    message = refused_everywhere(load_everywhere(legacy, new))
    assert "'wte' fp32: the ranks hold digest" in message


@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_deepspeed_checkpoint_is_digested_as_read_and_compared_after_redistribution(deepspeed_runs, tmp_path, monkeypatch):
    from zeroshard.deepspeed.checkpoint import open_deepspeed

    run = deepspeed_runs["w2_s2"]
    with open_deepspeed(run.save_dir) as source:
        new = source.info.layout.with_world_size(3)

    def one_rank(coord):
        return load_attested(lambda: open_deepspeed(run.save_dir), str(run.save_dir), new, coord.rank, coord)

    results = run_ranks(3, one_rank)
    assert all(a.ok and "the values read (no saved digests of ours)" in a.line() for _, a in results)
    # Converted, it carries digests of what was read: zlib.crc32 of each tensor it stores.
    from universal_helpers import universal_tensors

    from zeroshard.checkpoint.universal import open_universal, to_universal

    universal = to_universal(run.save_dir, tmp_path / "u", progress=False)
    digests = open_universal(universal).manifest.digests
    stored = universal_tensors(universal)
    for name, kinds in digests.params.items():
        for kind, value in kinds.items():
            assert value == zlib.crc32(stored[f"param/{name}/{kind}"].numpy().tobytes()), (name, kind)
    off_by_one(monkeypatch)
    message = refused_everywhere(run_ranks(3, one_rank, return_exceptions=True))
    assert "fp32: the ranks hold digest" in message and "but it was read as" in message


# ---- rank files bound to their checkpoint: the two edited manifests ---------------------------


def edited(saved, tmp_path, edit) -> object:
    copy = tmp_path / "edited"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def permuted_map(manifest):
    manifest["layout"]["groups"][1]["expert_map"] = [[4, 5, 6, 7], [0, 1, 2, 3]]


def ep_changed_to_4(manifest):
    manifest["layout"] = moe_layout(4, 4, num_experts=EXPERTS).to_dict()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (permuted_map, "rank-00001-of-00004.safetensors: does not belong where the manifest puts it: layout group 1: it holds "
         "rank 0 of 2 of shard group 'expert_dp', experts [4, 5, 6, 7], the manifest puts rank 0 of 2 of shard group "
         "'expert_dp', experts [0, 1, 2, 3] there"),
        (ep_changed_to_4, "rank-00000-of-00004.safetensors: does not belong where the manifest puts it: layout group 1: it holds "
         "rank 0 of 2 of shard group 'expert_dp', experts [0, 1, 2, 3], the manifest puts rank 0 of 1 of shard group "
         "'expert_dp', experts [0, 1] there"),
    ],
    ids=["permuted-expert-map", "ep-2-to-4"],
)
def test_a_manifest_edited_to_read_rank_files_as_other_experts_is_refused(saved, tmp_path, monkeypatch, edit, expected):
    """The issue's measured facts: both edits pass every size, header and CRC check (the
    files are untouched) and loaded scrambled experts; now the binding refuses them in one
    line, and, the binding check switched off, so does the attestation."""
    from zeroshard.checkpoint import open_checkpoint
    from zeroshard.checkpoint.verify import verify_checkpoint

    copy = edited(saved, tmp_path, edit)
    new = moe_layout(2, 1, num_experts=EXPERTS)
    message = refused_everywhere(load_everywhere(copy, new), CheckpointDamagedError)
    assert expected in message
    problems = verify_checkpoint(open_checkpoint(copy))
    assert problems and all("does not belong where the manifest puts it" in p for p in problems)
    monkeypatch.setattr("zeroshard.checkpoint.native.source.check_binding", lambda *args: None)
    message = refused_everywhere(load_everywhere(copy, new))
    assert "attestation failed: 'moe.experts.w1' expert " in message and "fp32 holds digest" in message


def test_a_rank_file_of_another_checkpoint_is_refused(saved, tmp_path):
    """A rank file swapped with another rank's (both intact, the manifest's CRCs edited to
    match): refused as not belonging there."""
    copy = tmp_path / "swapped"
    shutil.copytree(saved, copy)
    first, second = copy / "rank-00000-of-00004.safetensors", copy / "rank-00002-of-00004.safetensors"
    first_bytes, second_bytes = first.read_bytes(), second.read_bytes()
    first.write_bytes(second_bytes)
    second.write_bytes(first_bytes)
    manifest = json.loads((copy / "manifest.json").read_text())
    files = manifest["files"]
    files[first.name], files[second.name] = files[second.name], files[first.name]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    message = refused_everywhere(load_everywhere(copy, moe_layout(4, 2, num_experts=EXPERTS)), CheckpointDamagedError)
    assert "it is rank 2 of 4, the manifest reads it as rank 0 of 4" in message


def test_a_save_whose_ranks_hold_different_scalars_is_refused(tmp_path):
    """Optimizer scalars are the same on every rank, so the manifest records them once: a
    save in which one rank's step differs is refused on every rank, and nothing is published."""
    layout = moe_layout(4, 2, num_experts=EXPERTS)
    states = [synthesize_state(layout, rank, step=6 if rank == 2 else 7) for rank in range(4)]
    with pytest.raises(OSError, match=r"rank 2's optimizer scalars \(groups \[0, 1\]\) differ from rank 0's"):
        save_synthetic(tmp_path, layout, states=states)
    assert not (tmp_path / "t").exists()
