"""Reading real DeepSpeed ZeRO-1/2 checkpoints (built in this session by deepspeed_fixtures).

Compared bit for bit with DeepSpeed's own outputs: zero_to_fp32 for the fp32 weights, and
safe_get_full_fp32_param / safe_get_full_optimizer_state (called right before
save_checkpoint) for the master weights and Adam states.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from deepspeed_fixtures import CONFIGS, Fixture
from safetensors.torch import load_file

from zeroshard.io.dtypes import to_torch
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.source import read_param
from zeroshard.checkpoint.universal.write import to_universal
from zeroshard.deepspeed.checkpoint import (
    ALLOWED_GLOBALS,
    DeepSpeedFormatError,
    find_tag_dir,
    is_deepspeed_checkpoint,
    open_deepspeed,
)
from zeroshard.deepspeed.checkpoint.optimizers import ADAM, ADAMW, MUON, group_optimizers
from zeroshard.deepspeed.checkpoint.layout_check import check_rank
from zeroshard.deepspeed.checkpoint.source import TORCH_OPTIMIZERS, optimizer_class
from zeroshard.deepspeed.checkpoint.files import read_rank_shard

CONFIG_NAMES = [config.name for config in CONFIGS]
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(params=CONFIG_NAMES)
def run(request, deepspeed_runs) -> Fixture:
    return deepspeed_runs[request.param]


def bits(tensor: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(tensor, np.ndarray):
        tensor = to_torch(tensor)
    return tensor.detach().float().flatten().view(torch.int32)


# ---- layout ---------------------------------------------------------------------------------


def test_rebuilt_layout_matches_deepspeed_in_memory_layout(run):
    with open_deepspeed(run.save_dir) as source:
        layout = source.layout
        assert layout.world_size == run.config.world_size
        assert layout.policy.kind == "deepspeed"
        assert layout.policy.parameter_alignment == run.config.parameter_alignment
        for rank in range(layout.world_size):
            live = run.live_layout(rank)
            assert live["optimizer"] == "DeepSpeedZeroOptimizer"
            for group in layout.groups:
                assert [slot.name for slot in group.params] == live["order"][group.index]
                assert [slot.offset for slot in group.params] == live["offsets"][group.index]
                assert [slot.padding for slot in group.params] == live["paddings"][group.index]
                assert group.numel == live["flat_numel"][group.index]
                assert group.partition_numel == live["partition_size"][group.index]
                tail = group.partition_numel - sum(r.length for r in group.logical_ranges(rank))
                assert tail == live["groups_padding"][group.index]


def test_round_robin_order_comes_from_param_shapes(deepspeed_runs):
    with open_deepspeed(deepspeed_runs["w2_s2_align_rr"].save_dir) as source:
        assert [slot.name for slot in source.layout.groups[0].params] == ["embed.weight", "fc2.weight", "fc1.weight"]


def test_tiny_group_pads_several_ranks(deepspeed_runs):
    for name in ("w8_s2_align_tiny", "w8_s1_tiny"):
        with open_deepspeed(deepspeed_runs[name].save_dir) as source:
            tiny = source.layout.groups[1]
            assert tiny.param_numel == 3 and tiny.partition_numel == 2
            all_padding = [rank for rank, pad in enumerate(tiny.padding_per_rank()) if pad == tiny.partition_numel]
            assert all_padding == list(range(2, 8))
            for rank in all_padding:
                assert not source.read(rank, 1, "fp32", 0, 2).any()
                assert not source.read(rank, 1, "exp_avg", 0, 2).any()


# ---- values, bit for bit ----------------------------------------------------------------------


def test_fp32_matches_zero_to_fp32(run):
    expected = load_file(str(run.zero_to_fp32))
    with open_deepspeed(run.save_dir) as source:
        for name in source.layout.param_names:
            assert torch.equal(bits(read_param(source, name, "fp32")), bits(expected[name])), name
        for alias, target in source.info.aliases.items():
            assert torch.equal(bits(read_param(source, target, "fp32")), bits(expected[alias])), alias


def test_master_and_adam_states_match_deepspeed_accessors(run):
    expected = load_file(str(run.accessors))
    with open_deepspeed(run.save_dir) as source:
        names = source.layout.param_names
        assert {f"{key}/{name}" for key in ("fp32", "exp_avg", "exp_avg_sq") for name in names} == set(expected)
        for name in names:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(bits(read_param(source, name, key)), bits(expected[f"{key}/{name}"])), (key, name)


def test_partial_param_reads(deepspeed_runs):
    run = deepspeed_runs["w4_s2_align"]
    expected = load_file(str(run.accessors))["exp_avg/embed.weight"].flatten()
    with open_deepspeed(run.save_dir) as source:
        for start, end in ((0, 1), (5, 40), (41, 78), (77, 78)):
            assert torch.equal(to_torch(read_param(source, "embed.weight", "exp_avg", start, end)), expected[start:end])


def test_padding_reads_as_zero(run):
    with open_deepspeed(run.save_dir) as source:
        for group in source.layout.groups:
            for rank in range(source.layout.world_size):
                for key in ["fp32", *source.info.state_keys[group.index]]:
                    partition = source.read(rank, group.index, key, 0, group.partition_numel)
                    assert partition.dtype == np.float32 and partition.shape == (group.partition_numel,)
                    for begin, end in group.padding_ranges(rank):
                        assert not partition[begin:end].any(), (key, group.index, rank)


# ---- SourceInfo ------------------------------------------------------------------------------


def test_source_info(run):
    expected = load_file(str(run.zero_to_fp32))
    with open_deepspeed(run.save_dir) as source:
        info = source.info
        assert info.optimizer_class == "torch.optim.adamw.AdamW"
        assert info.extra["deepspeed_optimizer"]["implementation"] == "torch.optim.adamw.AdamW"
        decay, no_decay = (group.hyperparameters for group in info.param_groups)
        assert [group.layout_groups for group in info.param_groups] == [[0], [1]]
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        assert no_decay["lr"] == pytest.approx(2 * decay["lr"])  # 2e-3 vs 1e-3, same schedule
        assert decay["betas"] == (0.9, 0.95)
        assert info.state_keys == [["exp_avg", "exp_avg_sq"]] * 2
        assert all(torch.equal(to_torch(source.scalars(g)["step"]), torch.tensor(3.0)) for g in (0, 1))
        kinds = {entry.name: entry.kind for entry in info.model_entries}
        assert kinds == {
            "position_scale": "buffer",
            "frozen.weight": "frozen",
            "frozen.bias": "frozen",
            "empty": "frozen",
        }
        assert info.aliases == {"head.weight": "embed.weight"}
        extra = info.extra
        assert (extra["global_steps"], extra["skipped_steps"], extra["zero_stage"]) == (3, 0, run.config.stage)
        assert extra["deepspeed_version"] == "0.19.8"
        assert extra["lr_scheduler"] == {"last_batch_iteration": 2}
        assert extra["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
        assert torch.equal(to_torch(source.model_tensor("position_scale")).float(), expected["position_scale"])
        if run.config.stage == 2:  # zero_to_fp32 has frozen params only for stage 2
            assert torch.equal(to_torch(source.model_tensor("frozen.weight")), expected["frozen.weight"])
        assert source.model_tensor("head.weight").dtype.name == "bfloat16"


def test_each_rank_file_is_parsed_once(deepspeed_runs, monkeypatch, tmp_path):
    """Opening parses every file once; conversions (every parameter, state and rank) parse none again."""
    from zeroshard.deepspeed.checkpoint import pickled as deepspeed_pickle

    parsed = []
    original = deepspeed_pickle.read_torch_file
    monkeypatch.setattr(
        deepspeed_pickle, "read_torch_file", lambda path, **kw: parsed.append(path) or original(path, **kw)
    )
    run = deepspeed_runs["w8_s1_tiny"]
    with open_deepspeed(run.save_dir) as source:
        to_universal(source, tmp_path / "universal")
        to_fp32(source, tmp_path / "fp32")
    assert sorted(parsed) == sorted(run.tag_dir.glob("*.pt"))


def tensor_place(tensor) -> tuple:
    """Where a StoredTensor's bytes are and how it views them (not which load it came from)."""
    storage = tensor.storage
    view = (tensor.dtype, tensor.shape, tensor.stride, tensor.storage_offset, tensor.requires_grad)
    return (*view, storage.path, storage.key, storage.data_offset, storage.nbytes, storage.dtype, storage.crc32)


