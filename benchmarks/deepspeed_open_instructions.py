"""Instructions per file of opening a DeepSpeed checkpoint of thousands of tiny rank files,
this tree against a baseline tree: counted by valgrind (callgrind), so the figure does not
move with the load of a shared machine, where timings of a per-file change of a few percent
drown in noise.

The checkpoint is deepspeed_convert.py's: a 1.34 M-parameter run made by DeepSpeed at D=1
(torchrun, gloo), rewritten as DeepSpeed would save it at ``--world-size`` D
(deepspeed_expand.py). Each tree opens it once and twice (``open_deepspeed``, the parse and
the layout check of every rank file: what a conversion costs per file) in processes of their
own; the difference of the two counts is one open, imports excluded. Under callgrind a run
takes about 50x its native time (minutes at D=768).

    .venv/bin/python benchmarks/deepspeed_open_instructions.py --baseline /tmp/base/src [--world-size 768]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
_OPENS = "import sys\nfrom zeroshard.deepspeed.checkpoint import open_deepspeed\nfor _ in range(int(sys.argv[2])):\n    open_deepspeed(sys.argv[1]).close()\n"


def instructions(src: Path, tag_dir: Path, opens: int, work: Path) -> int:
    """Instructions callgrind counts for a process opening ``tag_dir`` ``opens`` times."""
    out = work / f"callgrind.{src.parent.name}.{opens}"
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", _OPENS]
    done = subprocess.run([*command, str(tag_dir), str(opens)], env=env, capture_output=True, text=True, check=True)
    return int(re.findall(r"Collected : (\d+)", done.stderr)[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="src folder of the tree to compare with")
    parser.add_argument("--world-size", type=int, default=768)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from deepspeed_convert import SYNTH_HIDDEN, SYNTH_LAYERS, TAG, make_checkpoint
    from deepspeed_expand import expand

    work = Path(tempfile.mkdtemp(prefix="ds_open_", dir=args.dir))
    make_checkpoint(work / "one", 1, SYNTH_LAYERS, SYNTH_HIDDEN)
    tag_dir = work / f"d{args.world_size}" / TAG
    expand(work / "one" / TAG, tag_dir, args.world_size)
    files = len(list(tag_dir.glob("*.pt")))
    per_open = {}
    for name, src in (("baseline", args.baseline), ("this tree", SRC)):
        per_open[name] = instructions(src, tag_dir, 2, work) - instructions(src, tag_dir, 1, work)
        print(
            f"{name}: {per_open[name]:,} instructions per open, {per_open[name] / files:,.0f} per file ({files} files)"
        )
    print(f"this tree / baseline: {per_open['this tree'] / per_open['baseline']:.4f}")


if __name__ == "__main__":
    main()
