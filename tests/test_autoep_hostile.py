"""Hostile AutoEP files: every field AutoEP adds (ds_autoep_layers, the expert files, the expert
group of the rank files) checked, as the dense DeepSpeed fields are (test_deepspeed_hostile).

Every case must end in a one-line DeepSpeedFormatError naming the file and the field, through
every way in (open_source, load_state, the converters, inspect), never a traceback from deeper
down; flipped bits and cuts either change nothing or are refused.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from test_deepspeed_hostile import bomb, edit, fuzz, open_error

from zeroshard.checkpoint.export.fp32 import load_fp32_state_dict
from zeroshard.checkpoint.source import read_param
from zeroshard.deepspeed.checkpoint import DeepSpeedFormatError, open_deepspeed

MODEL = "mp_rank_00_model_states.pt"
RANK0 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
EXPERT = "layer_0_expert_2_mp_rank_00_model_states.pt"  # EP rank 1's first expert


@pytest.fixture
def tag_dir(autoep_runs, tmp_path) -> Path:
    target = tmp_path / "w2_ep2_s2"
    shutil.copytree(autoep_runs["w2_ep2_s2"].tag_dir, target)
    return target


def layer(change, index: int = 0):
    return lambda raw: change(raw["ds_autoep_layers"][index])


def placement(change):
    return layer(lambda entry: change(entry["expert_placement"]))


def w1_map(change):
    return layer(lambda entry: change(entry["affine_maps"]["params"]["model.layers.0.mlp.experts.w1"]))


def expert_parallel(change):
    return lambda raw: change(raw["ds_config"]["expert_parallel"])


def self_containing() -> dict:
    value: dict = {"rank": 0}
    value["experts"] = value
    return value


FIELD_CASES = {
    "layers is a dict": (
        MODEL,
        lambda raw: raw.update(ds_autoep_layers={}),
        "ds_autoep_layers is a dict, expected a list",
    ),
    "layers is empty": (MODEL, lambda raw: raw.update(ds_autoep_layers=[]), "ds_autoep_layers is empty"),
    "a layer is a number": (
        MODEL,
        lambda raw: raw["ds_autoep_layers"].__setitem__(0, 5),
        "ds_autoep_layers[0] is a int, expected a dict",
    ),
    "num_experts is a float": (
        MODEL,
        layer(lambda e: e.update(num_experts=4.0)),
        "ds_autoep_layers[0]['num_experts'] is a float, expected an integer",
    ),
    "num_local_experts disagrees": (
        MODEL,
        layer(lambda e: e.update(num_local_experts=3)),
        "['num_local_experts'] is 3: 2 EP ranks x 3 is not 4 experts",
    ),
    "an expert on two EP ranks": (
        MODEL,
        placement(lambda p: p["ranks"][1].update(experts=[1, 3])),
        "places experts [[0, 1], [1, 3]]",
    ),
    "no placement": (MODEL, layer(lambda e: e.pop("expert_placement")), "['expert_placement'] is missing"),
    "a trillion experts": (  # refused by the ids' count, before anything of that size exists
        MODEL,
        layer(
            lambda e: [
                e.update(num_experts=10**12, num_local_experts=5 * 10**11),
                e["expert_placement"].update(num_experts=10**12),
            ]
        ),
        "['expert_placement']['ranks'][0]['experts'] lists 2 experts, expected 500000000000 (E / EP)",
    ),
    "placement version": (
        MODEL,
        placement(lambda p: p.update(version=2)),
        "['expert_placement']['version'] is 2, expected 1",
    ),
    "placement of EP rank 5": (
        MODEL,
        placement(lambda p: p["ranks"][1].update(rank=5)),
        "['expert_placement']['ranks'][1]['rank'] is 5",
    ),
    "placement contains itself": (
        MODEL,
        placement(lambda p: p["ranks"].__setitem__(1, self_containing())),
        "['expert_placement']['ranks'][1]['rank'] is 0: EP ranks are 0..1, each once",
    ),
    "affine map names other experts": (
        MODEL,
        w1_map(lambda m: m["ranks"][0]["pieces"][0].update(source=[768, [384, 24, 1]])),
        "does not map EP rank 0's experts [0, 1] as the placement does",
    ),
    "affine map keyed by strings": (
        MODEL,
        w1_map(lambda m: m.update(ranks={str(k): v for k, v in m["ranks"].items()})),
        "has keys '0', '1', expected EP ranks 0..1",
    ),
    "affine map of a wrong shape": (
        MODEL,
        w1_map(lambda m: m.update(logical_shape=[4, 24, 16])),
        "['logical_shape'] is [4, 24, 16], expected [4, 16, 24]",
    ),
    "affine map for another weight": (
        MODEL,
        layer(lambda e: e["affine_maps"]["params"].update(extra={})),
        "['affine_maps']['params'] holds ['extra',",
    ),
    "ZeRO-3 expert format": (
        MODEL,
        layer(lambda e: e.update(checkpoint_format="zero3_partitioned")),
        "only 'per_expert_files' is read",
    ),
    "EP group name": (MODEL, layer(lambda e: e.update(ep_group_name="ep_size_4")), "['ep_group_name'] is 'ep_size_4'"),
    "not rank 0's metadata": (MODEL, layer(lambda e: e.update(ep_rank=1)), "['ep_rank'] is 1, expected 0"),
    "expert range": (
        MODEL,
        layer(lambda e: e.update(global_expert_end=3)),
        "and global_expert_end are [0, 3), EP rank 0 holds experts [0, 1]",
    ),
    "prefix outside the module": (
        MODEL,
        layer(lambda e: e.update(expert_key_prefix="other.experts")),
        "'other.experts' is not inside module 'model.layers.0.mlp'",
    ),
    "a layer id twice": (
        MODEL,
        layer(lambda e: e.update(moe_layer_id=0), 1),
        "ds_autoep_layers names moe_layer_id 0 twice",
    ),
    "expert-DP size": (
        MODEL,
        layer(lambda e: e.update(expert_data_parallel_world_size=2)),
        "ds_autoep_layers says 2 expert-data-parallel ranks",
    ),
    "expert counts per layer": (MODEL, lambda raw: raw.update(num_experts=[4, 8]), "num_experts is [4, 8]"),
    "older metadata key": (
        MODEL,
        lambda raw: raw.update(autoep_layers=raw.pop("ds_autoep_layers")),
        "autoep_layers: AutoEP metadata of an older DeepSpeed",
    ),
    "expert parallelism off": (
        MODEL,
        expert_parallel(lambda c: c.update(enabled=False)),
        "ds_config['expert_parallel']['enabled'] is False",
    ),
    "another EP in the config": (MODEL, expert_parallel(lambda c: c.update(autoep_size=4)), "['autoep_size'] is 4"),
    "data before expert parallelism": (
        MODEL,
        lambda raw: raw["ds_config"].update(use_data_before_expert_parallelism=True),
        "that rank order of expert groups",
    ),
    "preset without names": (
        MODEL,
        expert_parallel(lambda c: c.update(preset_model="mixtral")),
        "AutoEP preset 'mixtral' has no transformers names",
    ),
    "stacked shape": (
        MODEL,
        lambda raw: raw["param_shapes"][1].update({"model.layers.0.mlp.experts.w2": (2, 16, 24)}),
        "param_shapes gives model.layers.0.mlp.experts.w1 [2, 16, 24], w2 [2, 16, 24]",
    ),
    "module tensor the model lacks": (
        MODEL,
        lambda raw: raw["module"].update({"model.layers.0.mlp.expert_bias": torch.zeros(4)}),
        "'model.layers.0.mlp.expert_bias' has no name in the transformers model",
    ),
    "expert files without metadata": (MODEL, lambda raw: raw.pop("ds_autoep_layers"), "no ds_autoep_layers"),
    "expert group not moe": (
        RANK0,
        lambda raw: raw["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1].update(moe=False),
        "says moe=False",
    ),
    "expert group partitions": (
        RANK1,
        lambda raw: raw["optimizer_state_dict"].update(partition_count=[2, 2]),
        "partition_count 2, expected 1",
    ),
    "expert file keys": (
        EXPERT,
        lambda raw: raw.update({"model.layers.0.mlp.experts.w1.3": raw.pop("model.layers.0.mlp.experts.w1.2")}),
        "expected exactly ['model.layers.0.mlp.experts.w1.2',",
    ),
    "expert transposed": (
        EXPERT,
        lambda raw: raw.update(
            {"model.layers.0.mlp.experts.w1.2": raw["model.layers.0.mlp.experts.w1.2"].t().contiguous()}
        ),
        "model.layers.0.mlp.experts.w1.2 is a bfloat16 tensor of shape [24, 16], expected bfloat16 [16, 24]",
    ),
    "expert in fp32": (
        EXPERT,
        lambda raw: raw.update({"model.layers.0.mlp.experts.w3.2": raw["model.layers.0.mlp.experts.w3.2"].float()}),
        "w3.2 is a float32 tensor of shape [16, 24], expected bfloat16",
    ),
    "expert is a number": (
        EXPERT,
        lambda raw: raw.update({"model.layers.0.mlp.experts.w2.2": 7}),
        "w2.2 is a int, expected a tensor",
    ),
    "expert bomb": (
        EXPERT,
        lambda raw: raw.update({"model.layers.0.mlp.experts.w2.2": bomb()}),
        "expanded view is refused",
    ),
}


NAMING_THE_FOLDER = {"expert files without metadata"}  # the stray files, not one file, are the problem


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_a_wrong_autoep_field_is_one_line_naming_file_and_field(tag_dir, case):
    name, change, words = FIELD_CASES[case]
    edit(tag_dir / name, change)
    message = open_error(tag_dir)
    named = tag_dir if case in NAMING_THE_FOLDER else tag_dir / name
    assert message.startswith(f"{named}: ") or message.startswith(f"{named}, "), message
    assert words in message, message


def test_a_missing_or_extra_expert_file_is_named(tag_dir):
    missing = tag_dir / "layer_1_expert_3_mp_rank_00_model_states.pt"
    kept = missing.read_bytes()
    missing.unlink()
    assert open_error(tag_dir) == f"{tag_dir}: {missing.name} is missing (1 AutoEP expert files in all)"
    missing.write_bytes(kept)
    shutil.copy(tag_dir / EXPERT, tag_dir / "layer_2_expert_0_mp_rank_00_model_states.pt")
    assert "layer_2_expert_0_mp_rank_00_model_states.pt belongs to no AutoEP layer" in open_error(tag_dir)


def test_every_entry_point_refuses_in_one_line(tag_dir, tmp_path, capsys):
    from zeroshard.checkpoint import open_source
    from zeroshard.cli import main

    (tag_dir / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(DeepSpeedFormatError, match="layer_1_expert_3_mp_rank_00_model_states.pt is missing"):
        open_source(tag_dir)
    for command in (
        ["to-fp32", str(tag_dir), str(tmp_path / "out")],
        ["to-universal", str(tag_dir), str(tmp_path / "u")],
        ["inspect", str(tag_dir)],
    ):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "layer_1_expert_3_mp_rank_00_model_states.pt is missing" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "u").exists()


def test_a_flipped_bit_in_an_expert_file_is_found_when_read(tag_dir, capsys):
    """Opening parses the pickles; the weights' records are checked when read (their CRC-32)."""
    from zeroshard.cli import main

    path = tag_dir / EXPERT
    data = bytearray(path.read_bytes())
    offset = data.index(b"data/0") + 200  # inside the first weight's record
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with open_deepspeed(tag_dir) as source:
        with pytest.raises(DeepSpeedFormatError, match=f"{EXPERT}: record .* is corrupt"):
            source.model_tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert main(["inspect", "--verify", str(tag_dir)]) == 1
    assert "is corrupt" in capsys.readouterr().out


