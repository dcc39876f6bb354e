"""Writers racing for one place, run as separate processes by tests/test_checkpoint_writers.py.

    python writer_workers.py save ROOT NAME SECONDS GO_FILE
    python writer_workers.py convert SOURCE OUT_DIR SECONDS GO_FILE

Each says it is ready (GO_FILE.ready-PID) and waits for GO_FILE, so both start together,
then writes in a loop for SECONDS (at most MAX_ATTEMPTS tries, MAX_PUBLISHED successes) and
prints one JSON line: its pid, what it published, the refusals (WriterLockedError) it met
and every other error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MAX_ATTEMPTS = 400
MAX_PUBLISHED = 40


def wait_for(go_file: Path) -> None:
    """Say this worker is ready (imports done), then wait for the start signal."""
    go_file.with_name(f"{go_file.name}.ready-{os.getpid()}").touch()
    deadline = time.monotonic() + 120
    while not go_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go_file} never appeared")
        time.sleep(0.01)


def loop(attempt, seconds: float, go_file: Path) -> dict:
    """Call ``attempt(i)`` until time is up; sort its outcomes."""
    from zeroshard.io.writer_lock import WriterLockedError

    wait_for(go_file)
    done, refused, failed = [], [], []
    deadline = time.monotonic() + seconds
    for i in range(MAX_ATTEMPTS):
        if time.monotonic() > deadline or len(done) >= MAX_PUBLISHED:
            break
        try:
            done.append(attempt(i))
        except WriterLockedError as err:
            refused.append(str(err))
            time.sleep(0.005)
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
            failed.append(f"{type(err).__name__}: {err}")
    return {"pid": os.getpid(), "done": done, "refused": refused, "failed": failed}


def save_loop(root: Path, name: str, seconds: float, go_file: Path) -> dict:
    """Two thread-ranks saving a new tag each time, so every published tag can be checked."""
    from zeroshard.checkpoint import run_ranks, save_sharded
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import ParamSpec, build_layout

    layout = build_layout([[ParamSpec.of("w", (64, 16), "bf16"), ParamSpec.of("b", (16,), "bf16")]], 2)
    states = [synthesize_state(layout, rank) for rank in range(2)]

    def attempt(i: int) -> str:
        tag = f"{name}-{i:04d}"
        results = run_ranks(
            2, lambda c: save_sharded(root, tag, states[c.rank], coordinator=c, block_size=4096), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return tag
        if len(errors) == len(results) and len({(type(e), str(e)) for e in errors}) == 1:
            raise errors[0]
        raise RuntimeError(f"the ranks did not fail together: {[repr(r) for r in results]}")

    return loop(attempt, seconds, go_file)


def convert_loop(source: Path, out: Path, seconds: float, go_file: Path) -> dict:
    """Alternately to-universal into OUT/u and to-fp32 into OUT/f, replacing what is there."""
    from zeroshard.checkpoint.export.fp32 import to_fp32
    from zeroshard.checkpoint.universal.write import to_universal

    def attempt(i: int) -> str:
        if i % 2:
            to_fp32(source, out / "f", overwrite=True, progress=False)
            return "f"
        to_universal(source, out / "u", overwrite=True, progress=False)
        return "u"

    return loop(attempt, seconds, go_file)


if __name__ == "__main__":
    mode, first, second, seconds, go = sys.argv[1:6]
    run = save_loop if mode == "save" else convert_loop
    print(json.dumps(run(Path(first), second if mode == "save" else Path(second), float(seconds), Path(go))))