@pytest.mark.parametrize("name", ["w4_s1", "w2_s2_align_rr"])
def test_a_file_with_the_pickle_of_the_one_before_reads_as_when_checked_in_full(deepspeed_runs, name, monkeypatch):
    """A rank file whose pickle is byte for byte that of the file read before it takes that
    file's checked values and only its own tensors: the same shard as a full read gives."""
    from zeroshard.deepspeed.checkpoint import files as deepspeed_files

    run = deepspeed_runs[name]
    taken = []
    original = deepspeed_files._same_pickle_as
    monkeypatch.setattr(deepspeed_files, "_same_pickle_as", lambda *args: taken.append(1) or original(*args))
    first = read_rank_shard(rank_file(run.tag_dir, 0), 0)
    for rank in range(run.config.world_size):
        path = rank_file(run.tag_dir, rank)
        full = read_rank_shard(path, rank, like=first)
        fast = read_rank_shard(path, rank, like=first, after=full)  # the same file: the same pickle
        assert len(taken) == rank + 1
        assert fast.pickle == full.pickle and fast.path == path and fast.rank == rank
        for field in dataclasses.fields(full):
            if field.name not in ("fp32", "states", "scalars", "pickle", "budget"):
                assert getattr(fast, field.name) == getattr(full, field.name), field.name
        assert fast.budget is not full.budget and fast.budget.path == path  # its own file's
        assert [tensor_place(t) for t in fast.fp32] == [tensor_place(t) for t in full.fp32]
        assert [{k: tensor_place(t) for k, t in g.items()} for g in fast.states] == [
            {k: tensor_place(t) for k, t in g.items()} for g in full.states
        ]
        assert [list(g) for g in fast.scalars] == [list(g) for g in full.scalars]
        assert fast.fp32[0].storage.load != full.fp32[0].storage.load  # its own tensors, from its own load


