"""AutoEP metadata against the per-file budget, and the expert files against the placement.

Hostile versions of a real AutoEP checkpoint (tests/autoep_fixtures.py): a model-states file
whose ``ds_autoep_layers`` declares counts it does not hold or shares one list or layer many
times, an expert or rank file that is a FIFO, thousands of expert files, a placement edited
without its expert files. Each must end in a one-line error naming the file, within 64 bytes
per byte of the input plus a constant (tracemalloc's peak), as test_budget_checkpoints checks
the dense DeepSpeed fields.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')", allow_module_level=True)

from hostile_files import edit_torch_file as edit
from test_budget_checkpoints import COMMANDS, run_command

from zeroshard.cli.main import main
from zeroshard.deepspeed.checkpoint import DeepSpeedFormatError, autoep_files, open_deepspeed
from zeroshard.deepspeed.checkpoint.autoep_experts import _rounds_to, read_expert_files
from zeroshard.deepspeed.checkpoint.autoep_files import AutoEP, AutoEPLayer
from zeroshard.deepspeed.checkpoint.pickled import load_checkpoint_file

MODEL = "mp_rank_00_model_states.pt"
RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
EXPERT = "layer_0_expert_2_mp_rank_00_model_states.pt"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def intact(autoep_runs, tmp_path_factory) -> Path:
    """A copy of a real W = 2, EP = 2 run; every command run on it once, so that what a measured
    run allocates is its own, not the first import of the modules it uses."""
    tag = tmp_path_factory.mktemp("autoep_budget") / "w2_ep2_s2"
    shutil.copytree(autoep_runs["w2_ep2_s2"].tag_dir, tag)
    warm = tmp_path_factory.mktemp("warm")
    for command in COMMANDS:
        target = [str(warm / command[0])] if command[0].startswith("to-") else []
        assert main([*command, str(tag), *target]) == 0, command
    return tag


@pytest.fixture
def tag_dir(intact, tmp_path) -> Path:
    target = tmp_path / "w2_ep2_s2"
    shutil.copytree(intact, target)
    return target


def layer_zero(change):
    """Edit ``ds_autoep_layers[0]`` (and drop the copy universal_checkpoint_info holds)."""

    def apply(raw):
        raw.pop("universal_checkpoint_info", None)
        change(raw["ds_autoep_layers"][0])

    return apply


def refused(capsys, tag_dir: Path, file: Path, words: str, command: tuple[str, ...] = ("inspect",)) -> str:
    """``command`` on ``tag_dir``: exit 2 with one short line naming ``file`` and saying ``words``,
    within the memory bound of run_command."""
    code, err = run_command(capsys, *command, tag_dir, within=tag_dir)
    assert code == 2 and "\n" not in err and len(err) < 500, (code, err[:500])
    assert f"{file}: " in err and words in err, err
    return err


# ---- counts bounded before anything of their size is built ------------------------------------------


def test_an_affine_piece_of_millions_of_experts_is_refused_before_its_runs_are_built(tag_dir, capsys):
    """A piece's shape[0] was turned into a list of that many (local, global) pairs before it
    was compared with the EP rank's experts: 10**15 (a 30 KB file) exhausted memory, exit 3."""

    def change(entry):
        maps = entry["affine_maps"]["params"]
        maps["model.layers.0.mlp.experts.w1"]["ranks"][0]["pieces"][0]["shape"][0] = 2_000_000

    edit(tag_dir / MODEL, layer_zero(change))
    refused(capsys, tag_dir, tag_dir / MODEL, "['pieces'][0] does not map EP rank 0's experts [0, 1]")


def test_ep_ranks_sharing_one_id_list_are_charged_before_it_is_copied(tag_dir, capsys):
    """3,000 EP ranks listing one memoised list of 3,000 ids: each was copied before any count
    was compared (20,000 x 20,000, a 650 KB file, exhausted memory)."""
    ep = local = 3000
    shared = list(range(local))

    def change(entry):
        entry.update(ep_size=ep, num_experts=ep * local, num_local_experts=local)
        ranks = [{"rank": rank, "experts": shared} for rank in range(ep)]
        entry["expert_placement"] = {"version": 1, "num_experts": ep * local, "ep_size": ep, "ranks": ranks}

    edit(tag_dir / MODEL, layer_zero(change))
    err = refused(capsys, tag_dir, tag_dir / MODEL, "['experts'] exceeds the budget")
    assert "copying ds_autoep_layers[0]['expert_placement']['ranks'][" in err, err


