"""to-universal and to-fp32 against ``cp -r`` of the same checkpoint, in the same run.

Two synthetic checkpoints (the testing pattern, saved with ``save_sharded`` on thread ranks):

* D=4, native policy, a GPT-like model of about 180 M bf16 parameters: about 2.1 GB of fp32
  master and Adam state, plus the bf16 model file;
* D=768, DeepSpeed policy (the seeds' case: a 266240-element group whose padding spans the
  last ranks, next to a large group), about 300 MB;
* D=4096, the same model: 4096 rank files of about 80 KB, where per-file costs dominate.

Each measurement runs in a fresh wrapper process that starts the command as its child and
reports the wall time and ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the peak resident set
of exactly that command. The page cache is warmed by one untimed ``cp -r`` of the source
first, so every timed command reads a cached checkpoint; the converters fsync what they
write, so ``cp -r`` is also timed followed by ``sync``. Peak memory is also given above the
resident set of a process that only imports the converter (``zeroshard.cli.convert_cmd``:
numpy, no torch).

    .venv/bin/python benchmarks/convert.py [--dir /tmp] [--cases 4 768 4096]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.checkpoint.testing import pattern, synthesize_state
from zeroshard.layout import Layout, LayoutPolicy, ParamSpec, build_layout

_WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True)
wall = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"code": done.returncode, "wall": wall, "peak_kb": peak, "stdout": done.stdout}))
"""
_REPEATS = 3
_CLI = "import sys; from zeroshard.cli.main import main; sys.exit(main(sys.argv[1:]))"


def gpt_layout(world_size: int, hidden: int = 1024, layers: int = 12, vocab: int = 27000) -> Layout:
    matrices = [ParamSpec.of("wte.weight", (vocab, hidden), "bf16")]
    vectors = []
    for i in range(layers):
        for name, shape in (("qkv", (3 * hidden, hidden)), ("proj", (hidden, hidden)), ("fc", (4 * hidden, hidden)), ("out", (hidden, 4 * hidden))):
            matrices.append(ParamSpec.of(f"h.{i}.{name}.weight", shape, "bf16"))
            vectors.append(ParamSpec.of(f"h.{i}.{name}.bias", (shape[0],), "bf16"))
        vectors += [ParamSpec.of(f"h.{i}.ln_{k}.{w}", (hidden,), "bf16") for k in (1, 2) for w in ("weight", "bias")]
    return build_layout([matrices, vectors], world_size, LayoutPolicy.native())


def seeds_layout(world_size: int = 768) -> Layout:
    small = [ParamSpec.of("final_norm.weight", (4096,), "bf16"), ParamSpec.of("router.weight", (64, 4096), "bf16")]
    large = [ParamSpec.of(f"layers.{i}.weight", (1024, 1024), "bf16") for i in range(24)]
    layout = build_layout([small, large], world_size, LayoutPolicy.deepspeed())
    assert layout.groups[0].param_numel == 266240
    assert world_size != 768 or layout.groups[0].padding_per_rank()[-1] == 348
    return layout


def synthesize(root: Path, layout: Layout) -> Path:
    started = time.perf_counter()
    path = _save_pattern(root, layout)  # its states are freed on return
    pattern.cache_clear()
    print(f"  synthesised and saved in {time.perf_counter() - started:.1f} s", flush=True)
    return path


def _save_pattern(root: Path, layout: Layout) -> Path:
    states = [synthesize_state(layout, rank) for rank in range(layout.world_size)]
    save = lambda c: save_sharded(root, "ckpt", states[c.rank], coordinator=c, buffer_names=["positions"])  # noqa: E731
    return run_ranks(layout.world_size, save, timeout=1200.0)[0]


def measure(command: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if result["code"] != 0:
        raise RuntimeError(f"{command} failed with {result['code']}: {out.stderr}")
    return result


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def settle() -> None:
    """Let writeback of earlier outputs finish, so it is not charged to the next command."""
    subprocess.run(["sync"], check=True)
    time.sleep(3.0)


def timed(command: list[str], out: Path) -> dict:
    settle()
    result = measure(command)
    result["written"] = du(out)
    shutil.rmtree(out)
    return result


def bench(name: str, checkpoint: Path, work: Path, baseline_mb: float) -> list[str]:
    """Median of _REPEATS interleaved rounds of cp -r, cp -r + sync, to-universal, to-fp32."""
    size = du(checkpoint)
    state_bytes = sum(p.stat().st_size for p in checkpoint.glob("rank-*.safetensors"))
    shutil.copytree(checkpoint, work / "warm")  # untimed: puts the source in the page cache
    shutil.rmtree(work / "warm")
    out = work / "out"
    commands = {
        "cp -r": ["cp", "-r", str(checkpoint), str(out)],
        "cp -r + sync": ["sh", "-c", f"cp -r {checkpoint} {out} && sync"],
        **{c: [sys.executable, "-c", _CLI, c, str(checkpoint), str(out), "--no-progress"] for c in ("to-universal", "to-fp32")},
    }
    runs: dict[str, list[dict]] = {label: [] for label in commands}
    for _ in range(_REPEATS):
        for label, command in commands.items():
            runs[label].append(timed(command, out))
    median = {label: sorted(r["wall"] for r in results)[len(results) // 2] for label, results in runs.items()}
    rows = [
        f"{name}: {size / 1e9:.2f} GB on disk ({state_bytes / 1e9:.2f} GB of fp32 state); median of {_REPEATS}: "
        f"cp -r {median['cp -r']:.2f} s, cp -r + sync {median['cp -r + sync']:.2f} s"
    ]
    for label in ("to-universal", "to-fp32"):
        wall = median[label]
        inner = sorted(float(r["stdout"].rsplit(" in ", 1)[1].split()[0]) for r in runs[label])[len(runs[label]) // 2]
        peak_mb = max(r["peak_kb"] for r in runs[label]) / 1024
        rows.append(
            f"  {label:12s} {wall:6.2f} s = {wall / median['cp -r']:.2f} x cp, {wall / median['cp -r + sync']:.2f} x cp+sync "
            f"(conversion alone {inner:.2f} s = {inner / median['cp -r + sync']:.2f} x cp+sync; the rest is starting "
            f"Python and importing the converter); wrote {runs[label][0]['written'] / 1e9:.2f} GB; "
            f"peak RSS {peak_mb:.0f} MB ({peak_mb - baseline_mb:.0f} MB above import) = "
            f"{peak_mb * 2**20 / size:.3f} x the checkpoint"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--cases", type=int, nargs="+", default=[4, 768, 4096], help="world sizes (4, 768, 4096)")
    args = parser.parse_args()
    baseline = measure([sys.executable, "-c", "import zeroshard.cli.convert_cmd"])
    baseline_mb = baseline["peak_kb"] / 1024
    print(f"a process importing zeroshard: peak RSS {baseline_mb:.0f} MB", flush=True)
    cases = [("D=4 native, 180M params", lambda: gpt_layout(4))] if 4 in args.cases else []
    cases += [(f"D={d} deepspeed policy", lambda d=d: seeds_layout(d)) for d in (768, 4096) if d in args.cases]
    report = []
    for name, make_layout in cases:
        layout = make_layout()
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            work = Path(tmp)
            print(f"{name}:", flush=True)
            checkpoint = synthesize(work / "src", layout)
            report += bench(name, checkpoint, work, baseline_mb)
            print("\n".join(report[-3:]), flush=True)
    print("\nsummary:\n" + "\n".join(report))


if __name__ == "__main__":
    main()
