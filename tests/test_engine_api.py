"""The engine's torch.optim surface, in a single process (world size 1, no process group):
lr schedulers, the Optimizer hooks, and state_dict / load_state_dict of a rank's shard.

At world size 1 in fp32 the engine steps exactly as a plain torch optimizer on the same
model, so the schedules are checked against one: the lrs (and OneCycleLR's betas) each step
and the parameters at the end, bit for bit.
"""

from __future__ import annotations

import copy
import warnings
import pytest
import torch
from torch.optim import lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook

from zeroshard.engine import ZeroOptimizer
from zeroshard.layout import LayoutPolicy
from zeroshard.models import OddSizedModel, gpt_param_groups

STEPS = 8
GROUP_LRS = (1e-2, 3e-3)


def _batches(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 13, (4, 8), generator=generator) for _ in range(count)]


def _model() -> OddSizedModel:
    torch.manual_seed(0)
    return OddSizedModel()


def _groups(model: torch.nn.Module) -> list[dict]:
    params = dict(model.named_parameters())
    decay, no_decay = gpt_param_groups(model)
    return [
        {"params": [params[n] for n in decay], "lr": GROUP_LRS[0], "weight_decay": 0.1},
        {"params": [params[n] for n in no_decay], "lr": GROUP_LRS[1], "weight_decay": 0.0},
    ]


def _engine(model: torch.nn.Module, **options) -> ZeroOptimizer:
    return ZeroOptimizer(model, torch.optim.AdamW, _groups(model), **{"betas": (0.9, 0.95), **options})


def _train(model, optimizer, batches, scheduler=None) -> list[list[tuple]]:
    """Per step: (lr, betas) of every group as the step used them."""
    seen = []
    for tokens in batches:
        loss = model(tokens, tokens)
        optimizer.backward(loss) if isinstance(optimizer, ZeroOptimizer) else loss.backward()
        seen.append([(group["lr"], group["betas"]) for group in optimizer.param_groups])
        optimizer.step()  # looked up each time: a scheduler wraps the instance's step
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return seen


# ---- lr schedulers on the engine itself ------------------------------------------------------------


def _one_cycle(optimizer):
    return lr_scheduler.OneCycleLR(optimizer, max_lr=[2e-2, 5e-3], total_steps=STEPS, pct_start=0.3)


def _warmup_cosine(optimizer):
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - 3, eta_min=1e-4)
    return lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])


SCHEDULES = {
    "lambda": lambda optimizer: lr_scheduler.LambdaLR(optimizer, [lambda s: 0.5**s, lambda s: 1.0 / (1 + s)]),
    "one-cycle": _one_cycle,  # also cycles AdamW's beta1 through param_groups
    "warmup-cosine": _warmup_cosine,
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_scheduler_on_the_engine_matches_a_plain_torch_optimizer_step_by_step(schedule):
    make_scheduler = SCHEDULES[schedule]
    batches = _batches(STEPS)

    reference_model = _model()
    reference = torch.optim.AdamW(_groups(reference_model), betas=(0.9, 0.95))
    expected = _train(reference_model, reference, batches, make_scheduler(reference))

    model = _model()
    engine = _engine(model)
    assert isinstance(engine, torch.optim.Optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        seen = _train(model, engine, batches, make_scheduler(engine))

    assert seen == expected
    assert len({lrs[0][0] for lrs in seen}) > 3  # the schedule really moved the lr
    if schedule == "one-cycle":
        assert len({lrs[0][1] for lrs in seen}) > 3  # and beta1
    # The wrapped optimizer used those lrs: the parameters are the plain optimizer's, bit for bit.
    for (name, param), reference_param in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.equal(param, reference_param), name


# ---- hooks -----------------------------------------------------------------------------------------


def test_step_hooks_fire_once_per_step_with_the_engine_and_its_arguments():
    model = _model()
    engine = _engine(model)
    calls = []
    pre = engine.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt, args, kwargs)))
    engine.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt, args, kwargs)))
    global_calls = []
    global_hook = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: global_calls.append(opt)
    )
    try:
        _train(model, engine, _batches(2))
    finally:
        global_hook.remove()
    assert [kind for kind, *_ in calls] == ["pre", "post", "pre", "post"]
    assert all(opt is engine and args == (engine,) and kwargs == {} for _, opt, args, kwargs in calls)
    # Global hooks see the engine and, inside its step, the wrapped optimizer: one each per step.
    assert global_calls == [engine.optimizer, engine, engine.optimizer, engine]

    pre.remove()
    calls.clear()
    _train(model, engine, _batches(1))
    assert [kind for kind, *_ in calls] == ["post"]


