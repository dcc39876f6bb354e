"""DeepSpeed's own converters against zeroshard's, on one real DeepSpeed ZeRO-2 checkpoint.

The checkpoint is made first, by DeepSpeed itself (torchrun, gloo on the CPU, bf16, ZeRO
stage 2, torch AdamW, D = 4): an MLP of about 25 M parameters in two param groups, one
training step, then ``save_checkpoint``. That is about 300 MB of fp32 master and Adam state
plus the 50 MB bf16 model file. Then, on that checkpoint:

* DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict`` (what its ``zero_to_fp32.py``
  runs, with ``safe_serialization=True`` so both sides write safetensors, and
  ``max_shard_size=None``: the script's default of 5GB needs ``huggingface_hub``, which splits
  nothing here anyway) against ``zeroshard to-fp32``;
* DeepSpeed ``ds_to_universal`` (``--num_extract_workers 1 --num_merge_workers 1``: one
  process, so one resident set to measure; ``--inject_missing_state``: the run was not made
  with universal-checkpoint metadata) against ``zeroshard to-universal``.

Each command runs in a fresh wrapper process that starts it as its child and reports the wall
time and ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the peak resident set of exactly that
command. The child imports its converter first and then times the conversion alone; both
times are shown, and the import-only rows give the memory floor of each side. The checkpoint
is read once before the timings, so every command reads it from the page cache. zeroshard
fsyncs what it writes; DeepSpeed does not. The fp32 exports are checked bit for bit against
each other, and so are the fp32 / exp_avg / exp_avg_sq of every parameter in the two
universal checkpoints.

With ``--synthesise 768 4096`` the checkpoints are instead a 1.34 M-parameter run made by
DeepSpeed at D=1 and rewritten as DeepSpeed would have saved it at each D
(``deepspeed_expand.py``): thousands of tiny rank files, where the per-file costs dominate.
``cp -r`` of the same tag folder is timed alongside. Commands run in interleaved rounds.

    DS_BUILD_OPS=0 pip install -e '.[deepspeed]'
    .venv/bin/python benchmarks/deepspeed_convert.py [--dir /tmp] [--world-size 4] [--layers 24] [--repeats 2]
    .venv/bin/python benchmarks/deepspeed_convert.py --synthesise 768 4096 [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from math import nan
from pathlib import Path

from torchrun_job import run_torchrun

TAG = "bench"
HIDDEN, LAYERS = 1024, 24  # 24 x (1024 x 1024 + 1024) + norms: 25.2 M parameters
SYNTH_HIDDEN, SYNTH_LAYERS = 384, 9  # 9 x (384 x 384 + 384) + norms: 1.34 M parameters

_WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
peak, cpu = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
report = {"code": done.returncode, "wall": wall, "cpu": cpu, "peak_kb": peak}
report.update(stdout=done.stdout[-2000:], stderr=done.stderr[-2000:])
print(json.dumps(report))
"""
_CONVERSION_SECONDS = "conversion seconds:"  # then the wall time and the CPU time of the conversion alone


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (DeepSpeed's worker pools)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _report_conversion(started: float, cpu_started: float) -> None:
    print(_CONVERSION_SECONDS, time.perf_counter() - started, _cpu_seconds() - cpu_started)


# ---- the checkpoint (torchrun workers run this file with ``--train``) ----------------------------


def _train_and_save(save_dir: Path, num_layers: int, hidden: int = HIDDEN) -> None:
    import importlib

    import deepspeed
    import torch
    from torch import nn

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo is enough; no g++ build
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = []
    for _ in range(num_layers):
        layers += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU()]
    model = nn.Sequential(*layers)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        config=config,
    )
    inputs = torch.randn(2, hidden, dtype=torch.bfloat16)
    loss = engine(inputs).float().square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(save_dir), tag=TAG)
    deepspeed.comm.destroy_process_group()