def everything(tag_dir: Path) -> dict[str, bytes]:
    """What a conversion or a resumed run takes from the checkpoint, as bytes: the to-fp32
    state dict, every optimizer state of every parameter, the expert files' weights, the
    scalars and the info."""
    out: dict[str, bytes] = {}
    with open_deepspeed(tag_dir) as source:
        for name, tensor in load_fp32_state_dict(source).items():
            out[f"fp32/{name}"] = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        for group in source.layout.groups:
            for slot in group.params:
                for key in ("fp32", *source.info.state_keys[group.index]):
                    out[f"{key}/{slot.name}"] = read_param(source, slot.name, key).tobytes()
                out[f"weight/{slot.name}"] = np.ascontiguousarray(source.model_tensor(slot.name)).tobytes()
            out[f"scalars/{group.index}"] = repr(
                {k: np.asarray(v).tobytes() for k, v in source.scalars(group.index).items()}
            ).encode()
        out["info"] = repr(
            [source.info.extra, [g.hyperparameters for g in source.info.param_groups], source.info.model_entries]
        ).encode()
    return out


def test_fuzzed_autoep_files_convert_identically_or_are_refused(tag_dir):
    files = [
        tag_dir / MODEL,
        tag_dir / EXPERT,
        tag_dir / "layer_1_expert_0_mp_rank_00_model_states.pt",
        tag_dir / RANK1,
    ]
    outcomes = fuzz(tag_dir, files, everything, 200, 20261201)
    assert outcomes["refused"] > 140, outcomes  # flips in bytes never read (zip padding) may pass
