"""Run a fixture script's jobs on ranks forked from one process that imported torch and DeepSpeed once.

``python forked_ranks.py SCRIPT ROOT JOBS [MODULE ...]`` imports torch, DeepSpeed, the extra
modules named and SCRIPT, then forks the ranks of every job in JOBS (``WORLD_SIZE:PORT:SPEC``
entries joined by commas; the jobs run side by side, each its own process group), each rank
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), calling
SCRIPT's ``_worker_main(ROOT, SPEC)``. torchrun's ranks are each a new interpreter that
imports all of that again: about 3.4 s of CPU a rank on the 2-core test VM, most of a
fixture launch's time. Nothing here starts a thread before the fork (the imports start none;
OMP_NUM_THREADS=1), so each rank starts as a fresh one would.

Exit status 0 when every rank exited 0. Once a rank fails, the others get a grace period to
finish on their own (a rank that fails in a collective leaves the others waiting in it), then
are killed. The launcher starts this in a session of its own and kills the whole session when
it times out, ranks included.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path

GRACE_S = 30.0  # after a rank failed: how long the others may take to finish
POLL_S = 0.05


def main(script: Path, root: Path, jobs: list[tuple[int, int, Path]], preload: list[str]) -> int:
    for name in ("torch", "deepspeed", *preload):
        importlib.import_module(name)
    module = _load(script)
    children = {}
    for world_size, port, spec in jobs:
        for rank in range(world_size):
            children[_fork_rank(module, root, spec, rank, world_size, port)] = f"rank {rank} of {world_size}"
    return _wait(children)


def _load(script: Path):
    sys.path.insert(0, str(script.parent))  # the script and its sibling modules, as when run as a script
    return importlib.import_module(script.stem)


def _fork_rank(module, root: Path, spec: Path, rank: int, world_size: int, port: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        module._worker_main(root, spec)  # leaves with os._exit(0) once its marker is written
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(children: dict[int, str]) -> int:
    """Reap every rank; the first failure's exit status (0: none failed)."""
    status, deadline = 0, None
    while children:
        pid, raw = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other, rank in children.items():
                    print(f"{rank} killed: still running {GRACE_S:.0f} s after another failed", file=sys.stderr)
                    os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(POLL_S)
            continue
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            print(f"{rank} exited with status {code}", file=sys.stderr)
            status = code if code > 0 else 128 - code
            deadline = time.monotonic() + GRACE_S
    return status


if __name__ == "__main__":
    script, root, jobs, *preload = sys.argv[1:]
    parsed = [(int(world), int(port), Path(spec)) for world, port, spec in (job.split(":", 2) for job in jobs.split(","))]
    sys.exit(main(Path(script), Path(root), parsed, preload))
