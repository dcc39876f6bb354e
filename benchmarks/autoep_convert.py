"""zeroshard's converters on a DeepSpeed AutoEP checkpoint against DeepSpeed's own, in one run.

The checkpoint is made first, by DeepSpeed 0.19.8 itself: AutoEP (``preset_model: qwen3_moe``)
trains a random transformers Qwen3-MoE one step at W = 4, EP = 2 on the CPU (gloo, bf16, ZeRO
stage 2, torch AdamW) and saves. The default model (8 layers, hidden 256, 32 experts of width
256, vocabulary 4096) has 54 M parameters, 50 M of them experts: 758 MB in 261 files (fp32
master and Adam state, the bf16 module and 256 expert files). AutoEP needs transformers 5.9.0, which
``scripts/setup.sh`` puts in ``.side/transformers-5.9``; only the training ranks see it.

Then, each command in a fresh process measured as in ``deepspeed_convert.py`` (wall time, CPU
time, the conversion alone, ``ru_maxrss``; page cache warm; interleaved rounds, best time and
largest peak):

* DeepSpeed ``ds_to_universal`` (one worker each for extraction and merging: one process, one
  resident set to measure) against ``zeroshard to-universal`` and ``zeroshard to-fp32`` (the
  model's own stacked layout, ``from_pretrained``-ready): ``ds_to_universal`` is DeepSpeed's only
  converter for these checkpoints, as its ``zero_to_fp32`` fails on them (run too, and shown
  failing);
* ``cp -r`` of the tag folder, and each side's imports alone (the memory floors).

The outputs are checked: the fp32 export's every tensor equals ds_to_universal's fp32 in the
model's layout (``gate_up_proj = cat(w1, w3)``, ``down_proj = w2``, ``gate = router.gate``),
and so do the universal checkpoint's fp32, exp_avg and exp_avg_sq of every parameter.

    .venv/bin/python benchmarks/autoep_convert.py [--dir /tmp] [--layers 8] [--experts 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from deepspeed_convert import TAG, best_of, directory_bytes, print_table, same_bits, warm_page_cache
from torchrun_job import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS_DIR = ROOT / ".side" / "transformers-5.9"
CONVERT = str(Path(__file__).with_name("deepspeed_convert.py"))
WORLD_SIZE, EP = 4, 2
PAIRS = (
    ("universal", "deepspeed ds_to_universal", "zeroshard to-universal"),
    ("fp32 export (against ds_to_universal)", "deepspeed ds_to_universal", "zeroshard to-fp32"),
)


def model_config(layers: int, experts: int) -> dict:
    return {
        "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": experts, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }  # fmt: skip


# ---- the checkpoint (torchrun workers run this file with ``--train``) ----------------------------


def _train_and_save(save_dir: Path, layers: int, experts: int) -> None:
    import importlib

    import deepspeed
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo is enough; no g++ build
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**model_config(layers, experts)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "expert_parallel": {"enabled": True, "autoep_size": EP, "preset_model": "qwen3_moe"},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(deepspeed.comm.get_rank()))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(str(save_dir), tag=TAG)
    deepspeed.comm.destroy_process_group()


def make_checkpoint(save_dir: Path, layers: int, experts: int) -> float:
    if not (TRANSFORMERS_DIR / "transformers-5.9.0.dist-info").is_dir():
        raise SystemExit(f"{TRANSFORMERS_DIR} holds no transformers 5.9.0 for DeepSpeed AutoEP (run scripts/setup.sh)")
    started = time.perf_counter()
    path = os.pathsep.join(p for p in (str(TRANSFORMERS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    done = run_torchrun(__file__, WORLD_SIZE, ["--train", str(save_dir), str(layers), str(experts)], timeout=900,
                        DS_ACCELERATOR="cpu", PYTHONPATH=path)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed AutoEP run failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return time.perf_counter() - started


def commands(save_dir: Path, work: Path) -> dict[str, tuple[list[str], Path | None]]:
    me, tag_dir = [sys.executable, CONVERT, "--run"], save_dir / TAG
    return {
        "cp -r (same bytes)": (["cp", "-r", str(tag_dir), str(work / "copy")], work / "copy"),
        "import deepspeed (floor)": ([*me, "import", "deepspeed.checkpoint.ds_to_universal"], None),
        "import zeroshard (floor)": ([*me, "import", "zeroshard.cli.main"], None),
        "deepspeed zero_to_fp32": ([*me, "zero_to_fp32", str(save_dir), str(work / "ds_fp32")], work / "ds_fp32"),
        "deepspeed ds_to_universal": (
            [
                *me,
                "ds_to_universal",
                "--input_folder",
                str(tag_dir),
                "--output_folder",
                str(work / "ds_universal"),
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
            ],  # fmt: skip
            work / "ds_universal",
        ),
        "zeroshard to-universal": (
            [*me, "zeroshard", "to-universal", str(save_dir), str(work / "zs_universal"), "--no-progress"],
            work / "zs_universal",
        ),
        "zeroshard to-fp32": (
            [*me, "zeroshard", "to-fp32", str(save_dir), str(work / "zs_fp32"), "--no-progress"],
            work / "zs_fp32",
        ),
    }


# ---- checks ---------------------------------------------------------------------------------------


def deepspeed_in_model_layout(universal: Path, key: str, layers: int) -> dict:
    """ds_to_universal's ``key`` tensors under the model's names, put together by hand."""
    import torch

    zero = universal / "zero"

    def load(name: str):
        return torch.load(zero / name / f"{key}.pt", weights_only=True)["param"].detach()

    out, autoep = {}, set()
    for layer in range(layers):
        block = f"model.layers.{layer}.mlp"
        out[f"{block}.experts.gate_up_proj"] = torch.cat([load(f"{block}.experts.w1"), load(f"{block}.experts.w3")], 1)
        out[f"{block}.experts.down_proj"] = load(f"{block}.experts.w2")
        out[f"{block}.gate.weight"] = load(f"{block}.router.gate.weight")
        autoep |= {f"{block}.experts.w{i}" for i in (1, 2, 3)} | {
            f"{block}.router.gate.weight",
            f"{block}.gate.gate.weight",
        }
    out.update({p.name: load(p.name) for p in zero.iterdir() if p.is_dir() and p.name not in autoep})
    return out


def outputs_equal(work: Path, layers: int) -> tuple[bool, bool]:
    """(to-fp32 equals ds_to_universal's fp32, to-universal equals its fp32 / exp_avg / exp_avg_sq)."""
    from safetensors.torch import load_file

    from zeroshard.checkpoint.source import read_param
    from zeroshard.checkpoint.universal.source import UniversalSource

    universal = work / "ds_universal"
    fp32 = deepspeed_in_model_layout(universal, "fp32", layers)
    exported = load_file(str(work / "zs_fp32" / "model.safetensors"))
    fp32_same = exported.keys() == fp32.keys() and all(same_bits(exported[k], fp32[k]) for k in fp32)
    with UniversalSource(work / "zs_universal") as ours:
        universal_same = True
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            theirs = fp32 if key == "fp32" else deepspeed_in_model_layout(universal, key, layers)
            for name, tensor in theirs.items():
                universal_same &= same_bits(read_param(ours, name, key).reshape(tensor.shape), tensor)
    return fp32_same, universal_same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32, help="experts per layer (EP = 2 holds half on each rank)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds: best wall time, largest peak")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autoep_convert_", dir=args.dir))
    try:
        save_dir = work / "ckpt"
        seconds = make_checkpoint(save_dir, args.layers, args.experts)
        tag_dir = save_dir / TAG
        print(
            f"DeepSpeed AutoEP run (W={WORLD_SIZE}, EP={EP}, {args.layers} layers x {args.experts} experts) made in "
            f"{seconds:.0f} s: {directory_bytes(tag_dir) / 1e6:.0f} MB in {len(list(tag_dir.iterdir()))} files"
        )
        warm_page_cache(tag_dir)
        load = os.getloadavg()[0]
        results = best_of(args.repeats, commands(save_dir, work))
        print(
            f"repeats: {args.repeats} interleaved (best wall time, largest peak); "
            f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
        )
        print_table(results, PAIRS)
        if not any(
            results[name]["error"]
            for name in ("deepspeed ds_to_universal", "zeroshard to-fp32", "zeroshard to-universal")
        ):
            fp32_same, universal_same = outputs_equal(work, args.layers)
            print(f"\nto-fp32 equals ds_to_universal's fp32 in the model's layout, bit for bit: {fp32_same}")
            print(f"to-universal equals ds_to_universal (fp32, exp_avg, exp_avg_sq), bit for bit: {universal_same}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:  # a torchrun worker
        _train_and_save(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
