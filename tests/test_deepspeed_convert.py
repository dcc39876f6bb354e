"""``zeroshard to-fp32`` and ``zeroshard to-universal`` on real DeepSpeed ZeRO-1/2 checkpoints.

The runs come from deepspeed_fixtures (stages 1 and 2, D = 1/2/4/8, alignment on and off, a
3-element no-decay group padded over most ranks at D = 8). The CLI runs in-process through
``zeroshard.cli.main`` and its outputs are compared bit for bit with DeepSpeed's own:

* to-fp32 against DeepSpeed's ``zero_to_fp32`` (run on rank 0 right after the save);
* to-universal against ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
  (called on every rank right before the save).

Where the two exports differ on purpose (to-fp32 with the default dtype fp32):

| entry | DeepSpeed zero_to_fp32 | zeroshard to-fp32 |
| --- | --- | --- |
| trained parameter | fp32 master | fp32 master (the same bits) |
| tied ``head.weight`` | the embedding's tensor | a copy of the embedding's fp32 master |
| frozen parameter | bf16 as saved (stage 2); absent (stage 1) | the saved bf16 weight cast to the export dtype (fp32) |
| buffer | upcast to fp32 | its own dtype |

DeepSpeed's bf16 engine casts parameters only, so the buffer here is fp32 on both sides and
compared as is. Frozen parameters are compared after casting zeroshard's back to bf16 (exact:
they were bf16); for stage 1 against the module state_dict in ``mp_rank_00_model_states.pt``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_fixtures import CONFIGS, Fixture
from safetensors.torch import load_file

from zeroshard.io.dtypes import to_torch
from zeroshard.checkpoint.universal import open_universal
from zeroshard.cli.main import main as zeroshard_cli

CONFIG_NAMES = [config.name for config in CONFIGS]
FROZEN = ("frozen.weight", "frozen.bias", "empty")
BUFFERS = ("position_scale",)
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(params=CONFIG_NAMES)
def run(request, deepspeed_runs) -> Fixture:
    return deepspeed_runs[request.param]


def same_bits(actual: torch.Tensor | np.ndarray, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 differs from 0.0, and a NaN equals itself)."""
    if isinstance(actual, np.ndarray):
        actual = to_torch(actual)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    return torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def convert(command: str, checkpoint: Path, out: Path) -> Path:
    assert zeroshard_cli([command, str(checkpoint), str(out), "--no-progress"]) == 0
    return out


def saved_module(run: Fixture) -> dict[str, torch.Tensor]:
    """The module state_dict DeepSpeed saved (bf16 weights, frozen parameters, buffers)."""
    states = torch.load(run.tag_dir / "mp_rank_00_model_states.pt", weights_only=True, map_location="cpu")
    return states["module"]


def accessor_names(run: Fixture) -> list[str]:
    return sorted(key.removeprefix("fp32/") for key in load_file(str(run.accessors)) if key.startswith("fp32/"))


# ---- to-fp32 ----------------------------------------------------------------------------------


def test_to_fp32_equals_zero_to_fp32(run, tmp_path):
    exported = load_file(str(convert("to-fp32", run.save_dir, tmp_path / "fp32") / "model.safetensors"))
    deepspeed = load_file(str(run.zero_to_fp32))
    module = saved_module(run)

    assert set(exported) == set(module), "every module state_dict name, frozen ones included"
    trained = set(deepspeed) - set(FROZEN) - set(BUFFERS)
    assert trained == set(accessor_names(run)) | {"head.weight"}
    for name in sorted(trained):
        assert same_bits(exported[name], deepspeed[name]), name
    for name in BUFFERS:
        assert exported[name].dtype == module[name].dtype == torch.float32
        assert same_bits(exported[name], deepspeed[name]), name
    for name in FROZEN:
        assert exported[name].dtype == torch.float32, name
        assert same_bits(exported[name].to(torch.bfloat16), module[name]), name
        if run.config.stage == 2:
            assert same_bits(exported[name].to(torch.bfloat16), deepspeed[name]), name
        else:  # stage 1 saves no frozen_param_fragments: zero_to_fp32 leaves them out
            assert name not in deepspeed


# ---- to-universal -------------------------------------------------------------------------------


def test_to_universal_equals_deepspeed_accessors(run, tmp_path):
    references = load_file(str(run.accessors))
    out = convert("to-universal", run.tag_dir, tmp_path / "universal")
    with open_universal(out) as universal:
        manifest = universal.manifest
        assert sorted(manifest.params) == accessor_names(run)
        for name, param in manifest.params.items():
            assert param.states == ("exp_avg", "exp_avg_sq"), name
            for key in STATE_KEYS:
                expected = references[f"{key}/{name}"]
                actual = universal.read_param(name, key).reshape(expected.shape)
                assert same_bits(actual, expected), f"{key}/{name}"
        assert [universal.scalars(g)["step"].item() for g in range(2)] == [3.0, 3.0]
        assert [group.hyperparameters["weight_decay"] for group in manifest.param_groups] == [0.1, 0.0]
        module = saved_module(run)
        for name in (*FROZEN, *BUFFERS):
            assert same_bits(universal.model_tensor(name), module[name]), name
        assert manifest.aliases == {"head.weight": "embed.weight"}


def test_to_fp32_of_the_universal_checkpoint_equals_to_fp32_of_deepspeed(deepspeed_runs, tmp_path):
    run = deepspeed_runs["w8_s2_align_tiny"]
    universal = convert("to-universal", run.save_dir, tmp_path / "universal")
    via_universal = load_file(str(convert("to-fp32", universal, tmp_path / "a") / "model.safetensors"))
    direct = load_file(str(convert("to-fp32", run.save_dir, tmp_path / "b") / "model.safetensors"))
    assert via_universal.keys() == direct.keys()
    for name in direct:
        assert same_bits(via_universal[name], direct[name]), name


# ---- finding the checkpoint ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["to-fp32", "to-universal"])
def test_tag_folder_and_parent_with_latest_give_the_same_output(deepspeed_runs, tmp_path, command):
    run = deepspeed_runs["w4_s2_align"]
    assert (run.save_dir / "latest").read_text().strip() == run.tag_dir.name
    from_tag = convert(command, run.tag_dir, tmp_path / "from_tag")
    from_parent = convert(command, run.save_dir, tmp_path / "from_parent")
    tensor_files = sorted(path.name for path in from_tag.glob("*.safetensors"))
    assert tensor_files and tensor_files == sorted(path.name for path in from_parent.glob("*.safetensors"))
    for name in tensor_files:
        assert (from_tag / name).read_bytes() == (from_parent / name).read_bytes(), name


def test_cli_error_on_a_broken_deepspeed_checkpoint(deepspeed_runs, tmp_path, capsys):
    """A DeepSpeed tag folder with a rank file missing: one line on stderr, exit status 2,
    no output that looks complete."""
    run = deepspeed_runs["w4_s1"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in run.tag_dir.iterdir():
        if "zero_pp_rank_2_" not in path.name:
            (broken / path.name).symlink_to(path)
    assert zeroshard_cli(["to-fp32", str(broken), str(tmp_path / "out"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt is missing" in error, error
    assert not (tmp_path / "out" / "model.safetensors").exists()
