"""zeroshard's expert parallelism against DeepSpeed AutoEP on the transformers Qwen3-MoE: step
time and bytes per step at W = 4, EP = 2, ZeRO stage 2, same model, weights and data.

The model is ``hf_moe_step.py``'s (8 experts, top-2, hidden 128, 2 layers, ``grouped_mm``
experts), its batches (8 sequences of 64 tokens per rank, each rank its own), bf16
parameters with fp32 masters, torch's AdamW with the hyperparameters of the AutoEP fixtures
(``tests/autoep_fixtures.py``: lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on every
parameter, clipping at 1.0). Every run starts from one set of initial weights (seeded,
written once by this process and loaded by every rank of every job).

DeepSpeed 0.19.8's AutoEP (``"expert_parallel": {"enabled": true, "autoep_size": 2,
"preset_model": "qwen3_moe"}``, which swaps each MoE block for its own, experts run by
``torch._grouped_mm``) trains only under transformers 5.9.0 (``.side/transformers-5.9``), so
its side runs in a torchrun job with that folder on PYTHONPATH. zeroshard's
``expert_parallel`` runs under 5.9.0 too, so that job also trains zeroshard on the same model
code, in the same process group, step by step in a rotating order (load on the machine hits
both alike): stage 2 reducing in fp32 (the default) and in bf16 (as DeepSpeed does). A second
job trains zeroshard (fp32 reduction) under the main environment's transformers. The two jobs
alternate for ``--rounds`` rounds; each job runs ``--warmup`` untimed steps, then ``--steps``
timed ones.

Per variant: the median over ranks and timed steps of the step time (forward, backward,
step), against DeepSpeed's of the same job (the main-environment job against the DeepSpeed
medians of all rounds: a ratio across jobs); bytes each rank writes per step (``wchar`` of
/proc/self/io, gloo's sockets; nothing else writes during a step) against DeepSpeed's, and
for zeroshard its collectives' payloads per kind (all-to-all: token rows and counts sent to
the other EP rank; reduce-scatter, all-gather: the engine's) against the minimum, as
``hf_moe_step.py`` counts it (the routed rows whose expert is on the other EP rank, four
times; the gradient and parameters of the rank's dense and E/EP experts). As a sanity figure (no check),
the largest relative difference of each variant's per-rank losses from DeepSpeed's at the
first step (same weights and data: only the forward's arithmetic differs) and over all of a
job's steps (the updates' rounding adds up).

    .venv/bin/python benchmarks/autoep_step.py [--rounds 2] [--steps 10] [--warmup 3]

Needs ``.side/transformers-5.9`` (``scripts/setup.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the AutoEP fixtures' launch helpers

from autoep_fixtures import (  # noqa: E402
    BASE_LR, BETAS, CLIP, TRANSFORMERS_DIR, WEIGHT_DECAY, AutoEPConfig, ds_config, transformers_ready,
)  # fmt: skip
from deepspeed_fixtures import finish_worker, init_cpu_distributed  # noqa: E402
from engine_vs_deepspeed import _written  # noqa: E402
from torchrun_job import run_for_json, write_gathered  # noqa: E402

WORLD_SIZE, EP = 4, 2
SIDE_JOB = ("deepspeed autoep", "zeroshard", "zeroshard bf16-reduce")  # under transformers 5.9.0
MAIN_JOB = ("zeroshard (main env)",)


# ---- worker (one rank under torchrun) ----------------------------------------------------------


def _model(weights: Path):
    import torch
    from hf_moe_step import CONFIG
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model


class DeepSpeedRun:
    """DeepSpeed AutoEP at EP = 2, ZeRO stage 2, as the fixtures configure it."""

    def __init__(self, weights: Path) -> None:
        import deepspeed
        from hf_moe_step import BATCH_SIZE

        model = _model(weights)
        config = {**ds_config(AutoEPConfig("bench", WORLD_SIZE, 2, EP)), "train_micro_batch_size_per_gpu": BATCH_SIZE}
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)

    def forward(self, ids):
        return self.engine(input_ids=ids, labels=ids).loss

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def payload(self) -> Counter:
        return Counter()

    def minimum(self, ids) -> Counter:
        return Counter()


class ZeroshardRun:
    """``expert_parallel`` on the unmodified model, ZeroOptimizer stage 2."""

    def __init__(self, weights: Path, reduce_dtype) -> None:
        import torch

        from zeroshard.engine import ZeroOptimizer
        from zeroshard.moe import expert_parallel, moe_param_groups, new_expert_groups

        groups = new_expert_groups(EP)
        self.model = _model(weights)
        expert_parallel(self.model, groups)
        self.engine = ZeroOptimizer(
            self.model, torch.optim.AdamW, moe_param_groups(self.model), stage=2, param_dtype=torch.bfloat16,
            reduce_dtype=reduce_dtype, expert_process_group=groups.expert_dp, max_grad_norm=CLIP, lr=BASE_LR,
            betas=BETAS, weight_decay=WEIGHT_DECAY,
        )  # fmt: skip
        held = sum(group.param_numel for group in self.engine.layout.groups)  # dense + E/EP experts, no padding
        reduce_bytes = (reduce_dtype or torch.float32).itemsize
        self.least = Counter({"reduce_scatter": reduce_bytes * held, "all_gather": 2 * held})

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()
        self.engine.zero_grad()

    def payload(self) -> Counter:
        """Bytes the engine's collectives and the MoE dispatch have sent so far, per kind."""
        from moe_step import _sent

        moved = Counter({"all_to_all": _sent["rows"] + _sent["counts"]})
        for comm in self.engine.comms.values():
            moved.update({kind: count for kind, count in comm.bytes_moved.items() if kind != "all_to_all"})
        return moved

    def minimum(self, ids) -> Counter:
        """The least each collective must carry this step: the gradient and parameters the rank
        holds, and each routed row whose expert is on the other EP rank four times (dispatch,
        combine, their gradients; bf16 rows)."""
        from hf_moe_step import CONFIG, off_rank_rows

        rows = off_rank_rows(self.model, ids)
        return self.least + Counter({"all_to_all": 4 * rows * 2 * CONFIG["hidden_size"]})


