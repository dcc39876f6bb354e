"""Muon under ZeRO (issue 32): (a) owner layouts of real model shapes, (b) step time against
DeepSpeed 0.19.8's Muon ZeRO-2.

(a) Layout only, no tensors: Llama-3-8B and Qwen3-30B-A3B shapes (bf16), the 2-D weights of
the blocks (and every expert matrix) in owner groups, the embeddings, head and norms in an
even group, at D = 8 and 64 (Qwen also at EP = 8). Per layout: the Newton-Schulz cost
imbalance (the largest rank's ``max(M, N) * min(M, N)^2`` over the mean; goal <= 1.05), the
whole-matrix lower bound any assignment of whole matrices meets (the mean, the largest
matrix, and two of the D + 1 largest on one rank), and the padding, which in an owner group
includes the memory imbalance (every rank's partition is the longest run), as a share of the
parameter bytes (goal <= 1%), with two lower bounds: matrices pooled over the groups, and
per group ("per group": every rank's partition of a group has one size, so each group's
partition holds at least two of its D + 1 largest matrices); and the goal's figure, "rank
memory": what the ranks hold over the model's bytes, less one (:func:`rank_memory_excess`).

(b) TinyGPT of about 3.7M parameters (vocab 2048, d_model 256, 4 layers, sequences of 64, 8
per rank), bf16 parameters, fp32 masters, clipping at 1.0, gloo with one thread per rank, at
D = 2 and 4, in one process group per D under torchrun:

* DeepSpeed 0.19.8 ZeRO stage 2, optimizer ``Muon`` (MuonWithAuxAdam: ``use_muon`` on the
  blocks' 2-D weights, its Adam for the rest), ``ns_method`` "standard" (torch's iteration);
* zeroshard stage 2, ``torch.optim.Muon`` for the same matrices and ``torch.optim.AdamW`` for
  the rest.

Both sides' Newton-Schulz calls are counted (DeepSpeed's ``muon_update``, torch's
``_zeropower_via_newtonschulz``), summed over the ranks per step. Rounds alternate the two
(the order flips every round); the figures are medians over rounds and ranks, and the median
of the per-round ratio.

    .venv/bin/python benchmarks/muon.py [--layout-only] [--world-sizes 2 4] [--rounds 7] [--steps 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from torchrun_job import add_round_arguments, exit_worker, run_rounds, write_gathered

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH = 2048, 256, 4, 4, 64, 8
MUON_LR, ADAM_LR, MOMENTUM, WEIGHT_DECAY, CLIP = 0.02, 3e-4, 0.95, 0.1, 1.0
VARIANTS = ("deepspeed muon stage 2", "zeroshard muon stage 2")


# ---- (a) layouts ----------------------------------------------------------------------------------


def llama3_8b() -> tuple[list, list, list]:
    """(Muon matrices, expert stacks, AdamW parameters) of Llama-3-8B, as ParamSpecs."""
    from zeroshard.layout import ParamSpec

    hidden, inter, kv, layers, vocab = 4096, 14336, 1024, 32, 128256
    matrices, rest = [], [ParamSpec("embed", (vocab, hidden), "bfloat16"), ParamSpec("head", (vocab, hidden), "bfloat16")]
    for i in range(layers):
        for name, shape in (
            ("q", (hidden, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, hidden)),
            ("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)),
        ):  # fmt: skip
            matrices.append(ParamSpec(f"layers.{i}.{name}", shape, "bfloat16"))
        rest += [ParamSpec(f"layers.{i}.norm{j}", (hidden,), "bfloat16") for j in (1, 2)]
    return matrices, [], rest


def qwen3_30b_a3b(ep: int) -> tuple[list, list, list]:
    """(Muon matrices, expert stacks of E / ep experts, AdamW parameters) of Qwen3-30B-A3B."""
    from zeroshard.layout import ParamSpec

    hidden, q, kv, layers, vocab, experts, inter = 2048, 4096, 512, 48, 151936, 128, 768
    matrices, stacks = [], []
    rest = [ParamSpec("embed", (vocab, hidden), "bfloat16"), ParamSpec("head", (vocab, hidden), "bfloat16")]
    local = experts // ep
    for i in range(layers):
        for name, shape in (("q", (q, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, q)), ("router", (experts, hidden))):
            matrices.append(ParamSpec(f"layers.{i}.{name}", shape, "bfloat16"))
        for name, shape in (("gate", (local, inter, hidden)), ("up", (local, inter, hidden)), ("down", (local, hidden, inter))):
            stacks.append(ParamSpec(f"layers.{i}.experts.{name}", shape, "bfloat16"))
        rest += [ParamSpec(f"layers.{i}.norm{j}", (hidden,), "bfloat16") for j in (1, 2, 3, 4)]
    return matrices, stacks, rest


def build(model: tuple[list, list, list], world_size: int, ep: int, owner: bool):
    """The layout of ``model`` at (D, EP): owner groups for the matrices and stacks (or even
    groups, ``owner=False``, for comparison), an even group for the rest."""
    from zeroshard.layout import ExpertMesh, GroupSpec, LayoutPolicy, build_layout

    matrices, stacks, rest = model
    groups: list = [GroupSpec(tuple(matrices), owner=owner), list(rest)]
    if stacks:
        groups.append(ExpertMesh(world_size, ep).expert_group(stacks, 128, owner=owner))
    return build_layout(groups, world_size, LayoutPolicy.native())


def whole_matrix_bound(model: tuple[list, list, list], world_size: int, ep: int, measure) -> float:
    """A lower bound on the imbalance of ``measure`` (a matrix shape's Newton-Schulz cost, or
    its elements) under any assignment of whole matrices to ranks: the largest of the mean,
    the largest matrix, and the two smallest of the D + 1 largest (two of them share a rank),
    over the mean. Experts count on their expert-DP group (D / EP ranks), each rank of it
    carrying the dense matrices' mean too."""
    matrices, stacks, _ = model
    dense = [measure(spec.shape) for spec in matrices]
    expert = [measure(spec.shape[1:]) for spec in stacks for _ in range(spec.shape[0])]
    mean = sum(dense) / world_size + sum(expert) / (world_size // ep)
    return max(mean, _fullest_rank(dense + expert if ep == 1 else dense, world_size)) / mean


def uniform_partition_bound(model: tuple[list, list, list], world_size: int, ep: int) -> float:
    """A lower bound on the owner groups' padding, as a share of their elements, when every
    rank's partition of a group has one size (as in zeroshard's formats): each group's
    partition holds at least its mean, its largest matrix and two of its D + 1 largest;
    the dense matrices over D ranks, the experts over their expert-DP group (D / EP)."""
    matrices, stacks, _ = model
    groups = [([math.prod(spec.shape) for spec in matrices], world_size)]
    if stacks:
        groups.append(([math.prod(spec.shape[1:]) for spec in stacks for _ in range(spec.shape[0])], world_size // ep))
    padding = 0
    for sizes, ranks in groups:
        partition = max(math.ceil(sum(sizes) / ranks), _fullest_rank(sizes, ranks))
        padding += ranks * partition - sum(sizes)
    return padding / sum(sum(sizes) for sizes, _ in groups)


def _fullest_rank(values: list[int], ranks: int) -> int:
    """The least that some rank holds when ``values`` go whole to ``ranks`` ranks, the mean
    aside: the largest value, and the two smallest of the ranks + 1 largest."""
    ordered = sorted(values, reverse=True)
    pair = ordered[ranks - 1] + ordered[ranks] if len(ordered) > ranks else 0
    return max(ordered[0], pair)


def layout_report() -> None:
    print("(a) owner layouts, bf16, native policy (16-byte alignment)")
    from zeroshard.layout import newton_schulz_cost

    header = (
        f"{'model':<16}{'D':>4}{'EP':>4}{'NS max/mean':>13}{'bound':>8}{'owner padding':>15}"
        f"{'bound':>8}{'per group':>11}{'layout padding':>16}{'rank memory':>13}{'even layout':>13}"
    )
    print(header)
    print("-" * len(header))
    cases = [("Llama-3-8B", llama3_8b(), 1)] + [(f"Qwen3-30B-A3B", qwen3_30b_a3b(ep), ep) for ep in (1, 8)]
    for label, model, ep in cases:
        for world_size in (8, 64):
            layout = build(model, world_size, ep, owner=True)
            owner_numel = sum(g.param_numel for g in layout.groups if g.owner)
            owner_padding = sum(g.inter_param_padding + g.tail_padding for g in layout.groups if g.owner)
            even = build(model, world_size, ep, owner=False)
            print(
                f"{label:<16}{world_size:>4}{ep:>4}{layout.owner_balance().imbalance:>13.3f}"
                f"{whole_matrix_bound(model, world_size, ep, newton_schulz_cost):>8.3f}"
                f"{owner_padding / owner_numel:>15.2%}{whole_matrix_bound(model, world_size, ep, math.prod) - 1:>8.2%}"
                f"{uniform_partition_bound(model, world_size, ep):>11.2%}"
                f"{layout.padding().fraction:>16.2%}{rank_memory_excess(layout):>13.2%}{even.padding().fraction:>13.2%}"
            )


def rank_memory_excess(layout) -> float:
    """What every rank holds (one partition of each group, each its group's longest run)
    over its share of the model (every parameter once over the job, an expert group's once
    per expert-parallel rank), less one: the padding and the imbalance in memory. Unlike
    ``Layout.padding()``, which weighs each group's padding against its own flat buffer (an
    expert group's: one expert-parallel rank's experts), this counts what the job holds."""
    from zeroshard.layout import itemsize

    held = layout.world_size * sum(g.partition_numel * itemsize(g.dtype) for g in layout.groups)
    model = sum(g.param_numel * itemsize(g.dtype) * (layout.world_size // g.world_size) for g in layout.groups)
    return held / model - 1


# ---- (b) step time, worker (one rank under torchrun) --------------------------------------------------


def _model():
    import torch

    from zeroshard.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, n_embd=D_MODEL))


def _is_matrix(name: str, param) -> bool:
    return param.ndim == 2 and name.startswith("blocks.")


def _batch(step: int, rank: int):
    import torch

    generator = torch.Generator().manual_seed(step * 7919 + rank)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


CALLS = {"ns": 0}


def _count_calls() -> None:
    """Count Newton-Schulz calls on both sides: torch's iteration, DeepSpeed's muon_update
    (one iteration per call; its ZeRO-2 imports it from the module at each step)."""
    import torch.optim._muon as torch_muon
    from deepspeed.runtime.zero.muon import original_muon

    def counted(original):
        def call(*args, **kwargs):
            CALLS["ns"] += 1
            return original(*args, **kwargs)

        return call

    torch_muon._zeropower_via_newtonschulz = counted(torch_muon._zeropower_via_newtonschulz)
    original_muon.muon_update = counted(original_muon.muon_update)


class DeepSpeedMuon:
    def __init__(self) -> None:
        import deepspeed

        self.model = _model()
        for name, param in self.model.named_parameters():
            param.use_muon = _is_matrix(name, param)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "optimizer": {
                "type": "Muon",
                "params": {"lr": MUON_LR, "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM,
                           "weight_decay": WEIGHT_DECAY, "ns_method": "standard"},
            },  # fmt: skip
            "bf16": {"enabled": True},
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(), config=config)

    def step(self, idx, targets) -> float:
        loss = self.engine(idx, targets)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss)


class ZeroshardMuon:
    def __init__(self) -> None:
        import torch

        from zeroshard.engine import ZeroOptimizer

        self.model = _model()
        named = list(self.model.named_parameters())
        matrices = [p for n, p in named if _is_matrix(n, p)]
        rest = [p for n, p in named if not _is_matrix(n, p)]
        groups = [{"params": matrices}, {"params": rest, "optimizer": torch.optim.AdamW, "lr": ADAM_LR}]
        self.engine = ZeroOptimizer(
            self.model, torch.optim.Muon, groups, stage=2, param_dtype=torch.bfloat16, max_grad_norm=CLIP,
            lr=MUON_LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
        )  # fmt: skip

    def step(self, idx, targets) -> float:
        loss = self.model(idx, targets)
        self.engine.backward(loss)
        self.engine.step()
        self.engine.zero_grad()
        return float(loss)


def _timed_step(variant, step: int, rank: int) -> dict[str, float]:
    import torch.distributed as dist

    idx, targets = _batch(step, rank)
    dist.barrier()
    calls = CALLS["ns"]
    cpu, start = time.process_time(), time.perf_counter()
    loss = variant.step(idx, targets)
    return {
        "total": time.perf_counter() - start,
        "cpu": time.process_time() - cpu,
        "ns_calls": CALLS["ns"] - calls,
        "loss": loss,
    }


def worker(out_path: Path, rounds: int, steps: int, warmup: int) -> None:
    import importlib

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does it all
    deepspeed.init_distributed(dist_backend="gloo")
    _count_calls()
    rank = dist.get_rank()
    variants = {VARIANTS[0]: DeepSpeedMuon(), VARIANTS[1]: ZeroshardMuon()}
    records: dict[str, list[list[dict]]] = {name: [] for name in variants}
    for round_index in range(warmup + rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            timed = [_timed_step(variants[name], round_index * steps + s, rank) for s in range(steps)]
            if round_index >= warmup:
                records[name].append(timed)
    params = sum(p.numel() for p in variants[VARIANTS[1]].model.parameters())
    matrices = sum(1 for n, p in variants[VARIANTS[1]].model.named_parameters() if _is_matrix(n, p))
    write_gathered(out_path, records, params=params, matrices=matrices)
    exit_worker()


# ---- (b) launcher and report -----------------------------------------------------------------------


def launch(world_size: int, rounds: int, steps: int, warmup: int) -> dict:
    return run_rounds(__file__, world_size, rounds, steps, warmup)


def step_report(result: dict) -> None:
    world_size, ranks = result["world_size"], result["ranks"]
    print(f"\nD = {world_size}: {result['params']:,} parameters, {result['matrices']} Muon matrices; medians over rounds and ranks")
    header = f"{'variant':<26}{'step ms':>9}{'cpu ms':>9}{'NS calls/step (all ranks)':>27}{'loss':>8}"
    print(header)
    print("-" * len(header))
    for name in VARIANTS:
        steps = [record for rank in ranks for round_ in rank[name] for record in round_]
        calls = [sum(rank[name][r][s]["ns_calls"] for rank in ranks) for r in range(len(ranks[0][name])) for s in range(len(ranks[0][name][r]))]
        print(
            f"{name:<26}{1e3 * statistics.median(s['total'] for s in steps):>9.1f}"
            f"{1e3 * statistics.median(s['cpu'] for s in steps):>9.1f}{statistics.median(calls):>27}"
            f"{steps[-1]['loss']:>8.3f}"
        )
    ratios = []
    for rank in ranks:
        for ds_round, zs_round in zip(rank[VARIANTS[0]], rank[VARIANTS[1]]):
            ds = statistics.median(s["total"] for s in ds_round)
            ratios.append(statistics.median(s["total"] for s in zs_round) / ds)
    print(f"zeroshard / DeepSpeed step time, median of per-round ratios: {statistics.median(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout-only", action="store_true", help="(a) only")
    add_round_arguments(parser)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.rounds, args.steps, args.warmup)
        return
    start = time.perf_counter()
    layout_report()
    if not args.layout_only:
        print(
            f"\n(b) TinyGPT vocab {VOCAB}, d_model {D_MODEL}, {LAYERS} layers, seq {SEQ}, batch {BATCH} per rank; bf16 "
            f"params, fp32 masters, Muon lr {MUON_LR} + Adam(W) lr {ADAM_LR}, clip {CLIP}; gloo, 1 thread per rank; "
            f"{args.rounds} rounds x {args.steps} steps"
        )
        for world_size in args.world_sizes:
            step_report(launch(world_size, args.rounds, args.steps, args.warmup))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
