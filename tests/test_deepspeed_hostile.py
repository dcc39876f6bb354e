"""Hostile DeepSpeed files: wrong field types, resource bombs, flipped bits and truncations.

Every one must end in a one-line DeepSpeedFormatError naming the file (and the field), never
a traceback from deeper down, and never an allocation beyond the bytes the file holds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from hostile_files import edit_torch_file as edit

from zeroshard.checkpoint.export.fp32 import load_fp32_state_dict
from zeroshard.checkpoint.source import read_param
from zeroshard.deepspeed.checkpoint import DeepSpeedFormatError, open_deepspeed

MODEL = "mp_rank_00_model_states.pt"
RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture
def tag_dir(deepspeed_runs, tmp_path) -> Path:
    target = tmp_path / "w2_s2"
    shutil.copytree(deepspeed_runs["w2_s2"].tag_dir, target)
    return target


def open_error(tag_dir: Path) -> str:
    with pytest.raises(DeepSpeedFormatError) as caught:  # any other type fails the test
        with open_deepspeed(tag_dir) as source:
            load_fp32_state_dict(source)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- field types ---------------------------------------------------------------------------------


def self_containing() -> dict:
    value: dict = {"last_batch_iteration": 2}
    value["again"] = value
    return value


def optimizer_state(change):
    return lambda raw: change(raw["optimizer_state_dict"])


def adam_state(change):
    return optimizer_state(lambda state: change(state["base_optimizer_state"]["state"][0]))


def first_slice(change):
    def apply(state):
        name = next(iter(state["param_slice_mappings"][0]))
        change(state["param_slice_mappings"][0], name)

    return optimizer_state(apply)


FIELD_CASES = {
    "module is a list": (MODEL, lambda raw: raw.update(module=[1, 2]), "module is a list, expected a dict"),
    "ds_config is 5": (MODEL, lambda raw: raw.update(ds_config=5), "ds_config is a int, expected a dict"),
    "ds_config bf16 is True": (
        MODEL,
        lambda raw: raw["ds_config"].update(bf16=True),
        "ds_config['bf16'] is a bool, expected a dict",
    ),
    "zero_optimization is 2": (
        MODEL,
        lambda raw: raw["ds_config"].update(zero_optimization=2),
        "ds_config['zero_optimization'] is a int, expected a dict",
    ),
    "param_shapes is None": (MODEL, lambda raw: raw.update(param_shapes=None), "param_shapes is None, expected a list"),
    "a shape is a string": (
        MODEL,
        lambda raw: raw["param_shapes"][0].update({"fc1.weight": "8x8"}),
        "param_shapes[0]['fc1.weight'] is a str, expected a list",
    ),
    "a dimension is a float": (
        MODEL,
        lambda raw: raw["param_shapes"][0].update({"fc1.weight": (8.0, 8)}),
        "param_shapes[0]['fc1.weight'][0] is a float, expected an integer",
    ),
    "unhashable buffer name": (
        MODEL,
        lambda raw: raw.update(buffer_names=[["position_scale"]]),
        "buffer_names[0] is a list, expected a string",
    ),
    "unhashable tied name": (
        MODEL,
        lambda raw: raw.update(shared_params={"head.weight": ["embed.weight"]}),
        "shared_params['head.weight'] is a list, expected a string",
    ),
    "lr_scheduler contains itself": (
        MODEL,
        lambda raw: raw.update(lr_scheduler=self_containing()),
        "lr_scheduler is nested more than 32 deep",
    ),
    "lr_scheduler holds a tensor": (
        MODEL,
        lambda raw: raw.update(lr_scheduler={"base_lrs": torch.ones(2)}),
        "lr_scheduler holds a StoredTensor at lr_scheduler['base_lrs']",
    ),
    "dp_world_size is a string": (MODEL, lambda raw: raw.update(dp_world_size="2"), "dp_world_size is a str"),
    "global_steps is a float": (MODEL, lambda raw: raw.update(global_steps=3.5), "global_steps is a float"),
    "ds_version is a float": (MODEL, lambda raw: raw.update(ds_version=0.19), "ds_version is a float"),
    "zero_stage is None": (RANK1, optimizer_state(lambda s: s.update(zero_stage=None)), "zero_stage is None"),
    "group_paddings is None": (
        RANK1,
        optimizer_state(lambda s: s.update(group_paddings=None)),
        "group_paddings is None",
    ),
    "a group padding is a string": (
        RANK1,
        optimizer_state(lambda s: s["group_paddings"].__setitem__(1, "0")),
        "group_paddings[1] is a str, expected an integer",
    ),
    "partition count is a float": (
        RANK1,
        optimizer_state(lambda s: s["partition_count"].__setitem__(0, 2.0)),
        "partition_count[0] is a float",
    ),
    "alignment paddings are None": (
        RANK1,
        optimizer_state(lambda s: s.update(param_alignment_paddings=[None, None])),
        "param_alignment_paddings[0] is None, expected a list",
    ),
    "alignment paddings too few": (
        RANK1,
        optimizer_state(lambda s: s.update(param_alignment_paddings=[[0, 0, 0]])),
        "rank 1: 1 param_alignment_paddings, the layout has 2 groups",
    ),
    "slice mapping is a tuple": (
        RANK1,
        first_slice(lambda mapping, name: mapping.update({name: (3, 0)})),
        "is tuple, expected a fragment_address",
    ),
    "fragment numel is None": (
        RANK1,
        first_slice(lambda mapping, name: setattr(mapping[name], "numel", None)),
        ".numel is None, expected an integer",
    ),
    "fp32 partitions is 5": (
        RANK1,
        optimizer_state(lambda s: s.update(single_partition_of_fp32_groups=5)),
        "single_partition_of_fp32_groups is a int, expected a list",
    ),
    "unhashable param id": (
        RANK1,
        optimizer_state(lambda s: s["base_optimizer_state"]["param_groups"][0].update(params=[[0]])),
        "optimizer group 0 should hold one flat partition: params=[[0]]",
    ),
    "optimizer state entry is a list": (
        RANK1,
        optimizer_state(lambda s: s["base_optimizer_state"]["state"].__setitem__(0, [1, 2])),
        "base_optimizer_state['state'][0] is a list, expected a dict",
    ),
    "exp_avg is int64": (
        RANK1,
        adam_state(lambda entry: entry.update(exp_avg=entry["exp_avg"].long())),
        "base_optimizer_state['state'][0]['exp_avg'] is a int64 tensor, expected floating point",
    ),
    "exp_avg is strided": (
        RANK1,
        adam_state(lambda entry: entry.update(exp_avg=torch.zeros(2 * len(entry["exp_avg"]))[::2])),
        "['exp_avg'] is a tensor of shape",
    ),
    "step is a set": (RANK1, adam_state(lambda entry: entry.update(step={1})), "['step'] holds a set"),
    "a hyperparameter is a tensor": (
        RANK1,
        optimizer_state(lambda s: s["base_optimizer_state"]["param_groups"][1].update(lr=torch.tensor(0.1))),
        "param_groups'][1] holds a StoredTensor at",
    ),
    "clip_grad contains itself": (
        RANK1,
        optimizer_state(lambda s: s.update(clip_grad=[self_containing()])),
        "clip_grad is nested more than 32 deep",
    ),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_a_wrong_field_type_is_one_line_naming_file_and_field(tag_dir, case):
    name, change, words = FIELD_CASES[case]
    edit(tag_dir / name, change)
    message = open_error(tag_dir)
    assert message.startswith(f"{tag_dir / name}") and words in message, message


def test_dp_world_size_is_compared_as_a_number(tag_dir):
    edit(tag_dir / MODEL, lambda raw: raw.update(dp_world_size=3))
    message = open_error(tag_dir)
    assert message == f"{tag_dir / MODEL}: dp_world_size is 3, but there are 2 rank files in {tag_dir}"
    edit(tag_dir / MODEL, lambda raw: raw.update(dp_world_size=2))
    with open_deepspeed(tag_dir) as source:
        assert source.info.extra["dp_world_size"] == 2


# ---- resource bombs --------------------------------------------------------------------------


def bomb() -> torch.Tensor:
    """A 2-byte storage viewed as 2e9 elements (3.7 GiB); torch.save keeps it 2 bytes."""
    return torch.zeros(1, dtype=torch.bfloat16).expand(50000, 40000)


@pytest.mark.parametrize(
    "name, change",
    [
        (MODEL, lambda raw: raw["module"].update({"frozen.weight": bomb()})),
        (RANK1, adam_state(lambda entry: entry.update(bomb=bomb()))),  # read when the run is opened
    ],
    ids=["module", "optimizer state"],
)
def test_an_expanded_tensor_is_refused_before_any_allocation(tag_dir, name, change):
    edit(tag_dir / name, change)
    assert (tag_dir / name).stat().st_size < 1 << 20
    before, started = resident_bytes(), time.thread_time()
    message = open_error(tag_dir)
    cpu, grown = time.thread_time() - started, resident_bytes() - before
    assert cpu < 1.0 and grown < 50 << 20, (cpu, grown)  # CPU seconds; allocating the view would take 4 GB
    assert message.startswith(f"{tag_dir / name}: ") and "expanded view is refused" in message, message


# ---- flipped bits and truncations --------------------------------------------------------------


def everything(tag_dir: Path) -> dict[str, bytes]:
    """What a conversion or a resumed run takes from the checkpoint, as bytes: the to-fp32
    state dict, every optimizer state of every parameter, the scalars and the info."""
    out: dict[str, bytes] = {}
    with open_deepspeed(tag_dir) as source:
        for name, tensor in load_fp32_state_dict(source).items():
            out[f"fp32/{name}"] = str(tensor.dtype).encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes()
        for name in source.layout.param_names:
            for key in ("fp32", *source.info.state_keys[0]):
                out[f"{key}/{name}"] = read_param(source, name, key).tobytes()
        for group in range(len(source.layout.groups)):
            scalars = {key: np.asarray(value).tobytes() for key, value in source.scalars(group).items()}
            out[f"scalars/{group}"] = repr(scalars).encode()
        info = source.info
        described = [info.extra, [group.hyperparameters for group in info.param_groups], info.aliases]
        out["info"] = json.dumps(described, default=repr).encode()
        out["entries"] = repr(info.model_entries).encode()
    return out


def mutations(data: bytes, rng: random.Random):
    """(description, mutated bytes): mostly single-bit flips, some bursts and truncations."""
    kind = rng.random()
    if kind < 0.15:
        cut = rng.randrange(len(data))
        return f"cut at {cut}", data[:cut]
    mutated = bytearray(data)
    flips = [rng.randrange(len(data)) for _ in range(1 if kind < 0.8 else rng.randint(2, 8))]
    for offset in flips:
        mutated[offset] ^= 1 << rng.randrange(8)
    return f"bits flipped at {flips}", bytes(mutated)


def fuzz(tag_dir: Path, files: list[Path], everything, cases: int, seed: int) -> dict[str, int]:
    """Mutate one of ``files`` at a time (``cases`` times): every outcome must be ``everything``
    of the intact checkpoint, byte for byte, or a one-line DeepSpeedFormatError naming a file
    in ``tag_dir``. Returns how many were each."""
    intact = everything(tag_dir)
    originals = {path: path.read_bytes() for path in files}
    rng = random.Random(seed)
    outcomes = {"same": 0, "refused": 0}
    started = time.perf_counter()
    for case in range(cases):
        path = rng.choice(files)
        what, data = mutations(originals[path], rng)
        path.write_bytes(data)
        try:
            found = everything(tag_dir)
        except DeepSpeedFormatError as err:
            message = str(err)
            assert "\n" not in message and message.startswith(str(tag_dir)), (case, path.name, what, message)
            outcomes["refused"] += 1
        else:
            assert found == intact, (case, path.name, what, [k for k in intact if found.get(k) != intact[k]])
            outcomes["same"] += 1
        finally:
            path.write_bytes(originals[path])
    print(f"fuzz: {outcomes} in {time.perf_counter() - started:.1f} s")
    return outcomes


def test_fuzzed_files_convert_identically_or_are_refused(tag_dir):
    files = sorted(tag_dir.glob("*.pt"))
    with zipfile.ZipFile(files[0]) as archive:
        assert archive.testzip() is None
    started = time.thread_time()
    outcomes = fuzz(tag_dir, files, everything, 300, 20261130)
    assert outcomes["refused"] > 200, outcomes  # flips in bytes never read (zip padding) may pass
    assert time.thread_time() - started < 60  # CPU seconds for 300 reads, each bounded by its file