def _build(name: str, weights: Path):
    import torch

    if name == "deepspeed autoep":
        return DeepSpeedRun(weights)
    return ZeroshardRun(weights, torch.bfloat16 if "bf16" in name else torch.float32)


def _timed_step(run, ids) -> dict:
    import torch.distributed as dist
    from moe_step import counting_dispatch

    least = run.minimum(ids)
    dist.barrier()
    before, written = run.payload(), _written()
    start = time.perf_counter()
    with counting_dispatch():
        loss = run.forward(ids)
        forward_done = time.perf_counter()
        run.backward(loss)
    backward_done = time.perf_counter()
    run.step()
    done = time.perf_counter()
    payload = run.payload()
    payload.subtract(before)
    return {
        "forward": forward_done - start,
        "backward": backward_done - forward_done,
        "step": done - backward_done,
        "total": done - start,
        "wire_bytes": _written() - written,
        "payload": dict(payload),
        "minimum": dict(least),
        "loss": float(loss),
    }


def worker(out: Path, names: list[str], weights: Path, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from hf_moe_step import batch

    torch.set_num_threads(1)
    init_cpu_distributed()
    rank = dist.get_rank()
    runs = {name: _build(name, weights) for name in names}
    records: dict[str, list[dict]] = {name: [] for name in names}
    for step in range(warmup + steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            records[name].append({**_timed_step(runs[name], batch(step, rank)), "timed": step >= warmup})
    write_gathered(out, records, transformers=transformers.__version__)
    finish_worker(out.parent)


# ---- launcher and report --------------------------------------------------------------------------


def write_weights(path: Path) -> str:
    """The initial weights every run loads (seed 0, this environment's transformers)."""
    import torch
    import transformers
    from hf_moe_step import CONFIG
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))
    return transformers.__version__


