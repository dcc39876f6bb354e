"""Real DeepSpeed ZeRO-1/2 checkpoints for the importer tests, built in the test session.

Two halves in one file:

* :func:`generate` (test process): launches this file with torchrun once per world size and
  returns a :class:`Fixture` per configuration;
* :func:`_worker_main` (torchrun workers, ``python deepspeed_fixtures.py OUT``): trains every
  configuration of its world size for a few steps in one process group, records DeepSpeed's
  own per-parameter accessors right before ``save_checkpoint``, saves, and on rank 0 runs
  DeepSpeed's ``zero_to_fp32`` on the result. Both references go to safetensors files.

Several configurations share one launch because starting a rank (torch and deepspeed
imports) costs more than training the tiny models. DeepSpeed runs on the CPU (gloo, bf16;
it refuses fp16 there).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TAG = "step3"
STEPS = 3
LAUNCH_TIMEOUT_S = 300


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

    def live_layout(self, rank: int) -> dict:
        """DeepSpeed's in-memory layout on ``rank`` during the run: per group the flat order,
        parameter offsets and paddings, partition size and this rank's tail padding."""
        return json.loads((self.save_dir.parent / f"live_layout_rank{rank}.json").read_text())


def fixture_paths(config: FixtureConfig, root: Path) -> Fixture:
    base = root / config.name
    return Fixture(
        config, base / "ckpt", base / "ckpt" / TAG, base / "accessors.safetensors", base / "zero_to_fp32.safetensors"
    )


# ---- test-process side -----------------------------------------------------------------


def generate(root: Path, configs: tuple[FixtureConfig, ...] = CONFIGS) -> dict[str, Fixture]:
    """Run DeepSpeed for every configuration; one torchrun launch per world size."""
    root.mkdir(parents=True, exist_ok=True)
    for world_size in sorted({config.world_size for config in configs}):
        batch = [config for config in configs if config.world_size == world_size]
        _launch(root, world_size, batch)
    return {config.name: fixture_paths(config, root) for config in configs}


def _launch(root: Path, world_size: int, configs: list[FixtureConfig]) -> None:
    spec = root / f"configs_w{world_size}.json"
    spec.write_text(json.dumps([asdict(config) for config in configs]))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, str(root), str(spec),
    ]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(
            f"DeepSpeed fixture launch (world size {world_size}) timed out after {LAUNCH_TIMEOUT_S} s"
        ) from err
    if done.returncode != 0:
        raise RuntimeError(
            f"DeepSpeed fixture launch (world size {world_size}) failed with exit code {done.returncode}:\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    (root / f"launch_w{world_size}.log").write_text(
        f"{time.perf_counter() - started:.1f} s\n{done.stdout}\n{done.stderr}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- torchrun worker side ------------------------------------------------------------------


def _build_model(tiny_no_decay: bool):
    import torch
    from torch import nn

    class FixtureModel(nn.Module):
        """Odd sizes (padding everywhere), a tied head, a frozen layer, a 0-element parameter
        and a buffer. ``tiny_no_decay``: the only no-decay parameter is a 3-element bias."""

        def __init__(self) -> None:
            super().__init__()
            vocab, hidden = 13, 6
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


def _param_groups(model) -> list[dict]:
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [p for name, p in trainable if p.dim() >= 2]
    no_decay = [p for name, p in trainable if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3},
    ]


def _ds_config(config: FixtureConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True}},
        # Scales each group's own lr, so the two groups keep different ones.
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 20, "warmup_num_steps": 2, "warmup_min_ratio": 0.1},
        },
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
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
    model = _build_model(config.tiny_no_decay)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=_param_groups(model), config=_ds_config(config)
    )
    _record_live_layout(engine, paths.save_dir.parent / f"live_layout_rank{rank}.json")
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, 13, (4, 5), generator=generator)
        loss = engine(tokens, torch.roll(tokens, 1, dims=1))
        engine.backward(loss)
        engine.step()

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
    engine.destroy()


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
    import importlib

    import deepspeed

    # The shared-memory all-reduce extension would be compiled with g++ on first use (~40 s);
    # gloo does everything these runs need. (``deepspeed.comm.torch`` as an attribute is the
    # torch package, re-exported; the submodule has to be fetched by name.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for entry in json.loads(spec.read_text()):
        _run_config(FixtureConfig(**entry), root)


if __name__ == "__main__":
    _worker_main(Path(sys.argv[1]), Path(sys.argv[2]))