def make_checkpoint(save_dir: Path, world_size: int, num_layers: int, hidden: int = HIDDEN) -> float:
    """Train one step with DeepSpeed at ``world_size`` and save; returns the seconds it took."""
    started = time.perf_counter()
    args = ["--train", str(save_dir), str(num_layers), str(hidden)]
    done = run_torchrun(__file__, world_size, args, timeout=600, DS_ACCELERATOR="cpu")
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed run failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return time.perf_counter() - started


# ---- the measured commands (``deepspeed_convert.py --run KIND ARGS...`` in a fresh process) ---------


def _run_zero_to_fp32(save_dir: str, out: str) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    started, cpu_started = time.perf_counter(), _cpu_seconds()
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, max_shard_size=None, safe_serialization=True, tag=TAG)
    _report_conversion(started, cpu_started)


def _run_ds_to_universal(*argv: str) -> None:
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = ["ds_to_universal", *argv]
    parsed = ds_to_universal.parse_arguments()
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    ds_to_universal.main(parsed)
    _report_conversion(started, cpu_started)


def _run_zeroshard(*argv: str) -> None:
    import zeroshard.deepspeed.checkpoint  # noqa: F401  (imported lazily by the CLI; not part of the conversion)
    from zeroshard.cli.main import main

    started, cpu_started = time.perf_counter(), _cpu_seconds()
    code = main(list(argv))
    _report_conversion(started, cpu_started)
    sys.exit(code)


def _run_import(module: str) -> None:
    import importlib

    importlib.import_module(module)
    print(_CONVERSION_SECONDS, 0.0, 0.0)


_RUNNERS = {
    "zero_to_fp32": _run_zero_to_fp32,
    "ds_to_universal": _run_ds_to_universal,
    "zeroshard": _run_zeroshard,
    "import": _run_import,
}


# ---- measuring -------------------------------------------------------------------------------------


