"""load_pretrained on broken checkpoints: one ValueError line naming the file, nothing copied.

A transformers checkpoint folder comes from disk and is hostile until checked: a shard
truncated, empty or not safetensors at all, an index that puts a tensor in a shard that does
not hold it, an index nested 100,000 deep or not JSON, a FIFO where a file belongs. Each is
refused in one ``ValueError`` line naming the file (not safetensors' ``SafetensorError``,
which names none, nor a RecursionError), before the model is touched; a FIFO is refused
without waiting for a writer (those tests run in a subprocess with a timeout, so a
regression fails instead of hanging the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zeroshard.moe import load_pretrained
from zeroshard.moe.pretrained import INDEX_FILE, SINGLE_FILE

SHARDS = {"a.safetensors": ("0.weight", "0.bias"), "b.safetensors": ("1.weight", "1.bias")}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def sharded(folder: Path) -> Path:
    """``folder`` holding model()'s weights times 2 as two shards and their index."""
    state = {name: tensor * 2 for name, tensor in model().state_dict().items()}
    folder.mkdir()
    for shard, names in SHARDS.items():
        save_file({name: state[name].contiguous() for name in names}, str(folder / shard))
    weight_map = {name: shard for shard, names in SHARDS.items() for name in names}
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return folder


def single(folder: Path) -> Path:
    folder.mkdir()
    save_file({name: tensor * 2 for name, tensor in model().state_dict().items()}, str(folder / SINGLE_FILE))
    return folder


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _misdirect(folder: Path) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["1.bias"] = "a.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))


def _folder_for_shard(folder: Path) -> None:
    (folder / "b.safetensors").unlink()
    (folder / "b.safetensors").mkdir()


# (id, how the folder is made, what breaks it, the file the message names, what it says)
BROKEN = [
    ("misdirected", sharded, _misdirect, "", f"{INDEX_FILE} puts '1.bias' in a.safetensors, which does not hold it"),
    ("truncated-shard", sharded, lambda f: _truncate(f / "b.safetensors", -5), "b.safetensors", "not fully covered"),
    ("empty-shard", sharded, lambda f: _truncate(f / "b.safetensors", 0), "b.safetensors", "header too small"),
    ("header-only-shard", sharded, lambda f: _truncate(f / "b.safetensors", 8), "b.safetensors", "not a readable"),
    ("garbage-shard", sharded, lambda f: (f / "b.safetensors").write_bytes(b"\xff" * 64), "b.safetensors", "header"),
    ("missing-shard", sharded, lambda f: (f / "b.safetensors").unlink(), "b.safetensors", "missing"),
    ("folder-for-shard", sharded, _folder_for_shard, "b.safetensors", "not a regular file"),
    (
        "deep-index",
        sharded,
        lambda f: (f / INDEX_FILE).write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        INDEX_FILE,
        "nested more than 100 levels deep",
    ),
    ("truncated-index", sharded, lambda f: _truncate(f / INDEX_FILE, 20), INDEX_FILE, "not valid JSON"),
    ("empty-index", sharded, lambda f: _truncate(f / INDEX_FILE, 0), INDEX_FILE, "not valid JSON"),
    ("binary-index", sharded, lambda f: (f / INDEX_FILE).write_bytes(b"\xff\xfe\x00{"), INDEX_FILE, "not valid JSON"),
    ("truncated-single", single, lambda f: _truncate(f / SINGLE_FILE, -3), SINGLE_FILE, "not fully covered"),
    ("empty-single", single, lambda f: _truncate(f / SINGLE_FILE, 0), SINGLE_FILE, "header too small"),
]


@pytest.mark.parametrize("make, breaks, file, says", [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_a_broken_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path, make, breaks, file, says):
    folder = make(tmp_path / "checkpoint")
    target = model()
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    assert load_pretrained(model(), folder).dense, "the checkpoint loads before it is broken"
    breaks(folder)
    with pytest.raises(ValueError) as error:
        load_pretrained(target, folder)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(folder / file)) and says in message, message
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items()), "nothing copied"


def test_a_truncated_single_file_source_is_named(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in model().state_dict().items()}, str(path))
    _truncate(path, -1)
    with pytest.raises(ValueError, match=f"^{path}: not a readable safetensors file: .*not fully covered"):
        load_pretrained(model(), path)


_FIFO_SCRIPT = """
import sys
import torch
from zeroshard.moe import load_pretrained
torch.manual_seed(0)
try:
    load_pretrained(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), sys.argv[1])
except ValueError as err:
    print("refused:", err)
"""


def _replace_with_fifo(path: Path) -> Path:
    if path.is_file():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    "make, fifo",
    [(sharded, "b.safetensors"), (sharded, INDEX_FILE), (single, SINGLE_FILE), (single, "")],
    ids=["shard", "index", "model.safetensors", "the source itself"],
)
def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(tmp_path, make, fifo):
    folder = make(tmp_path / "checkpoint")
    if fifo:
        path = _replace_with_fifo(folder / fifo)
    else:
        path = _replace_with_fifo(tmp_path / "weights.safetensors")
    import zeroshard

    src = Path(zeroshard.__file__).resolve().parents[1]  # the sources this test runs on
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _FIFO_SCRIPT, str(folder if fifo else path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"refused: {path}: not a regular file", done.stdout