def launch(folder: Path, job: int, names: tuple[str, ...], weights: Path, args, side: bool) -> dict:
    out = folder / f"job{job}" / "result.json"
    out.parent.mkdir()
    env = {"DS_ACCELERATOR": "cpu"}
    if side:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRANSFORMERS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    command = ["--worker", str(out), "--names", *names, "--weights", str(weights)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    return run_for_json(__file__, WORLD_SIZE, command, out, timeout=1800, **env)


def _records(results: list[dict], name: str) -> list[dict]:
    """Every timed step's record of ``name``, all ranks and jobs."""
    return [r for result in results for records in result["ranks"] for r in records[name] if r["timed"]]


def _median(results: list[dict], name: str, key: str) -> float:
    return statistics.median(r[key] for r in _records(results, name))


def _bytes(results: list[dict], name: str, kind: str) -> str:
    """The median payload of ``kind`` per step, and its mean over the mean minimum."""
    records = _records(results, name)
    payload = statistics.median(r["payload"].get(kind, 0) for r in records)
    least = statistics.mean(r["minimum"][kind] for r in records)
    ratio = statistics.mean(r["payload"].get(kind, 0) for r in records) / least
    return f"{payload / 1e3:>10.1f}{ratio:>7.3f}x"


def loss_difference(reference: dict, result: dict, name: str, steps: slice) -> float:
    """Largest |loss - DeepSpeed's| / DeepSpeed's over the ranks and ``steps`` (``reference``:
    a job that ran DeepSpeed, on the same weights and data)."""
    return max(
        abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"])
        for ours, others in zip(result["ranks"], reference["ranks"])
        for mine, theirs in zip(ours[name][steps], others[SIDE_JOB[0]][steps])
    )


def report(side: list[dict], main: list[dict], weights_version: str) -> None:
    print(f"medians over ranks and timed steps; initial weights written under transformers {weights_version}")
    header = (
        f"{'variant':<22}{'transformers':>13}{'total ms':>10}{'fwd ms':>8}{'bwd ms':>8}{'step ms':>8}{'vs DS':>7}"
        f"{'wire kB':>9}{'vs DS':>7}{'a2a kB':>10}{'vs min':>8}{'r-s kB':>10}{'vs min':>8}{'a-g kB':>10}{'vs min':>8}"
        f"{'loss 1st':>10}{'loss max':>10}"
    )
    print(header)
    print("-" * len(header))
    ds_total, ds_wire = _median(side, SIDE_JOB[0], "total"), _median(side, SIDE_JOB[0], "wire_bytes")
    for names, results in ((SIDE_JOB, side), (MAIN_JOB, main)):
        for name in names:
            total, wire = _median(results, name, "total"), _median(results, name, "wire_bytes")
            zeroshard = name != SIDE_JOB[0]
            kinds = ("all_to_all", "reduce_scatter", "all_gather")
            payload = "".join(_bytes(results, name, kind) for kind in kinds) if zeroshard else f"{'-':>10}{'':>8}" * 3
            loss = "".join(
                f"{loss_difference(side[0], results[0], name, steps):>10.2e}" if zeroshard else f"{'-':>10}"
                for steps in (slice(0, 1), slice(None))
            )
            print(
                f"{name:<22}{results[0]['transformers']:>13}{1e3 * total:>10.1f}"
                f"{1e3 * _median(results, name, 'forward'):>8.1f}{1e3 * _median(results, name, 'backward'):>8.1f}"
                f"{1e3 * _median(results, name, 'step'):>8.1f}{total / ds_total:>7.3f}{wire / 1e3:>9.1f}"
                f"{wire / ds_wire:>7.3f}{payload}{loss}"
            )
    per_round = [_median([result], SIDE_JOB[1], "total") / _median([result], SIDE_JOB[0], "total") for result in side]
    print("zeroshard / DeepSpeed step time per round (same job): " + ", ".join(f"{r:.3f}" for r in per_round))
    print(
        "loss 1st / max: largest relative difference from DeepSpeed's per-rank losses (first job) at the first step "
        "and over all steps; payloads: zeroshard's collectives (mean over the minimum's mean)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs both jobs, in alternating order")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--names", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.names, args.weights, args.steps, args.warmup)
        return
    if not transformers_ready():
        raise SystemExit(f"{TRANSFORMERS_DIR} holds no transformers 5.9.0 for DeepSpeed AutoEP (run scripts/setup.sh)")
    from hf_moe_step import BATCH_SIZE, CONFIG, SEQ

    print(
        f"transformers Qwen3MoeForCausalLM {CONFIG}\nW={WORLD_SIZE}, EP={EP}, ZeRO stage 2, bf16 parameters, AdamW "
        f"lr {BASE_LR} betas {BETAS} wd {WEIGHT_DECAY}, clip {CLIP}; batch {BATCH_SIZE}x{SEQ} per rank; gloo, 1 thread "
        f"per rank; {args.rounds} rounds, each job {args.warmup} warm-up + {args.steps} timed steps"
    )
    start = time.perf_counter()
    side, main_env = [], []
    with tempfile.TemporaryDirectory() as folder:
        weights = Path(folder) / "initial.safetensors"
        weights_version = write_weights(weights)
        for round_index in range(args.rounds):
            jobs = [(SIDE_JOB, True), (MAIN_JOB, False)]
            for names, in_side in jobs if round_index % 2 == 0 else jobs[::-1]:
                result = launch(Path(folder), len(side) + len(main_env), names, weights, args, in_side)
                (side if in_side else main_env).append(result)
                medians = ", ".join(f"{name} {1e3 * _median([result], name, 'total'):.1f} ms" for name in names)
                print(f"  job done at {time.perf_counter() - start:.0f} s: {medians}", flush=True)
    report(side, main_env, weights_version)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
