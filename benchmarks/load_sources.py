"""Load time per checkpoint kind: the one loader against the loaders it replaced.

One checkpoint of each kind the loader reads, of the same model where the format allows:

* native: a synthesised run of the checkpoint_io.py "large" shapes (hidden 1024, 4 layers) at D=2;
* universal: that native checkpoint converted with ``to_universal``;
* deepspeed: a DeepSpeed 0.19.8 ZeRO-2 run at D=2 (deepspeed_convert.py's model, trained and
  saved by DeepSpeed itself under torchrun).

Each load (rank 0 of the same D, and rank 0 of D=3: resharded) runs in a fresh process, once
with this tree's ``src`` and once with a baseline tree (``--baseline SRC``, e.g. a
``git worktree`` of the commit before the loader change), in interleaved rounds; the table
gives the best time of each and the ratio. The process imports and opens the checkpoint
before the clock starts: what is timed is the load of one rank's full state (masters,
optimizer state, model state) for the new layout.

    .venv/bin/python benchmarks/load_sources.py --baseline /tmp/base/src [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
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
        from zeroshard.importers import open_deepspeed

        source = open_deepspeed(path)
        layout = source.info.layout.with_world_size(world)
        started = time.perf_counter()
        state = load_from_source(source, layout, 0)
    else:
        from zeroshard.checkpoint import open_checkpoint

        native = path if kind == "native" else json.loads(os.environ["LOAD_SOURCES_NATIVE"])
        layout = open_checkpoint(native).manifest.layout.with_world_size(world)
        load = load_sharded if kind == "native" else load_universal
        started = time.perf_counter()
        state = load(path, layout, 0)
    elapsed = time.perf_counter() - started
    numel = sum(t.numel() for t in state.fp32_partitions)
    print(json.dumps({"seconds": elapsed, "fp32_numel": numel}))


# ---- the checkpoints -------------------------------------------------------------------------------


def make_native(root: Path) -> Path:
    from zeroshard.checkpoint import run_ranks, save_sharded
    from zeroshard.checkpoint.testing import synthesize_state
    from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

    hidden, layers = 1024, 4
    specs = [ParamSpec(f"layers.{i}.weight", (hidden, hidden), "bfloat16") for i in range(layers)]
    layout = build_layout([specs], world_size=2, policy=LayoutPolicy.native())
    run_ranks(2, lambda coord: save_sharded(root, "t", synthesize_state(layout, coord.rank), coordinator=coord))
    return root / "t"


def make_universal(native: Path, out: Path) -> Path:
    from zeroshard.checkpoint.universal import to_universal

    to_universal(native, out, progress=False)
    return out


def make_deepspeed(root: Path) -> Path:
    sys.path.insert(0, str(HERE))
    import deepspeed_convert

    deepspeed_convert.make_checkpoint(root, world_size=2, num_layers=4)
    return root


# ---- measuring ---------------------------------------------------------------------------------------


def measure(tree: Path, kind: str, path: Path, world: int, native: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", LOAD_SOURCES_NATIVE=json.dumps(str(native)))
    command = [sys.executable, __file__, "--run", kind, str(path), str(world)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} load with {tree} failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="src folder of the tree to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.dir))
    native = make_native(work / "native")
    paths = {
        "native": native,
        "universal": make_universal(native, work / "universal"),
        "deepspeed": make_deepspeed(work / "deepspeed"),
    }
    trees = {"this tree": SRC, "baseline": args.baseline}
    best: dict[tuple[str, int, str], float] = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            for world in (2, 3):
                for name, tree in trees.items():
                    seconds = measure(tree, kind, paths[kind], world, native)
                    key = (kind, world, name)
                    best[key] = min(best.get(key, float("inf")), seconds)
    print(f"best of {args.rounds} interleaved rounds, rank 0's load (load average {os.getloadavg()[0]:.1f})")
    print(f"{'kind':<10} {'to D':>4} {'baseline':>10} {'this tree':>10} {'ratio':>7}")
    for kind in KINDS:
        for world in (2, 3):
            old, new = best[(kind, world, "baseline")], best[(kind, world, "this tree")]
            print(f"{kind:<10} {world:>4} {old * 1e3:>8.1f}ms {new * 1e3:>8.1f}ms {new / old:>7.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        _run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
