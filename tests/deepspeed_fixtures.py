"""Real DeepSpeed ZeRO-1/2 checkpoints for the importer tests, built in the test session.

Two halves in one file:

* :func:`generate` (test process): launches this file's ranks once per world size
  (:func:`launch_ranks`) and returns a :class:`Fixture` per configuration;
* :func:`_worker_main` (each rank, ``RANK`` etc. in its environment as torchrun's): trains every
  configuration of its world size for a few steps in one process group, records DeepSpeed's
  own per-parameter accessors right before ``save_checkpoint``, saves, and on rank 0 runs
  DeepSpeed's ``zero_to_fp32`` on the result. Both references go to safetensors files.
  Then it trains ``CONTINUE_STEPS`` more steps and records their losses and learning rates,
  the reference for resuming the run elsewhere.

Every step trains on one global batch (:func:`global_batch`), split into equal row ranges
per rank (:func:`rank_rows`), so a run at another world size can see the same data.

Several configurations share one launch because starting a rank (torch and deepspeed
imports) costs more than training the tiny models. DeepSpeed runs on the CPU (gloo, bf16;
it refuses fp16 there).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TAG = "step3"
STEPS = 3
CONTINUE_STEPS = 4  # trained after the save: what a resumed run must reproduce
LAUNCH_TIMEOUT_S = 300
VOCAB, SEQ_LEN = 13, 5
GLOBAL_BATCH = 24  # rows per step, split evenly over 1, 2, 3, 4, 6 or 8 ranks
BASE_LR, NO_DECAY_LR, BETAS, CLIP = 1e-3, 2e-3, (0.9, 0.95), 1.0
SCHEDULE = {"total_num_steps": 20, "warmup_num_steps": 2, "warmup_min_ratio": 0.1}


@dataclass(frozen=True)
class FixtureConfig:
    """One DeepSpeed run."""

    name: str
    world_size: int
    stage: int
    parameter_alignment: bool
    round_robin: bool = False
    tiny_no_decay: bool = False  # the no-decay group is one 3-element bias: padding on most ranks


CONFIGS: tuple[FixtureConfig, ...] = (
    FixtureConfig("w1_s1", 1, 1, False),
    FixtureConfig("w1_s2_align", 1, 2, True),
    FixtureConfig("w2_s1_align", 2, 1, True),
    FixtureConfig("w2_s2", 2, 2, False),
    FixtureConfig("w2_s2_align_rr", 2, 2, True, round_robin=True),
    FixtureConfig("w4_s1", 4, 1, False),
    FixtureConfig("w4_s2_align", 4, 2, True),
    FixtureConfig("w8_s2_align_tiny", 8, 2, True, tiny_no_decay=True),
    FixtureConfig("w8_s1_tiny", 8, 1, False, tiny_no_decay=True),
)


@dataclass(frozen=True)
class Fixture:
    """Where one configuration's outputs are."""

    config: FixtureConfig
    save_dir: Path  # holds `latest` and the tag folder
    tag_dir: Path
    accessors: Path  # safetensors: "fp32/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"
    zero_to_fp32: Path  # safetensors: DeepSpeed's consolidated fp32 state dict
    continued: Path  # json: "losses" and "lrs" (per param group) of the steps after the save

    def live_layout(self, rank: int) -> dict:
        """DeepSpeed's in-memory layout on ``rank`` during the run: per group the flat order,
        parameter offsets and paddings, partition size and this rank's tail padding."""
        return json.loads((self.save_dir.parent / f"live_layout_rank{rank}.json").read_text())


def fixture_paths(config: FixtureConfig, root: Path) -> Fixture:
    base = root / config.name
    return Fixture(
        config,
        base / "ckpt",
        base / "ckpt" / TAG,
        base / "accessors.safetensors",
        base / "zero_to_fp32.safetensors",
        base / "continued.json",
    )


def deepspeed_universal_folder(run: Fixture, root: Path) -> Path:
    """What DeepSpeed's ds_to_universal writes (deepspeed/checkpoint/ds_to_universal.py): per
    parameter a folder of .pt files under zero/, the model-states file copied beside it, and
    latest_universal in the parent. Only the names matter: zeroshard refuses it by name."""
    folder = root / "step3_universal"
    for name in ("fc1.weight", "fc1.bias"):
        (folder / "zero" / name).mkdir(parents=True)
        for state in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            (folder / "zero" / name / f"{state}.pt").write_bytes(b"")
    (folder / "zero" / "optimizer_state.pt").write_bytes(b"")
    shutil.copy(run.tag_dir / "mp_rank_00_model_states.pt", folder)
    (root / "latest_universal").write_text(folder.name)
    return folder


def global_batch(step: int):
    """(tokens, targets) of training step ``step`` (from 0), all ranks' rows together."""
    import torch

    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1000 + step))
    return tokens, torch.roll(tokens, 1, dims=1)


def rank_rows(batch, rank: int, world_size: int):
    """This rank's equal share of a global batch."""
    rows = GLOBAL_BATCH // world_size
    return tuple(tensor[rank * rows : (rank + 1) * rows] for tensor in batch)