def test_a_step_pre_hook_can_replace_the_arguments():
    engine = _engine(_model())
    engine.register_step_pre_hook(lambda opt, args, kwargs: (args, {"closure": lambda: 0.0}))
    with pytest.raises(ValueError, match="takes no closure"):
        engine.step()


def test_state_dict_hooks_fire_and_can_change_the_dict():
    engine = _engine(_model())
    calls = []
    engine.register_state_dict_pre_hook(lambda opt: calls.append(("pre", opt)))

    def post(opt, state_dict):
        calls.append(("post", opt, sorted(state_dict)))
        return {**state_dict, "note": "added by a hook"}

    engine.register_state_dict_post_hook(post)
    state_dict = engine.state_dict()
    assert calls == [("pre", engine), ("post", engine, ["param_groups", "state", "zero"])]
    assert state_dict["note"] == "added by a hook"


def test_load_state_dict_hooks_fire_and_a_pre_hook_can_replace_the_dict():
    engine = _engine(_model())
    saved = copy.deepcopy(engine.state_dict())
    calls = []

    def pre(opt, state_dict):
        calls.append(("pre", opt, state_dict.get("wrapped")))
        return state_dict["inner"]

    engine.register_load_state_dict_pre_hook(pre)
    engine.register_load_state_dict_post_hook(lambda opt: calls.append(("post", opt)))
    engine.load_state_dict({"wrapped": True, "inner": saved})
    assert calls == [("pre", engine, True), ("post", engine)]


def test_a_failing_load_pre_hook_is_reported_and_nothing_loads():
    engine = _engine(_model())
    saved = copy.deepcopy(engine.state_dict())

    def broken(opt, state_dict):
        raise KeyError("boom")

    engine.register_load_state_dict_pre_hook(broken)
    with pytest.raises(ValueError, match=r"rank 0: a load_state_dict pre hook raised KeyError: 'boom'"):
        engine.load_state_dict(saved)


# ---- state_dict: this rank's shard -----------------------------------------------------------------


def _steps(engine: ZeroOptimizer, model, batches) -> None:
    for tokens in batches:
        engine.backward(model(tokens, tokens))
        engine.step()
        engine.zero_grad()


def test_state_dict_round_trip_resumes_bit_for_bit_in_bf16():
    batches = _batches(6, seed=1)
    model = _model()
    engine = _engine(model, param_dtype=torch.bfloat16, max_grad_norm=0.05)
    _steps(engine, model, batches[:3])
    saved = copy.deepcopy(engine.state_dict())
    assert saved["zero"]["global_steps"] == 3 and saved["zero"]["world_size"] == 1
    _steps(engine, model, batches[3:])

    resumed_model = _model()
    resumed = _engine(resumed_model, param_dtype=torch.bfloat16, max_grad_norm=0.05)
    resumed.load_state_dict(saved)
    # The model's bf16 parameters are the loaded masters in their dtype, before any step.
    # (At world size 1 a partition is the whole flat buffer the parameters view.)
    for buffer, master in zip(resumed.buffers, saved["zero"]["fp32_partitions"]):
        assert torch.equal(buffer.data, master.to(torch.bfloat16))
    assert resumed.global_steps == 3
    _steps(resumed, resumed_model, batches[3:])

    for original, again in zip(engine.masters, resumed.masters):
        assert torch.equal(original, again)
    for (name, param), again in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(param, again), name
    state, resumed_state = engine.state_dict()["state"], resumed.state_dict()["state"]
    assert state.keys() == resumed_state.keys() and all(
        torch.equal(state[i][key], resumed_state[i][key]) for i in state for key in state[i]
    )


