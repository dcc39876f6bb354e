"""Worker code for the multi-process engine tests, and the single-process reference.

Everything here is module level so ``zeroshard.launch.spawn`` can import it in its workers.
A spawned worker runs several configurations in one process group (each process costs
about 1.5 s of torch import) and returns plain Python values: numbers, booleans, strings.

The reference mirrors the engine's arithmetic on one process: each (rank, micro-batch)
gradient in the parameter dtype is added in fp32 to an accumulator, micro-batch 1 first;
ranks are summed in rank order and divided by the world size (per micro-batch for stage 2,
which reduces every backward, once per step for stage 1); with a lower-precision reduce
dtype each rank's part is divided first and rounded to it, and the sum is in fp32; the
loss scale is divided out;
an inf/nan anywhere skips the step and halves the scale; clip_grad_norm_ clips; the torch
optimizer steps on fp32 masters; the model's parameters are the masters cast back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zeroshard.buffers import owns_storage
from zeroshard.engine import ZeroOptimizer
from zeroshard.engine.probe import GradientMemoryProbe
from zeroshard.layout import LayoutPolicy
from zeroshard.models import GPTConfig, OddSizedModel, TinyGPT, gpt_param_groups

SMALL_GPT = GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=3, n_embd=24)
FP16_INITIAL_SCALE = 2.0**16
# torch 2.13 renamed the tensor collective; older releases only have the first name.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
}


class NineBiasModel(nn.Module):
    """Its only no-decay parameter is a 9-element bias: at D=4 with 64-byte alignment the
    no-decay group is 9 real elements in 4 partitions, so ranks 1-3 own padding only."""

    vocab_size = 11

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab_size, 6)
        self.fc = nn.Linear(6, 9)
        self.head = nn.Linear(9, self.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.gelu(self.fc(self.embed(idx))))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


@dataclass(frozen=True)
class RunConfig:
    """One training run, the same for the engine and the reference."""

    name: str
    model: str = "odd"  # "odd" (OddSizedModel), "gpt" (small TinyGPT), "nine" (NineBiasModel)
    stage: int = 2
    param_dtype: str | None = "bfloat16"  # None keeps the model's fp32
    reduce_dtype: str | None = "float32"  # None: the parameter dtype
    optimizer: str = "AdamW"
    optimizer_options: tuple[tuple[str, Any], ...] = (("betas", (0.9, 0.95)),)
    decay_options: tuple[tuple[str, Any], ...] = (("lr", 3e-3), ("weight_decay", 0.1))
    no_decay_options: tuple[tuple[str, Any], ...] = (("lr", 1e-3), ("weight_decay", 0.0))
    steps: int = 12
    accumulation: int = 2
    max_grad_norm: float | None = 0.05  # below every step's norm: clipping is always active
    alignment_bytes: int = 16
    compact: bool = False
    bucket_numel: int | None = None
    lr_schedule: str | None = None  # "lambda" or "step"
    offload: bool = False
    frozen: tuple[str, ...] = ()
    batch_size: int = 4
    seq_len: int = 8
    seed: int = 0

    def policy(self) -> LayoutPolicy:
        return LayoutPolicy.native(self.alignment_bytes, compact=self.compact, bucket_numel=self.bucket_numel)

    def dtype(self) -> torch.dtype | None:
        return getattr(torch, self.param_dtype) if self.param_dtype else None

    def reduce_torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.reduce_dtype) if self.reduce_dtype else None

    def effective_reduce_dtype(self, world_size: int) -> torch.dtype:
        """What the engine reduces in: nothing is rounded at world size 1."""
        if world_size == 1:
            return torch.float32
        return self.reduce_torch_dtype() or self.dtype() or torch.float32


# ---- model, data and param groups (identical for engine and reference) ------------------------


def build_model(config: RunConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    model = {"odd": OddSizedModel, "gpt": lambda: TinyGPT(SMALL_GPT), "nine": NineBiasModel}[config.model]()
    for name, param in model.named_parameters():
        if name in config.frozen:
            param.requires_grad_(False)
    return model


def vocab_size(config: RunConfig) -> int:
    return {"odd": 13, "gpt": SMALL_GPT.vocab_size, "nine": NineBiasModel.vocab_size}[config.model]


def batch_for(config: RunConfig, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens rank ``rank`` sees in micro-batch ``micro`` of ``step``; a learnable target."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + (step * 64 + rank) * 16 + micro)
    vocab = vocab_size(config)
    idx = torch.randint(0, vocab, (config.batch_size, config.seq_len), generator=generator)
    return idx, (idx * 3 + 1) % vocab


def torch_param_groups(model: nn.Module, config: RunConfig) -> list[dict[str, Any]]:
    """Decayed matrices and undecayed norms/biases, with their own lr and weight decay."""
    params = dict(model.named_parameters())
    decay, no_decay = gpt_param_groups(model)
    return [
        {"params": [params[name] for name in decay], **dict(config.decay_options)},
        {"params": [params[name] for name in no_decay], **dict(config.no_decay_options)},
    ]


def make_scheduler(optimizer: torch.optim.Optimizer, config: RunConfig):
    if config.lr_schedule == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.2 * step))
    if config.lr_schedule == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return None


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


# ---- the engine side ----------------------------------------------------------------------------


def make_engine(model: nn.Module, config: RunConfig, **overrides: Any) -> ZeroOptimizer:
    options = dict(
        stage=config.stage,
        param_dtype=config.dtype(),
        reduce_dtype=config.reduce_torch_dtype(),
        policy=config.policy(),
        gradient_accumulation_steps=config.accumulation,
        max_grad_norm=config.max_grad_norm,
        offload=config.offload,
    )
    options.update(overrides)
    return ZeroOptimizer(
        model,
        OPTIMIZERS[config.optimizer],
        torch_param_groups(model, config),
        **options,
        **dict(config.optimizer_options),
    )


@dataclass
class TrainLog:
    """What a training run saw, step by step."""

    losses: list[list[float]] = field(default_factory=list)  # [step][micro] on this rank
    stepped: list[bool] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    lrs: list[list[float]] = field(default_factory=list)  # [step][group] used by the step
    scales: list[float] = field(default_factory=list)


def train_engine(
    engine: ZeroOptimizer, model: nn.Module, config: RunConfig, rank: int, snapshots: list[Snapshot] | None = None
) -> TrainLog:
    """Trains ``config.steps`` steps; with ``snapshots`` (collective), appends the full state
    before every step and after the last, for the step-by-step reference."""
    log = TrainLog()
    scheduler = make_scheduler(engine.optimizer, config)
    for step in range(config.steps):
        if snapshots is not None:
            snapshots.append(take_snapshot(engine))
        losses = []
        for micro in range(config.accumulation):
            idx, targets = batch_for(config, step, rank, micro)
            loss = model(idx, targets)
            engine.backward(loss)
            losses.append(loss.item())
        log.lrs.append([group["lr"] for group in engine.param_groups])
        log.scales.append(engine.scaler.scale)
        log.stepped.append(engine.step())
        log.grad_norms.append(engine.last_grad_norm)
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()
        log.losses.append(losses)
    if snapshots is not None:
        snapshots.append(take_snapshot(engine))
    return log


@dataclass
class Snapshot:
    """The full fp32 masters and optimizer state of a run at one point, by parameter name."""

    masters: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]
    scale: float  # the loss scale the next step's backward uses


def take_snapshot(engine: ZeroOptimizer) -> Snapshot:
    """Collective: every rank gets the full masters and optimizer state."""
    return Snapshot(engine_masters(engine), engine_optimizer_state(engine), engine.scaler.scale)


def gather_partitions(engine: ZeroOptimizer, partitions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full fp32 parameters from every rank's partitions, reassembled from the layout's pieces."""
    full: dict[str, torch.Tensor] = {}
    for group, partition in zip(engine.layout.groups, partitions):
        partition = partition.detach().float().contiguous()
        everyone = torch.empty(engine.world_size * partition.numel(), dtype=partition.dtype)
        if engine.world_size == 1:
            everyone.copy_(partition)
        else:
            _all_gather_tensor(everyone, partition)
        per_rank = everyone.view(engine.world_size, -1)
        for slot in group.params:
            values = torch.empty(slot.numel, dtype=torch.float32)
            for piece in group.pieces(slot.index):
                source = per_rank[piece.rank, piece.partition_start : piece.partition_start + piece.length]
                values[piece.param_start : piece.param_start + piece.length] = source
            full[slot.name] = values.view(slot.spec.shape)
    return full


