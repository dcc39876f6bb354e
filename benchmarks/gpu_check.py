"""GPU proof: what only a CUDA device can show about zeroshard, in one command.

Five checks at D=1 on one GPU (an NCCL process group of one, from a FileStore), each
printed as one line and written to a JSON report:

1. engine_equal (gpu_check_engine.py): the engine on CUDA equals the engine on the CPU,
   stages 1 and 2, bf16 and fp16 (loss scaling), clipping, accumulation, within bounds
   derived from the arithmetic; every parameter view 16-byte aligned.
2. grouped_mm (gpu_check_moe.py): CUDA's grouped GEMM accepts the flat buffer's expert
   views (MoEGPT; transformers' Qwen3-MoE if installed), forward and backward, gradients
   equal to a per-expert loop; the same weights in a compact layout are refused.
3. checkpointer (gpu_check_checkpoint.py): the async save's stall on a 1 GB-of-state
   model against one plain device-to-host copy of the same bytes and a synchronous save;
   steps during the background write against steps without one.
4. memory (gpu_check_memory.py): memory per state kind against the ZeRO formula.
5. step_time (gpu_check_step.py): the engine's step against the bare model + AdamW and
   against DeepSpeed 0.19.8 ZeRO-2 (if it imports).

Each verdict compares one figure with a limit (a derived error bound, or the issue's goal).
The report is rewritten after every check ("complete": false until the last), so a run
cut short keeps what it found.
``--cpu`` runs the same checks on the CPU with small sizes (gloo), where the CUDA-only
comparisons are marked skipped. Exit status: 0 every verdict holds, 1 some verdict fails,
2 bad arguments (no CUDA device without --cpu), 3 a check crashed.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--json gpu_check.json]
    PYTHONPATH=src python3 benchmarks/gpu_check.py --cpu --no-deepspeed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import gpu_check_checkpoint
import gpu_check_engine
import gpu_check_memory
import gpu_check_moe
import gpu_check_step
from gpu_check_common import CheckResult, Context
from zeroshard.launch import free_port, import_group_binding_modules

CHECKS = {
    "engine_equal": gpu_check_engine.run,
    "grouped_mm": gpu_check_moe.run,
    "checkpointer": gpu_check_checkpoint.run,
    "memory": gpu_check_memory.run,
    "step_time": gpu_check_step.run,  # last: DeepSpeed's NCCL collectives are the likeliest to hang
}


def init_single_rank_group(context: Context) -> None:
    """A process group of one (NCCL on a GPU, gloo on the CPU) from a FileStore; the
    variables torchrun would set are set too, for DeepSpeed."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import_group_binding_modules()
    if context.cuda:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one rank: NCCL's bootstrap needs no network
        torch.cuda.set_device(context.device)
    store = dist.FileStore(str(Path(context.workdir) / "store"), 1)
    dist.init_process_group("nccl" if context.cuda else "gloo", store=store, rank=0, world_size=1)


def run_check(name: str, context: Context) -> tuple[CheckResult, float, bool]:
    """The check's result, its wall time, and whether it crashed (then the result holds the error)."""
    start = time.perf_counter()
    try:
        result, crashed = CHECKS[name](context), False
    except Exception as err:  # noqa: BLE001 - reported in the JSON; the other checks still run
        result, crashed = CheckResult(name), True
        result.notes.append(f"crashed: {type(err).__name__}: {err}")
        result.notes.append(traceback.format_exc()[-3000:])
    return result, time.perf_counter() - start, crashed


def summary_line(result: CheckResult, seconds: float, crashed: bool) -> str:
    status = "CRASH" if crashed else ("ok" if result.ok else "FAIL")
    held = sum(v["ok"] for v in result.verdicts.values())
    parts = [f"{key}={v['value']:.4g} {v['op']} {v['limit']:.4g}{'' if v['ok'] else ' (no)'}" for key, v in result.verdicts.items()]
    if crashed:
        parts = [result.notes[0]]
    skipped = f"; skipped: {', '.join(result.skipped)}" if result.skipped else ""
    return f"{result.name:<13} {status:<5} {held}/{len(result.verdicts)} ({seconds:.1f} s): {', '.join(parts)}{skipped}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo), small sizes unless --size full")
    parser.add_argument("--size", choices=("small", "full"), help="default: full on a GPU, small with --cpu")
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the report goes")
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out of the step-time check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --cpu", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    with tempfile.TemporaryDirectory(prefix="zs-gpu-check-") as workdir:
        context = Context(device, args.size or ("small" if args.cpu else "full"), workdir, not args.no_deepspeed)
        init_single_rank_group(context)
        name = torch.cuda.get_device_name(device) if context.cuda else "cpu"
        print(f"gpu_check on {name}: torch {torch.__version__}, {dist.get_backend()} group of one, size {context.size}")
        header = {"device": name, "torch": torch.__version__, "backend": dist.get_backend(), "size": context.size}
        rows = []
        for check in args.checks:
            rows.append(run_check(check, context))
            print(summary_line(*rows[-1]), flush=True)
            report = write_report(args.json, header, rows, complete=len(rows) == len(args.checks))
        dist.destroy_process_group()
    print(f"report: {args.json}")
    if any(crashed for _, _, crashed in rows):
        return 3
    return 0 if report["ok"] else 1


def write_report(path: Path, header: dict, rows: list[tuple[CheckResult, float, bool]], complete: bool) -> dict:
    """Write the report so far (after every check: a run cut short keeps what it found)."""
    report = {
        **header,
        "complete": complete,
        "ok": all(result.ok and not crashed for result, _, crashed in rows),
        "checks": [dict(result.to_json(), seconds=seconds, crashed=crashed) for result, seconds, crashed in rows],
    }
    path.write_text(json.dumps(report, indent=1, allow_nan=False))
    return report


if __name__ == "__main__":
    sys.exit(main())
