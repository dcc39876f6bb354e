"""gpu_check.py, check 3: the asynchronous Checkpointer's stall on a device.

``checkpointer.py``'s rounds (its ``measure``) at D=1 on the device: on a GPU the 1 GB-of-
state model (83M parameters: bf16 weights, fp32 masters and AdamW state), whose snapshot is
a device-to-host copy into pinned memory. Next to them, the plainest copy of the same bytes:
one contiguous device tensor into one pinned host tensor (on the CPU, into a host tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from checkpointer import measure
from gpu_check_common import CheckResult, Context, StepTimer, median

STALL_PER_COPY_GOAL = 1.5
STALL_PER_SYNC_GOAL = 0.05


def plain_copy_s(nbytes: int, context: Context, repeats: int = 5) -> float:
    """Median time of one copy of ``nbytes`` from the device into (pinned) host memory."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=context.device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=context.cuda)
    timer = StepTimer(context)
    times = [timer(lambda: target.copy_(source, non_blocking=True)) for _ in range(repeats + 1)]
    return median(times[1:])  # the first touches the pages


def run(context: Context) -> CheckResult:
    result = CheckResult("checkpointer")
    kind, saves = ("large", 3) if context.size == "full" else ("demo", 2)
    device = str(context.device)
    measured = measure(0, 1, kind, str(Path(context.workdir) / "checkpoints"), saves, device)
    result.figure("state_bytes", measured["state_bytes"])
    result.figure("snapshot_bytes", measured["snapshot_bytes"])
    for key in ("stall_s", "snapshot_s", "floor_s", "sync_s", "write_s", "idle_step_s", "busy_step_s"):
        result.figure(key, measured[key])
    result.figure("busy_steps", measured["busy_steps"])
    copy = result.figure("plain_copy_s", plain_copy_s(int(measured["snapshot_bytes"]), context))
    result.figure("stall_per_plain_copy", measured["stall_s"] / copy)
    result.figure("stall_per_sync_save", measured["stall_per_sync"])
    result.figure("stall_per_snapshot_floor", measured["stall_per_floor"])
    result.figure("busy_step_per_idle_step", measured["busy_step_s"] / measured["idle_step_s"])
    result.compare("stall_vs_copy", "stall_per_plain_copy", "<=", STALL_PER_COPY_GOAL, "goal: at most 1.5x one plain copy")
    result.compare("stall_vs_sync", "stall_per_sync_save", "<=", STALL_PER_SYNC_GOAL, "goal: at most 5% of a sync save")
    result.notes.append(f"model {kind!r}, {saves} saves; pinned host buffers: {context.cuda}")
    return result
