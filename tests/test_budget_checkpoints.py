"""Hostile checkpoints against the per-file budget, through the commands a user runs.

DeepSpeed files edited with torch (its own classes), so that one object is shared many
times, as torch.save writes a shared object once and refers to it after: values copied into
``universal.json``, tensors viewing one storage, a chain of objects whose repr() doubles at
each link. Native and universal manifests that declare more than they list or hold values
of the wrong kind. Each must end in a one-line error naming the file, fast and within 64
bytes per byte of the input plus a constant (tracemalloc's peak), or convert as before.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from hostile_files import edit_torch_file as edit
from hostile_files import measured

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.io.safetensors_io import read_header
from zeroshard.checkpoint.native.manifest import read_manifest
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.checkpoint.universal import to_universal
from zeroshard.checkpoint.universal.format import read_universal_manifest
from zeroshard.cli.main import main
from zeroshard.layout import ParamSpec, build_layout

SLACK = 4 << 20  # what a command may allocate besides 64 bytes per byte of its input
CPU_SECONDS = 5.0  # CPU time under tracemalloc: at most 0.26 s here (measured); the old readers took 30 s
MODEL = "mp_rank_00_model_states.pt"
RANK0 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"

SPECS = [[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")], [ParamSpec.of("c", (9,), "bf16")]]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.fixture(scope="module", autouse=True)
def imported(tmp_path_factory) -> None:
    """Every command run once, so that what the measured runs allocate and take is theirs,
    not the first import of the modules they use."""
    root = tmp_path_factory.mktemp("warm")
    layout = build_layout(SPECS, 1)
    run_ranks(1, lambda c: save_sharded(root, "t", synthesize_state(layout, c.rank), coordinator=c))
    for command in (["inspect"], ["inspect", "--verify"], ["to-universal"], ["to-fp32"]):
        target = [str(root / command[0])] if command[0].startswith("to-") else []
        assert main([*command, str(root / "t"), *target]) == 0


def input_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def run_command(capsys, *args: str | Path, within: Path) -> tuple[int, str]:
    """(exit status, what it printed) of ``zeroshard ARGS`` run in this process, asserting
    it took under CPU_SECONDS and at most 64 bytes per byte of ``within`` plus SLACK."""
    capsys.readouterr()
    code, peak, cpu = measured(lambda: main([str(arg) for arg in args]))
    cheap = cpu < CPU_SECONDS and peak < 64 * input_bytes(within) + SLACK
    assert cheap, f"{args[0]}: {peak:,} bytes, {cpu:.2f} CPU seconds for {input_bytes(within):,} bytes of input"
    printed = capsys.readouterr()
    return code, (printed.err if code == 2 else printed.out).strip()


def expect_refused(capsys, *args: str | Path, within: Path, file: Path, words: str) -> str:
    code, err = run_command(capsys, *args, within=within)
    assert code == 2 and "\n" not in err and len(err) < 500, (code, err[:500])
    assert f"{file}: " in err and words in err, err
    return err


# ---- DeepSpeed: shared objects ---------------------------------------------------------------------


@pytest.fixture
def tag_dir(deepspeed_runs, tmp_path) -> Path:
    target = tmp_path / "w2_s2"
    shutil.copytree(deepspeed_runs["w2_s2"].tag_dir, target)
    return target


COMMANDS = [("inspect",), ("inspect", "--verify"), ("to-universal",), ("to-fp32",)]


def every_command(capsys, tag_dir: Path, out: Path, file: Path, words: str) -> None:
    for command in COMMANDS:
        target = [out / command[0]] if command[0].startswith("to-") else []
        code, printed = run_command(capsys, *command, tag_dir, *target, within=tag_dir)
        expected = 1 if command == ("inspect", "--verify") else 2  # --verify reports damage, exit 1
        assert code == expected and "\n" not in printed and len(printed) < 500, (command, code, printed[:500])
        assert f"{file}: " in printed and words in printed, (command, printed)
        assert not target or not target[0].exists(), command


@needs_deepspeed
def test_a_value_shared_in_the_lr_scheduler_is_charged_per_copy(tag_dir, tmp_path, capsys):
    """One 10 KB string referred to 5,000 times: a 26 KB model-states file gave a 50 MB
    universal.json, exit 0 (1.1 MB to 1.05 GB at full size)."""
    edit(tag_dir / MODEL, lambda raw: raw.update(lr_scheduler={"names": ["x" * 10_000] * 5000}))
    every_command(capsys, tag_dir, tmp_path, tag_dir / MODEL, "copying lr_scheduler exceeds the budget")


@needs_deepspeed
def test_the_loss_scaler_is_charged_as_any_value_copied_out(tag_dir, tmp_path, capsys):
    """5,000 attributes of the loss scaler holding one 10 KB string: 100 KB gave 50 MB."""

    shared = "x" * 10_000

    def change(raw):
        scaler = raw["optimizer_state_dict"]["loss_scaler"]
        for index in range(5000):
            setattr(scaler, f"a{index}", shared)

    edit(tag_dir / RANK0, change)
    every_command(capsys, tag_dir, tmp_path, tag_dir / RANK0, "copying loss_scaler exceeds the budget")


@needs_deepspeed
def test_a_padding_list_shared_by_many_groups_is_charged_before_it_is_copied(tag_dir, tmp_path, capsys):
    """param_alignment_paddings: 8,000 references to one list of 4,000 paddings (a 150 KB
    rank file) were each copied and checked before anything was charged: 256 MB here, and a
    146 KB file reached 3 GB and exit 3 after 30 s."""
    shared = [0] * 4000
    rank1 = tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    edit(rank1, lambda raw: raw["optimizer_state_dict"].update(param_alignment_paddings=[shared] * 8000))
    every_command(capsys, tag_dir, tmp_path, rank1, "copying param_alignment_paddings[")


@needs_deepspeed
def test_a_shape_shared_by_many_parameters_is_charged_before_it_is_copied(tag_dir, tmp_path, capsys):
    """param_shapes: 2,000 parameters sharing one shape of 16,000 dimensions (a 90 KB
    model-states file) were each copied twice (a list, a tuple) before the dimensions were
    charged: 512 MB here, and a 373 KB file reached 3 GB and exit 3 after 30 s."""
    dims = (1,) * 16_000
    edit(tag_dir / MODEL, lambda raw: raw.update(param_shapes=[{f"p{i}": dims for i in range(2000)}]))
    every_command(capsys, tag_dir, tmp_path, tag_dir / MODEL, "copying param_shapes[0]['p")


@needs_deepspeed
def test_a_tuple_key_that_doubles_at_each_link_is_refused_by_every_command(tag_dir, tmp_path, capsys):
    """Each tuple holds the one before twice: 24 links, 2^25 steps to hash (0.3 s here, once,
    to build the dict; each link more doubles it), past the budget of the rank file."""
    chain = None
    for _ in range(24):
        chain = (chain, chain)
    edit(tag_dir / RANK0, lambda raw: raw.update(extra={chain: 1}))
    every_command(capsys, tag_dir, tmp_path, tag_dir / RANK0, "hashing its dict keys")


@needs_deepspeed
def test_real_deepspeed_files_pass_the_cheap_bound_on_hashing(deepspeed_runs, monkeypatch):
    """No file of any fixture run needs the exact count of hashing (Python, slower than
    unpickling): the bound from byte values or the opcode pass clears each."""
    from zeroshard.torchfile import pickle_scan
    from zeroshard.deepspeed.checkpoint.pickled import ALLOWED_GLOBALS
    from zeroshard.torchfile.torch_file import load_torch_file

    counted = []
    monkeypatch.setattr(pickle_scan, "hash_steps", lambda data, limit: counted.append(len(data)))
    monkeypatch.setattr(pickle_scan, "_PASSED", {})
    files = [path for run in deepspeed_runs.values() for path in sorted(run.tag_dir.glob("*.pt"))]
    for path in files:
        load_torch_file(path, ALLOWED_GLOBALS)
    assert len(files) > 10 and counted == []


@needs_deepspeed
def test_a_chain_of_fragment_addresses_is_not_printed(tag_dir, capsys):
    """Each fragment_address holds the one before twice: repr() doubles at each link (377
    bytes took 50 s, 20 links 3 s); the error names the value by its type and length."""
    from deepspeed.utils.tensor_fragment import fragment_address

    chain = fragment_address(numel=1, start=0)
    for _ in range(40):
        chain = fragment_address(numel=chain, start=chain)
    rank1 = tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    edit(
        rank1, lambda raw: raw["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0].update(params=[chain])
    )
    expect_refused(capsys, "inspect", tag_dir, within=tag_dir, file=rank1, words="params=a list of 1 item")


@needs_deepspeed
@pytest.mark.parametrize("where", ["optimizer state", "module"])
def test_one_storage_viewed_by_many_tensors_is_charged_per_view(tag_dir, tmp_path, capsys, where):
    """50 views of one 1 MiB storage (distinct views as optimizer state of rank 0, one tensor
    50 times in the module): read once per view, they took the old reader's inspect to
    gigabytes at full size and made a 100 MB fp32 export of a 0.5 MB model-states file."""
    import torch

    big = torch.zeros(256 * 1024)
    if where == "module":
        file = tag_dir / MODEL
        edit(file, lambda raw: raw["module"].update({f"frozen{i}": big for i in range(50)}))
        words = "reading the module's tensors exceeds the budget"
    else:
        file = tag_dir / RANK0
        state = lambda raw: raw["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        edit(file, lambda raw: state(raw).update({f"s{i}": big.view(512, 512) for i in range(50)}))
        words = "reading its tensors exceeds the budget"
    assert file.stat().st_size < 1_100_000
    every_command(capsys, tag_dir, tmp_path, file, words)


@needs_deepspeed
def test_an_integer_too_long_for_json_is_refused_naming_the_file(tag_dir, tmp_path, capsys):
    """json.dumps of universal.json raised Python's own ValueError (more than 4,300 digits)."""
    edit(tag_dir / MODEL, lambda raw: raw.update(lr_scheduler={"seed": 10**5000}))
    words = "refused to unpickle data.pkl: an integer of 2,077 bytes"
    expect_refused(capsys, "to-universal", tag_dir, tmp_path / "out", within=tag_dir, file=tag_dir / MODEL, words=words)


