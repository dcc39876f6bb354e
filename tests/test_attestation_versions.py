"""A native manifest may not claim an older format version than what it holds or what its rank
files carry (issue 28 M6): set to ``"version": 1`` with its digests dropped, a version 2 MoE
manifest with a permuted expert map skipped every check (bindings and digests are version 2's)
and loaded, converted and verified with its experts swapped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_attestation import legacy_save, load_everywhere, refused_everywhere
from test_moe_checkpoint import moe_layout
from universal_helpers import save_synthetic

from zeroshard.checkpoint import open_checkpoint, verify_checkpoint
from zeroshard.io.damage import CheckpointDamagedError
from zeroshard.cli.main import main
from zeroshard.layout import ExpertMesh, ExpertStack, ParamSpec, build_layout

EXPERTS = 8
BINDING_REFUSAL = (
    "carries a zeroshard.binding, which only format version 2 writes, but the manifest says format version 1"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return save_synthetic(tmp_path_factory.mktemp("versions"), moe_layout(4, 2, num_experts=EXPERTS))


def _edited(saved: Path, tmp_path: Path, *, drop_digests: bool, layout: dict | None = None) -> Path:
    """A copy whose manifest claims version 1 and permutes the expert map; rank files untouched."""
    copy = tmp_path / "edited"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["version"] = 1
    if drop_digests:
        manifest.pop("digests")
    if layout is not None:
        manifest["layout"] = layout
    group = manifest["layout"]["groups"][1]
    group["expert_map"] = group["expert_map"][::-1]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _refused_by_the_cli(path: Path, tmp_path: Path, capsys, expected: str) -> None:
    assert main(["inspect", "--verify", str(path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(expected in line for line in lines), lines
    for command in ("to-fp32", "to-universal"):
        assert main([command, str(path), str(tmp_path / command), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
        assert not (tmp_path / command).exists()


def test_a_manifest_downgraded_to_version_1_over_bound_rank_files_is_refused(saved, tmp_path, capsys):
    copy = _edited(saved, tmp_path, drop_digests=True)
    message = refused_everywhere(load_everywhere(copy, moe_layout(2, 1, num_experts=EXPERTS)), CheckpointDamagedError)
    assert f"{copy}/rank-0000" in message and f"-of-00004.safetensors: {BINDING_REFUSAL}" in message, message
    problems = verify_checkpoint(open_checkpoint(copy))
    assert len(problems) == 4 and all(BINDING_REFUSAL in problem for problem in problems)
    _refused_by_the_cli(copy, tmp_path, capsys, BINDING_REFUSAL)


def test_a_version_1_manifest_holding_digests_is_refused(saved, tmp_path, capsys):
    copy = _edited(saved, tmp_path, drop_digests=False)  # version 1 readers ignored them
    expected = f"{copy / 'manifest.json'}: format version 1, but it holds digests, which version 2 added"
    with pytest.raises(ValueError, match=expected):
        open_checkpoint(copy)
    _refused_by_the_cli(copy, tmp_path, capsys, expected)


def test_a_version_1_manifest_holding_a_layout_of_version_3_is_refused(tmp_path, capsys):
    """Layout version 3 (expert stacks described) came after format version 2."""
    stack = ExpertStack("out_in", "stacked", ())
    experts = ExpertMesh(4, 2).expert_group([ParamSpec.of("moe.w1", (2, 3, 4), "bf16")], 4, stacks=(stack,))
    layout = build_layout([[ParamSpec.of("embed", (9, 4), "bf16")], experts], 4)
    saved = save_synthetic(tmp_path / "v3", layout)
    assert json.loads((saved / "manifest.json").read_text())["layout"]["version"] == 3
    copy = _edited(saved, tmp_path, drop_digests=True)
    expected = f"{copy / 'manifest.json'}: format version 1, but its layout is version 3, which came after"
    with pytest.raises(ValueError, match=expected):
        open_checkpoint(copy)
    _refused_by_the_cli(copy, tmp_path, capsys, expected)


def test_a_version_1_checkpoint_as_version_1_wrote_it_still_verifies_and_converts(tmp_path, capsys):
    legacy = legacy_save(tmp_path)
    assert main(["inspect", "--verify", str(legacy)]) == 0
    assert "every checksum matches (no digests)" in capsys.readouterr().out
    assert main(["to-fp32", str(legacy), str(tmp_path / "fp32"), "--no-progress"]) == 0


# ---- the universal format: the same rule, and shards that say their version ------------------------


@pytest.fixture(scope="module")
def universal(saved, tmp_path_factory) -> Path:
    from zeroshard.checkpoint.universal import to_universal

    return to_universal(saved, tmp_path_factory.mktemp("universal") / "u", progress=False)


def _universal_edited(universal: Path, tmp_path: Path, version: int, *, drop: tuple[str, ...]) -> Path:
    """A copy whose universal.json claims ``version``, without ``drop``, its legacy expert
    lists reversed (each stack's experts swapped end for end); shards untouched."""
    copy = tmp_path / "edited-universal"
    shutil.copytree(universal, copy)
    manifest = json.loads((copy / "universal.json").read_text())
    assert manifest["version"] == 4 and manifest["experts"], manifest.keys()
    manifest["version"] = version
    for key in drop:
        manifest.pop(key)
    manifest["experts"] = {stack: names[::-1] for stack, names in manifest["experts"].items()}
    (copy / "universal.json").write_text(json.dumps(manifest))
    return copy


def test_a_universal_manifest_claiming_a_version_before_its_digests_is_refused(universal, tmp_path, capsys):
    """Version 3 readers skip digests: the swapped experts would have passed."""
    copy = _universal_edited(universal, tmp_path, 3, drop=())
    expected = f"{copy / 'universal.json'}: format version 3, but it holds digests, which version 4 added"
    assert main(["inspect", "--verify", str(copy)]) == 1  # damage, as for a native manifest
    assert expected in capsys.readouterr().out
    assert main(["to-fp32", str(copy), str(tmp_path / "fp32"), "--no-progress"]) == 2
    assert expected in capsys.readouterr().err and not (tmp_path / "fp32").exists()


def test_a_universal_manifest_downgraded_below_its_shards_is_refused(universal, tmp_path, capsys):
    """Digests dropped too, the manifest alone looks like a genuine version 3 one: its shards,
    written as version 4, say otherwise wherever they are read."""
    copy = _universal_edited(universal, tmp_path, 3, drop=("digests",))
    assert main(["inspect", "--verify", str(copy)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    claim = "written as universal format version '4', but universal.json claims version 3"
    assert lines and all(claim in line for line in lines if "universal-" in line), lines
    assert main(["to-fp32", str(copy), str(tmp_path / "fp32"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written as universal format version '4'" in err, err
    assert not (tmp_path / "fp32").exists()


def test_universal_shards_name_the_version_of_their_manifest(universal):
    from zeroshard.io.safetensors_io import read_metadata

    version = json.loads((universal / "universal.json").read_text())["version"]
    shards = sorted(universal.glob("universal-*.safetensors"))
    assert shards and all(read_metadata(shard).get("version") == str(version) for shard in shards)