def pieces_of(weight: str, rank: int):
    return lambda entry: entry["affine_maps"]["params"][f"model.layers.0.mlp.experts.{weight}"]["ranks"][rank]["pieces"]


COUNTS = {
    "fewer ids than E / EP": (
        lambda e: e["expert_placement"]["ranks"][1].update(experts=[2]),
        "['expert_placement']['ranks'][1]['experts'] lists 1 experts, expected 2 (E / EP)",
    ),
    "more EP ranks than EP": (
        lambda e: e["expert_placement"]["ranks"].append({"rank": 2, "experts": [4, 5]}),
        "['expert_placement']['ranks'] lists 3 EP ranks, expected 2",
    ),
    "more pieces than experts": (
        lambda e: pieces_of("w2", 1)(e).extend([{}] * 2),
        "['ranks'][1]['pieces'] lists 3 pieces, more than EP rank 1's 2 experts",
    ),
    "a logical shape of 100,000 dimensions": (
        lambda e: e["affine_maps"]["params"]["model.layers.0.mlp.experts.w3"].update(logical_shape=[1] * 100_000),
        "['logical_shape'] is a list of 100,000 items, expected [4, 16, 24]",
    ),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_a_count_is_compared_with_what_it_must_equal_before_its_items_are_read(tag_dir, capsys, case):
    change, words = COUNTS[case]
    edit(tag_dir / MODEL, layer_zero(change))
    refused(capsys, tag_dir, tag_dir / MODEL, words)


def row_major(shape: list[int]) -> list[int]:
    return [math.prod(shape[index + 1 :]) for index in range(len(shape))]


def widened(raw, local: int) -> None:
    """Every layer at EP 2 with ``local`` experts per EP rank, its placement, affine maps and
    param_shapes saying so consistently (the expert files and rank files are left as they are)."""
    experts = 2 * local
    placement = [{"rank": rank, "experts": list(range(rank * local, (rank + 1) * local))} for rank in range(2)]
    for entry in raw["ds_autoep_layers"]:
        entry.update(num_experts=experts, num_local_experts=local, global_expert_end=local)
        entry["expert_placement"].update(num_experts=experts, ranks=placement)
        for saved in entry["affine_maps"]["params"].values():
            logical = [experts, *saved["logical_shape"][1:]]
            shard = [local, *logical[1:]]
            saved["logical_shape"] = logical
            for rank, rank_map in saved["ranks"].items():
                source = [rank * math.prod(shard), row_major(logical)]
                rank_map.update(shard_shape=shard)
                dest = [0, row_major(shard)]
                rank_map["pieces"] = [{"shape": shard, "source": source, "dest": dest, "locations": [rank]}]
    raw["num_experts"] = [experts] * len(raw["ds_autoep_layers"])
    raw["param_shapes"][1] = {name: (local, *shape[1:]) for name, shape in raw["param_shapes"][1].items()}
    raw.pop("universal_checkpoint_info", None)


def test_a_rank_map_repeating_one_piece_is_refused_at_its_second(tag_dir, capsys):
    """One piece mapping all 3,000 experts of an EP rank, listed 3,000 times: every reference
    was walked into a list of covered experts, 9 million of them, then printed whole."""

    def change(raw):
        widened(raw, 3000)
        pieces = raw["ds_autoep_layers"][0]["affine_maps"]["params"]["model.layers.0.mlp.experts.w1"]["ranks"][0]
        pieces["pieces"] = pieces["pieces"] * 3000

    edit(tag_dir / MODEL, change)
    refused(capsys, tag_dir, tag_dir / MODEL, "['ranks'][0]['pieces'] cover local expert 0 twice, expected 0..2999")


def test_one_layer_shared_by_every_entry_is_refused_at_its_second(tag_dir, capsys, monkeypatch):
    """20,000 references to one layer dict: every one was parsed before the layer ids were
    compared (180,000 in a 930 KB file: 5-14 s, 286 MB)."""
    parsed = []
    real = autoep_files._layer
    monkeypatch.setattr(autoep_files, "_layer", lambda *args: parsed.append(args[1]) or real(*args))

    def change(raw):
        raw.pop("universal_checkpoint_info", None)
        raw["ds_autoep_layers"] = [raw["ds_autoep_layers"][0]] * 20_000

    edit(tag_dir / MODEL, change)
    refused(capsys, tag_dir, tag_dir / MODEL, "ds_autoep_layers names module_path 'model.layers.0.mlp' twice")
    assert parsed == ["ds_autoep_layers[0]", "ds_autoep_layers[1]"]


# ---- values quoted by type and length ---------------------------------------------------------------


def placement_of_60000_per_rank(entry):
    entry.update(ep_size=2, num_experts=120_000, num_local_experts=60_000)
    ranks = [{"rank": rank, "experts": list(range(60_000))} for rank in range(2)]  # expert 0 on both
    entry["expert_placement"].update(num_experts=120_000, ranks=ranks)


QUOTED = {
    "an expert on two EP ranks, 60,000 per rank": (
        layer_zero(placement_of_60000_per_rank),
        "places 120,000 experts (expert 0 is on two): each of 0..119999 must be on exactly one EP rank",
    ),
    "num_experts of 100,000 layers": (
        lambda raw: raw.update(num_experts=list(range(100_000))),
        "num_experts is a list of 100,000 items, ds_autoep_layers gives [4, 4]",
    ),
    "affine map ranks keyed by long strings": (
        layer_zero(
            lambda e: e["affine_maps"]["params"]["model.layers.0.mlp.experts.w1"].update(
                ranks={"x" * 100_000 + str(key): {} for key in range(5)}
            )
        ),
        "['ranks'] has keys a str of 100,001 characters, a str of 100,001 characters, ",
    ),
    "a stacked shape of 100,000 dimensions": (
        lambda raw: raw["param_shapes"][1].update({"model.layers.0.mlp.experts.w2": (2,) * 100_000}),
        "w2 a list of 100,000 items, w3 [2, 16, 24]; expected",
    ),
}


@pytest.mark.parametrize("case", list(QUOTED))
def test_an_autoep_error_quotes_a_value_by_its_type_and_length(tag_dir, capsys, case):
    """The placement's error printed every id (a 208 KB file: a line of 818 KB)."""
    change, words = QUOTED[case]
    edit(tag_dir / MODEL, change)
    refused(capsys, tag_dir, tag_dir / MODEL, words)


def test_an_expert_file_holding_other_keys_is_named_by_bounded_keys(tag_dir, capsys):
    """Its keys were sorted and printed: a key that is not a string made sorting raise a
    TypeError (exit 3), a long one a line of its length."""

    def change(raw):
        weights = dict(raw)
        raw.clear()
        raw.update({7: None, "x" * 100_000: None, **weights})

    edit(tag_dir / EXPERT, change)
    words = "holds 5 keys (7, a str of 100,000 characters, model.layers.0.mlp.experts.w1.2, "
    refused(capsys, tag_dir, tag_dir / EXPERT, words + "model.layers.0.mlp.experts.w2.2, ...), expected exactly [")


# ---- FIFOs ------------------------------------------------------------------------------------------


def run_cli(*args: str | Path, timeout: float = 60) -> tuple[int | None, str]:
    """(exit status, what it printed) of ``python -m zeroshard ARGS`` in a process of its own;
    None when it ran past ``timeout`` (killed), so that a command blocked on a FIFO fails the test."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "zeroshard", *map(str, args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environ)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stdout + done.stderr).strip()


@pytest.mark.parametrize("name", [EXPERT, RANK1])
def test_an_expert_or_rank_file_that_is_a_fifo_is_refused_by_every_command(tag_dir, tmp_path, name):
    """Opening one blocked every command for ever (no writer ever came)."""
    (tag_dir / name).unlink()
    os.mkfifo(tag_dir / name)
    for command in COMMANDS:
        target = [tmp_path / command[0]] if command[0].startswith("to-") else []
        code, err = run_cli(*command, tag_dir, *target)
        expected = 1 if command == ("inspect", "--verify") else 2  # --verify reports damage, exit 1
        assert code == expected and "\n" not in err, (command, code, err)
        assert f"{tag_dir / name}: not a regular file" in err, (command, err)


# ---- the presence check -----------------------------------------------------------------------------


def presence_check_seconds(root: Path, layers: int, experts: int) -> float:
    """CPU seconds of read_expert_files in a folder of ``layers`` x ``experts`` expert files,
    the last missing: the names are compared, nothing is read (best of 3)."""
    autoep_layers = tuple(
        AutoEPLayer(i, f"m.{i}", f"m.{i}.experts", experts, 1, (tuple(range(experts)),), {}, 1) for i in range(layers)
    )
    folder = Path(tempfile.mkdtemp(dir=root))
    names = [layer.expert_file(g) for layer in autoep_layers for g in range(experts)]
    for name in names[:-1]:
        (folder / name).touch()
    best = float("inf")
    for _ in range(3):
        started = time.thread_time()
        with pytest.raises(DeepSpeedFormatError, match=f"{names[-1]} is missing"):
            read_expert_files(folder, AutoEP(autoep_layers, 1, None), {}, "bfloat16")
        best = min(best, time.thread_time() - started)
    return best


def test_the_expert_file_presence_check_is_linear_in_the_files(tmp_path):
    """Each expected name was looked up in a set made again of every name found: 4.8 s at
    DeepSeek-V3's 14,848 files before a byte was read. 8x the files must cost well under 64x."""
    small = presence_check_seconds(tmp_path, 4, 256)
    large = presence_check_seconds(tmp_path, 32, 256)
    assert large < 24 * max(small, 1e-3), (small, large)


# ---- the placement against the expert files -----------------------------------------------------------


def test_a_placement_changed_without_its_expert_files_is_refused(tag_dir, tmp_path, capsys):
    """Experts 0 and 1 swapped in expert_placement, affine_maps left out: every check passed and
    every output gave expert 0 expert 1's masters (and the other way round)."""

    def change(raw):
        for entry in raw["ds_autoep_layers"]:
            ranks = entry["expert_placement"]["ranks"]
            ranks[0]["experts"] = ranks[0]["experts"][::-1]
            entry["affine_maps"] = None
        raw["universal_checkpoint_info"]["ds_autoep_layers"] = raw["ds_autoep_layers"]

    edit(tag_dir / MODEL, change)
    expert = tag_dir / "layer_0_expert_0_mp_rank_00_model_states.pt"
    words = (
        "model.layers.0.mlp.experts.w1.0 disagrees with the fp32 master where the expert_placement of "
        f"{MODEL} puts expert 0 (EP rank 0, local expert 1, in bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt)"
    )
    for command in COMMANDS:
        target = (tmp_path / command[0],) if command[0].startswith("to-") else ()
        code, err = run_command(capsys, *command, tag_dir, *target, within=tag_dir)
        expected = 1 if command == ("inspect", "--verify") else 2
        assert code == expected and "\n" not in err and f"{expert}: {words}" in err, (command, code, err)
        assert not target or not target[0].exists()


def test_damaged_bytes_where_the_experts_are_compared_are_named_as_damage(tag_dir):
    """The comparison reads without checking CRCs; a difference is read again, checked, so a
    flipped bit there is reported as a corrupt record, not as a changed placement."""
    path = tag_dir / "layer_0_expert_1_mp_rank_00_model_states.pt"
    content, _, _ = load_checkpoint_file(path)
    weight = content["model.layers.0.mlp.experts.w1.1"]
    data = bytearray(path.read_bytes())
    data[weight.data_offset + 2 * weight.storage_offset + 1] ^= 0x40  # a high bit of its first bf16 element
    path.write_bytes(bytes(data))
    with pytest.raises(DeepSpeedFormatError) as caught:
        open_deepspeed(tag_dir)
    assert str(caught.value).startswith(f"{path}: record ") and "is corrupt" in str(caught.value)


def test_an_expert_file_agrees_with_its_master_rounded_either_way_and_no_further():
    """DeepSpeed rounds a master to nearest (torch's copy_); a CPU optimizer may truncate. Both
    agree, as do NaN for NaN and an infinity for a master past the dtype's range; two units in
    the last place, or another expert's value, do not."""
    rng = np.random.default_rng(0)
    master = rng.standard_normal(4096).astype(np.float32)
    nearest = master.astype(ml_dtypes.bfloat16)
    toward_zero = (master.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(ml_dtypes.bfloat16)
    assert _rounds_to(nearest, master, "bfloat16") and _rounds_to(toward_zero, master, "bfloat16")
    assert _rounds_to(master.astype(np.float16), master, "float16") and _rounds_to(master, master, "float32")
    special = np.array([np.nan, 70000.0, -70000.0, 0.0], dtype=np.float32)  # past float16's range
    assert _rounds_to(np.array([np.nan, np.inf, -np.inf, 0.0], dtype=np.float16), special, "float16")
    two_units = (nearest.view(np.uint16) + 2).view(ml_dtypes.bfloat16)
    assert not _rounds_to(two_units, master, "bfloat16")
    assert not _rounds_to(nearest, rng.permutation(master), "bfloat16")
