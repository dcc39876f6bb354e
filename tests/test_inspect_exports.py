"""The CLI a new user meets: ``--version``; ``inspect`` of an fp32 export (it used to say "not a
checkpoint, or an unfinished save"); ``inspect --verify --files`` listing what it checked (it
listed nothing); and what the step number of the report counts (``step: 30`` for the
checkpoint tagged step 29, unexplained)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard import __version__
from zeroshard.checkpoint import Checkpointer
from zeroshard.checkpoint.export.fp32 import to_fp32
from zeroshard.checkpoint.universal import to_universal
from zeroshard.cli.main import main
from zeroshard.engine import ZeroOptimizer


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A Checkpointer root after 30 optimizer steps, saved as the loop's step 29."""
    root = tmp_path_factory.mktemp("run") / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    with Checkpointer(engine, root, async_save=False) as ckpt:
        for _ in range(30):
            model(torch.randn(2, 4)).sum().backward()
            engine.step()
            engine.zero_grad()
        ckpt.save(29)
    return root


@pytest.fixture(scope="module")
def exports(saved, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exports")
    return {
        "single": to_fp32(saved, out / "single", progress=False),
        "sharded": to_fp32(saved, out / "sharded", max_shard_size=40, progress=False),
        "universal": to_universal(saved, out / "universal", progress=False),
    }


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and _lines(capsys) == [f"zeroshard {__version__}"]
    code = "import sys; from zeroshard.cli.main import main\ntry: main(['--version'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["zeroshard", __version__, "False"], "--version imports no command (nor torch)"


def test_the_step_line_says_what_each_number_counts(saved, exports, capsys):
    expected = (
        "step: 29 (the training-loop step it was saved after, extra['step']: Checkpointer.load() resumes at step 30); "
        "30 optimizer steps taken (extra['global_steps'])"
    )
    for path in (saved, exports["universal"]):
        assert main(["inspect", str(path)]) == 0
        assert expected in _lines(capsys)


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_inspect_describes_an_fp32_export(exports, which, capsys):
    path = exports[which]
    assert main(["inspect", "--files", str(path)]) == 0
    lines = _lines(capsys)
    assert lines[0] == f"export {path}"
    assert lines[1].startswith(
        "kind: fp32 export (to-fp32 output): a Hugging Face style model state dict, weights only"
    )
    assert lines[2] == "step: not recorded (an export holds weights only)"
    assert lines[3] == "tensors: 5 (27 elements); by dtype: float32 5"
    assert lines[4:9] == [
        "  0.bias: float32 [3]",
        "  0.weight: float32 [3, 4]",
        "  1.bias: float32 [3]",
        "  1.weight: float32 [3]",
        "  2.weight: float32 [2, 3]",
    ]
    files = sorted(p.name for p in path.iterdir())
    assert all(any(line.startswith(f"  {name}: ") for line in lines) for name in files)


def test_verify_checks_an_fp32_export_and_lists_the_files(exports, capsys):
    path = exports["sharded"]
    assert main(["inspect", "--verify", "--files", str(path)]) == 0
    lines = _lines(capsys)
    sizes = {p.name: p.stat().st_size for p in path.iterdir()}
    assert lines[0] == (
        f"{path}: OK, fp32 export, {len(sizes)} files, {sum(sizes.values()):,} bytes, 5 tensors: every header, tensor "
        "size, index entry and tensor digest agrees"
    )
    assert lines[1] == f"files checked: {len(sizes)}, {sum(sizes.values()):,} bytes"
    assert sorted(lines[2:]) == sorted(f"  {name}: {size:,} bytes" for name, size in sizes.items())


def test_verify_finds_damage_in_an_fp32_export(exports, tmp_path, capsys):
    import shutil

    path = Path(shutil.copytree(exports["sharded"], tmp_path / "damaged"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    moved = sorted(weight_map)[0]
    holder = weight_map[moved]
    weight_map[moved] = next(file for file in sorted(set(weight_map.values())) if file != holder)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model-00009-of-00009.safetensors").write_bytes(b"")
    assert main(["inspect", "--verify", str(path)]) == 1
    lines = _lines(capsys)
    index_file = path / "model.safetensors.index.json"
    assert f"{index_file}: tensor {moved!r} is listed in {weight_map[moved]} but in {holder}" in lines
    assert lines[-1] == f"{path / 'model-00009-of-00009.safetensors'}: not listed in model.safetensors.index.json"


@pytest.mark.parametrize("kind", ["native", "universal"])
def test_verify_files_lists_every_file_checked(saved, exports, kind, capsys):
    path = saved / "step-00000029" if kind == "native" else exports["universal"]
    assert main(["inspect", "--verify", "--files", str(path)]) == 0
    lines = _lines(capsys)
    sizes = {p.name: p.stat().st_size for p in path.iterdir()}
    assert lines[1] == f"files checked: {len(sizes)}, {sum(sizes.values()):,} bytes"
    assert sorted(lines[2:]) == sorted(f"  {name}: {size:,} bytes" for name, size in sizes.items())
    assert main(["inspect", "--verify", str(path)]) == 0
    assert len(_lines(capsys)) == 1, "without --files: the summary only"


def _one_tensor_flipped(path: Path) -> str:
    """Flip one byte of the first tensor of the first shard; that tensor's name."""
    from safetensors import safe_open

    shard = sorted(path.glob("model-*.safetensors"))[0]
    with safe_open(str(shard), "np") as handle:
        name = sorted(handle.keys())[0]
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:header_end])[name]["data_offsets"]
    data[header_end + offsets[0]] ^= 0x40
    shard.write_bytes(bytes(data))
    return name


def test_verify_checks_each_tensor_against_the_digests_it_was_written_with(exports, tmp_path, capsys):
    import shutil

    path = Path(shutil.copytree(exports["sharded"], tmp_path / "flipped"))
    name = _one_tensor_flipped(path)  # headers, sizes and index all still agree
    assert main(["inspect", "--verify", str(path)]) == 1
    (line,) = _lines(capsys)
    assert f": tensor {name!r} reads as CRC-32 " in line and "it is not what was written" in line


def test_verify_refuses_a_digest_record_that_does_not_name_the_tensors(exports, tmp_path, capsys):
    import shutil

    path = Path(shutil.copytree(exports["single"], tmp_path / "edited"))
    record_file = path / "zeroshard.digests.json"
    record = json.loads(record_file.read_text())
    dropped = sorted(record["tensors"])[0]
    del record["tensors"][dropped]
    record_file.write_text(json.dumps(record))
    assert main(["inspect", "--verify", str(path)]) == 1
    assert _lines(capsys) == [
        f"{record_file}: does not record exactly the export's tensors (extra [], absent [{dropped!r}])"
    ]


def test_verify_of_an_export_without_digests_says_so(exports, tmp_path, capsys):
    import shutil

    path = Path(shutil.copytree(exports["single"], tmp_path / "older"))
    (path / "zeroshard.digests.json").unlink()
    assert main(["inspect", "--verify", str(path)]) == 0
    (line,) = _lines(capsys)
    assert line.endswith("(no zeroshard.digests.json: written before digests)")