def test_import_state_copies_the_optimizer_state_and_masters_unless_they_are_taken():
    """By default the caller's state is left alone by later steps; ``take=True`` (a checkpoint
    load, which built the state for the call) hands its tensors to the optimizer and its fp32
    partitions to the masters uncopied."""
    batches = _batches(3, seed=2)
    model = _model()
    engine = _engine(model)
    _steps(engine, model, batches[:1])
    given = engine.export_state()
    before = {key: value.clone() for key, value in given.optimizer_states[0].items()}
    masters_before = [master.clone() for master in given.fp32_partitions]
    pointers = [master.data_ptr() for master in engine.masters]
    engine.import_state(given)
    assert [master.data_ptr() for master in engine.masters] == pointers
    _steps(engine, model, batches[1:2])
    assert all(torch.equal(given.optimizer_states[0][key], value) for key, value in before.items())
    assert all(torch.equal(a, b) for a, b in zip(given.fp32_partitions, masters_before))

    taken = engine.export_state()
    imported = taken.optimizer_states[0]["exp_avg"].clone()
    imported_master = taken.fp32_partitions[0].clone()
    masters = list(engine.masters)
    engine.import_state(taken, take=True)
    assert [m is n for m, n in zip(engine.masters, masters)] == [True] * len(masters)  # the same parameters
    assert [m.data_ptr() for m in engine.masters] == [t.data_ptr() for t in taken.fp32_partitions]
    live = engine.optimizer.state[engine.masters[0]]
    assert all(live[key].data_ptr() == taken.optimizer_states[0][key].data_ptr() for key in before)
    _steps(engine, model, batches[2:])  # steps on the taken tensors themselves
    assert not torch.equal(taken.optimizer_states[0]["exp_avg"], imported)
    assert not torch.equal(taken.fp32_partitions[0], imported_master)


def _refused(engine: ZeroOptimizer, state_dict, match: str) -> None:
    masters = [m.detach().clone() for m in engine.masters]
    params = [b.data.clone() for b in engine.buffers]
    state = copy.deepcopy(engine.optimizer.state_dict())
    with pytest.raises(ValueError, match=match) as error:
        engine.load_state_dict(state_dict)
    assert "zeroshard.checkpoint" in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.masters))
    assert all(torch.equal(a, b.data) for a, b in zip(params, engine.buffers))
    assert str(engine.optimizer.state_dict()) == str(state)


def test_load_state_dict_refuses_what_is_not_this_ranks_shard_and_changes_nothing():
    model = _model()
    engine = _engine(model, param_dtype=torch.bfloat16)
    _steps(engine, model, _batches(2))
    good = copy.deepcopy(engine.state_dict())

    plain = torch.optim.AdamW(_model().parameters()).state_dict()
    _refused(engine, plain, "not a ZeroOptimizer state_dict")

    other_layout = _engine(_model(), param_dtype=torch.bfloat16, policy=LayoutPolicy.native(64)).state_dict()
    _refused(engine, other_layout, "another layout or world size")

    other_rank = copy.deepcopy(good)
    other_rank["zero"]["rank"] = 1
    _refused(engine, other_rank, "the shard is rank 1's, this is rank 0")

    sgd_model = _model()
    sgd = ZeroOptimizer(sgd_model, torch.optim.SGD, _groups(sgd_model), param_dtype=torch.bfloat16, momentum=0.9)
    _refused(engine, sgd.state_dict(), "optimizer is 'torch.optim.sgd.SGD'")

    short = copy.deepcopy(good)
    short["zero"]["fp32_partitions"][0] = short["zero"]["fp32_partitions"][0][:-1]
    _refused(engine, short, "fp32 partition 0 is")

    bad_state = copy.deepcopy(good)
    bad_state["state"][1]["exp_avg"] = torch.zeros(3)
    _refused(engine, bad_state, "optimizer state 'exp_avg' of partition 1 has shape")

    fewer_groups = copy.deepcopy(good)
    fewer_groups["param_groups"] = fewer_groups["param_groups"][:1]
    _refused(engine, fewer_groups, "1 param groups")

    engine.load_state_dict(good)  # and the intact one still loads


