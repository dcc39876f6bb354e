"""Load time per checkpoint kind: the one loader against the loaders it replaced.

One checkpoint of each kind the loader reads, of the same model where the format allows,
for each size in ``--layers`` (layers of 1024 x 1024; 4 layers: 4 M parameters, 57 MB):

* native: a synthesised run of the checkpoint_io.py "large" shapes (hidden 1024) at D=2;
* universal: that native checkpoint converted with ``to_universal``;
* deepspeed: a DeepSpeed 0.19.8 ZeRO-2 run at D=2 (deepspeed_convert.py's model, trained and
  saved by DeepSpeed itself under torchrun).

Each load (rank 0 of the same D, and rank 0 of D=3: resharded) runs in a fresh process, once
with this tree's ``src`` and once with a baseline tree (``--baseline SRC``, e.g. a
``git worktree`` of the commit before the loader change), in interleaved rounds; the table
gives the median wall time and the median CPU time (user + system of the loading process,
steadier on a shared machine) of each, and their ratios. The process imports and opens the
checkpoint before the clock starts: what is timed is the load of one rank's full state
(masters, optimizer state, model state) for the new layout. Two sizes tell a fixed cost per
load from a cost per byte.

    .venv/bin/python benchmarks/load_sources.py --baseline /tmp/base/src [--rounds 9] [--layers 4 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
KINDS = ("native", "universal", "deepspeed")


# ---- one load, in a fresh process (``load_sources.py --run KIND PATH WORLD``) ----------------------


def _load_functions():
    """The three public loaders, as both trees name them."""
    from zeroshard.checkpoint import load_sharded
    from zeroshard.checkpoint.universal import load_from_source, load_universal

    return load_sharded, load_universal, load_from_source


def _run(kind: str, path: str, world: int) -> None:
    load_sharded, load_universal, load_from_source = _load_functions()
    if kind == "deepspeed":
        from zeroshard.deepspeed.checkpoint import open_deepspeed

        source = open_deepspeed(path)
        layout = source.info.layout.with_world_size(world)
        started, cpu = time.perf_counter(), time.process_time()
        state = load_from_source(source, layout, 0)
    else:
        from zeroshard.checkpoint import open_checkpoint

        native = path if kind == "native" else json.loads(os.environ["LOAD_SOURCES_NATIVE"])
        layout = open_checkpoint(native).manifest.layout.with_world_size(world)
        load = load_sharded if kind == "native" else load_universal
        started, cpu = time.perf_counter(), time.process_time()
        state = load(path, layout, 0)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    numel = sum(t.numel() for t in state.fp32_partitions)
    print(json.dumps({"seconds": elapsed, "cpu": cpu, "fp32_numel": numel}))


# ---- the checkpoints -------------------------------------------------------------------------------


def make_native(root: Path, layers: int) -> Path:
    from zeroshard.checkpoint import run_ranks, save_sharded
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

    hidden = 1024
    specs = [ParamSpec(f"layers.{i}.weight", (hidden, hidden), "bfloat16") for i in range(layers)]
    layout = build_layout([specs], world_size=2, policy=LayoutPolicy.native())
    run_ranks(2, lambda coord: save_sharded(root, "t", synthesize_state(layout, coord.rank), coordinator=coord))
    return root / "t"


def make_universal(native: Path, out: Path) -> Path:
    from zeroshard.checkpoint.universal import to_universal

    to_universal(native, out, progress=False)
    return out


def make_deepspeed(root: Path, layers: int) -> Path:
    sys.path.insert(0, str(HERE))
    import deepspeed_convert

    deepspeed_convert.make_checkpoint(root, world_size=2, num_layers=layers)
    return root


def make_checkpoints(root: Path, layers: int) -> dict[str, Path]:
    """One checkpoint of each kind under ``root`` (made once: an existing one is reused)."""
    native, universal, deepspeed = root / "native", root / "universal", root / "deepspeed"
    if not (native / "t").is_dir():
        make_native(native, layers)
    if not universal.is_dir():
        make_universal(native / "t", universal)
    if not deepspeed.is_dir():
        make_deepspeed(deepspeed, layers)
    return {"native": native / "t", "universal": universal, "deepspeed": deepspeed}


# ---- measuring ---------------------------------------------------------------------------------------


def measure(tree: Path, kind: str, path: Path, world: int, native: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one load in a fresh process with ``tree`` as its source."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", LOAD_SOURCES_NATIVE=json.dumps(str(native)))
    command = [sys.executable, __file__, "--run", kind, str(path), str(world)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} load with {tree} failed: {done.stderr.strip().splitlines()[-1]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["seconds"], report["cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="src folder of the tree to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 24], help="model sizes: layers of 1024 x 1024")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints are made (or reused)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp())
    paths = {layers: make_checkpoints(work / f"layers{layers}", layers) for layers in args.layers}
    trees = {"this tree": SRC, "baseline": args.baseline}
    cases = [(layers, kind, world) for layers in args.layers for kind in args.kinds for world in (2, 3)]
    times: dict[tuple[int, str, int, str], list[tuple[float, float]]] = {}
    load_before = os.getloadavg()[0]
    for _ in range(args.rounds):
        for layers, kind, world in cases:
            for name, tree in trees.items():
                native = paths[layers]["native"]
                times.setdefault((layers, kind, world, name), []).append(
                    measure(tree, kind, paths[layers][kind], world, native)
                )
    print(
        f"median of {args.rounds} interleaved rounds, rank 0's load "
        f"(load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})"
    )
    print(f"{'layers':>6} {'kind':<10} {'to D':>4} {'baseline':>10} {'this tree':>10} {'ratio':>6}  {'CPU base':>9} {'CPU this':>9} {'ratio':>6}")
    for layers, kind, world in cases:
        old = times[(layers, kind, world, "baseline")]
        new = times[(layers, kind, world, "this tree")]
        wall_old, wall_new = (statistics.median(t[0] for t in old), statistics.median(t[0] for t in new))
        cpu_old, cpu_new = (statistics.median(t[1] for t in old), statistics.median(t[1] for t in new))
        print(
            f"{layers:>6} {kind:<10} {world:>4} {wall_old * 1e3:>8.1f}ms {wall_new * 1e3:>8.1f}ms {wall_new / wall_old:>6.2f}"
            f"  {cpu_old * 1e3:>7.1f}ms {cpu_new * 1e3:>7.1f}ms {cpu_new / cpu_old:>6.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        _run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
