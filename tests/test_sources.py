"""One way to open a checkpoint (``open_source`` over registered formats) and one loader
(``load_state``) for every kind: recognition, registration, and equal results
from a native checkpoint and its universal conversion for every load option."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from universal_helpers import save_synthetic

from zeroshard.checkpoint import (
    SourceFormat,
    UnsupportedCheckpointError,
    checkpoint_kind,
    load_state,
    open_source,
    recognise,
    register_format,
    registered_formats,
    unregister_format,
)
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.native.source import NativeSource
from zeroshard.checkpoint.source import in_place_target
from zeroshard.checkpoint.testing import expected_partition
from zeroshard.checkpoint.universal import to_universal
from zeroshard.checkpoint.universal.source import UniversalSource
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SPECS = [
    [ParamSpec.of("embed", (13, 7), "bf16"), ParamSpec.of("w", (5, 3), "bf16")],
    [ParamSpec.of("head.bias", (11,), "bf16"), ParamSpec.of("norm", (4,), "bf16")],
]


@pytest.fixture(scope="module")
def native_and_universal(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    native = save_synthetic(root / "native", build_layout(SPECS, 2))
    return native, to_universal(native, root / "universal", progress=False)


def test_the_built_in_formats_are_tried_in_order():
    """The built-in formats, registered from zeroshard.CHECKPOINT_FORMATS in its order. (That
    the checkpoint layer imports none of the readers it names, and that the layers inside it
    import only downwards, is tests/test_architecture.py's to check.)"""
    assert [f.kind for f in registered_formats()] == ["universal", "deepspeed", "native"]


def test_each_kind_is_recognised_and_opened(native_and_universal, tmp_path):
    native, universal = native_and_universal
    assert checkpoint_kind(native) == checkpoint_kind(native.parent) == "native"  # the tag, or its root
    assert checkpoint_kind(universal) == "universal" and recognise(tmp_path) is None
    with open_source(native.parent) as source:
        assert isinstance(source, NativeSource) and source.path == native
    with open_source(universal) as source:
        assert isinstance(source, UniversalSource) and source.info.weights_from_masters
    with pytest.raises(ValueError, match="empty directory, not a checkpoint"):  # the native reader's words
        open_source(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_deepspeed_checkpoint_is_recognised(deepspeed_runs):
    from zeroshard.deepspeed.checkpoint import DeepSpeedSource

    run = deepspeed_runs["w2_s2"]
    assert checkpoint_kind(run.save_dir) == checkpoint_kind(run.tag_dir) == "deepspeed"
    with open_source(run.save_dir) as source:
        assert isinstance(source, DeepSpeedSource) and source.info.layout.world_size == 2


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("where", ["folder", "root"])
def test_deepspeeds_universal_format_is_recognised_and_refused_by_name(deepspeed_runs, tmp_path, where):
    """ds_to_universal's output (or the root whose latest_universal names it) is the DeepSpeed
    format's to refuse, in one line naming it, wherever it is opened."""
    from deepspeed_fixtures import deepspeed_universal_folder

    folder = deepspeed_universal_folder(deepspeed_runs["w2_s2"], tmp_path / "ds")
    path = folder if where == "folder" else folder.parent
    assert checkpoint_kind(path) == "deepspeed"
    expected = f"{path}: a DeepSpeed universal checkpoint (ds_to_universal output), which zeroshard does not read"
    out = tmp_path / "out"
    for opening in (open_source, lambda p: to_universal(p, out, progress=False), lambda p: to_fp32(p, out)):
        with pytest.raises(UnsupportedCheckpointError) as error:
            opening(path)
        assert str(error.value).startswith(expected) and "\n" not in str(error.value)
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_optimizer_files_alone_are_deepspeeds_and_name_the_missing_file(deepspeed_runs, tmp_path):
    tag_dir = tmp_path / "optimizer-only"
    tag_dir.mkdir()
    for rank_file in deepspeed_runs["w2_s2"].tag_dir.glob("*_optim_states.pt"):
        (tag_dir / rank_file.name).symlink_to(rank_file)
    assert checkpoint_kind(tag_dir) == "deepspeed"
    with pytest.raises(ValueError, match=f"^{re.escape(str(tag_dir))}: mp_rank_00_model_states.pt is missing$"):
        open_source(tag_dir)


def test_a_registered_format_is_tried_first_and_can_be_removed(native_and_universal, tmp_path):
    native, _ = native_and_universal
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    (pointer / "points-to").write_text(str(native))
    opened = []

    def open_pointer(path: Path) -> NativeSource:
        opened.append(path)
        return NativeSource((path / "points-to").read_text())

    register_format(SourceFormat("pointer", lambda path: (path / "points-to").is_file(), open_pointer))
    try:
        assert registered_formats()[0].kind == "pointer" and checkpoint_kind(pointer) == "pointer"
        with open_source(pointer) as source:
            state = load_state(source, build_layout(SPECS, 1), 0)
        assert opened == [pointer]
        assert torch.equal(state.fp32_partitions[1], expected_partition(build_layout(SPECS, 1), 0, 1, "fp32"))
    finally:
        unregister_format("pointer")
    assert checkpoint_kind(pointer) == "native" and "pointer" not in [f.kind for f in registered_formats()]


OPTIONS = [
    {},
    {"load_optimizer_states": False},
    {"load_module_only": True},
    {"strict": False},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["full", "no-optimizer-state", "module-only", "non-strict"])
def test_native_and_universal_load_alike_for_every_option(native_and_universal, options):
    """The same run, saved natively and converted to universal, loads to the same state at
    another world size and policy, bit for bit, whatever the options."""
    native, universal = native_and_universal
    new = build_layout(SPECS, 3, LayoutPolicy.native(compact=True))
    for rank in range(3):
        with open_source(native) as a, open_source(universal) as b:
            ours, theirs = load_state(a, new, rank, **options), load_state(b, new, rank, **options)
        assert_same_state(ours, theirs)
        assert any(torch.count_nonzero(p) for p in ours.fp32_partitions)


def assert_same_state(a, b) -> None:
    assert len(a.fp32_partitions) == len(b.fp32_partitions)
    for x, y in zip(a.fp32_partitions, b.fp32_partitions):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for x, y in zip(a.optimizer_states, b.optimizer_states):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for x, y in zip(a.optimizer_scalars, b.optimizer_scalars):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a.model_state.keys() == b.model_state.keys()
    for name in a.model_state:
        assert a.model_state[name].dtype == b.model_state[name].dtype and torch.equal(a.model_state[name], b.model_state[name]), name
    assert a.param_groups == b.param_groups and a.optimizer_class == b.optimizer_class
    assert a.extra.keys() == b.extra.keys()


def test_a_prefetch_lands_in_place_only_in_memory_that_can_take_the_read_whole():
    memory = np.zeros(8, dtype=np.float32)
    assert in_place_target(memory, np.float32, 8) is memory
    frozen = memory.copy()
    frozen.flags.writeable = False
    refused = {
        "absent": (None, np.float32, 8),
        "another dtype": (memory, np.float16, 8),
        "too short": (memory, np.float32, 9),
        "too long": (memory, np.float32, 7),
        "strided": (np.zeros(16, dtype=np.float32)[::2], np.float32, 8),
        "read-only": (frozen, np.float32, 8),
    }
    assert [why for why, args in refused.items() if in_place_target(*args) is not None] == []
