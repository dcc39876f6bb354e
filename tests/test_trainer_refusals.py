"""What the trainer integrations refuse, each in one line and before anything is written or
loaded: a model another wrapper owns, a DeepSpeed engine asked for on the side, a checkpoint
another trainer wrote, a ZeRO-3 config, batch settings the world size does not fit. All in
this process, at world size 1."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[transformers]')")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import trainer_workers  # noqa: E402

ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}


@pytest.fixture(scope="module")
def hf():
    return trainer_workers.example("trainer_transformers")


def _trainer(hf, out, **options):
    args = hf.training_arguments(hf.parse_args(["--out", str(out), "--steps", "2"]), 1)
    return hf.ZeroShardTrainer(model=hf.tiny_gpt2(), args=args, train_dataset=hf.ProgressionCorpus(), **options)


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def _files(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_a_model_in_ddp_or_fsdp_is_refused(hf, tmp_path):
    # Unbuilt instances of the wrappers: the check looks at the type before anything else.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    args = hf.training_arguments(hf.parse_args(["--out", str(tmp_path)]), 1)
    with pytest.raises(ValueError, match="already wrapped in DistributedDataParallel") as error:
        hf.ZeroShardTrainer(model=ddp, args=args)
    assert "pass the bare model" in _one_line(error)

    from torch.distributed.fsdp import FSDPModule

    fsdp = object.__new__(type("FSDPGPT2", (FSDPModule, nn.Module), {}))  # as fully_shard makes it, unbuilt
    with pytest.raises(ValueError, match="already wrapped in FSDP"):
        hf.ZeroShardTrainer(model=fsdp, args=args)


def test_training_arguments_with_deepspeed_are_refused(hf, tmp_path):
    from transformers import TrainingArguments

    environment = dict(os.environ)  # TrainingArguments(deepspeed=...) sets Accelerate's variables
    try:
        config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
        args = TrainingArguments(output_dir=str(tmp_path), deepspeed=config, use_cpu=True, report_to=[])
        with pytest.raises(ValueError, match=r"TrainingArguments\(deepspeed=\.\.\.\)") as error:
            hf.ZeroShardTrainer(model=hf.tiny_gpt2(), args=args)
        assert "zeroshard=config" in _one_line(error)
    finally:
        os.environ.clear()
        os.environ.update(environment)


def test_a_stock_trainer_checkpoint_is_refused_before_anything_loads(hf, tmp_path):
    from transformers import Trainer

    stock_out = tmp_path / "stock"
    args = hf.training_arguments(hf.parse_args(["--out", str(stock_out), "--steps", "2"]), 1)
    Trainer(model=hf.tiny_gpt2(), args=args, train_dataset=hf.ProgressionCorpus()).train()
    checkpoint = stock_out / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").is_file()

    trainer = _trainer(hf, tmp_path / "zeroshard")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="written by a stock transformers Trainer") as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "rank 0 alone" in _one_line(error)
    assert trainer.engine is None and trainer.state.global_step == 0
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert _files(tmp_path / "zeroshard") == []


def test_a_zero3_config_is_refused_before_the_model_changes(hf, tmp_path):
    trainer = _trainer(hf, tmp_path, zeroshard={**ZERO2, "zero_optimization": {"stage": 3}})
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="zero_optimization.stage = 3: ZeRO-3") as error:
        trainer.train()
    _one_line(error)
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert _files(tmp_path) == []


def test_batch_settings_the_world_size_does_not_fit_name_the_key_to_drop(hf, tmp_path):
    # 6 rows per step do not split into micro-batches of 4 on 1 rank (nor on any world size).
    trainer = _trainer(hf, tmp_path, zeroshard={**ZERO2, "train_batch_size": 6})
    with pytest.raises(ValueError, match="train_batch_size = 6 but per_device_train_batch_size 4") as error:
        trainer.train()
    assert "drop train_batch_size (or set it to 'auto')" in _one_line(error)
    assert _files(tmp_path) == []


def test_zeroshard_settings_that_mix_engine_arguments_and_config_keys_are_refused(hf, tmp_path):
    with pytest.raises(ValueError, match="mixes ZeroOptimizer arguments") as error:
        _trainer(hf, tmp_path, zeroshard={"stage": 1, "train_batch_size": 8})
    _one_line(error)


# ---- Accelerate --------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps one AcceleratorState per process: each test starts and ends without one."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _masters(engine) -> list[torch.Tensor]:
    return [master.detach().clone() for master in engine.masters]


def test_prepare_zeroshard_refuses_a_deepspeed_accelerator_and_a_wrapped_model(hf, fresh_accelerate):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from zeroshard.integrations.accelerate import prepare_zeroshard

    model = hf.tiny_gpt2()
    environment = dict(os.environ)  # a DeepSpeed plugin sets Accelerate's variables
    try:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))  # DeepSpeed's CPU accelerator here
        with pytest.raises(ValueError, match="the Accelerator has a DeepSpeed plugin") as error:
            prepare_zeroshard(accelerator, model, torch.optim.AdamW, lr=1e-3)
        assert "config= here instead" in _one_line(error)
        assert all(p.dtype == torch.float32 for p in model.parameters())
    finally:
        os.environ.clear()
        os.environ.update(environment)

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match="already wrapped in DistributedDataParallel"):
        prepare_zeroshard(Accelerator(cpu=True), ddp, torch.optim.AdamW, lr=1e-3)


def test_load_state_of_a_stock_accelerate_folder_is_refused_before_anything_loads(hf, tmp_path, fresh_accelerate):
    from accelerate import Accelerator

    from zeroshard.integrations.accelerate import prepare_zeroshard

    stock = Accelerator(cpu=True)
    model, optimizer = stock.prepare(hf.tiny_gpt2(), None)[0], None
    optimizer = stock.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.stack([hf.ProgressionCorpus()[i]["input_ids"] for i in range(4)])
    stock.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    stock.save_state(str(tmp_path / "stock"))
    assert (tmp_path / "stock" / "optimizer.bin").is_file()

    accelerator = Accelerator(cpu=True)
    model, optimizer = prepare_zeroshard(accelerator, hf.tiny_gpt2(), torch.optim.AdamW, lr=1e-3)
    before, weights = _masters(optimizer.engine), [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="written by a stock accelerator.save_state") as error:
        accelerator.load_state(str(tmp_path / "stock"))
    _one_line(error)
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(optimizer.engine)))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_prepare_zeroshard_refuses_zero3_and_a_batch_the_accumulation_does_not_split(hf, fresh_accelerate):
    from accelerate import Accelerator

    from zeroshard.integrations.accelerate import prepare_zeroshard

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = hf.tiny_gpt2()
    with pytest.raises(ValueError, match="zero_optimization.stage = 3: ZeRO-3") as error:
        prepare_zeroshard(accelerator, model, torch.optim.AdamW, config={"zero_optimization": {"stage": 3}}, lr=1e-3)
    _one_line(error)
    # 6 rows per step do not split over 4 accumulation steps on 1 rank.
    with pytest.raises(ValueError, match="train_batch_size = 6 does not split over") as error:
        prepare_zeroshard(accelerator, model, torch.optim.AdamW, config={"train_batch_size": 6}, lr=1e-3)
    assert "drop train_batch_size" in _one_line(error)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not getattr(model, "_is_accelerate_prepared", False)


# ---- Lightning ---------------------------------------------------------------------------------


@pytest.fixture
def lightning_fit(hf, tmp_path):
    """Fit the Lightning example's module in this process (1 device) with ZeroShardStrategy
    options; the process group and the variables Lightning sets up are undone afterwards."""
    pytest.importorskip("lightning")
    import torch.distributed as dist

    pl = trainer_workers.example("trainer_lightning")
    environment = dict(os.environ)

    def fit(ckpt_path=None, config=None, **trainer_options):
        import lightning as L

        from zeroshard.integrations.lightning import ZeroShardStrategy

        module = pl.TinyLM(pl.parse_args(["--out", str(tmp_path / "out"), "--steps", "1"]))
        options = dict(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
        options.update(enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
        trainer = L.Trainer(strategy=ZeroShardStrategy(config=config), **{**options, **trainer_options})
        trainer.fit(module, ckpt_path=ckpt_path)
        return module

    yield fit
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def test_lightning_refuses_zero3_a_batch_it_cannot_split_and_clipping_by_value(lightning_fit, tmp_path):
    with pytest.raises(ValueError, match="zero_optimization.stage = 3: ZeRO-3") as error:
        lightning_fit(config={"zero_optimization": {"stage": 3}})
    _one_line(error)
    with pytest.raises(ValueError, match="train_batch_size = 6 does not split over Trainer") as error:
        lightning_fit(config={"train_batch_size": 6}, accumulate_grad_batches=4)
    assert "drop train_batch_size" in _one_line(error)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        lightning_fit(gradient_clip_val=1.0, gradient_clip_algorithm="value")
    assert not (tmp_path / "out").exists()


def test_lightning_refuses_a_precision_it_does_not_train_in(hf):
    pytest.importorskip("lightning")
    import lightning as L

    from zeroshard.integrations.lightning import ZeroShardStrategy

    with pytest.raises(ValueError, match="precision '64-true': zeroshard trains in fp32, bf16 or fp16"):
        L.Trainer(strategy=ZeroShardStrategy(), accelerator="cpu", devices=1, precision="64-true", logger=False)


def test_lightning_refuses_a_single_file_checkpoint_before_anything_loads(lightning_fit, hf, tmp_path):
    import lightning as L

    pl = trainer_workers.example("trainer_lightning")
    stock = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    stock.fit(pl.TinyLM(pl.parse_args(["--out", str(tmp_path / "stock"), "--steps", "1"])))
    stock.save_checkpoint(tmp_path / "stock.ckpt")

    with pytest.raises(ValueError, match="a single-file Lightning checkpoint another strategy wrote") as error:
        lightning_fit(ckpt_path=tmp_path / "stock.ckpt")
    assert "load_from_checkpoint" in _one_line(error)
    assert not (tmp_path / "out").exists()