def test_what_an_output_repeats_is_charged_to_the_file_it_comes_from(tmp_path):
    """A universal checkpoint names every parameter once per optimizer state and every state
    once per parameter; an fp32 export writes a tied parameter again under each alias. One
    state named with 100,000 characters in a rank file of a few KB would be written once for
    each of 300 parameters; 100 aliases of a 4 MB parameter, each a short name in
    shared_params, would make 400 MB of export."""
    from types import SimpleNamespace

    from zeroshard.io.budget import Budget
    from zeroshard.deepspeed.checkpoint.source import KEY_BYTES, charge_outputs
    from zeroshard.deepspeed.checkpoint.pickled import DeepSpeedFormatError

    layout = build_layout([[ParamSpec.of(f"p{i}", (4,), "bf16") for i in range(300)]], 2)
    model = SimpleNamespace(budget=Budget(tmp_path / MODEL, 10_000))
    fine = SimpleNamespace(states=[{"exp_avg": None, "exp_avg_sq": None}], budget=Budget(tmp_path / RANK0, 5_000))
    charge_outputs(layout, model, fine, {"alias": "p0"})
    names = sum(len(f"p{i}") + KEY_BYTES for i in range(300))
    assert fine.budget.spent == 3 * names + len("exp_avgexp_avg_sq") * 300
    assert model.budget.spent == len("alias") + KEY_BYTES + 4 * 4
    long = SimpleNamespace(states=[{"s" * 100_000: None}], budget=Budget(tmp_path / RANK0, 5_000))
    with pytest.raises(DeepSpeedFormatError) as caught:
        charge_outputs(layout, model, long, {})
    assert str(caught.value).startswith(f"{tmp_path / RANK0}: naming every parameter's optimizer states in an output")
    big = build_layout([[ParamSpec.of("embed", (1024, 1024), "bf16")]], 2)
    aliases = {f"alias{i}": "embed" for i in range(100)}
    with pytest.raises(DeepSpeedFormatError) as caught:
        charge_outputs(big, SimpleNamespace(budget=Budget(tmp_path / MODEL, 2_000_000)), fine, aliases)
    assert str(caught.value).startswith(f"{tmp_path / MODEL}: copying 100 tied parameters into an export exceeds")


