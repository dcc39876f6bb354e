"""The framework-free part of the trainer integrations (one process, no framework): a
Checkpointer save into another folder (``save(root=, tag=)``), a framework folder holding a
sharded checkpoint beside the framework's files, what a resume refuses, the fp32 export into a
folder that holds other files, and a DeepSpeed-style config reconciled with a framework."""

from __future__ import annotations

import pytest
import torch

from zeroshard.checkpoint import Checkpointer, checkpoint_kind
from zeroshard.engine import ZeroOptimizer
from zeroshard.integrations.building import Setting, build_engine, reconcile, split_settings
from zeroshard.integrations.saves import FolderSaves, check_resumable, export_fp32, newest_committed


def make_engine(seed: int = 0) -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return model, ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)


def train(model: torch.nn.Module, engine: ZeroOptimizer, steps: int) -> None:
    for step in range(steps):
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        engine.step()
        engine.zero_grad()


def test_a_save_into_another_root_keeps_the_checkpointers_root_and_its_retention(tmp_path):
    model, engine = make_engine()
    with Checkpointer(engine, tmp_path / "root", keep_last=1, async_save=True) as ckpt:
        train(model, engine, 1)
        ckpt.save(0)
        train(model, engine, 1)
        stats = ckpt.save(1, root=tmp_path / "checkpoint-2", tag="zeroshard")
        ckpt.wait()
    assert stats.path == tmp_path / "checkpoint-2" / "zeroshard"
    assert (tmp_path / "checkpoint-2" / "latest").read_text().strip() == "zeroshard"
    # The save elsewhere neither moved the root's latest nor ran its retention there.
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["latest", "step-00000000"]


def test_folder_saves_resume_and_newest_committed(tmp_path):
    model, engine = make_engine()
    saves = FolderSaves(engine, async_save=True)
    for step in (2, 4):
        train(model, engine, 2)
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")  # the framework's file
        saves.save(tmp_path / f"checkpoint-{step}", extra={"step": step})
    saves.close()
    (tmp_path / "checkpoint-6").mkdir()  # a save cut short: the framework's folder, no zeroshard checkpoint
    assert newest_committed(tmp_path, "checkpoint-") == tmp_path / "checkpoint-4"
    assert checkpoint_kind(tmp_path / "checkpoint-4") == "native"

    other_model, other = make_engine(seed=1)
    extra, attestation = FolderSaves(other).load(tmp_path / "checkpoint-4")
    assert extra == {"step": 4} and attestation.line()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other_model.state_dict().values()))

    with pytest.raises(ValueError, match="holds no zeroshard checkpoint .*did not finish"):
        check_resumable(tmp_path / "checkpoint-6", lambda folder: None)
    with pytest.raises(ValueError, match="stock file"):
        check_resumable(tmp_path / "checkpoint-6", lambda folder: f"{folder}: a stock file")
    with pytest.raises(ValueError, match="no such checkpoint folder"):
        check_resumable(tmp_path / "checkpoint-8", lambda folder: None)


def test_the_fp32_export_replaces_an_earlier_one_and_leaves_other_files(tmp_path):
    model, engine = make_engine()
    train(model, engine, 1)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an earlier export")
    written = export_fp32(engine, folder)
    assert written == ["model.safetensors", "zeroshard.digests.json"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", *written]
    from safetensors.torch import load_file

    exported = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(exported[name], engine.get_full_fp32_param(name)) for name, _ in model.named_parameters())


def test_reconcile_fills_auto_and_names_every_contradiction():
    settings = [
        Setting("train_micro_batch_size_per_gpu", 4, "per_device_train_batch_size = 4"),
        Setting("gradient_clipping", 1.0, "max_grad_norm = 1.0"),
        Setting("optimizer.params.lr", 3e-4, "learning_rate = 0.0003", fill_missing=False),
        Setting("bf16.enabled", True, "bf16 = True"),
    ]
    config = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    filled = reconcile(config, settings, "Owner", "Framework")
    assert filled["train_micro_batch_size_per_gpu"] == 4 and filled["optimizer"]["params"]["lr"] == 3e-4
    assert filled["gradient_clipping"] == 1.0 and filled["bf16"] == {"enabled": True}
    assert config["train_micro_batch_size_per_gpu"] == "auto", "the caller's config is not changed"

    contradicting = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5, "bf16": {"enabled": False}}
    with pytest.raises(ValueError) as error:
        reconcile(contradicting, settings, "Owner", "Framework")
    text = str(error.value)
    assert "\n" not in text and text.startswith("Owner: the zeroshard config contradicts the Framework: ")
    for key in ("train_micro_batch_size_per_gpu = 8", "gradient_clipping = 0.5", "bf16.enabled = False"):
        assert key in text


def test_an_adopted_optimizer_keeps_its_groups_and_its_scheduler():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[1].parameters(), "weight_decay": 0.0}],
        lr=1e-2,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    engine = build_engine(model, optimizer, owner="Owner", framework="Framework").engine
    assert engine.optimizer is optimizer and [g["weight_decay"] for g in engine.param_groups] == [0.1, 0.0]
    train(model, engine, 1)
    scheduler.step()
    assert [g["lr"] for g in engine.param_groups] == [5e-3, 5e-3]
    with pytest.raises(ValueError, match="has taken steps already"):
        build_engine(model, optimizer, owner="Owner", framework="Framework")


def test_zeroshard_settings_are_a_config_or_engine_arguments():
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0}
    assert split_settings(config, "Owner") == (config, {})  # gradient_accumulation_steps is DeepSpeed's key too
    assert split_settings({"stage": 1, "offload": True}, "Owner") == (None, {"stage": 1, "offload": True})
    assert split_settings("ds_config.json", "Owner") == ("ds_config.json", {})
    with pytest.raises(ValueError, match=r"mixes ZeroOptimizer arguments \(stage\) with other keys \(train_batch_size\)"):
        split_settings({"stage": 1, "train_batch_size": 8}, "Owner")
