"""Real DeepSpeed ZeRO-1/2 Muon checkpoints (``MuonWithAuxAdam``), built in the test session.

As :mod:`deepspeed_fixtures` (whose launcher and worker set-up this reuses): :func:`generate`
launches this file's ranks once per world size; the ranks train every configuration
of their world size for a few steps with DeepSpeed's ``"optimizer": {"type": "Muon"}``, record
what DeepSpeed holds in memory right before ``save_checkpoint``, save, and on rank 0 run
DeepSpeed's own ``ds_to_universal`` on the result and record how it fails.

DeepSpeed 0.19.8 tags every parameter with ``use_muon`` in ``deepspeed.initialize``: true for
a parameter of two or more dimensions whose name holds neither "embed" nor "lm_head". It then
splits the parameters into a Muon group and an Adam group (torch's AdamW with ``torch_adam``).
The model here gives the Muon group three odd-sized matrices, so that at D = 2 one of them lies
across the partition boundary, and the Adam group the embedding (2-D, kept off Muon by its
name), biases and a norm.

DeepSpeed runs these (bf16, stage 1 or 2) with its ``DeepSpeedZeroOptimizer``, which keeps
the Muon group's ``momentum_buffer`` in a layout of its own: not the partition's (as exp_avg
is), but the momentum of every matrix that has a piece in the partition, whole, back to back
in flat order, in the gradients' dtype (bf16). A matrix split across partitions is held whole
by each of its owners.

What DeepSpeed holds in memory right before the save is the reference: the fp32 masters with
``safe_get_full_fp32_param``, the Adam states with ``safe_get_full_optimizer_state``, and the
momentum of each matrix from the buffer of the first rank that holds it (DeepSpeed's accessors
map optimizer state with the partition's layout, which is not the momentum's), with whether
the other owners hold the same bits.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from deepspeed_fixtures import (
    GLOBAL_BATCH,
    VOCAB,
    finish_worker,
    global_batch,
    init_cpu_distributed,
    job_specs,
    launch_ranks,
    rank_rows,
)

TAG = "step3"
STEPS = 3
# Imported once before the ranks fork: DeepSpeed's Muon pulls in torch.compile (5 s a rank).
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer",)
MUON_LR, ADAM_LR, MOMENTUM, WEIGHT_DECAY, BETAS, CLIP = 2e-2, 1e-3, 0.95, 0.1, (0.9, 0.95), 1.0
MUON_PARAMS = ("fc1.weight", "fc2.weight", "fc3.weight")  # the parameters DeepSpeed puts on Muon
ADAM_PARAMS = ("embed.weight", "fc1.bias", "norm.weight", "norm.bias", "fc3.bias")


@dataclass(frozen=True)
class MuonConfig:
    """One DeepSpeed Muon run."""

    name: str
    world_size: int
    stage: int
    parameter_alignment: bool = False


CONFIGS: tuple[MuonConfig, ...] = (
    MuonConfig("muon_w1_s1", 1, 1),
    MuonConfig("muon_w1_s2", 1, 2),
    MuonConfig("muon_w2_s1", 2, 1),
    MuonConfig("muon_w2_s2", 2, 2),
    MuonConfig("muon_w2_s2_align", 2, 2, parameter_alignment=True),
)


@dataclass(frozen=True)
class MuonFixture:
    """Where one configuration's outputs are."""

    config: MuonConfig
    save_dir: Path  # holds `latest` and the tag folder
    tag_dir: Path
    accessors: Path  # safetensors: "fp32/<name>", "momentum_buffer/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"
    record: Path  # json: ds_to_universal's error, the optimizer classes, each rank's partition

    def recorded(self) -> dict:
        """What the run wrote down besides the tensors (see :func:`_run_config`)."""
        return json.loads(self.record.read_text())


def fixture_paths(config: MuonConfig, root: Path) -> MuonFixture:
    base = root / config.name
    return MuonFixture(
        config, base / "ckpt", base / "ckpt" / TAG, base / "accessors.safetensors", base / "record.json"
    )


# ---- test-process side -----------------------------------------------------------------

_GENERATED: dict[MuonConfig, MuonFixture] = {}


def generate(root: Path, configs: tuple[MuonConfig, ...] = CONFIGS) -> dict[str, MuonFixture]:
    """Run DeepSpeed Muon for every configuration not yet run in this process (a job per
    world size, side by side) under ``root``; earlier runs are returned where they were made."""
    root.mkdir(parents=True, exist_ok=True)
    missing = [config for config in configs if config not in _GENERATED]
    jobs = job_specs(root, missing, "muon_configs")
    if jobs:
        # DeepSpeed's Muon compiles its Newton-Schulz iteration with torch.compile at the first
        # step (6 s a rank here): these runs take it eagerly, the same algorithm; the tests
        # compare with what the runs themselves held, recorded before each save.
        env = {"TORCH_COMPILE_DISABLE": "1"}
        launch_ranks(Path(__file__), root, jobs, what="DeepSpeed Muon fixture launch", env=env, preload=MUON_MODULES)
    _GENERATED.update({config: fixture_paths(config, root) for config in missing})
    return {config.name: _GENERATED[config] for config in configs}


# ---- rank side ------------------------------------------------------------------------------


