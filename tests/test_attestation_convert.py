"""The converters and inspect --verify check what they read against the saved digests, with
torch unimportable: a checkpoint whose values are not what was saved (its files intact, so
no checksum notices) is refused in one line naming the parameter and expert."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import pytest
from safetensors import safe_open
from test_moe_checkpoint import moe_layout
from universal_helpers import save_synthetic

from zeroshard.checkpoint.universal import to_universal

EXPERTS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_synthetic(tmp_path_factory.mktemp("convert"), moe_layout(4, 2, num_experts=EXPERTS))


def _with_a_wrong_digest(saved, tmp_path, name: str, kind: str, expert: int | None):
    """A copy whose manifest records another digest for one tensor: as if the values were not
    what was saved (the files' checksums all still match)."""
    copy = tmp_path / "tampered"
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    kinds = manifest["digests"]["params"][name]
    if expert is None:
        kinds[kind] ^= 1
    else:
        kinds[kind][expert] ^= 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _with_a_changed_value(universal, key: str):
    """Change one value of a universal shard and record the shard's new checksums: only the
    digests still know what was saved."""
    manifest = json.loads((universal / "universal.json").read_text())
    shard = universal / manifest["weight_map"][key]
    with safe_open(shard, "numpy") as handle:
        header_bytes = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        offsets = json.loads(shard.read_bytes()[8:header_bytes])[key]["data_offsets"]
        assert handle.get_tensor(key).size
    data = bytearray(shard.read_bytes())
    data[header_bytes + offsets[0] + 3] ^= 0x40  # a bit of the first element's exponent
    shard.write_bytes(bytes(data))
    record = manifest["shards"][shard.name]
    size = record["block_size"]
    record["crc32"] = [zlib.crc32(bytes(data[i : i + size])) for i in range(0, len(data), size)]
    (universal / "universal.json").write_text(json.dumps(manifest))


def _run_without_torch(*commands) -> list[tuple[int, str]]:
    """Each command's exit status and stderr, run by ``zeroshard.cli.main`` in one process where
    importing torch fails."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        sys.modules["torch"] = None  # any import of torch fails
        from zeroshard.cli.main import main
        found = []
        for argv in {[list(map(str, c)) for c in commands]!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                found.append((main(argv), err.getvalue()))
        print(json.dumps(found))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=dict(os.environ), check=False)
    assert done.returncode == 0, done.stderr
    return [tuple(item) for item in json.loads(done.stdout)]


def test_conversions_and_verify_refuse_values_that_are_not_what_was_saved(saved, tmp_path):
    fp32_wrong = _with_a_wrong_digest(saved, tmp_path / "a", "moe.experts.w2", "fp32", 3)
    state_wrong = _with_a_wrong_digest(saved, tmp_path / "b", "wte", "exp_avg_sq", None)
    results = _run_without_torch(
        ["to-universal", state_wrong, tmp_path / "u"],
        ["to-fp32", fp32_wrong, tmp_path / "f"],
        ["inspect", "--verify", fp32_wrong],
        ["to-universal", saved, tmp_path / "good"],
    )
    (code, err), (fp32_code, fp32_err), (verify_code, verify_out), (good, _) = results
    assert code == 2 and err.count("\n") == 1 and "zeroshard to-universal: error: " in err
    assert "'wte' exp_avg_sq reads as digest" in err and "it does not hold what was saved" in err
    assert fp32_code == 2 and fp32_err.count("\n") == 1 and "'moe.experts.w2' expert 3 fp32 reads as digest" in fp32_err
    assert verify_code == 1 and verify_out.count("\n") == 1 and "'moe.experts.w2' expert 3 fp32 reads as digest" in verify_out
    assert not (tmp_path / "u").exists() and not (tmp_path / "f").exists() and good == 0


def test_a_universal_checkpoint_whose_values_changed_is_refused_by_verify_and_to_fp32(saved, tmp_path):
    universal = to_universal(saved, tmp_path / "u", progress=False)
    _with_a_changed_value(universal, "param/moe.experts.1.w3.weight/fp32")
    (verify_code, verify_out), (code, err) = _run_without_torch(
        ["inspect", "--verify", universal], ["to-fp32", universal, tmp_path / "f"]
    )
    assert verify_code == 1 and "'moe.experts.w3' expert 1 fp32 reads as digest" in verify_out, verify_out
    assert code == 2 and "'moe.experts.w3' expert 1 fp32 reads as digest" in err and err.count("\n") == 1