# ---- native and universal manifests ---------------------------------------------------------------


@pytest.fixture
def native(tmp_path) -> Path:
    layout = build_layout(SPECS, 2)
    run_ranks(2, lambda c: save_sharded(tmp_path, "t", synthesize_state(layout, c.rank), coordinator=c, block_size=128))
    return tmp_path / "t"


@pytest.fixture
def universal(native, tmp_path) -> Path:
    out = tmp_path / "universal"
    to_universal(native, out)
    return out


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("world_size", [10**6, 10**12])
def test_a_declared_world_size_is_compared_with_the_files_listed_first(native, capsys, world_size):
    """A 2.7 KB manifest declaring world_size 10**6 took 13 s and 200 MB to be refused (10**9:
    MemoryError or the OOM killer): every reader built a name per rank first."""
    path = native / "manifest.json"

    def change(data):
        data["world_size"] = world_size
        data["layout"] = build_layout(SPECS, world_size).to_dict()

    edit_json(path, change)
    expected = f"{path}: file list does not match world size {world_size}: 3 files listed"
    _, peak, cpu = measured(lambda: pytest.raises(ValueError, read_manifest, native))
    assert peak < 1 << 20 and cpu < 0.5, (peak, cpu)
    with pytest.raises(ValueError) as caught:
        read_manifest(native)
    assert str(caught.value).startswith(expected)
    for command in (["inspect"], ["inspect", "--verify"], ["to-fp32"]):
        target = [native.parent / "fp32"] if command[0] == "to-fp32" else []
        code, printed = run_command(capsys, *command, native, *target, within=native)
        assert code in (1, 2) and expected in printed, (command, code, printed)