def build_model():
    """Embedding (tied head), three matrices of 30, 35 and 42 elements, biases, a norm, a buffer."""
    import torch
    from torch import nn

    class MuonFixtureModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hidden = 6
            self.embed = nn.Embedding(VOCAB, hidden)
            self.fc1 = nn.Linear(hidden, 5)
            self.norm = nn.LayerNorm(5)
            self.fc2 = nn.Linear(5, 7, bias=False)
            self.fc3 = nn.Linear(7, hidden)
            self.head = nn.Linear(hidden, VOCAB, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("position_scale", torch.linspace(0.5, 1.5, hidden))

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) * self.position_scale.to(self.embed.weight.dtype)
            x = self.fc3(torch.relu(self.fc2(self.norm(self.fc1(x)))))
            logits = self.head(x).float()
            return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    return MuonFixtureModel()


def ds_config(config: MuonConfig) -> dict:
    """The DeepSpeed config of one run: Muon with torch's AdamW beside it, bf16, clipping."""
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // config.world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": MUON_LR,
                "adam_lr": ADAM_LR,
                "momentum": MOMENTUM,
                "weight_decay": WEIGHT_DECAY,
                "betas": list(BETAS),
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": config.stage, "parameter_alignment": config.parameter_alignment},
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def _run_config(config: MuonConfig, root: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    paths = fixture_paths(config, root)
    rank = dist.get_rank()
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(config))
    for step in range(STEPS):
        tokens, targets = rank_rows(global_batch(step), rank, dist.get_world_size())
        engine.backward(engine(tokens, targets))
        engine.step()
    references, copies = _references(engine)
    engine.save_checkpoint(str(paths.save_dir), tag=TAG)
    dist.barrier()
    if rank == 0:
        save_file(references, str(paths.accessors))
        record = {
            "optimizer": type(engine.optimizer).__name__,
            "base_optimizer": type(engine.optimizer.optimizer).__name__,
            "split_matrices": copies,
            "ds_to_universal": _try_ds_to_universal(paths),
        }
        paths.record.write_text(json.dumps(record))
    dist.barrier()
    engine.destroy()


def _references(engine) -> tuple[dict, dict]:
    """Every trained parameter's fp32 master and optimizer state as DeepSpeed holds them, and
    whether the owners of a split matrix hold the same momentum for it (collectives: every
    rank calls this)."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    # The per-parameter views are linked after the first group's first step (see deepspeed_fixtures).
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
    references: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad or param.numel() == 0:
            continue
        references[f"fp32/{name}"] = safe_get_full_fp32_param(param).detach().cpu().clone()
        if not param.use_muon:
            for key in ("exp_avg", "exp_avg_sq"):
                references[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    copies_equal = {}
    for name, (param, held) in sorted(_momentum_held(engine).items()):
        # Each rank's copy (zeros where it holds none) in its own row, then every rank has all.
        rows = torch.zeros(world_size, param.numel(), dtype=torch.float32)
        holders = torch.zeros(world_size, dtype=torch.int32)
        if held is not None:
            rows[rank] = held.float().reshape(-1)
            holders[rank] = 1
        dist.all_reduce(rows)
        dist.all_reduce(holders)
        owners = [r for r in range(world_size) if holders[r]]
        references[f"momentum_buffer/{name}"] = rows[owners[0]].reshape(param.shape).clone()
        copies_equal[name] = {
            "owners": owners,
            "equal": all(torch.equal(rows[owners[0]], rows[r]) for r in owners),
        }
    return references, copies_equal


def _momentum_held(engine) -> dict:
    """Per Muon matrix: (param, this rank's whole copy of its momentum, or None). DeepSpeed's
    stage 1/2 optimizer keeps, per Muon group, the momentum of every matrix that has a piece
    in the rank's partition, whole and back to back in partition order."""
    optimizer, names = engine.optimizer, engine.param_names
    held = {}
    for group_index, group in enumerate(optimizer.optimizer.param_groups):
        if not group.get("use_muon"):
            continue
        buffer = optimizer.optimizer.state[group["params"][0]]["momentum_buffer"]
        owned, start = {}, 0
        for param in optimizer.params_in_partition[group_index]:
            owned[id(param)] = buffer.narrow(0, start, param.numel()).detach().cpu().clone()
            start += param.numel()
        assert start == buffer.numel(), (start, buffer.numel())
        for param in optimizer.round_robin_bit16_groups[group_index]:
            held[names[param]] = (param, owned.get(id(param)))
    return held


def _try_ds_to_universal(paths: MuonFixture) -> str:
    """Run DeepSpeed's ds_to_universal on the checkpoint; its error as one line, or "ok"."""
    import contextlib
    import io
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = SimpleNamespace(
        input_folder=str(paths.tag_dir),
        output_folder=str(paths.save_dir.parent / "ds_universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the plain engine saves no universal_checkpoint_info
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal(args)
    except BaseException as err:  # noqa: BLE001 - recorded, whatever it is
        last = traceback.extract_tb(err.__traceback__)[-1]
        return f"{type(err).__name__}: {err} ({Path(last.filename).name}:{last.lineno})"
    return "ok"


def _worker_main(root: Path, spec: Path) -> None:
    init_cpu_distributed()
    for entry in json.loads(spec.read_text()):
        _run_config(MuonConfig(**entry), root)
    finish_worker(root)


if __name__ == "__main__":
    _worker_main(Path(sys.argv[1]), Path(sys.argv[2]))
