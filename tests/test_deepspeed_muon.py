"""DeepSpeed ZeRO-1/2 Muon checkpoints (``MuonWithAuxAdam``): read, converted, resharded, refused.

The runs come from deepspeed_muon_fixtures (D = 1 and 2, stages 1 and 2, alignment on and off;
at D = 2 the matrix fc3.weight lies across the partition boundary). Each is compared bit for
bit with what DeepSpeed held in memory right before it saved (fp32 masters; Muon's
momentum_buffer per matrix; Adam's exp_avg / exp_avg_sq per parameter), where DeepSpeed's own
ds_to_universal fails.
"""

from __future__ import annotations

import importlib.util
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_muon_fixtures import ADAM_PARAMS, CONFIGS, MUON_PARAMS, STEPS, MuonFixture, build_model
from safetensors.torch import load_file
from test_deepspeed_import import rewrite_rank_file

from zeroshard.checkpoint import run_ranks
from zeroshard.checkpoint.attest.attested import load_attested
from zeroshard.checkpoint.formats import open_source
from zeroshard.checkpoint.source import read_param
from zeroshard.checkpoint.universal import open_universal
from zeroshard.cli.main import main as zeroshard_cli
from zeroshard.deepspeed.checkpoint import DeepSpeedFormatError, open_deepspeed

CONFIG_NAMES = [config.name for config in CONFIGS]
MOMENTUM, ADAM_STATES = ("momentum_buffer",), ("exp_avg", "exp_avg_sq")


@pytest.fixture(params=CONFIG_NAMES)
def run(request, deepspeed_muon_runs) -> MuonFixture:
    return deepspeed_muon_runs[request.param]