def test_a_copy_of_the_rank_file_before_still_fails_the_layout_check(copy_of, monkeypatch):
    """A file holding the previous rank's pickle skips the field checks, never the layout's."""
    from zeroshard.deepspeed.checkpoint import files as deepspeed_files

    taken = []
    original = deepspeed_files._same_pickle_as
    monkeypatch.setattr(deepspeed_files, "_same_pickle_as", lambda *args: taken.append(args[3]) or original(*args))
    tag_dir = copy_of("w4_s1")
    shutil.copyfile(rank_file(tag_dir, 1), rank_file(tag_dir, 2))
    where = r"bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt, group \d, rank 2: "
    with pytest.raises(DeepSpeedFormatError, match=where):
        open_deepspeed(tag_dir)
    assert taken == [2]


@pytest.mark.parametrize("enabled", [True, False])
def test_opening_leaves_the_garbage_collector_as_it_was(deepspeed_runs, copy_of, enabled):
    """The collector is paused while the rank files are parsed, and set back after, also on an error."""
    import gc

    tag_dir = copy_of("w4_s1")
    rank_file(tag_dir, 3).write_bytes(b"not a zip")
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        open_deepspeed(deepspeed_runs["w4_s1"].save_dir).close()
        assert gc.isenabled() == enabled
        with pytest.raises(DeepSpeedFormatError, match="rank_3"):
            open_deepspeed(tag_dir)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_reads_without_deepspeed_or_torch(deepspeed_runs):
    run = deepspeed_runs["w2_s2_align_rr"]
    script = (
        "import sys; sys.modules['deepspeed'] = None; sys.modules['torch'] = None\n"  # importing either fails
        "from zeroshard.deepspeed.checkpoint import open_deepspeed\n"
        "from zeroshard.checkpoint.source import read_param\n"
        f"source = open_deepspeed({str(run.save_dir)!r})\n"
        "print(float(read_param(source, 'fc1.bias', 'exp_avg_sq').sum()))\n"
        "assert not any(name == 'deepspeed' or name.startswith('deepspeed.') for name in sys.modules if sys.modules[name])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    expected = load_file(str(run.accessors))["exp_avg_sq/fc1.bias"]
    assert float(done.stdout.strip()) == float(expected.sum())


# ---- finding checkpoints ------------------------------------------------------------------------


def test_tag_folder_or_parent_with_latest(run, tmp_path):
    assert find_tag_dir(run.save_dir) == run.tag_dir == find_tag_dir(run.tag_dir)
    assert is_deepspeed_checkpoint(run.save_dir) and is_deepspeed_checkpoint(run.tag_dir)
    assert not is_deepspeed_checkpoint(tmp_path) and not is_deepspeed_checkpoint(tmp_path / "missing")


def test_other_checkpoint_with_latest_is_not_deepspeed(tmp_path):
    (tmp_path / "latest").write_text("step3")
    (tmp_path / "step3").mkdir()
    (tmp_path / "step3" / "manifest.json").write_text("{}")
    assert not is_deepspeed_checkpoint(tmp_path)


def test_latest_naming_a_missing_tag(tmp_path):
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(DeepSpeedFormatError, match="names tag 'global_step9'"):
        open_deepspeed(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(DeepSpeedFormatError, match="not a DeepSpeed checkpoint"):
        open_deepspeed(tmp_path)
    with pytest.raises(FileNotFoundError):
        open_deepspeed(tmp_path / "nowhere")


# ---- bad files ------------------------------------------------------------------------------------


@pytest.fixture
def copy_of(deepspeed_runs, tmp_path):
    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(deepspeed_runs[name].tag_dir, target)
        return target

    return make


def rank_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_missing_rank_file(copy_of):
    tag_dir = copy_of("w4_s1")
    rank_file(tag_dir, 2).unlink()
    with pytest.raises(DeepSpeedFormatError, match="bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt is missing"):
        open_deepspeed(tag_dir)


def test_missing_last_rank_file_disagrees_with_partition_count(copy_of):
    tag_dir = copy_of("w4_s1")
    rank_file(tag_dir, 3).unlink()
    with pytest.raises(DeepSpeedFormatError, match="partition_count .* 3 rank files"):
        open_deepspeed(tag_dir)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_rank_file(copy_of, keep):
    tag_dir = copy_of("w2_s2")
    path = rank_file(tag_dir, 1)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(
        DeepSpeedFormatError, match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: truncated or corrupt"
    ):
        open_deepspeed(tag_dir)


def test_garbage_model_states_file(copy_of):
    tag_dir = copy_of("w2_s2")
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DeepSpeedFormatError, match="mp_rank_00_model_states.pt: not a torch.save file"):
        open_deepspeed(tag_dir)


def test_module_entry_that_is_not_a_tensor(copy_of):
    tag_dir = copy_of("w2_s2")
    path = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(path, map_location="cpu", weights_only=False)
    model["module"]["fc1.weight"] = 3
    torch.save(model, path)
    with pytest.raises(DeepSpeedFormatError, match=r"model_states.pt: module entries \['fc1.weight'\] are not tensors"):
        open_deepspeed(tag_dir)


def test_rank_file_from_another_run(copy_of, deepspeed_runs):
    """Same model and world size, other alignment: the layouts differ, and the check says where."""
    tag_dir = copy_of("w2_s2_align_rr")
    shutil.copy(rank_file(deepspeed_runs["w2_s2"].tag_dir, 1), rank_file(tag_dir, 1))
    with pytest.raises(
        DeepSpeedFormatError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt, group 0, rank 1: "
    ):
        open_deepspeed(tag_dir)


def test_stage_3_folder(copy_of):
    tag_dir = copy_of("w2_s2")
    (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(DeepSpeedFormatError, match="ZeRO stage 3 checkpoints are not supported"):
        open_deepspeed(tag_dir)


def _fail_on(tag_dir: Path, rank: int, mutate) -> str:
    """Rewrite one rank file with ``mutate`` applied, open the checkpoint, return the error."""
    rewrite_rank_file(rank_file(tag_dir, rank), mutate)
    with pytest.raises(DeepSpeedFormatError) as caught:
        open_deepspeed(tag_dir)
    return str(caught.value)


def test_zero_stage_3_in_file(copy_of):
    message = _fail_on(copy_of("w2_s2"), 0, lambda state: state.update(zero_stage=3))
    assert "ZeRO stage 3 checkpoints are not supported" in message


def test_bf16_optimizer_file(copy_of):
    message = _fail_on(copy_of("w2_s2"), 1, lambda state: state.pop("zero_stage"))
    assert "BF16_Optimizer" in message and "rank_1" in message


def test_group_paddings_mismatch_in_file(copy_of):
    message = _fail_on(copy_of("w4_s2_align"), 3, lambda state: state["group_paddings"].__setitem__(1, 0))
    assert "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt, group 1, rank 3: group_paddings says 0" in message


def test_dynamic_loss_scaler(copy_of):
    """fp16 runs save a DynamicLossScaler (DeepSpeed refuses fp16 on the CPU, so swap one in)."""
    tag_dir = copy_of("w2_s2")

    def to_dynamic(state):
        scaler = DynamicLossScalerStandIn()
        scaler.__dict__.update(cur_scale=512.0, cur_iter=7, dynamic=True, scale_window=1000, dtype=torch.float16)
        state["loss_scaler"] = scaler

    for rank in (0, 1):
        rewrite_rank_file(rank_file(tag_dir, rank), to_dynamic)
    with open_deepspeed(tag_dir) as source:
        scaler = source.info.extra["loss_scaler"]
        # (the dtype global is read as its name)
        assert scaler == {"cur_scale": 512.0, "cur_iter": 7, "dynamic": True, "scale_window": 1000, "dtype": "float16"}


def as_fp16_run(tag_dir: Path) -> None:
    """Turn a bf16 ZeRO run into what DeepSpeed writes for the same run in fp16 (it refuses
    fp16 on the CPU): fp16 module weights, an fp16 config, a dynamic loss scaler, and rank
    files named without the ``bf16_`` prefix. The flat layout is the same (2-byte elements)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    def fp16_config(config: dict) -> dict:
        return {**config, "bf16": {"enabled": False}, "fp16": {"enabled": True, "loss_scale": 0}}

    model_file = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(model_file, map_location="cpu", weights_only=False)
    model["module"] = {k: v.half() if v.dtype == torch.bfloat16 else v for k, v in model["module"].items()}
    model["ds_config"] = fp16_config(model["ds_config"])
    torch.save(model, model_file)
    for path in sorted(tag_dir.glob("bf16_zero_pp_rank_*")):
        raw = torch.load(path, map_location="cpu", weights_only=False)
        scaler = DynamicLossScaler.__new__(DynamicLossScaler)
        scaler.__dict__.update(cur_scale=1024.0, cur_iter=3, dynamic=True, scale_window=1000)
        raw["optimizer_state_dict"]["loss_scaler"] = scaler
        raw["ds_config"] = fp16_config(raw.get("ds_config") or {})
        torch.save(raw, tag_dir / path.name.removeprefix("bf16_"))
        path.unlink()


def test_fp16_run(copy_of, deepspeed_runs, tmp_path):
    """An fp16 run reads as the bf16 run it was made from, but for the weights' dtype."""
    bf16_run = deepspeed_runs["w4_s2_align"]
    tag_dir = copy_of("w4_s2_align")
    as_fp16_run(tag_dir)
    with open_deepspeed(tag_dir) as fp16, open_deepspeed(bf16_run.tag_dir) as bf16:
        assert [g.dtype for g in fp16.layout.groups] == ["float16", "float16"]
        assert fp16.layout.with_policy(bf16.layout.policy) == fp16.layout
        for name in fp16.layout.param_names:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert read_param(fp16, name, key).tobytes() == read_param(bf16, name, key).tobytes(), (key, name)
        assert fp16.model_tensor("embed.weight").dtype == np.float16
        assert fp16.info.extra["loss_scaler"]["dynamic"] and fp16.info.extra["loss_scaler"]["cur_scale"] == 1024.0
    from zeroshard.checkpoint.export.fp32 import to_fp32

    exported = load_file(to_fp32(tag_dir, tmp_path / "fp32", progress=False) / "model.safetensors")
    reference = load_file(str(bf16_run.zero_to_fp32))
    for name in ("embed.weight", "fc1.weight", "fc1.bias"):
        assert torch.equal(exported[name], reference[name]), name


def test_unknown_class_in_file_is_refused(copy_of):
    tag_dir = copy_of("w2_s2")
    rewrite_rank_file(rank_file(tag_dir, 0), lambda state: state.update(extra=Smuggled()))
    with pytest.raises(DeepSpeedFormatError, match="refused to unpickle.*Smuggled"):
        open_deepspeed(tag_dir)


class Smuggled:
    pass


class DynamicLossScalerStandIn:
    """Turned into DeepSpeed's DynamicLossScaler by rewrite_rank_file (by class name)."""


DynamicLossScalerStandIn.__name__ = "DynamicLossScaler"


def shorter(tensor):
    return dataclasses.replace(tensor, shape=(tensor.shape[0] - 1,))


def mismatches(tag_dir: Path):
    """(description, mutation of a parsed RankShard, expected message part)."""
    yield "fp32 length", lambda s: s.fp32.__setitem__(0, shorter(s.fp32[0])), "saved fp32 partition has"
    yield (
        "fp32 dtype",
        lambda s: s.fp32.__setitem__(0, dataclasses.replace(s.fp32[0], dtype="bfloat16")),
        "saved fp32 partition is bfloat16, not float32",
    )
    yield "tail padding", lambda s: s.group_paddings.__setitem__(0, s.group_paddings[0] + 2), "group_paddings says"
    yield (
        "state length",
        lambda s: s.states[1].__setitem__("exp_avg", torch.zeros(1)),
        "optimizer state 'exp_avg' has 1",
    )
    yield "alignment pads", lambda s: s.param_alignment_paddings[0].__setitem__(0, 7), "param_alignment_paddings"
    yield "slice start", lambda s: s.slice_mappings[1].update({"fc2.bias": (6, 1)}), "param_slice_mappings['fc2.bias']"
    yield "slice missing", lambda s: s.slice_mappings[0].popitem(), "param_slice_mappings["
    yield "partition count", lambda s: s.partition_count.__setitem__(1, 4), "partition_count 4, expected 2"


@pytest.mark.parametrize("case", [name for name, _, _ in mismatches(Path())])
def test_layout_check_names_file_group_and_rank(deepspeed_runs, case):
    run = deepspeed_runs["w2_s2"]
    _, mutate, expected = next(item for item in mismatches(run.tag_dir) if item[0] == case)
    with open_deepspeed(run.save_dir) as source:
        layout = source.layout
    shard = read_rank_shard(rank_file(run.tag_dir, 1), 1)
    check_rank(layout, shard)
    shard = dataclasses.replace(shard, fp32=list(shard.fp32), states=[dict(s) for s in shard.states])
    mutate(shard)
    with pytest.raises(
        DeepSpeedFormatError, match=r"/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt, group \d, rank 1: "
    ) as caught:
        check_rank(layout, shard)
    assert expected in str(caught.value)


def test_read_bounds(deepspeed_runs):
    with open_deepspeed(deepspeed_runs["w2_s2"].save_dir) as source:
        numel = source.layout.groups[0].partition_numel
        with pytest.raises(ValueError, match="outside"):
            source.read(0, 0, "fp32", 0, numel + 1)
        with pytest.raises(ValueError, match="rank 2 is outside"):
            source.read(2, 0, "fp32", 0, 1)
        with pytest.raises(KeyError, match="no optimizer state 'momentum'"):
            source.read(0, 0, "momentum", 0, 1)


# ---- writing DeepSpeed files for the bad-input tests ---------------------------------------------


def rewrite_rank_file(path: Path, mutate) -> None:
    """Load a rank file (with DeepSpeed's classes: the test wrote it), let ``mutate`` edit its
    optimizer_state_dict, and save it back with DeepSpeed's real classes, as DeepSpeed would
    have written it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    raw = torch.load(path, map_location="cpu", weights_only=False)
    state = raw["optimizer_state_dict"]
    mutate(state)
    if "zero_stage" in state:
        state["zero_stage"] = ZeroStageEnum(int(state["zero_stage"]))
    state["param_slice_mappings"] = [
        {name: fragment_address(numel=a.numel, start=a.start) for name, a in group.items()}
        for group in state["param_slice_mappings"]
    ]
    real_class = DynamicLossScaler if type(state["loss_scaler"]).__name__ == "DynamicLossScaler" else LossScaler
    scaler = real_class.__new__(real_class)
    scaler.__dict__.update(vars(state["loss_scaler"]))
    state["loss_scaler"] = scaler
    raw["optimizer_state_dict"] = state
    temporary = path.with_name(path.name + ".new")
    torch.save(raw, temporary)
    os.replace(temporary, path)  # the old file may still be memory-mapped


def test_allowed_globals_are_just_deepspeeds_four():
    assert sorted(ALLOWED_GLOBALS) == [
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    ]


@pytest.mark.parametrize(
    ("optimizer", "groups", "expected"),
    [
        ({"type": "AdamW", "params": {"torch_adam": True}}, [], "torch.optim.adamw.AdamW"),
        ({"type": "Adam", "params": {"torch_adam": True}}, [], "torch.optim.adamw.AdamW"),  # adam_w_mode defaults on
        ({"type": "Adam", "params": {"adam_w_mode": False}}, [], "torch.optim.adam.Adam"),
        ({"type": "SGD", "params": {}}, [], "torch.optim.sgd.SGD"),
        ({"type": "Lamb", "params": {}}, [], "deepspeed:Lamb"),
        (None, [{"betas": (0.9, 0.99), "decoupled_weight_decay": True}], "torch.optim.adamw.AdamW"),
        (None, [{"momentum": 0.9}], "deepspeed:client optimizer"),
        # MuonWithAuxAdam: torch's Muon on the use_muon groups, its Adam's class on the rest, in group order
        ({"type": "Muon", "params": {}}, [{"use_muon": True}, {"use_muon": False}], f"{MUON}+{ADAMW}"),
        ({"type": "muon", "params": {"adam_w_mode": False}}, [{"use_muon": False}, {"use_muon": True}], f"{ADAM}+{MUON}"),
        ({"type": "Muon", "params": {}}, [{"use_muon": True}], MUON),  # every parameter a matrix
    ],
)
def test_optimizer_class_from_config(optimizer, groups, expected):
    config = {"optimizer": optimizer} if optimizer else {}
    assert optimizer_class(config, groups) == expected


@pytest.mark.parametrize(
    ("optimizer", "groups", "expected"),
    [
        ({"type": "Muon", "params": {}}, [{"use_muon": True}, {"use_muon": False}], [MUON, ADAMW]),
        ({"type": "Muon", "params": {"adam_w_mode": False}}, [{"use_muon": False}, {"use_muon": True}], [ADAM, MUON]),
        ({"type": "Muon", "params": {}}, [{"use_muon": True}, {"use_muon": True}], ["", ""]),  # one class: the run's
        ({"type": "AdamW", "params": {}}, [{}, {}], ["", ""]),
    ],
)
def test_group_optimizers_are_recorded_where_the_run_has_several(optimizer, groups, expected):
    assert group_optimizers({"optimizer": optimizer}, groups) == expected


def test_torch_optimizer_table_is_torch_optim():
    found = {
        name: f"{cls.__module__}.{cls.__qualname__}"
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
    }
    assert MUON == found.pop("Muon")  # DeepSpeed's Muon is MuonWithAuxAdam: its groups name torch's
    assert TORCH_OPTIMIZERS == found