def measure(command: list[str], out: Path | None) -> dict:
    """Run ``command`` under the wrapper (``out`` removed first); wall s, peak MB, error.
    A leading ``PYTHONPATH=...`` word sets that variable for the command."""
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    if command[0].startswith("PYTHONPATH="):
        env["PYTHONPATH"], command = command[0].partition("=")[2], command[1:]
    done = subprocess.run([sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, env=env)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    error = None
    if report["code"] != 0:
        lines = [line for line in report["stderr"].splitlines() if line.strip()]
        error = lines[-1] if lines else f"exit status {report['code']}"
    timed = [line for line in report["stdout"].splitlines() if line.startswith(_CONVERSION_SECONDS)]
    conversion, conversion_cpu = (float(word) for word in timed[-1].split()[-2:]) if timed else (nan, nan)
    return {
        "wall": report["wall"], "cpu": report["cpu"], "conversion": conversion, "conversion_cpu": conversion_cpu,
        "peak_mb": report["peak_kb"] / 1024, "error": error,
    }  # fmt: skip


def best_of(repeats: int, commands: dict[str, tuple[list[str], Path | None]]) -> dict[str, dict]:
    """Every command ``repeats`` times, in interleaved rounds (so a change of machine load
    hits all of them alike): per command the best wall, CPU and conversion time, the
    largest peak, or the first failure."""
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, (command, out) in commands.items():
            runs[name].append(measure(command, out))
    results = {}
    for name, found in runs.items():
        failed = next((run for run in found if run["error"]), None)
        best = {key: min(run[key] for run in found) for key in ("wall", "cpu", "conversion", "conversion_cpu")}
        results[name] = failed or {**best, "peak_mb": max(run["peak_mb"] for run in found), "error": None}
    return results


def commands(save_dir: Path, work: Path, baseline: Path | None = None) -> dict[str, tuple[list[str], Path | None]]:
    me, tag_dir = [sys.executable, __file__, "--run"], save_dir / TAG
    before = {}
    if baseline is not None:  # the same commands on another zeroshard source tree, for before/after figures
        for command in ("to-fp32", "to-universal"):
            out = work / f"baseline_{command}"
            line = [f"PYTHONPATH={baseline}", *me, "zeroshard", command, str(save_dir), str(out), "--no-progress"]
            before[f"baseline {command}"] = (line, out)
    return {
        **before,
        "cp -r (same bytes)": (["cp", "-r", str(tag_dir), str(work / "copy")], work / "copy"),
        "import deepspeed (floor)": ([*me, "import", "deepspeed.utils.zero_to_fp32"], None),
        "import zeroshard (floor)": ([*me, "import", "zeroshard.cli.main"], None),
        "deepspeed zero_to_fp32": ([*me, "zero_to_fp32", str(save_dir), str(work / "ds_fp32")], work / "ds_fp32"),
        "zeroshard to-fp32": (
            [*me, "zeroshard", "to-fp32", str(save_dir), str(work / "zs_fp32"), "--no-progress"],
            work / "zs_fp32",
        ),
        "deepspeed ds_to_universal": (
            [
                *me, "ds_to_universal", "--input_folder", str(tag_dir), "--output_folder", str(work / "ds_universal"),
                "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state",
            ],  # fmt: skip
            work / "ds_universal",
        ),
        "zeroshard to-universal": (
            [*me, "zeroshard", "to-universal", str(save_dir), str(work / "zs_universal"), "--no-progress"],
            work / "zs_universal",
        ),
    }


def same_bits(a, b) -> bool:
    import numpy as np
    import torch

    from zeroshard.io.dtypes import to_torch

    a, b = (to_torch(x) if isinstance(x, np.ndarray) else x.contiguous() for x in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp32_exports_equal(work: Path) -> bool:
    """zeroshard's to-fp32 tensors against DeepSpeed's zero_to_fp32 ones, bit for bit."""
    from safetensors.torch import load_file

    theirs = load_file(str(work / "ds_fp32" / "model.safetensors"))
    ours = load_file(str(work / "zs_fp32" / "model.safetensors"))
    return ours.keys() == theirs.keys() and all(same_bits(ours[k], theirs[k]) for k in ours)


def universal_checkpoints_equal(work: Path) -> bool:
    """Every parameter's fp32 / exp_avg / exp_avg_sq in DeepSpeed's universal checkpoint
    (``zero/<name>/<key>.pt``, the tensor under "param") against zeroshard's, bit for bit."""
    import torch

    from zeroshard.checkpoint.universal import open_universal

    theirs = next((work / "ds_universal").rglob("zero"))
    with open_universal(work / "zs_universal") as ours:
        names = sorted(ours.manifest.params)
        if names != sorted(path.name for path in theirs.iterdir() if path.is_dir()):
            return False
        for name in names:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                saved = torch.load(theirs / name / f"{key}.pt", weights_only=True)["param"]
                if not same_bits(ours.read_param(name, key).reshape(saved.shape), saved):
                    return False
    return True


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def warm_page_cache(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                while handle.read(1 << 24):
                    pass


# ---- report ------------------------------------------------------------------------------------------


DENSE_PAIRS = (
    ("fp32 export", "deepspeed zero_to_fp32", "zeroshard to-fp32"),
    ("universal", "deepspeed ds_to_universal", "zeroshard to-universal"),
)


def print_table(results: dict[str, dict], pairs: tuple[tuple[str, str, str], ...] = DENSE_PAIRS) -> None:
    """The table of ``results``, then per (task, DeepSpeed's command, ours) the ratios."""
    print(
        f"| {'command':<27} | {'process s':>9} | {'CPU s':>6} | {'conversion s':>12} | {'conversion CPU s':>16} "
        f"| {'peak RSS MB':>11} |"
    )
    print(f"| {'-' * 27} | {'-' * 8}: | {'-' * 5}: | {'-' * 11}: | {'-' * 15}: | {'-' * 10}: |")
    for name, result in results.items():
        if result["error"]:
            print(f"| {name:<27} | failed: {result['error'][:160]} | | | | |")
        else:
            print(
                f"| {name:<27} | {result['wall']:>9.2f} | {result['cpu']:>6.2f} | {result['conversion']:>12.2f} "
                f"| {result['conversion_cpu']:>16.2f} | {result['peak_mb']:>11.0f} |"
            )
    print()
    for task, theirs, ours in pairs:
        a, b = results[theirs], results[ours]
        if a["error"] or b["error"]:
            print(f"{task}: no ratio ({theirs if a['error'] else ours} failed)")
            continue
        floor_a = results["import deepspeed (floor)"]["peak_mb"]
        floor_b = results["import zeroshard (floor)"]["peak_mb"]
        copy = results["cp -r (same bytes)"]["wall"]
        print(
            f"{task}: zeroshard {a['conversion'] / b['conversion']:.1f}x faster on the conversion"
            f" (conversion time {b['conversion'] / a['conversion']:.2f}x DeepSpeed's, {b['conversion']:.2f} s;"
            f" conversion CPU {b['conversion_cpu']:.2f} s ="
            f" {b['conversion_cpu'] / a['conversion_cpu']:.2f}x DeepSpeed's;"
            f" {a['wall'] / b['wall']:.1f}x faster on the whole process, {b['wall'] / copy:.2f}x cp -r),"
            f" {b['peak_mb'] / a['peak_mb']:.2f}x the peak RSS"
            f" ({(b['peak_mb'] - floor_b) / max(a['peak_mb'] - floor_a, 1):.2f}x above each side's import floor)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"Linear({HIDDEN}, {HIDDEN}) layers (1.05 M parameters each)")
    parser.add_argument(
        "--synthesise", type=int, nargs="+", metavar="D", default=None,
        help=f"instead: train {SYNTH_LAYERS} Linear({SYNTH_HIDDEN}) layers (1.34 M parameters) at D=1 and "
        "expand the checkpoint to each D (deepspeed_expand.py)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds: best wall time, worst peak")
    parser.add_argument("--skip-check", action="store_true", help="do not compare the outputs bit for bit")
    parser.add_argument("--baseline", type=Path, default=None, help="also time zeroshard from this src/ (before/after)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ds_convert_", dir=args.dir))
    try:
        if args.synthesise:
            seconds = make_checkpoint(work / "one", 1, SYNTH_LAYERS, SYNTH_HIDDEN)
            print(f"DeepSpeed run at D=1 ({SYNTH_LAYERS} x Linear({SYNTH_HIDDEN})) made in {seconds:.0f} s")
            for world_size in args.synthesise:
                save_dir = work / f"ckpt_d{world_size}"
                started = time.perf_counter()
                from deepspeed_expand import expand

                expand(work / "one" / TAG, save_dir / TAG, world_size)
                print(f"\nexpanded to D={world_size} in {time.perf_counter() - started:.0f} s")
                run_case(save_dir, work, world_size, args)
                shutil.rmtree(save_dir)
        else:
            save_dir = work / "ckpt"
            seconds = make_checkpoint(save_dir, args.world_size, args.layers)
            print(f"DeepSpeed run made in {seconds:.0f} s")
            run_case(save_dir, work, args.world_size, args)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run_case(save_dir: Path, work: Path, world_size: int, args: argparse.Namespace) -> None:
    tag_dir = save_dir / TAG
    state_mb = directory_bytes(tag_dir) / 1e6
    print(f"DeepSpeed checkpoint: D={world_size}, {state_mb:.0f} MB in {len(list(tag_dir.iterdir()))} files")
    warm_page_cache(tag_dir)
    load = os.getloadavg()[0]
    results = best_of(args.repeats, commands(save_dir, work, args.baseline))
    print(
        f"repeats: {args.repeats} interleaved (best wall time, largest peak); "
        f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print_table(results)
    if args.skip_check:
        return
    if not (results["deepspeed zero_to_fp32"]["error"] or results["zeroshard to-fp32"]["error"]):
        print(f"\nfp32 exports bit for bit equal: {fp32_exports_equal(work)}")
    if not (results["deepspeed ds_to_universal"]["error"] or results["zeroshard to-universal"]["error"]):
        same = universal_checkpoints_equal(work)
        print(f"universal checkpoints bit for bit equal (fp32, exp_avg, exp_avg_sq): {same}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:  # a torchrun worker
        _train_and_save(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["--run"]:  # one measured command
        _RUNNERS[sys.argv[2]](*sys.argv[3:])
    else:
        main()