WRONG_KINDS = {
    ("native", "version true"): (lambda d: d.update(version=True), "format version True is not valid"),
    ("native", "a shape of strings"): (
        lambda d: d["model"]["tensors"]["a"].update(shape=["7", "5"]),
        "the shape of module tensor 'a' has a dimension that is '7', expected an integer",
    ),
    ("native", "a float dimension"): (
        lambda d: d["model"]["tensors"]["b"].update(shape=[13.0]),
        "the shape of module tensor 'b' has a dimension that is 13.0, expected an integer",
    ),
    ("native", "a shape that is a string"): (
        lambda d: d["model"]["tensors"]["b"].update(shape="13"),
        "the shape of module tensor 'b' is '13', expected a list of integers",
    ),
    ("universal", "a negative dimension"): (
        lambda d: d["params"]["a"].update(shape=[-7, -5]),
        "params['a']['shape'] has a dimension that is -7, expected at least 0",
    ),
    ("universal", "a shape of strings"): (
        lambda d: d["params"]["c"].update(shape=["9"]),
        "params['c']['shape'] has a dimension that is '9', expected an integer",
    ),
    ("universal", "a float dimension"): (
        lambda d: d["params"]["c"].update(shape=[9.5]),
        "params['c']['shape'] has a dimension that is 9.5, expected an integer",
    ),
    ("universal", "a boolean group"): (
        lambda d: d["params"]["c"].update(group=True),
        "params['c']['group'] is True, expected an integer",
    ),
}


def manifest_of(kind: str, native: Path, universal: Path):
    """(the checkpoint's directory, its manifest, the function reading it)."""
    if kind == "native":
        return native, native / "manifest.json", read_manifest
    return universal, universal / "universal.json", read_universal_manifest


@pytest.mark.parametrize("kind, case", list(WRONG_KINDS), ids=[" ".join(key) for key in WRONG_KINDS])
def test_a_manifest_holding_the_wrong_kind_of_value_is_refused(native, universal, kind, case):
    change, words = WRONG_KINDS[kind, case]
    directory, path, read = manifest_of(kind, native, universal)
    edit_json(path, change)
    with pytest.raises(ValueError) as caught:
        read(directory)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and words in message, message


@pytest.mark.parametrize("kind", ["native", "universal"])
def test_an_integer_of_more_than_4300_digits_is_refused_naming_the_manifest(native, universal, kind):
    """json.loads raised Python's own ValueError, which named no file."""
    directory, path, read = manifest_of(kind, native, universal)
    path.write_text(path.read_text().replace('"extra": {', '"extra": {"big": ' + "9" * 5000 + ", ", 1))
    with pytest.raises(ValueError) as caught:
        read(directory)
    assert str(caught.value) == f"{path}: corrupted: it holds an integer of more than 4,300 digits"


@pytest.mark.parametrize("kind", ["native", "universal", "safetensors header"])
def test_a_byte_that_is_not_utf8_is_not_taken_for_a_long_integer(native, universal, kind):
    """A bit flipped in a JSON text (a space, 0x20, become 0xa0) was reported as "an integer of
    more than 4,300 digits": the UnicodeDecodeError, a ValueError, was taken for the digits limit."""
    if kind == "safetensors header":
        path, expected = native / "rank-00000-of-00002.safetensors", "the safetensors header is not valid JSON"
        read = lambda: read_header(path, path.stat().st_size)  # noqa: E731
    else:
        directory, path, reader = manifest_of(kind, native, universal)
        expected, read = "not UTF-8 text", lambda: reader(directory)  # noqa: E731
    data = bytearray(path.read_bytes())
    data[data.index(b" " if kind != "safetensors header" else b"dtype")] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as caught:
        read()
    assert str(caught.value) == f"{path}: corrupted: {expected}"


def test_a_manifest_value_of_keys_of_one_hash_is_refused_in_one_line(native):
    """The manifest's ``extra`` as a tagged dict of 20,000 int keys sharing one hash (the old
    reader built it in seconds, quadratic in the keys)."""
    path = native / "manifest.json"
    keys = [k * ((1 << 61) - 1) for k in range(1, 20_001)]
    edit_json(path, lambda data: data.update(extra={"__zeroshard__": "dict", "items": [[k, 0] for k in keys]}))
    _, _, cpu = measured(lambda: pytest.raises(ValueError, read_manifest, native))
    assert cpu < 1.0, cpu  # CPU seconds
    with pytest.raises(ValueError) as caught:
        read_manifest(native)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "of one hash" in message and "\n" not in message, message
