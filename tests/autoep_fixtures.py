"""Real DeepSpeed AutoEP ZeRO-1/2 checkpoints of a tiny transformers Qwen3-MoE, built in the test session.

As :mod:`deepspeed_fixtures`, two halves in one file: :func:`generate` (test process) launches
this file's ranks once per world size; the ranks train every configuration of their
world size for a few steps with DeepSpeed's AutoEP (``"expert_parallel": {"enabled": true,
"autoep_size": EP, "preset_model": "qwen3_moe"}``), save, and rank 0 runs DeepSpeed's own
``ds_to_universal`` on the checkpoint (the reference the tests compare with) and tries
``zero_to_fp32`` on it (which fails on AutoEP checkpoints; its error is recorded).

DeepSpeed 0.19.8's AutoEP runs with transformers 5.9.0 only (with 5.24 its output recorders
raise ``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``),
so the workers run with :data:`TRANSFORMERS_DIR` (``.side/transformers-5.9``, which
``scripts/setup.sh`` fills with ``pip install --target``) first on PYTHONPATH. Nothing else sees
that folder: the test process keeps the main environment's transformers.

The model is random (no download): 2 layers, 4 experts, hidden 24, expert width 16 (bf16 rows
of 48 and 32 bytes: grouped_mm on the CPU refuses strides that are not multiples of 16 bytes).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deepspeed_fixtures import finish_worker, init_cpu_distributed, job_specs, launch_ranks

# Imported once before the ranks fork (transformers from TRANSFORMERS_DIR, on PYTHONPATH).
AUTOEP_MODULES = ("transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe")
TRANSFORMERS_VERSION = "5.9.0"
TRANSFORMERS_DIR = Path(__file__).resolve().parents[1] / ".side" / "transformers-5.9"
TAG = "step3"
STEPS = 3
GLOBAL_BATCH, SEQ_LEN = 8, 8  # rows per step, split evenly over 1, 2, 4 or 8 ranks
BASE_LR, BETAS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0
MODEL_CONFIG = {
    "vocab_size": 61,
    "hidden_size": 24,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class AutoEPConfig:
    """One DeepSpeed AutoEP run."""

    name: str
    world_size: int
    stage: int
    ep_size: int
    parameter_alignment: bool = False


CONFIGS: tuple[AutoEPConfig, ...] = (
    AutoEPConfig("w2_ep2_s1", 2, 1, 2),
    AutoEPConfig("w2_ep2_s2", 2, 2, 2),
    AutoEPConfig("w2_ep1_s2", 2, 2, 1),
    AutoEPConfig("w4_ep2_s2_align", 4, 2, 2, parameter_alignment=True),
)


@dataclass(frozen=True)
class AutoEPFixture:
    """Where one configuration's outputs are."""

    config: AutoEPConfig
    save_dir: Path  # holds `latest` and the tag folder
    tag_dir: Path
    universal: Path  # ds_to_universal's output: zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt
    record: Path  # json: zero_to_fp32's error, the transformers version, seconds per phase

    def recorded(self) -> dict:
        return json.loads(self.record.read_text())


def fixture_paths(config: AutoEPConfig, root: Path) -> AutoEPFixture:
    base = root / config.name
    return AutoEPFixture(config, base / "ckpt", base / "ckpt" / TAG, base / "ds_universal", base / "record.json")


def global_batch(step: int):
    """Tokens of training step ``step``, all ranks' rows together."""
    import torch

    generator = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, MODEL_CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=generator)


def transformers_ready() -> bool:
    """Whether :data:`TRANSFORMERS_DIR` holds transformers 5.9.0 (scripts/setup.sh makes it)."""
    return (TRANSFORMERS_DIR / f"transformers-{TRANSFORMERS_VERSION}.dist-info").is_dir()


# ---- test-process side -----------------------------------------------------------------

_GENERATED: dict[AutoEPConfig, AutoEPFixture] = {}


def generate(root: Path, configs: tuple[AutoEPConfig, ...] = CONFIGS) -> dict[str, AutoEPFixture]:
    """Run DeepSpeed AutoEP for every configuration not yet run in this process under ``root``:
    a job per world size, side by side (the ranks of one job wait on each other)."""
    import os

    root.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(TRANSFORMERS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    missing = [config for config in configs if config not in _GENERATED]
    jobs = job_specs(root, missing, "autoep_configs")
    if jobs:
        what = "DeepSpeed AutoEP fixture launch"
        launch_ranks(Path(__file__), root, jobs, what=what, env={"PYTHONPATH": path}, preload=AUTOEP_MODULES)
    _GENERATED.update({config: fixture_paths(config, root) for config in missing})
    return {config.name: _GENERATED[config] for config in configs}


# ---- rank side ------------------------------------------------------------------------------


def ds_config(config: AutoEPConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // config.world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": BASE_LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": config.stage, "parameter_alignment": config.parameter_alignment},
        "expert_parallel": {"enabled": True, "autoep_size": config.ep_size, "preset_model": "qwen3_moe"},
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }


def _run_config(config: AutoEPConfig, root: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    paths = fixture_paths(config, root)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL_CONFIG))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=ds_config(config)
    )
    rows = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        tokens = global_batch(step)[rank * rows : (rank + 1) * rows]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(paths.save_dir), tag=TAG)
    trained = time.perf_counter() - started
    dist.barrier()
    if rank == 0:
        record = {"transformers": transformers.__version__, "train_and_save_s": trained, **_references(paths)}
        paths.record.write_text(json.dumps(record, indent=1))
    dist.barrier()
    engine.destroy()


def _references(paths: AutoEPFixture) -> dict:
    """DeepSpeed's own converters on the checkpoint: ds_to_universal's output (the reference),
    and the error zero_to_fp32 raises."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    started = time.perf_counter()
    args = argparse.Namespace(
        input_folder=str(paths.tag_dir), output_folder=str(paths.universal), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)
    universal_s = time.perf_counter() - started
    try:
        get_fp32_state_dict_from_zero_checkpoint(str(paths.save_dir), tag=TAG)
        error = None
    except Exception as err:  # what it raises is the record
        error = f"{type(err).__name__}: {err}"
    return {"ds_to_universal_s": universal_s, "zero_to_fp32_error": error}


def _worker_main(root: Path, spec: Path) -> None:
    init_cpu_distributed()
    for entry in json.loads(spec.read_text()):
        _run_config(AutoEPConfig(**entry), root)
    finish_worker(root)


if __name__ == "__main__":
    _worker_main(Path(sys.argv[1]), Path(sys.argv[2]))