def engine_masters(engine: ZeroOptimizer) -> dict[str, torch.Tensor]:
    return gather_partitions(engine, list(engine.masters))


def engine_optimizer_state(engine: ZeroOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name and state key: the full state tensor, or the scalar as it is."""
    per_group = [engine.optimizer.state.get(master, {}) for master in engine.masters]
    keys = sorted({key for state in per_group for key, value in state.items() if torch.is_tensor(value)})
    names = [slot.name for group in engine.layout.groups for slot in group.params]
    result: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key in keys:
        tensors = [state[key] for state in per_group]
        if all(t.dim() == 1 and t.numel() == m.numel() for t, m in zip(tensors, engine.masters)):
            for name, value in gather_partitions(engine, tensors).items():
                result[name][key] = value
        else:
            for group, tensor in zip(engine.layout.groups, tensors):
                for slot in group.params:
                    result[slot.name][key] = tensor.detach().clone()
    return result


def _tensor_state(engine: ZeroOptimizer, master: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: value for key, value in engine.optimizer.state.get(master, {}).items() if torch.is_tensor(value)}


def scalar_state(engine: ZeroOptimizer) -> list[dict[str, float]]:
    """This rank's scalar optimizer state (Adam's 'step', ...) per layout group."""
    return [
        {key: float(value) for key, value in _tensor_state(engine, master).items() if value.dim() == 0}
        for master in engine.masters
    ]


def padding_is_zero(engine: ZeroOptimizer) -> bool:
    """Padding of this rank's partitions (masters, every optimizer state) and of the flat
    buffers (everything outside a parameter slot) is exactly zero."""
    for group, master, buffer in zip(engine.layout.groups, engine.masters, engine.buffers):
        partitions = [master.detach()] + [
            value for value in _tensor_state(engine, master).values() if value.dim() == 1
        ]
        for begin, end in group.padding_ranges(engine.rank):
            if any(bool(partition[begin:end].any()) for partition in partitions):
                return False
        covered = torch.zeros(group.numel, dtype=torch.bool)
        for slot in group.params:
            covered[slot.offset : slot.end] = True
        if bool(buffer.data[~covered].float().any()):
            return False
    return True


# ---- the single-process reference -----------------------------------------------------------------


@dataclass
class Reference:
    """The reference's side of a run, step by step from the engine's own state."""

    log: TrainLog  # losses are [step][rank * accumulation + micro]; scales its own, from its overflows
    step_errors: list[StepError]
    final_state_keys: list[str]


@dataclass
class StepError:
    """How far the engine's state after one step is from the reference's step taken from the
    engine's state before it."""

    masters: float  # max |engine - reference| over every master element
    update: float  # max |master after - master before|: the step's largest move
    state_relative: float  # per state tensor kind, max |engine - reference| / max |engine|
    masters_equal: bool
    state_equal: bool


