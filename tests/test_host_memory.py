"""New host arrays for loads (zeroshard.io.host_memory): zeroed, writable, shared with torch."""

from __future__ import annotations

import gc
import mmap

import ml_dtypes
import numpy as np
import pytest
import torch

from zeroshard.io.host_memory import SMALL, new_zeros


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.uint8])
@pytest.mark.parametrize("nbytes", [0, 12, SMALL - 4, SMALL, 3 * SMALL + 4])
def test_new_zeros_is_a_zeroed_writable_array(dtype, nbytes):
    numel = nbytes // np.dtype(dtype).itemsize
    array = new_zeros(numel, dtype)
    assert array.shape == (numel,) and array.dtype == np.dtype(dtype)
    assert array.flags.writeable and array.flags.c_contiguous
    assert not array.view(np.uint8).any()
    array[:] = 3
    assert (array == np.asarray(3, dtype)).all()


@pytest.mark.parametrize("populated", [True, False])
@pytest.mark.parametrize("phase", [0, 16, 1032, 4092])
def test_new_zeros_starts_a_big_array_at_its_phase_in_a_page(phase, populated):
    array = new_zeros(SMALL, np.float32, populated=populated, phase=phase)
    assert array.ctypes.data % mmap.PAGESIZE == phase and array.size == SMALL and not array.any()
    array[-1] = 2.0  # the array's last element lies in its mapping
    assert torch.from_numpy(array).data_ptr() == array.ctypes.data
    small = new_zeros(12, np.float32, phase=phase)  # small arrays take numpy's memory, whatever the phase
    assert small.size == 12 and not small.any()


@pytest.mark.parametrize("phase", [2, -4, mmap.PAGESIZE])
def test_new_zeros_refuses_a_phase_off_its_itemsize_or_outside_a_page(phase):
    with pytest.raises(ValueError, match=f"phase {phase}"):
        new_zeros(SMALL, np.float32, phase=phase)


def test_new_zeros_outlives_its_callers_references_and_is_shared_with_torch():
    array = new_zeros(SMALL, np.float32)
    tensor = torch.from_numpy(array)
    del array
    gc.collect()
    tensor[5] = 7.0  # the mapping lives as long as the tensor holding it
    assert tensor[5].item() == 7.0 and tensor.sum().item() == 7.0
    again = tensor.numpy()
    again[6] = 1.0
    assert tensor[6].item() == 1.0


def test_a_load_builds_its_partitions_in_new_zeros_memory(tmp_path, monkeypatch):
    """Every fp32 partition and optimizer state a load returns lies in memory new_zeros
    mapped (not numpy's, whose huge-page requests make a load's time a lottery)."""
    from universal_helpers import save_synthetic

    from zeroshard.checkpoint import loader
    from zeroshard.checkpoint.loader import load_state
    from zeroshard.checkpoint.native.source import NativeSource
    from zeroshard.layout import ParamSpec, build_layout

    layout = build_layout([[ParamSpec.of("w", (1024, 600), "bf16")], [ParamSpec.of("b", (600,), "bf16")]], 2)
    path = save_synthetic(tmp_path, layout, block_size=1 << 16)
    made = []

    def spy(numel, dtype, **options):
        array = new_zeros(numel, dtype, **options)
        made.append(array.ctypes.data)
        return array

    monkeypatch.setattr(loader, "new_zeros", spy)
    with NativeSource(path) as source:
        state = load_state(source, layout, 1)
    partitions = [*state.fp32_partitions, *(t for group in state.optimizer_states for t in group.values())]
    assert len(partitions) == 6 and sorted(t.data_ptr() for t in partitions) == sorted(made)


def test_release_later_drops_on_a_thread_and_wait_released_waits_for_it():
    """What release_later is given is dropped on another thread; wait_released returns
    only once it is (a drop that takes a while, as unmapping a GiB does, included)."""
    import threading
    import time

    from zeroshard.io.host_memory import release_later, wait_released

    dropped = []

    class Slow:
        def __del__(self):
            time.sleep(0.05)
            dropped.append(threading.current_thread().name)

    release_later([Slow(), Slow()])
    wait_released()
    assert dropped == ["zeroshard-release"] * 2


def test_one_thread_releases_for_every_caller_and_a_forked_child_gets_its_own():
    """Releases go to one running thread (a load's end starts none); a child forked while it
    runs releases on a thread of its own (none of its parent's runs in it)."""
    import os
    import threading
    import time

    from zeroshard.io.host_memory import release_later, wait_released

    dropped = []

    class Noted:
        def __del__(self):
            dropped.append(threading.get_ident())

    wait_released()  # the thread runs from here on
    release_later([Noted()])
    release_later([Noted()])
    wait_released()
    assert len(dropped) == 2 and dropped[0] == dropped[1] != threading.get_ident()
    assert [t.name for t in threading.enumerate()].count("zeroshard-release") == 1

    child = os.fork()
    if child == 0:  # the child: release, wait, report by exit code
        release_later([Noted()])
        wait_released()
        os._exit(0 if len(dropped) == 3 and dropped[2] != threading.get_ident() else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail("the forked child did not release within 30 s")
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_load_frees_the_state_it_replaced_on_a_thread(tmp_path):
    """The masters and optimizer state a load replaces are dropped by the release thread,
    not by the load (which returns before they are unmapped)."""
    import threading
    import weakref

    from load_bytes_workers import train_and_save

    from zeroshard.checkpoint.engine_io import load_checkpoint
    from zeroshard.io.host_memory import wait_released

    engine = train_and_save(0, tmp_path, "t")
    old_masters = {master.data_ptr() for master in engine.masters}
    states = [t for per_param in engine.optimizer.state.values() for t in per_param.values() if t.dim()]
    dropped_by = []
    for tensor in states:
        weakref.finalize(tensor, lambda: dropped_by.append(threading.current_thread().name))
    count = len(states)
    del states, tensor
    load_checkpoint(engine, tmp_path / "t")
    wait_released()
    assert dropped_by == ["zeroshard-release"] * count
    assert not old_masters & {master.data_ptr() for master in engine.masters}  # the loaded state's memory