def bits(tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
    """An fp32 tensor's bits, flat (so -0.0 differs from 0.0, and a NaN equals itself)."""
    tensor = torch.from_numpy(np.array(tensor)) if isinstance(tensor, np.ndarray) else tensor
    assert tensor.dtype == torch.float32
    return tensor.contiguous().reshape(-1).view(torch.int32)


def states_of(name: str) -> tuple[str, ...]:
    return MOMENTUM if name in MUON_PARAMS else ADAM_STATES


def expected_keys() -> set[str]:
    return {f"{key}/{name}" for name in (*MUON_PARAMS, *ADAM_PARAMS) for key in ("fp32", *states_of(name))}


# ---- the fixtures are what they claim ------------------------------------------------------------


def test_deepspeeds_ds_to_universal_fails_on_every_muon_checkpoint(run):
    """DeepSpeed issue #8608, reproduced on each run (with --inject_missing_state, which a plain
    engine's checkpoint needs to get that far)."""
    failure = run.recorded()["ds_to_universal"]
    assert failure.startswith("KeyError: 'exp_avg' (ds_to_universal.py:"), failure  # :154 in 0.19.8


def test_a_matrix_lies_across_the_partitions_and_each_owner_holds_it_whole(deepspeed_muon_runs):
    for name in ("muon_w2_s1", "muon_w2_s2", "muon_w2_s2_align"):
        run = deepspeed_muon_runs[name]
        split = run.recorded()["split_matrices"]["fc3.weight"]
        assert split == {"owners": [0, 1], "equal": True}, name
        with open_deepspeed(run.save_dir) as source:
            muon = source.layout.groups[0]
            assert [f.name for f in muon.fragments(0)][-1] == [f.name for f in muon.fragments(1)][0] == "fc3.weight"
        files = [torch.load(path, weights_only=False) for path in sorted(run.tag_dir.glob("*optim_states.pt"))]
        held = [f["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["momentum_buffer"] for f in files]
        assert [t.numel() for t in held] == [35 + 42, 42 + 30], "whole matrices, not the partition's 54 elements"
        assert all(t.dtype == torch.bfloat16 for t in held)
        assert torch.equal(held[0][35:].view(torch.int16), held[1][:42].view(torch.int16)), "fc3's two copies"


# ---- the reader ------------------------------------------------------------------------------------


def test_reader_gives_deepspeeds_in_memory_state_per_parameter(run):
    expected = load_file(str(run.accessors))
    assert set(expected) == expected_keys()
    with open_deepspeed(run.save_dir) as source:
        assert source.info.state_keys == [list(MOMENTUM), list(ADAM_STATES)]
        for name in source.layout.param_names:
            for key in ("fp32", *states_of(name)):
                actual = read_param(source, name, key)
                assert torch.equal(bits(actual), bits(expected[f"{key}/{name}"])), (key, name)


def test_source_info_names_muon_and_adam_groups(run):
    with open_deepspeed(run.save_dir) as source:
        info = source.info
        assert [group.hyperparameters["use_muon"] for group in info.param_groups] == [True, False]
        assert info.optimizer_class == "deepspeed:Muon"
        assert source.scalars(0) == {} and float(source.scalars(1)["step"]) == STEPS
        assert info.aliases == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("name", ["muon_w2_s2_align", "muon_w1_s2"])
def test_momentum_reads_any_range_of_the_partition_and_padding_as_zeros(deepspeed_muon_runs, name):
    with open_deepspeed(deepspeed_muon_runs[name].save_dir) as source:
        group = source.layout.groups[0]
        for rank in range(group.world_size):
            whole = source.read(rank, 0, "momentum_buffer", 0, group.partition_numel)
            inside = np.zeros(group.partition_numel, dtype=bool)
            for fragment in group.fragments(rank):
                inside[fragment.partition_start : fragment.partition_start + fragment.length] = True
            assert not inside.all(), "the partition has padding"
            assert (whole[~inside] == 0).all() and (whole[inside] != 0).any()
            for start, end in [(0, 1), (3, 40), (29, 31), (34, 36), (1, group.partition_numel)]:
                assert np.array_equal(source.read(rank, 0, "momentum_buffer", start, end), whole[start:end])


# ---- conversions -------------------------------------------------------------------------------------


def convert(command: str, checkpoint: Path, out: Path) -> Path:
    assert zeroshard_cli([command, str(checkpoint), str(out), "--no-progress"]) == 0
    return out


def test_to_universal_holds_deepspeeds_in_memory_state_and_digests_of_it(run, tmp_path):
    expected = load_file(str(run.accessors))
    out = convert("to-universal", run.save_dir, tmp_path / "universal")
    with open_universal(out) as universal:
        manifest = universal.manifest
        assert {name: param.states for name, param in manifest.params.items()} == {
            name: states_of(name) for name in (*MUON_PARAMS, *ADAM_PARAMS)
        }
        for name, param in manifest.params.items():
            for key in ("fp32", *param.states):
                assert torch.equal(bits(universal.read_param(name, key)), bits(expected[f"{key}/{name}"])), (key, name)
                stored = np.ascontiguousarray(universal.read_param(name, key))
                assert manifest.digests.params[name][key] == zlib.crc32(stored.tobytes()), (key, name)
        assert manifest.aliases == {"head.weight": "embed.weight"}


def test_to_fp32_exports_deepspeeds_fp32_masters(run, tmp_path):
    expected = load_file(str(run.accessors))
    exported = load_file(str(convert("to-fp32", run.save_dir, tmp_path / "fp32") / "model.safetensors"))
    assert set(exported) == {*MUON_PARAMS, *ADAM_PARAMS, "head.weight", "position_scale"}
    for name in (*MUON_PARAMS, *ADAM_PARAMS):
        assert torch.equal(bits(exported[name]), bits(expected[f"fp32/{name}"])), name
    assert torch.equal(bits(exported["head.weight"]), bits(expected["fp32/embed.weight"]))


# ---- resharded: each new rank's partitions hold DeepSpeed's values, attested ------------------------


def assert_holds(state, layout, rank: int, expected: dict[str, torch.Tensor]) -> None:
    """Every fragment of the rank's fp32 partitions and optimizer states holds the reference."""
    for group in layout.groups:
        keys = ("fp32", *state.optimizer_states[group.index])
        assert set(keys) - {"fp32"} == set(states_of(group.params[0].name))
        for key in keys:
            held = state.fp32_partitions[group.index] if key == "fp32" else state.optimizer_states[group.index][key]
            for fragment in group.fragments(rank):
                got = held[fragment.partition_start : fragment.partition_start + fragment.length].float()
                want = expected[f"{key}/{fragment.name}"].reshape(-1)
                want = want[fragment.param_start : fragment.param_start + fragment.length]
                assert torch.equal(bits(got), bits(want)), (rank, key, fragment.name)


@pytest.mark.parametrize("via", ["direct", "universal"])
@pytest.mark.parametrize(
    "name, world_size", [("muon_w2_s2", 3), ("muon_w2_s2_align", 1), ("muon_w1_s1", 2), ("muon_w2_s1", 4)]
)
def test_loads_at_another_world_size_hold_deepspeeds_state(deepspeed_muon_runs, tmp_path, via, name, world_size):
    run = deepspeed_muon_runs[name]
    expected = load_file(str(run.accessors))
    path = run.save_dir if via == "direct" else convert("to-universal", run.save_dir, tmp_path / "u")
    with open_deepspeed(run.save_dir) as source:
        new = source.info.layout.with_world_size(world_size)

    def one_rank(coord):
        return load_attested(lambda: open_source(path), str(path), new, coord.rank, coord)

    for rank, (state, attestation) in enumerate(run_ranks(world_size, one_rank)):
        assert attestation.ok, attestation.line()
        assert_holds(state, new, rank, expected)


# ---- bad input: one line naming the file, group and parameter or state ------------------------------


@pytest.fixture
def muon_copy(deepspeed_muon_runs, tmp_path) -> Path:
    target = tmp_path / "muon_w2_s2"
    shutil.copytree(deepspeed_muon_runs["muon_w2_s2"].tag_dir, target)
    return target


def rank_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def set_flag(group: int, value):
    def mutate(state):
        state["base_optimizer_state"]["param_groups"][group]["use_muon"] = value

    return mutate


def edit_group_state(group: int, edit):
    def mutate(state):
        edit(state["base_optimizer_state"]["state"][group])

    return mutate


def refused(tag_dir: Path, rank: int, mutate) -> str:
    rewrite_rank_file(rank_file(tag_dir, rank), mutate)
    with pytest.raises(DeepSpeedFormatError) as caught:
        open_deepspeed(tag_dir)
    message = str(caught.value)
    assert "\n" not in message and str(rank_file(tag_dir, rank)) in message
    return message


BAD_MUON_FILES = {
    "flag not a bool": (0, set_flag(0, "yes"), "group 0: use_muon is 'yes', expected true or false"),
    "Adam group flagged Muon": (
        0,
        set_flag(1, True),
        "group 1: use_muon is true, but parameter 'fc1.bias' of shape [5] is not a matrix (Muon updates matrices only)",
    ),
    "Muon group flagged Adam": (
        0,
        set_flag(0, False),
        "group 0: use_muon is false, but the group holds Muon's 'momentum_buffer'",
    ),
    "another rank's flag differs": (
        1,
        set_flag(0, False),
        "group 0, rank 1: use_muon is false, rank 0's file says true",
    ),
    "momentum cut short": (
        1,
        edit_group_state(0, lambda s: s.update(momentum_buffer=s["momentum_buffer"][:-1].clone())),
        "group 0, rank 1: 'momentum_buffer' has 71 elements, but the 2 matrices with a piece in the partition have 72",
    ),
    "momentum missing on a rank": (
        1,
        edit_group_state(0, lambda s: s.pop("momentum_buffer")),
        "group 0, rank 1: 'momentum_buffer' is missing, but the 2 matrices with a piece in the partition have 72",
    ),
    "Adam state in the Muon group": (
        1,
        edit_group_state(0, lambda s: s.update(exp_avg=torch.zeros(54))),
        "group 0, rank 1: use_muon is true, but the group holds optimizer state ['exp_avg'] besides 'momentum_buffer'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MUON_FILES))
def test_a_bad_muon_file_is_one_line_naming_what_is_wrong(muon_copy, case):
    rank, mutate, expected = BAD_MUON_FILES[case]
    assert expected in refused(muon_copy, rank, mutate)


def test_cli_refuses_a_bad_muon_file_with_exit_code_2(muon_copy, tmp_path, capsys):
    rewrite_rank_file(rank_file(muon_copy, 0), set_flag(1, True))
    assert zeroshard_cli(["to-universal", str(muon_copy), str(tmp_path / "out"), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "parameter 'fc1.bias' of shape [5] is not a matrix" in error
    assert not (tmp_path / "out").exists()


def test_a_rank_holding_no_piece_of_a_muon_group_may_hold_no_momentum():
    """DeepSpeed sizes a rank's momentum by the matrices with a piece in its partition: a rank
    past the group's last element has none to hold. Its partition (padding) reads as zeros;
    a rank with a piece and no momentum is refused."""
    from zeroshard.deepspeed.checkpoint.muon import PartitionMomentum
    from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

    layout = build_layout([[ParamSpec.of("w", (3, 2), "bfloat16")]], 8, LayoutPolicy.deepspeed())
    group = layout.groups[0]
    assert [len(group.fragments(rank)) for rank in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    empty = PartitionMomentum(None, group, 5, "rank 5's file")
    assert empty.numel() == group.partition_numel and not empty.read(0, group.partition_numel).any()
    with pytest.raises(DeepSpeedFormatError, match="rank 2's file: 'momentum_buffer' is missing, but the 1 matrices"):
        PartitionMomentum(None, group, 2, "rank 2's file")
