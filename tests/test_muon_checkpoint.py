"""Checkpoints of ZeroOptimizer runs with torch.optim.Muon (matrices, in owner groups) and
torch.optim.AdamW (the rest), on spawned gloo ranks (issue 32, parts 4 and 6).

* a TinyGPT run at D = 4 and a MoEGPT run at (D, EP) = (4, 2) save natively; the momentum
  buffers are stored per parameter as ``momentum_buffer``, beside AdamW's states;
* loaded at D = 3 (native and through the universal conversion) and the MoE run at (2, 1)
  and (2, 2), with no conversion step, every fp32 master and optimizer state equals the
  source's bit for bit (resharding copies values), attested, and a further step trains;
* the fp32 export loads strictly into the model and holds the source's masters;
* ``inspect`` names each group's optimizer;
* a Muon checkpoint loads module-only into an AdamW engine and the reverse, keeping the
  loading run's optimizer state; a full load across them is refused on every rank and
  changes nothing; engines with a parameter that is not a matrix in a Muon group, or Muon
  options torch refuses (at construction or only at a step), are refused on every rank.

Three spawns (D = 4, 3, 2), every check of a world size in its spawn.
"""

from __future__ import annotations

import pytest
import torch
from muon_checkpoint_workers import Run
from safetensors import safe_open
from safetensors.torch import load_file

from zeroshard.checkpoint import open_checkpoint
from zeroshard.cli.main import main
from zeroshard.launch import spawn

GPT = Run()
MOE = Run(model="moe", ep=2)
ADAMW = Run(muon=False)
LOADS_AT_3 = [("gpt", Run(stage=1)), ("universal", GPT)]
LOADS_AT_2 = [("moe", Run(model="moe", ep=1)), ("moe", Run(model="moe", ep=2, stage=1))]


def _grouped(world_size: int, calls: list) -> list[list]:
    from muon_checkpoint_workers import grouped

    return spawn(grouped, world_size, (calls,), backend="gloo", timeout_s=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from zeroshard.checkpoint.export.fp32 import to_fp32
    from zeroshard.checkpoint.universal import to_universal

    root = tmp_path_factory.mktemp("muonckpt")
    dirs = {name: str(root / name) for name in ("gpt", "moe", "adamw", "refgpt", "refmoe", "refadamw", "universal", "fp32")}
    at_4 = _grouped(
        4,
        [
            ("source_run", (GPT, dirs["gpt"], dirs["refgpt"])),
            ("source_run", (MOE, dirs["moe"], dirs["refmoe"])),
            ("source_run", (ADAMW, dirs["adamw"], dirs["refadamw"])),
        ],
    )
    to_universal(dirs["gpt"], dirs["universal"], progress=False)
    to_fp32(dirs["gpt"], dirs["fp32"], progress=False)
    at_3 = _grouped(
        3,
        [("resumed_run", (run, dirs[name], dirs["refgpt"])) for name, run in LOADS_AT_3]
        + [
            ("module_only_run", (ADAMW, dirs["gpt"], dirs["refgpt"])),
            ("module_only_run", (GPT, dirs["adamw"], dirs["refadamw"])),
            ("refused_load", (ADAMW, dirs["gpt"])),
            ("refused_load", (GPT, dirs["adamw"])),
            ("refused_engines", ()),
        ],
    )
    at_2 = _grouped(2, [("resumed_run", (run, dirs[name], dirs["refmoe"])) for name, run in LOADS_AT_2])
    return {"dirs": dirs, "at_4": at_4, "at_3": at_3, "at_2": at_2}


def test_sources_train_muon_in_owner_groups(runs):
    gpt, moe, adamw = runs["at_4"][0]
    assert gpt["owners"] == [True, False] and moe["owners"] == [True, False, True]
    assert adamw["owners"] == [False]
    assert gpt["momentum"] == ["momentum_buffer"] and adamw["momentum"] == ["exp_avg", "exp_avg_sq"]


def test_rank_files_store_momentum_buffer_per_group(runs):
    directory = open_checkpoint(runs["dirs"]["gpt"]).directory
    with safe_open(directory / "rank-00000-of-00004.safetensors", framework="pt") as handle:
        keys = set(handle.keys())
    assert "group0.state.momentum_buffer" in keys and "group1.state.exp_avg" in keys
    assert "group0.state.exp_avg" not in keys


def _loaded(runs):
    for world_size, loads, first in ((3, LOADS_AT_3, 0), (2, LOADS_AT_2, 0)):
        for index, (name, run) in enumerate(loads):
            yield world_size, name, run, [ranks[first + index] for ranks in runs[f"at_{world_size}"]]


def test_loads_at_another_d_and_ep_equal_the_saved_state_bit_for_bit(runs):
    checked = 0
    for world_size, name, run, outcomes in _loaded(runs):
        for rank, outcome in enumerate(outcomes):
            where = f"{name} -> D={world_size} {run} rank {rank}"
            assert outcome["keys"] == [], where
            assert any(key.startswith("momentum_buffer/") for key in outcome["differing"]), where
            assert {key: n for key, n in outcome["differing"].items() if n} == {}, where
            assert "attested" in outcome["attested"] and outcome["finite"], where
            checked += 1
    assert checked == 3 * 2 + 2 * 2


def test_fp32_export_loads_strictly_and_holds_the_masters(runs):
    from muon_workers import GPT as CONFIG

    from zeroshard.models import TinyGPT

    model = TinyGPT(CONFIG)
    model.load_state_dict(load_file(f"{runs['dirs']['fp32']}/model.safetensors"), strict=True)
    reference = load_file(f"{runs['dirs']['refgpt']}/state.safetensors")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), reference[f"fp32/{name}"]), name


def test_inspect_names_each_groups_optimizer(runs, capsys):
    for name in ("gpt", "universal"):
        assert main(["inspect", runs["dirs"][name]]) == 0
        out = capsys.readouterr().out
        assert "torch.optim.Muon+torch.optim.adamw.AdamW" in out, out
        groups = [line for line in out.splitlines() if line.strip().startswith("group ")]
        assert "optimizer torch.optim.Muon" in groups[0] and "momentum_buffer" in groups[0], out
        assert "optimizer torch.optim.adamw.AdamW" in groups[1] and "exp_avg" in groups[1], out


def test_module_only_loads_across_muon_and_adamw_engines(runs):
    for ranks in runs["at_3"]:
        for outcome in ranks[2:4]:
            assert {n: c for n, c in outcome["weights"].items() if c} == {}
            assert outcome["kept"] and {k: c for k, c in outcome["kept"].items() if c} == {}


def test_full_loads_across_muon_and_adamw_are_refused_on_every_rank(runs):
    for ranks in runs["at_3"]:
        for outcome in ranks[4:6]:
            assert outcome["changed"] == 0
            assert "optimizer" in outcome["error"] and "\n" not in outcome["error"], outcome
    assert len({ranks[4]["error"] for ranks in runs["at_3"]}) == 1


def test_engines_with_what_muon_refuses_are_refused_on_every_rank(runs):
    errors = [ranks[6] for ranks in runs["at_3"]]
    assert all(e == errors[0] for e in errors)
    for label, error in errors[0].items():
        assert error != "no error" and "\n" not in error, (label, error)
    assert "has shape [" in errors[0]["vector"] and "2-D matrices" in errors[0]["vector"]
    assert "weight" in errors[0]["cube"] and "expert stack" in errors[0]["cube"]
    assert "Muon" in errors[0]["bad_ns_steps"] and "Muon" in errors[0]["bad_adjust_lr"]