def test_param_groups_stay_fixed():
    engine = _engine(_model())
    with pytest.raises(NotImplementedError, match="fixed when it is built"):
        engine.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


# ---- stage 2 staging: unwritten slots and padding reduce as zeros ------------------------------------


class SometimesUnused(torch.nn.Module):
    """``extra`` takes part in the forward only when ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(13, 7)
        self.extra = torch.nn.Parameter(torch.randn(7, 7))
        self.head = torch.nn.Linear(7, 13)
        self.use_extra = True

    def forward(self, idx, targets):
        x = self.embed(idx)
        if self.use_extra:
            x = x @ self.extra
        return torch.nn.functional.cross_entropy(self.head(x).view(-1, 13), targets.view(-1))


def test_stage2_parameter_without_gradient_and_padding_reduce_as_zeros():
    """Stage 2 writes each gradient into an uninitialised bucket buffer; a parameter the
    backward skipped and the padding must still be reduced as zeros, also when the buffer
    reuses memory that held the previous step's gradients."""
    model = SometimesUnused()
    policy = LayoutPolicy.native(64, bucket_numel=200)
    engine = ZeroOptimizer(model, torch.optim.SGD, stage=2, policy=policy, lr=0.1)
    tokens = _batches(1)[0]
    for use_extra in (True, True, False):
        model.use_extra = use_extra
        engine.backward(model(tokens, tokens))
        extra = engine.get_full_grad("extra")
        assert bool(extra.any()) == use_extra
        for group, grad in zip(engine.layout.groups, engine.reducer.partition_grads):
            assert all(not grad[begin:end].any() for begin, end in group.padding_ranges(0))
        engine.step()
        engine.zero_grad()


def test_reduce_dtype_other_than_a_float_dtype_is_refused():
    with pytest.raises(ValueError, match="reduce_dtype must be None or one of torch.float32, torch.bfloat16"):
        ZeroOptimizer(_model(), torch.optim.AdamW, reduce_dtype=torch.int8)


def test_a_bad_fragment_call_raises_its_own_error_in_a_single_process():
    engine = ZeroOptimizer(OddSizedModel(), torch.optim.AdamW, lr=1e-2)
    name = engine.layout.param_names[0]
    with pytest.raises(KeyError, match="optimizer has no state 'exp_avg'"):
        engine.get_full_optimizer_state(name, "exp_avg")
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.set_full_fp32_param("nope", torch.zeros(1))
    with pytest.raises(ValueError, match=f"parameter {name!r} has shape"):
        engine.set_full_fp32_param(name, torch.zeros(10**4))


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_after_zero_grad_is_zero_and_a_set_one_is_added_to(stage):
    """zero_grad leaves the gradient partition stale (zero-filled lazily, or overwritten by
    the next reduction): read before any backward it is zero, and a gradient set then is
    added to by the next backward, not overwritten."""
    model = _model()
    engine = _engine(model, stage=stage, policy=LayoutPolicy.native(64, bucket_numel=200 if stage == 2 else None))
    first, second = _batches(2)
    engine.backward(model(first, first))
    engine.step()
    engine.zero_grad()
    names = [name for name, _ in model.named_parameters()]
    assert all(not engine.get_full_grad(name).any() for name in names)
    engine.backward(model(second, second))
    expected = {name: engine.get_full_grad(name) for name in names}
    engine.zero_grad()
    for index, name in enumerate(names):
        engine.set_full_grad(name, torch.full_like(expected[name], float(index + 1)))
    engine.backward(model(second, second))
    for index, name in enumerate(names):
        assert torch.equal(engine.get_full_grad(name), expected[name] + (index + 1)), name
