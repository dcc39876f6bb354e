"""The report lines of layouts with expert groups (inspect and ``zeroshard layout``): shard
groups, EP and the expert map, on synthesised version-2 layouts; dense reports unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from zeroshard.cli.expert_report import format_ids, group_partitioning, shard_group_lines
from zeroshard.cli.main import main
from zeroshard.layout import ExpertMesh, GroupSpec, Layout, ParamSpec, build_layout


def expert_layout(world_size: int, ep: int, experts: int = 8) -> Layout:
    local = experts // ep
    dense = [ParamSpec.of("wte", (11, 8), "bf16"), ParamSpec.of("ln.bias", (8,), "bf16")]
    stacked = [ParamSpec.of("moe.w1", (local, 8, 16), "bf16"), ParamSpec.of("moe.w2", (local, 16, 8), "bf16")]
    return build_layout([dense, ExpertMesh(world_size, ep).expert_group(stacked, experts)], world_size)


def test_shard_groups_ep_and_expert_map():
    layout = Layout.from_json(expert_layout(8, 4).to_json())  # as read back from a manifest (version 2)
    assert layout.to_dict()["version"] == 2
    assert shard_group_lines(layout) == [
        "shard groups: dp (8 ranks), expert_dp (2 ranks); expert parallelism EP=4",
        "expert map of group 1: 8 experts, 2 per EP rank; 512 elements per EP rank, 2,048 in all",
        "  EP rank 0: experts 0, 1 on ranks 0, 4",
        "  EP rank 1: experts 2, 3 on ranks 1, 5",
        "  EP rank 2: experts 4, 5 on ranks 2, 6",
        "  EP rank 3: experts 6, 7 on ranks 3, 7",
    ]
    assert group_partitioning(layout, layout.groups[0]) == "dense, over dp (8 ranks)"
    assert group_partitioning(layout, layout.groups[1]) == "experts, over expert_dp (2 ranks)"


def test_an_expert_map_read_from_json_is_shown_as_stored():
    data = expert_layout(4, 2).to_dict()
    data["groups"][1]["expert_map"] = [[0, 2, 5, 7], [1, 3, 4, 6]]  # not contiguous: still valid
    lines = shard_group_lines(Layout.from_dict(data))
    assert lines[2:] == [
        "  EP rank 0: experts 0, 2, 5, 7 on ranks 0, 2",
        "  EP rank 1: experts 1, 3, 4, 6 on ranks 1, 3",
    ]


def test_every_rank_holds_all_experts_at_ep_1():
    assert shard_group_lines(expert_layout(1, 1))[1:] == [
        "expert map of group 1: 8 experts, 8 per EP rank; 2,048 elements per EP rank, 2,048 in all",
        "  EP rank 0: experts 0-7 on rank 0",
    ]


def test_long_expert_maps_are_cut():
    layout = expert_layout(64, 16, experts=32)
    lines = shard_group_lines(layout)
    assert lines[0] == "shard groups: dp (64 ranks), expert_dp (4 ranks); expert parallelism EP=16"
    assert lines[2] == "  EP rank 0: experts 0, 1 on ranks 0, 16, 32, 48"
    assert lines[-1] == "  ... 8 more EP ranks" and len(lines) == 2 + 8 + 1
    assert len(shard_group_lines(layout, listed=None)) == 2 + 16


def test_dense_layouts_have_no_such_lines():
    dense = build_layout([[ParamSpec.of("a", (3,), "fp32")]], 4)
    assert shard_group_lines(dense) == [] and group_partitioning(dense, dense.groups[0]) == ""
    # A shard group other than "dp" without experts is listed, without EP or an expert map.
    other = build_layout([[ParamSpec.of("a", (3,), "fp32")], GroupSpec((ParamSpec.of("b", (5,), "fp32"),), "tp", 2)], 4)
    assert shard_group_lines(other) == ["shard groups: dp (4 ranks), tp (2 ranks)"]


@pytest.mark.parametrize(
    "ids, text",
    [
        ((), ""),
        ((3,), "3"),
        ((4, 5), "4, 5"),
        ((0, 1, 2), "0-2"),
        ((1, 3, 5, 7), "1, 3, 5, 7"),
        ((1, 3, 5, 7, 9), "1, 3, ..., 9"),
        ((0, 9, 2, 8, 4, 7, 1), "0, 9, 2, 8, 4, 7, ... (7 in all)"),
    ],
)
def test_format_ids(ids, text):
    assert format_ids(ids) == text


def test_layout_report_of_the_moe_demo_model(capsys):
    assert main(["layout", "--moe", "--ep", "2", "--world-size", "4", "8"]) == 0
    out = capsys.readouterr().out
    assert "MoE demo model (MoEGPT, 8 experts, top-2) at EP=2" in out
    assert "group 1 (bfloat16, experts, over expert_dp (2 ranks)): 6 parameters" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4 ", "8 "))]
    assert [row[:2] for row in rows] == [["4", "4"], ["8", "8"], ["4", "2"], ["8", "4"]]  # D, then the group's ranks
    assert "shard groups: dp (8 ranks), expert_dp (4 ranks); expert parallelism EP=2" in out
    assert "EP rank 1: experts 4-7 on ranks 1, 3, 5, 7" in out and "EP rank 1: experts 4-7 on ranks 1, 3\n" in out
    assert main(["layout", "--moe", "--ep", "4", "--world-size", "4", "--json"]) == 0
    layout = Layout.from_json(capsys.readouterr().out)
    assert layout.shard_groups == {"dp": 4, "expert_dp": 1}
    assert layout.groups[1].expert_map == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_dense_layout_report_is_unchanged(capsys):
    assert main(["layout", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "shard groups" not in out and "expert" not in out
    header = next(line for line in out.splitlines() if "tail pad" in line)
    assert header.split() == [
        "D",
        "tail",
        "pad",
        "partition/rank",
        "padding",
        "bytes",
        "overhead",
        "ranks",
        "with",
        "padding",
    ]


@pytest.mark.parametrize(
    "args, error",
    [
        (["--moe", "--ep", "3"], "--ep 3 does not divide the demo model's 8 experts"),
        (["--moe", "--ep", "4", "--world-size", "4", "6"], "--ep 4 does not divide --world-size 6"),
        (["--moe", "--model", "shapes.json"], "give either --moe or --model"),
    ],
)
def test_bad_moe_layout_arguments(args, error, capsys):
    assert main(["layout", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and error in err[0]


def test_model_json_still_reads(tmp_path, capsys):
    model = tmp_path / "shapes.json"
    model.write_text(json.dumps({"groups": [[[8, 4]], [[3]]]}))
    assert main(["layout", "--model", str(model), "--world-size", "2"]) == 0
    assert "2 parameters in 2 group(s)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A native checkpoint of an expert layout at W=8, EP=4, saved by thread ranks."""
    from universal_helpers import save_synthetic

    return save_synthetic(tmp_path_factory.mktemp("moe84"), expert_layout(8, 4))


