"""Worker code for tests/test_attestation_engine.py (module level, so spawned ranks import it)."""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_workers import SAVE_POLICY, build, full_state, train

from zeroshard.checkpoint import loader
from zeroshard.checkpoint.attest.attestation import AttestationError
from zeroshard.checkpoint.engine_io import load_checkpoint, load_checkpoint_attested, save_checkpoint


def refused_on_every_rank(rank: int, world: int, out: str) -> dict:
    """Save, train on; then a load whose exp_avg rank 1 alone never reads (a stale state):
    every rank refuses it and every engine is as before. Then the correct load attests."""
    model, engine = build(seed=0, stage=2, policy=SAVE_POLICY)
    train(model, engine, 0, 2)
    path = save_checkpoint(engine, Path(out) / "ckpt")
    at_save = full_state(engine)
    train(model, engine, 2, 1)
    before = full_state(engine)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    original = loader._fill

    def stale_on_rank_1(source, plan, key, dest, evidence):
        return dest if key == "exp_avg" and rank == 1 else original(source, plan, key, dest, evidence)

    loader._fill = stale_on_rank_1
    try:
        load_checkpoint(engine, path)
        message, kind = None, None
    except AttestationError as err:
        message, kind = str(err), type(err).__name__
    finally:
        loader._fill = original
    after = full_state(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and all(
        torch.equal(params_before[n], p) for n, p in model.named_parameters()
    )
    _, attestation = load_checkpoint_attested(engine, path)
    loaded = full_state(engine)
    return {
        "message": message,
        "kind": kind,
        "unchanged": unchanged,
        "line": attestation.line(),
        "exact": all(torch.equal(loaded[k], at_save[k]) for k in at_save),
    }