def warmup_cosine_lr(base_lr: float, iteration: int) -> float:
    """The lr DeepSpeed's WarmupCosineLR (log warmup, the SCHEDULE above) sets for
    ``iteration``, the same float arithmetic as deepspeed/runtime/lr_schedules.py."""
    warmup, total, floor = SCHEDULE["warmup_num_steps"], SCHEDULE["total_num_steps"], 1e-4
    if iteration < warmup:
        ratio = 1.0 / math.log(warmup) * math.log(iteration + 1)
        return base_lr * (SCHEDULE["warmup_min_ratio"] + ratio * (1.0 - SCHEDULE["warmup_min_ratio"]))
    progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
    return base_lr * max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)


# ---- test-process side -----------------------------------------------------------------


# Runs already generated in this process, by configuration: several test modules share one
# pytest session, and the runs are read-only inputs, so they are built once.
_GENERATED: dict[FixtureConfig, Fixture] = {}


def generate(root: Path, configs: tuple[FixtureConfig, ...] = CONFIGS) -> dict[str, Fixture]:
    """Run DeepSpeed for every configuration not yet run in this process (a job per world
    size, side by side) under ``root``; earlier runs are returned where they were made."""
    root.mkdir(parents=True, exist_ok=True)
    missing = [config for config in configs if config not in _GENERATED]
    jobs = job_specs(root, missing, "configs")
    if jobs:
        launch_ranks(Path(__file__), root, jobs, what="DeepSpeed fixture launch")
    _GENERATED.update({config: fixture_paths(config, root) for config in missing})
    return {config.name: _GENERATED[config] for config in configs}


def job_specs(root: Path, configs: list, prefix: str) -> dict[int, Path]:
    """A job per world size of ``configs`` (dataclasses with a ``world_size``): its spec file,
    ``ROOT/PREFIX_wN.json``, listing the configurations its ranks run."""
    jobs = {}
    for world_size in sorted({config.world_size for config in configs}):
        batch = [asdict(config) for config in configs if config.world_size == world_size]
        jobs[world_size] = root / f"{prefix}_w{world_size}.json"
        jobs[world_size].write_text(json.dumps(batch))
    return jobs


