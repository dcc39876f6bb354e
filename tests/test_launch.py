"""zeroshard.launch.spawn hands every rank's result back intact, or says why it cannot."""

from __future__ import annotations

import launch_workers
import pytest

from zeroshard.launch import spawn

COUNT = 200


def _max_abs_difference(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    worst = 0.0
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        worst = max(worst, float((got[name].double() - tensor.double()).abs().max()))
    return worst


def test_results_holding_many_tensors_come_back_intact():
    # The loss was a race with the children's exit: tensors shared through file descriptors
    # that the parent fetched from a rank already gone. With the queue's own pickler one spawn
    # of 4 ranks failed in 8 tries of 8 (FileNotFoundError); a storage that came back shared
    # says so even when the race is won.
    results = spawn(launch_workers.return_many_tensors, 4, (COUNT,), timeout_s=240)
    assert len(results) == 4
    for rank, result in enumerate(results):
        assert len(result) == COUNT
        assert _max_abs_difference(result, launch_workers.expected_tensors(rank, COUNT)) == 0.0
        shared = [name for name, tensor in result.items() if tensor.is_shared()]
        assert shared == [], f"rank {rank}: {len(shared)} tensors came back in shared memory, not by value"


def test_a_result_that_cannot_be_sent_is_refused_naming_the_rank():
    with pytest.raises(RuntimeError, match="rank 1's result cannot be sent to the parent"):
        spawn(launch_workers.return_unpicklable, 2, timeout_s=120)


def test_the_process_group_is_freed_when_destroyed_after_the_demo_phase(tmp_path):
    # torch.distributed.nn binds the live default group as a default argument when the first
    # optimizer imports it; the group then outlived destroy_process_group and was torn down at
    # interpreter exit, where gloo aborted about one run in eight.
    results = spawn(launch_workers.demo_phase_then_destroy, 2, (str(tmp_path),), timeout_s=240)
    for result in results:
        assert result == {"group_freed": True, "functions_holding_a_group": []}


def test_a_rank_starts_with_the_preloaded_modules_imported():
    # conftest.py preloads what the tests' ranks import (2-4 s of CPU each a rank otherwise).
    names = ("lightning.pytorch", "transformers.trainer", "zeroshard.engine")
    assert spawn(launch_workers.imported_at_start, 2, (names,), timeout_s=120) == [dict.fromkeys(names, True)] * 2


def test_preloading_once_the_forkserver_runs_is_refused():
    from zeroshard import launch

    spawn(launch_workers.imported_at_start, 1, ((),), timeout_s=120)
    with pytest.raises(RuntimeError, match=r"preload\(json\): the ranks. forkserver is running already"):
        launch.preload("json")


def test_preloading_a_module_the_forkserver_has_is_no_error():
    from zeroshard import launch

    spawn(launch_workers.imported_at_start, 1, ((),), timeout_s=120)
    launch.preload("lightning.pytorch")  # conftest.py's, before any spawn


def test_the_hf_demo_runs_after_other_spawns_without_its_preload(monkeypatch):
    """The HF demo's preload is an optimisation: in a process whose forkserver runs already
    without the model module, the demo goes on (its ranks import it themselves)."""
    from zeroshard import launch
    from zeroshard.cli import demo_moe_cmd

    spawn(launch_workers.imported_at_start, 1, ((),), timeout_s=120)
    monkeypatch.setattr(launch, "_also_preloaded", [])
    with pytest.raises(RuntimeError):
        launch.preload(demo_moe_cmd.HF_MODEL_MODULE)
    demo_moe_cmd._preload_hf_model()