def test_inspect_shows_shard_groups_ep_and_the_expert_map(moe_checkpoint, capsys):
    assert main(["inspect", str(moe_checkpoint)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("groups:")
    assert out[start + 1].startswith("  group 0 (bfloat16, dense, over dp (8 ranks)): 2 parameters, 96 elements")
    assert out[start + 2].startswith(
        "  group 1 (bfloat16, experts, over expert_dp (2 ranks)): 2 parameters, 512 elements"
    )
    assert out[start + 3 : start + 9] == shard_group_lines(expert_layout(8, 4))
    assert "parameters: 4 trainable (608 elements with one EP rank's experts, 2,144 with all)" in out[start + 9]
    assert "world size: 8" in out


@pytest.fixture(scope="module")
def moe_universal(moe_checkpoint, tmp_path_factory):
    from zeroshard.checkpoint.universal import to_universal

    return to_universal(moe_checkpoint, tmp_path_factory.mktemp("moe84u") / "universal")


def test_inspect_of_a_universal_moe_checkpoint_names_its_experts(moe_universal, capsys):
    assert main(["inspect", str(moe_universal)]) == 0
    out = capsys.readouterr().out
    assert (
        "experts: 2 stacked expert weights of 8 experts each, stored as one [out, in] tensor per expert by global id "
        "(moe.w1 -> moe.0.w1.weight, ...); any expert parallelism that divides the experts loads them\n"
    ) in out
    assert "parameters: 18 trainable (2,144 elements)" in out  # 2 dense, 2 x 8 experts
    assert "padding overhead: none (the source run's expert parallelism is not recorded" in out


def test_inspect_of_moe_checkpoints_needs_no_torch(moe_checkpoint, moe_universal):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from zeroshard.cli.main import main
        for path in ({str(moe_checkpoint)!r}, {str(moe_universal)!r}):
            assert main(["inspect", path]) == 0 and main(["inspect", "--verify", path]) == 0
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "expert parallelism EP=4" in done.stdout and "EP rank 3: experts 6, 7 on ranks 3, 7" in done.stdout
    assert "experts: 2 stacked expert weights of 8 experts each" in done.stdout
    assert done.stdout.count(": OK, ") == 2
