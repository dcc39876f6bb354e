"""What the torchrun benchmarks share: start a script on local gloo ranks and collect what
its ranks measured as JSON.

The launcher runs ``python -m torch.distributed.run`` on 127.0.0.1 with one thread per rank;
the worker side gathers every rank's records and rank 0 writes them to the file the
launcher named. Import it from a script in this folder (a script's folder is first on
``sys.path``, also for the ranks torchrun starts).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: str, nproc: int, args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``script args`` on ``nproc`` local ranks (OMP_NUM_THREADS=1, warnings off, ``env``
    added); returns the finished process. Raises ``subprocess.TimeoutExpired`` past ``timeout``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args,
    ]  # fmt: skip
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


def run_for_json(script: str, nproc: int, args: list[str], out: Path, timeout: float, **env: str) -> dict:
    """:func:`run_torchrun`, then the JSON its rank 0 wrote to ``out``. Raises RuntimeError with
    the tail of the ranks' output if there is none."""
    done = run_torchrun(script, nproc, args, timeout, **env)
    if not out.is_file():
        output = f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        raise RuntimeError(f"{Path(script).name} at D={nproc} failed ({done.returncode}):\n{output}")
    return json.loads(out.read_text())


def write_gathered(out: Path, mine: Any, **fields: Any) -> None:
    """Worker side (a collective: every rank calls it): gather every rank's ``mine``; rank 0
    writes ``{"world_size", **fields, "ranks": [each rank's mine]}`` to ``out``."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"world_size": dist.get_world_size(), **fields, "ranks": gathered}))
    dist.barrier()


def per_round(result: dict, step: str, key: str) -> list[float]:
    """Of a gathered result whose ranks record ``{"records": {step: [one dict per round]}}``:
    per round, the largest ``key`` over the ranks (the slowest rank sets a round's time)."""
    ranks = [rank["records"][step] for rank in result["ranks"]]
    return [max(records[i][key] for records in ranks) for i in range(len(ranks[0]))]


def round_ratio(result: dict, step: str, baseline: str, key: str) -> float:
    """The median over rounds of ``step``'s ``key`` over ``baseline``'s in the same round."""
    pairs = zip(per_round(result, step, key), per_round(result, baseline, key))
    return statistics.median(a / b for a, b in pairs)


def add_round_arguments(parser: Any) -> None:
    """The arguments of a step-time benchmark that :func:`run_rounds` launches (an
    ``argparse.ArgumentParser``): world sizes, rounds, steps, warm-up rounds, and the hidden
    ``--worker`` its ranks are started with."""
    import argparse

    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds; each runs every variant --steps steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)


def run_rounds(script: str, world_size: int, rounds: int, steps: int, warmup: int) -> dict:
    """Launcher side of a step-time benchmark whose worker takes ``--worker OUT --rounds
    --steps --warmup`` (DeepSpeed on the CPU accelerator): its gathered JSON."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        args = ["--worker", str(out), "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup)]
        return run_for_json(script, world_size, args, out, timeout=3600, DS_ACCELERATOR="cpu")


def exit_worker() -> None:
    """Worker side, last: leave the process group and exit at once, skipping gloo's
    interpreter teardown (as tests/deepspeed_fixtures.py does)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