def reference_run(config: RunConfig, world_size: int, snapshots: list[Snapshot]) -> Reference:
    """Every step of the run on one process, each started from the engine's own state.

    Step t loads the engine's masters and optimizer state from before step t, so the two
    runs see the same bf16/fp16 parameters at every step. Started from its own previous step
    instead, the reference would drift from the engine chaotically: once the masters differ
    in the last fp32 bit (another summation order), some master rounds to the neighbouring
    bf16 value, the gradients then differ by bf16 roundings, and how far the runs drift
    depends on the CPU's kernels, not on the engine. Step by step, each comparison measures
    one step's arithmetic only.
    """
    model = build_model(config)
    names = trainable_names(model)
    params = dict(model.named_parameters())
    masters = {name: nn.Parameter(params[name].detach().clone().float()) for name in names}
    groups = [
        {**group, "params": [masters[name] for name in _names_of(model, group["params"]) if name in masters]}
        for group in torch_param_groups(model, config)
    ]
    optimizer = OPTIMIZERS[config.optimizer](groups, **dict(config.optimizer_options))
    ordered_masters = [param for group in groups for param in group["params"]]  # the engine's norm order
    scheduler = make_scheduler(optimizer, config)
    dtype = config.dtype()
    scale = FP16_INITIAL_SCALE if dtype == torch.float16 else 1.0
    log = TrainLog()
    errors = []
    for step in range(config.steps):
        _load_snapshot(optimizer, masters, snapshots[step])
        with torch.no_grad():
            for name in names:
                params[name].data = masters[name].detach().to(dtype or torch.float32).clone()
        # The gradient is scaled by the engine's scale of this step; this run's own scale
        # (halved on its own overflows) is logged for the comparison of the two schedules.
        engine_scale = snapshots[step].scale
        grads, losses = _reference_gradients(model, names, config, step, world_size, engine_scale)
        log.losses.append(losses)
        log.lrs.append([group["lr"] for group in optimizer.param_groups])
        log.scales.append(scale)
        if engine_scale != 1.0:
            grads = {name: grad.div_(engine_scale) for name, grad in grads.items()}
        if dtype == torch.float16 and not all(bool(torch.isfinite(g).all()) for g in grads.values()):
            scale /= 2
            log.stepped.append(False)
            log.grad_norms.append(None)
        else:
            for name, master in masters.items():
                master.grad = grads[name]
            norm = torch.nn.utils.clip_grad_norm_(ordered_masters, config.max_grad_norm or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.stepped.append(True)
            log.grad_norms.append(float(norm))
        if scheduler is not None:
            scheduler.step()
        errors.append(_step_error(masters, optimizer, snapshots[step], snapshots[step + 1]))
    keys = sorted({key for master in masters.values() for key in optimizer.state[master]})
    return Reference(log, errors, keys)


def _load_snapshot(optimizer: torch.optim.Optimizer, masters: dict[str, nn.Parameter], snapshot: Snapshot) -> None:
    with torch.no_grad():
        for name, master in masters.items():
            master.copy_(snapshot.masters[name])
            state = snapshot.state.get(name, {})
            if state:
                optimizer.state[master] = {key: value.detach().clone() for key, value in state.items()}


def _step_error(
    masters: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, before: Snapshot, after: Snapshot
) -> StepError:
    reference_masters = {name: master.detach() for name, master in masters.items()}
    reference_state = {
        (name, key): value
        for name, master in masters.items()
        for key, value in optimizer.state[master].items()
        if torch.is_tensor(value)
    }
    engine_state = {(name, key): value for name, keys in after.state.items() for key, value in keys.items()}
    same_keys = reference_state.keys() == engine_state.keys()
    return StepError(
        masters=max_abs_difference(reference_masters, after.masters),
        update=max_abs_difference(after.masters, before.masters),
        state_relative=_max_relative_by_kind(engine_state, reference_state) if same_keys else math.inf,
        masters_equal=all_equal(reference_masters, after.masters),
        state_equal=same_keys and all_equal(reference_state, engine_state),
    )


def _max_relative_by_kind(
    engine: dict[tuple[str, str], torch.Tensor], reference: dict[tuple[str, str], torch.Tensor]
) -> float:
    """Per state kind (exp_avg, exp_avg_sq, ...): the largest difference over the kind's
    largest magnitude; the kinds' magnitudes differ by orders (a gradient and its square)."""
    worst = 0.0
    for kind in {key for _, key in engine}:
        names = [name for name, key in engine if key == kind]
        difference = max(_max_abs(engine[n, kind].float() - reference[n, kind].float()) for n in names)
        magnitude = max(_max_abs(engine[n, kind]) for n in names)
        if difference:
            worst = max(worst, difference / magnitude)
    return worst


def _names_of(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    name_of = {id(param): name for name, param in model.named_parameters()}
    return [name_of[id(param)] for param in params]


def _reference_gradients(
    model: nn.Module, names: list[str], config: RunConfig, step: int, world_size: int, scale: float
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reduced fp32 gradient of one step (still scaled) and every (rank, micro) loss."""
    per_rank_micro, losses = _per_rank_micro_gradients(model, names, config, step, world_size, scale)
    return reduce_like_the_engine(per_rank_micro, names, config, world_size), losses


def _per_rank_micro_gradients(
    model: nn.Module, names: list[str], config: RunConfig, step: int, world_size: int, scale: float
) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], list[float]]:
    """Every (rank, micro) gradient of one step in fp32 (still scaled), and the losses."""
    params = dict(model.named_parameters())
    per_rank_micro = {}
    losses = []
    for rank in range(world_size):
        for micro in range(config.accumulation):
            idx, targets = batch_for(config, step, rank, micro)
            model.zero_grad(set_to_none=True)
            loss = model(idx, targets)
            (loss * (scale / config.accumulation)).backward()
            losses.append(loss.item())
            per_rank_micro[rank, micro] = {name: _fp32_grad(params[name]) for name in names}
    model.zero_grad(set_to_none=True)
    return per_rank_micro, losses


def reduce_like_the_engine(
    per_rank_micro: dict[tuple[int, int], dict[str, torch.Tensor]],
    names: list[str],
    config: RunConfig,
    world_size: int,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The reduced fp32 gradient from every (rank, micro) fp32 gradient, in the engine's order
    and, for a lower-precision ``reduce_dtype`` (default: the config's), its rounding."""
    reduce_dtype = reduce_dtype or config.effective_reduce_dtype(world_size)
    first = per_rank_micro[0, 0]
    total = {name: torch.zeros_like(first[name]) for name in names}

    def reduce(parts: list[torch.Tensor]) -> torch.Tensor:
        if reduce_dtype == torch.float32:
            return _sum_in_rank_order(parts).div_(world_size)
        return _sum_in_rank_order([part.div(world_size).to(reduce_dtype).float() for part in parts])

    if config.stage == 2:  # stage 2 reduces every backward: average over ranks per micro-batch
        for micro in range(config.accumulation):
            for name in names:
                total[name].add_(reduce([per_rank_micro[rank, micro][name] for rank in range(world_size)]))
    else:  # stage 1 accumulates locally and reduces once at the step
        for name in names:
            local = []
            for rank in range(world_size):
                accumulator = torch.zeros_like(total[name])
                for micro in range(config.accumulation):
                    accumulator.add_(per_rank_micro[rank, micro][name])
                local.append(accumulator)
            total[name].add_(reduce(local))
    return total


def _fp32_grad(param: nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(param, dtype=torch.float32) if param.grad is None else param.grad.float()


def _sum_in_rank_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total


# ---- comparing ------------------------------------------------------------------------------------


def _max_abs(tensor: torch.Tensor) -> float:
    return float(tensor.float().abs().max()) if tensor.numel() else 0.0


def max_abs_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys(), (sorted(left), sorted(right))
    return max(float((left[n].float() - right[n].float()).abs().max()) if left[n].numel() else 0.0 for n in left)


def all_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


@dataclass
class EngineOutcome:
    """Everything the comparison needs from an engine run, gathered onto every rank."""

    config: RunConfig
    world_size: int
    snapshots: list[Snapshot]  # before every step, and after the last
    losses: list[list[float]]  # [step][rank * accumulation + micro]
    log: TrainLog  # this rank's
    padding_zero_on_every_rank: bool
    scalar_state_per_rank: list[list[dict[str, float]]]
    layout_facts: dict[str, Any]


def train_and_gather(config: RunConfig, engine: ZeroOptimizer, model: nn.Module, rank: int) -> EngineOutcome:
    """Collective: trains, and gives every rank the full state before and after every step."""
    snapshots: list[Snapshot] = []
    log = train_engine(engine, model, config, rank, snapshots)
    per_rank_losses = engine.comm.all_gather_object(log.losses)
    groups = engine.layout.groups
    return EngineOutcome(
        config=config,
        world_size=engine.world_size,
        snapshots=snapshots,
        losses=[[loss for losses in per_rank_losses for loss in losses[step]] for step in range(config.steps)],
        log=log,
        padding_zero_on_every_rank=all(engine.comm.all_gather_object(padding_is_zero(engine))),
        scalar_state_per_rank=engine.comm.all_gather_object(scalar_state(engine)),
        layout_facts={
            "padding_per_rank": [list(group.padding_per_rank()) for group in groups],
            "partition_numel": [group.partition_numel for group in groups],
            "num_buckets": [len(group.buckets) for group in groups],
            "layout_names": list(engine.layout.param_names),
        },
    )


FP32_UNIT_ROUNDOFF = 2.0**-24


@dataclass(frozen=True)
class StepTolerance:
    """How far one engine step may be from the reference's step from the same state.

    Both steps start from the same fp32 masters and optimizer state, so they see the same
    bf16/fp16 parameters, and the forward and backward are the same kernels on the same
    values (CPU kernels are chosen by shape, dtype and instruction set, not by address):
    each (rank, micro-batch) gradient and loss is the same on both sides, on any CPU. What
    differs is fp32 arithmetic only, each operation within the unit roundoff u = 2^-24:

    * a reduced gradient element is a sum of n = D x accumulation terms, added in another
      order (gloo's, against rank order): two orders differ by at most 2(n - 1)u of the
      terms' magnitude;
    * the gradient norm adds N squares grouped by fragment on each rank, then over ranks:
      another grouping of a sum of N terms, within 2 log2(N) u for blocked sums, plus the
      gradient's own 2(n - 1)u, twice over in a square and halved by the root;
    * an optimizer state is a linear function of the gradient and its square, updated with
      a few roundings (lerp, addcmul, sqrt, division): within 2(2(n - 1) + 4)u of the
      state kind's largest magnitude;
    * a master is rounded at most twice per step (weight decay, then the update; the two
      runs may round differently where a vectorised kernel's tail differs from its body):
      4u of its magnitude, plus the update's own relative error (that of the state) times
      the step's largest move.

    A lost 1/D or 1/accumulation, a fragment counted twice or left out, a stale state or a
    padding element taken for a parameter is off by many orders more.
    """

    grad_norm_relative: float
    state_relative: float
    masters: float

    @classmethod
    def of(cls, world_size: int, accumulation: int, numel: int, masters_max_abs: float, max_update: float):
        u = FP32_UNIT_ROUNDOFF
        gradient = 2 * (world_size * accumulation - 1) * u
        state = 2 * gradient + 8 * u
        return cls(
            grad_norm_relative=2 * gradient + 2 * math.log2(max(numel, 2)) * u,
            state_relative=state,
            masters=4 * u * masters_max_abs + state * max_update,
        )


def compare_with_reference(outcome: EngineOutcome) -> dict[str, Any]:
    """Runs the reference (no collectives) and reports how the engine run differs from it."""
    config, log = outcome.config, outcome.log
    reference = reference_run(config, outcome.world_size, outcome.snapshots)
    errors = reference.step_errors
    final = outcome.snapshots[-1]
    state_keys = sorted({k for keys in final.state.values() for k in keys})
    return {
        "name": config.name,
        "world_size": outcome.world_size,
        "masters_equal": all(error.masters_equal for error in errors),
        "masters_max_error": max(error.masters for error in errors),
        "masters_moved": max_abs_difference(final.masters, outcome.snapshots[0].masters),
        "state_keys_match": state_keys == reference.final_state_keys,
        "masters_max_update": max(error.update for error in errors),
        "state_equal": all(error.state_equal for error in errors),
        "state_max_relative_error": max(error.state_relative for error in errors),
        "state_keys": state_keys,
        "losses_equal": outcome.losses == reference.log.losses,
        "stepped": log.stepped,
        "reference_stepped": reference.log.stepped,
        "scales": log.scales,
        "reference_scales": reference.log.scales,
        "lrs": log.lrs,
        "reference_lrs": reference.log.lrs,
        "grad_norms": log.grad_norms,
        "reference_grad_norms": reference.log.grad_norms,
        "grad_norm_max_relative_error": max(
            (abs(e - r) / r for e, r in zip(log.grad_norms, reference.log.grad_norms) if None not in (e, r)),
            default=0.0,
        ),
        "padding_zero_on_every_rank": outcome.padding_zero_on_every_rank,
        "scalar_state_per_rank": outcome.scalar_state_per_rank,
        "tolerance": StepTolerance.of(
            outcome.world_size,
            config.accumulation,
            sum(master.numel() for master in final.masters.values()),
            max(_max_abs(master) for master in final.masters.values()),
            max(error.update for error in errors),
        ),
        **outcome.layout_facts,
    }


def run_equivalence(rank: int, world_size: int, configs: list[RunConfig]) -> list[dict[str, Any]]:
    """Spawn target: train every config with the engine, then compare with the reference.

    The references need no collectives, so once every engine run is done each rank computes
    those of the configs it owns (index % world_size) in parallel with the others; the
    caller merges the ranks' lists.
    """
    owned = []
    for index, config in enumerate(configs):
        model = build_model(config)
        engine = make_engine(model, config)
        outcome = train_and_gather(config, engine, model, rank)
        engine.reducer.remove_hooks()
        if index % world_size == rank:
            owned.append(outcome)
    return [compare_with_reference(outcome) for outcome in owned]


# ---- behaviour checks (each returns plain values; all ranks run them together) --------------------


def check_alignment(rank: int, world_size: int) -> dict[str, Any]:
    """OddSizedModel in bf16, stage 2 with several buckets: aligned views that keep their storage."""
    config = RunConfig("alignment", bucket_numel=128, steps=3)
    model = build_model(config)
    engine = make_engine(model, config)
    named = _engine_params(engine)
    before = {name: param.data_ptr() for name, param in named.items()}
    aligned_before = {name: param.data_ptr() % 16 == 0 for name, param in named.items()}
    inside_before = _inside_own_buffer(engine)
    train_engine(engine, model, config, rank)
    engine.zero_grad()
    after = {name: param.data_ptr() for name, param in named.items()}
    aligned_after = {name: param.data_ptr() % 16 == 0 for name, param in named.items()}
    inside_after = _inside_own_buffer(engine)
    # The module's own parameters are the bound views (not copies made elsewhere).
    module_is_view = all(dict(model.named_parameters())[name] is param for name, param in named.items())

    offsets = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    tokens = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with torch.no_grad():
        on_view = torch._grouped_mm(tokens, model.experts, offs=offsets)
        on_copy = torch._grouped_mm(tokens, model.experts.detach().clone(), offs=offsets)
    expert_buffer = _buffer_of(engine, "experts")

    compact_config = replace(config, compact=True)
    compact_model = build_model(compact_config)
    compact_engine = make_engine(compact_model, compact_config)
    compact_misaligned = sorted(name for name, p in _engine_params(compact_engine).items() if p.data_ptr() % 16)
    return {
        "aligned_before": aligned_before,
        "aligned_after": aligned_after,
        "inside_before": inside_before,
        "inside_after": inside_after,
        "data_ptr_unchanged": before == after,
        "module_is_view": module_is_view,
        "num_buckets": [len(group.buckets) for group in engine.layout.groups],
        "experts_shape": tuple(model.experts.shape),
        "experts_in_buffer": owns_storage(expert_buffer, model.experts),
        "experts_aligned": model.experts.data_ptr() % 16 == 0,
        "grouped_mm_equal": torch.equal(on_view, on_copy),
        "compact_misaligned": compact_misaligned,
    }


def _engine_params(engine: ZeroOptimizer) -> dict[str, nn.Parameter]:
    return {slot.name: param for buffer in engine.buffers for slot, param in zip(buffer.group.params, buffer.params)}


def _buffer_of(engine: ZeroOptimizer, name: str):
    group, _ = engine.layout.param(name)
    return engine.buffers[group.index]


def _inside_own_buffer(engine: ZeroOptimizer) -> dict[str, bool]:
    return {
        slot.name: owns_storage(buffer, param)
        for buffer in engine.buffers
        for slot, param in zip(buffer.group.params, buffer.params)
    }


def check_gradient_memory(rank: int, world_size: int) -> dict[str, Any]:
    """The gradient tensors the reducer holds after a backward: stage 1 after one, stage 2
    (fp32 and bf16 reduction) after the last micro-batch of each of three steps."""
    result = {}
    for stage, reduce_dtype in ((1, "float32"), (2, "float32"), (2, "bfloat16")):
        config = RunConfig(f"memory-stage{stage}", stage=stage, bucket_numel=128, reduce_dtype=reduce_dtype)
        model = build_model(config)
        engine = make_engine(model, config)
        after_backward = []
        for step in range(3 if stage == 2 else 1):
            for micro in range(config.accumulation):
                idx, targets = batch_for(config, step, rank, micro)
                engine.backward(model(idx, targets))
            after_backward.append(_held_gradient_storages(engine))
            report = engine.memory_report()
            engine.step()
            engine.zero_grad()
        result[stage if stage == 1 else f"2-{reduce_dtype}"] = {
            "held_numels": sorted(t.numel() for t in engine.reducer.held_tensors()),
            "held_after_backward": after_backward,
            "partition_numels": sorted(group.partition_numel for group in engine.layout.groups),
            "group_numels": sorted(group.numel for group in engine.layout.groups),
            "num_buckets": [len(group.buckets) for group in engine.layout.groups],
            "largest_bucket_reduction_bytes": max(
                _reduction_bytes(bucket, reduce_dtype) for group in engine.layout.groups for bucket in group.buckets
            ),
            "grads_none": all(param.grad is None for param in model.parameters()),
            "report_bytes": (report.gradient_bytes, report.bucket_pool_bytes),
        }
        engine.reducer.remove_hooks()
    return result


def _held_gradient_storages(engine: ZeroOptimizer) -> dict[str, Any]:
    """The storages the reducer holds, as (data_ptr, bytes), and which are the partitions."""
    held = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in engine.reducer.held_tensors()}
    partitions = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in engine.reducer.partition_grads}
    return {"held": sorted(held), "partitions": sorted(partitions)}


def _reduction_bytes(bucket, reduce_dtype: str) -> int:
    """One bucket's reduction buffers, at most: staging, the receive buffer of a bf16
    reduction on gloo (the whole bucket; half at two ranks), an fp32 temporary for its
    reduced partition."""
    if reduce_dtype == "float32":
        return 4 * bucket.numel + 4 * bucket.partition_numel
    return 2 * bucket.numel + 2 * bucket.numel + 4 * bucket.partition_numel


def check_stage2_peak_gradient_memory(rank: int, world_size: int, reduce_dtype: str = "float32") -> dict[str, Any]:
    """Peak gradient bytes while one stage-2 backward runs, with many small buckets."""
    config = RunConfig("stage2-peak", model="gpt", stage=2, bucket_numel=1000, reduce_dtype=reduce_dtype)
    model = build_model(config)
    engine = make_engine(model, config)
    probe = GradientMemoryProbe(engine, model)
    idx, targets = batch_for(config, 0, rank, 0)
    engine.backward(model(idx, targets))
    buckets = [bucket for group in engine.layout.groups for bucket in group.buckets]
    return {
        "peak_bytes": probe.peak_bytes,
        "partition_bytes": 4 * sum(group.partition_numel for group in engine.layout.groups),
        "full_gradient_bytes": 4 * sum(group.numel for group in engine.layout.groups),
        "num_buckets": len(buckets),
        # One bucket's staging buffer and its reduced partition.
        "largest_bucket_bytes": 4 * max(bucket.numel + bucket.partition_numel for bucket in buckets),
    }


def check_overflow_on_one_rank(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """fp16: at step 1 rank 1 alone makes an inf gradient, for a parameter whose reduced
    gradient only rank 0 holds. So rank 0 alone sees the overflow and rank 1 alone made it;
    both must skip the step together."""
    config = RunConfig(f"overflow-stage{stage}", stage=stage, param_dtype="float16", steps=3, bucket_numel=256)
    model = build_model(config)
    engine = make_engine(model, config)
    poisoned = next(
        slot.name
        for group in engine.layout.groups
        for slot in group.params
        if slot.numel and {piece.rank for piece in group.pieces(slot.index)} == {0}
    )
    inject_at_step = 1
    current_step = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and current_step[0] == inject_at_step:
            return torch.full_like(grad, math.inf)
        return grad

    dict(model.named_parameters())[poisoned].register_hook(poison)
    stepped, scales, masters_changed, buffer_changed = [], [], [], []
    for step in range(config.steps):
        current_step[0] = step
        masters_before = [m.detach().clone() for m in engine.masters]
        buffers_before = [b.data.clone() for b in engine.buffers]
        for micro in range(config.accumulation):
            idx, targets = batch_for(config, step, rank, micro)
            engine.backward(model(idx, targets))
        scales.append(engine.scaler.scale)
        stepped.append(engine.step())
        engine.zero_grad()
        masters_changed.append(any(not torch.equal(a, b) for a, b in zip(masters_before, engine.masters)))
        buffer_changed.append(any(not torch.equal(a, b.data) for a, b in zip(buffers_before, engine.buffers)))
    return {
        "poisoned": poisoned,
        "stepped": stepped,
        "scales": scales + [engine.scaler.scale],
        "masters_changed": masters_changed,
        "buffer_changed": buffer_changed,
        "skipped_steps": engine.scaler.skipped_steps,
        "global_steps": engine.global_steps,
        "masters_finite": all(bool(torch.isfinite(m).all()) for m in engine.masters),
    }


def check_frozen_and_tied(rank: int, world_size: int) -> dict[str, Any]:
    """TinyGPT with wpe frozen: wpe stays out of the buffers; wte/lm_head counted once."""
    config = RunConfig("frozen-tied", model="gpt", param_dtype=None, frozen=("wpe.weight",), steps=4, seq_len=8)
    model = build_model(config)
    frozen_before = model.wpe.weight.detach().clone()
    engine = make_engine(model, config)
    outcome = train_and_gather(config, engine, model, rank)
    comparison = compare_with_reference(outcome) if rank == 0 else None
    unique_trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return {
        "layout_names": list(engine.layout.param_names),
        "layout_param_numel": sum(group.param_numel for group in engine.layout.groups),
        "unique_trainable_numel": sum(unique_trainable.values()),
        "frozen_unchanged": torch.equal(model.wpe.weight, frozen_before),
        "frozen_in_a_buffer": any(owns_storage(buffer, model.wpe.weight) for buffer in engine.buffers),
        "still_tied": model.lm_head.weight is model.wte.weight,
        "tied_in_a_buffer": any(owns_storage(buffer, model.wte.weight) for buffer in engine.buffers),
        "comparison": comparison,
    }


def check_different_models(rank: int, world_size: int) -> str:
    """Rank 1 builds another model; the engine must refuse on every rank, naming the ranks."""
    config = RunConfig("mismatch", model="gpt" if rank == 1 else "odd", param_dtype=None)
    model = build_model(config)
    try:
        make_engine(model, config)
    except ValueError as error:
        return str(error)
    return "no error"


def check_shard_state_dict(rank: int, world_size: int) -> dict[str, Any]:
    """ZeroOptimizer.state_dict() / load_state_dict() at D > 1: a rank's own shard resumes
    the run bit for bit; another rank's shard, given to one rank only or to all, is refused
    on every rank (no rank left blocked in the re-gather) and changes nothing."""
    import copy

    config = RunConfig("shard-state-dict", model="gpt", stage=2, bucket_numel=500, steps=2)
    model = build_model(config)
    engine = make_engine(model, config)
    train_engine(engine, model, config, rank)
    saved = copy.deepcopy(engine.state_dict())
    continued = replace(config, seed=1)  # other batches for the steps after the save
    train_engine(engine, model, continued, rank)

    resumed_model = build_model(config)
    resumed = make_engine(resumed_model, config)
    errors = {}
    others = engine.comm.all_gather_object(saved)
    for label, given in (("rank 1 given rank 0's", others[0] if rank == 1 else saved), ("swapped", others[1 - rank])):
        masters = [m.detach().clone() for m in resumed.masters]
        try:
            resumed.load_state_dict(given)
            errors[label] = "loaded"
        except ValueError as error:
            errors[label] = str(error)
        errors[label + " unchanged"] = all(torch.equal(a, b) for a, b in zip(masters, resumed.masters))
    resumed.load_state_dict(saved)
    train_engine(resumed, resumed_model, continued, rank)
    return {
        "errors": errors,
        "masters_max_error": max(float((a - b).abs().max()) for a, b in zip(engine.masters, resumed.masters)),
        "params_equal": all(torch.equal(a.data, b.data) for a, b in zip(engine.buffers, resumed.buffers)),
        "global_steps": resumed.global_steps,
    }


REDUCE_DTYPE_CONFIGS = (
    # stage 1 rounds its fp32 sum of two bf16 micro-batch gradients
    RunConfig("reduce-bf16-stage1", stage=1, reduce_dtype="bfloat16"),
    # fp32 gradients rounded to bf16, several buckets
    RunConfig(
        "reduce-bf16-stage2-fp32-params", model="gpt", param_dtype=None, reduce_dtype="bfloat16", bucket_numel=500
    ),
    # None: the parameter dtype, here fp16 under a loss scale
    RunConfig("reduce-param-dtype-fp16-stage2", param_dtype="float16", reduce_dtype=None, bucket_numel=128),
    RunConfig("reduce-param-dtype-bf16-stage1", model="gpt", stage=1, reduce_dtype=None),
)


def check_reduce_dtype(rank: int, world_size: int) -> dict[str, Any]:
    """One step's reduced gradient with a low-precision reduce dtype, against the reference
    that rounds the same way (the engine sums in fp32 in rank order, as it does) and the
    fp32 one; the reduce-scatter bytes against the same run reducing in fp32."""
    results = {}
    for config in REDUCE_DTYPE_CONFIGS:
        moved, grads = {}, {}
        for reduce_dtype in (config.reduce_dtype, "float32"):
            run = replace(config, reduce_dtype=reduce_dtype)
            model = build_model(run)
            engine = make_engine(model, run)
            for micro in range(run.accumulation):
                engine.backward(model(*batch_for(run, 0, rank, micro)))
            grads[reduce_dtype] = {name: engine.get_full_grad(name) for name in engine.layout.param_names}
            moved[reduce_dtype] = engine.comm.bytes_moved["reduce_scatter"]
            engine.reducer.remove_hooks()
        model = build_model(config)
        names = trainable_names(model)
        if config.dtype() is not None:
            for param in model.parameters():
                param.data = param.data.to(config.dtype())
        scale = FP16_INITIAL_SCALE if config.dtype() == torch.float16 else 1.0
        per_rank_micro, _ = _per_rank_micro_gradients(model, names, config, 0, world_size, scale)
        rounded = reduce_like_the_engine(per_rank_micro, names, config, world_size)
        exact = reduce_like_the_engine(per_rank_micro, names, config, world_size, torch.float32)
        unscale = lambda grads: {name: grad / scale for name, grad in grads.items()}  # noqa: E731
        engine_grads = grads[config.reduce_dtype]
        results[config.name] = {
            "vs_rounding_reference": max_abs_difference(engine_grads, unscale(rounded)),
            "vs_fp32_reference": max_abs_difference(engine_grads, unscale(exact)),
            "fp32_run_vs_fp32_reference": max_abs_difference(grads["float32"], unscale(exact)),
            "largest_gradient": max(float(grad.abs().max()) for grad in engine_grads.values()),
            "reduce_scatter_bytes": moved[config.reduce_dtype],
            "fp32_reduce_scatter_bytes": moved["float32"],
        }
    return results


def check_all_gather(rank: int, world_size: int) -> dict[str, float]:
    """Collectives.all_gather_into against torch's all-gather, per way of calling it: the
    input a slice of the output (the engine's) or a separate tensor, sync or async, bf16
    and fp32; the max abs difference of each (0 when equal)."""
    from zeroshard.comm import Collectives

    comm = Collectives()
    differences = {}
    for dtype in (torch.bfloat16, torch.float32):
        mine = torch.arange(1000, dtype=torch.float32).to(dtype) * (rank + 1) - 7 * rank
        expected = torch.empty(world_size * 1000, dtype=dtype)
        _all_gather_tensor(expected, mine)
        for aliased in (True, False):
            for async_op in (True, False):
                output = torch.full((world_size * 1000,), float("nan"), dtype=dtype)
                own = output[rank * 1000 : (rank + 1) * 1000]
                if aliased:
                    own.copy_(mine)
                handle = comm.all_gather_into(output, own if aliased else mine.clone(), async_op=async_op)
                handle.wait()
                name = f"{dtype}-{'slice' if aliased else 'separate'}-{'async' if async_op else 'sync'}"
                differences[name] = (output.float() - expected.float()).abs().nan_to_num(float("inf")).max().item()
    return differences


def run_checks(rank: int, world_size: int, checks: list[tuple[str, str, tuple]]) -> dict[str, Any]:
    """Spawn target: run (label, check name, extra args) in order on every rank; results by label."""
    functions: dict[str, Callable[..., Any]] = {
        "alignment": check_alignment,
        "gradient_memory": check_gradient_memory,
        "stage2_peak_gradient_memory": check_stage2_peak_gradient_memory,
        "overflow": check_overflow_on_one_rank,
        "frozen_and_tied": check_frozen_and_tied,
        "different_models": check_different_models,
        "shard_state_dict": check_shard_state_dict,
        "reduce_dtype": check_reduce_dtype,
        "equivalence": run_equivalence,
        "all_gather": check_all_gather,
    }
    return {label: functions[name](rank, world_size, *args) for label, name, args in checks}