def launch_ranks(
    script: Path,
    root: Path,
    jobs: dict[int, Path],
    *,
    what: str,
    env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
) -> None:
    """``script``'s ``_worker_main(ROOT, SPEC)`` on CPU ranks, for each world size -> SPEC of
    ``jobs``: every job's ranks side by side, forked from one process that imported torch,
    DeepSpeed and ``preload`` once (tests/forked_ranks.py); the log goes to ROOT. A job
    counts as done when every rank of it wrote its finished marker (see _worker_main)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    spelled = ",".join(f"{world_size}:{_free_port()}:{spec}" for world_size, spec in jobs.items())
    command = [sys.executable, str(Path(__file__).with_name("forked_ranks.py")), str(script), str(root), spelled, *preload]
    sizes = ", ".join(str(world_size) for world_size in jobs)
    started = time.perf_counter()
    # A session of its own: a launch that times out is killed with every rank it forked.
    launch = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launch.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()
        raise RuntimeError(f"{what} (world sizes {sizes}) timed out after {LAUNCH_TIMEOUT_S} s") from err
    finished = all(finished_marker(root, size, rank).is_file() for size in jobs for rank in range(size))
    if launch.returncode != 0 and not finished:
        raise RuntimeError(
            f"{what} (world sizes {sizes}) failed with exit code {launch.returncode}:\n{stdout[-4000:]}\n{stderr[-8000:]}"
        )
    note = "" if launch.returncode == 0 else f"exit code {launch.returncode} after every rank finished: ignored\n"
    name = "launch_w" + "_w".join(str(size) for size in jobs)
    (root / f"{name}.log").write_text(f"{time.perf_counter() - started:.1f} s\n{note}{stdout}\n{stderr}")


def finished_marker(root: Path, world_size: int, rank: int) -> Path:
    """Written by a rank once every run of its launch is saved and every rank has got there."""
    return root / f"finished_w{world_size}_rank{rank}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- rank side ------------------------------------------------------------------------------


def build_model(tiny_no_decay: bool):
    import torch
    from torch import nn

    class FixtureModel(nn.Module):
        """Odd sizes (padding everywhere), a tied head, a frozen layer, a 0-element parameter
        and a buffer. ``tiny_no_decay``: the only no-decay parameter is a 3-element bias."""

        def __init__(self) -> None:
            super().__init__()
            vocab, hidden = VOCAB, 6
            self.embed = nn.Embedding(vocab, hidden)
            self.fc1 = nn.Linear(hidden, 3 if tiny_no_decay else 7, bias=True)
            self.norm = nn.Identity() if tiny_no_decay else nn.LayerNorm(7)
            self.fc2 = nn.Linear(self.fc1.out_features, hidden, bias=not tiny_no_decay)
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.embed.weight
            self.frozen = nn.Linear(hidden, 3)
            self.frozen.requires_grad_(False)
            self.empty = nn.Parameter(torch.empty(0))
            self.register_buffer("position_scale", torch.linspace(0.5, 1.5, hidden))

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) * self.position_scale.to(self.embed.weight.dtype)
            x = x + self.frozen(x).sum(-1, keepdim=True)
            x = self.fc2(torch.relu(self.norm(self.fc1(x))))
            logits = self.head(x).float()
            return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    return FixtureModel()


def param_groups(model) -> list[dict]:
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [p for name, p in trainable if p.dim() >= 2]
    no_decay = [p for name, p in trainable if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": NO_DECAY_LR},
    ]


def _ds_config(config: FixtureConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // config.world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": BASE_LR, "betas": list(BETAS), "torch_adam": True}},
        # Scales each group's own lr, so the two groups keep different ones.
        "scheduler": {"type": "WarmupCosineLR", "params": dict(SCHEDULE)},
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "zero_optimization": {
            "stage": config.stage,
            "parameter_alignment": config.parameter_alignment,
            "round_robin_gradients": config.round_robin,
        },
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def _run_config(config: FixtureConfig, root: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    paths = fixture_paths(config, root)
    rank = dist.get_rank()
    model = build_model(config.tiny_no_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=_ds_config(config))
    _record_live_layout(engine, paths.save_dir.parent / f"live_layout_rank{rank}.json")
    for step in range(STEPS):
        _train_step(engine, step)

    # DeepSpeed 0.19.8 links the per-parameter optimizer-state views once, right after the
    # first group's first step, before torch's AdamW has created the later groups' state:
    # safe_get_full_optimizer_state then fails for every group but the first. Link again.
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    references: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad or param.numel() == 0:
            continue
        # Collectives: every rank calls them in the same order.
        references[f"fp32/{name}"] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            references[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    engine.save_checkpoint(str(paths.save_dir), tag=TAG)
    dist.barrier()
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        save_file(references, str(paths.accessors))
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(paths.save_dir), tag=TAG)
        save_file(
            {name: tensor.detach().clone().contiguous() for name, tensor in consolidated.items()},
            str(paths.zero_to_fp32),
        )
    dist.barrier()
    continued = {"losses": [], "lrs": []}
    for step in range(STEPS, STEPS + CONTINUE_STEPS):
        continued["lrs"].append([group["lr"] for group in engine.optimizer.param_groups])
        continued["losses"].append(_train_step(engine, step))
    if rank == 0:
        paths.continued.write_text(json.dumps(continued))
    engine.destroy()


def _train_step(engine, step: int) -> float:
    """One step on this rank's rows of the global batch; returns the global mean loss."""
    import torch.distributed as dist

    tokens, targets = rank_rows(global_batch(step), dist.get_rank(), dist.get_world_size())
    loss = engine(tokens, targets)
    engine.backward(loss)
    engine.step()
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _record_live_layout(engine, path: Path) -> None:
    optimizer = engine.optimizer  # DeepSpeedZeroOptimizer; private attributes, read for the test only
    live = {
        "optimizer": type(optimizer).__name__,
        "order": [[engine.param_names[p] for p in group] for group in optimizer.round_robin_bit16_groups],
        "offsets": [[int(o) for o in group] for group in optimizer.round_robin_bit16_offsets],
        "paddings": [[int(p) for p in group] for group in optimizer.round_robin_bit16_padding],
        "partition_size": [int(size) for size in optimizer.partition_size],
        "groups_padding": [int(p) for p in optimizer.groups_padding],
        "flat_numel": [int(flat.numel()) for flat in optimizer.bit16_groups_flat],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(live))


def _worker_main(root: Path, spec: Path) -> None:
    init_cpu_distributed()
    for entry in json.loads(spec.read_text()):
        _run_config(FixtureConfig(**entry), root)
    finish_worker(root)


def init_cpu_distributed() -> None:
    """DeepSpeed's process group on gloo, in a fixture rank."""
    import importlib

    import deepspeed

    # The shared-memory all-reduce extension would be compiled with g++ on first use (~40 s);
    # gloo does everything these runs need. (``deepspeed.comm.torch`` as an attribute is the
    # torch package, re-exported; the submodule has to be fetched by name.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def finish_worker(root: Path) -> None:
    """Mark this rank finished once every rank got here, and leave (never returns)."""
    import deepspeed

    deepspeed.comm.barrier()
    rank, world_size = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    finished_marker(root, world_size, rank).write_text("")
    # Teardown of the gloo groups sometimes aborted a rank after all the work was done
    # ("terminate called without an active exception"; seen 3 times in some 25 launches under
    # load once the continued steps were added, never in 40 launches run for it). Destroy the groups
    # and leave without the interpreter's own teardown; the launcher also accepts an exit
    # code when every rank wrote its marker.
    deepspeed.comm.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main(Path(sys.argv[1]), Path(sys.argv[2]))
