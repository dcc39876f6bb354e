"""The command line's contract: every error is one line on stderr (exit 2 for bad input, 3 for
a bug, with the way to see its traceback), never a traceback; ``python -m zeroshard`` is the
console script."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint import run_ranks, save_sharded
from zeroshard.io import jsonvalue
from zeroshard.checkpoint.testing import synthesize_state
from zeroshard.cli.main import main
from zeroshard.layout import LayoutPolicy, ParamSpec, build_layout

SRC = Path(__file__).resolve().parents[1] / "src"
SCRIPT = Path(sys.executable).parent / "zeroshard"
LAYOUT = build_layout([[ParamSpec.of("a", (7, 5), "bf16"), ParamSpec.of("b", (13,), "bf16")]], 2, LayoutPolicy.native())


@pytest.fixture
def saved(tmp_path) -> Path:
    """A native checkpoint root holding tag step7."""
    root = tmp_path / "ckpt"
    run_ranks(2, lambda c: save_sharded(root, "step7", synthesize_state(LAYOUT, c.rank), coordinator=c, block_size=64))
    return root


def _cli(*args: str, module: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "zeroshard"] if module else [str(SCRIPT)]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    environ.pop("ZEROSHARD_DEBUG", None)
    environ.update(env or {})
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, env=environ)


def _assert_one_line_error(done: subprocess.CompletedProcess | tuple[int, str], *expected: str, code: int = 2) -> str:
    returncode, stderr = (done.returncode, done.stderr) if isinstance(done, subprocess.CompletedProcess) else done
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---- python -m zeroshard -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, code",
    [(["inspect", "{ckpt}"], 0), (["inspect", "{ckpt}/missing"], 2), (["layout", "--world-size", "0"], 2), ([], 2)],
)
def test_python_m_zeroshard_is_the_console_script(saved, args, code):
    args = [arg.format(ckpt=saved) for arg in args]
    script, module = _cli(*args), _cli(*args, module=True)
    assert script.returncode == code, script.stderr
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, script.stdout, script.stderr)


def test_a_path_the_terminal_cannot_encode_is_printed_escaped(saved):
    """Under PYTHONIOENCODING=ascii the export was written, then printing its path raised
    UnicodeEncodeError: exit 2 "error: 'ascii' codec can't encode" for work that was done."""
    out = saved.parent / "exp\u00f6rt"
    done = _cli("to-fp32", str(saved), str(out), "--no-progress", env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(f"wrote {saved.parent}/exp\\xf6rt: 2 files"), done.stdout
    described = _cli("inspect", str(out), env={"PYTHONIOENCODING": "ascii"})
    assert described.returncode == 0 and "exp\\xf6rt" in described.stdout, described.stderr


# ---- user errors: exit 2, one line -------------------------------------------------------------


def test_manifest_nested_too_deeply_for_json(saved):
    manifest = saved / "step7" / "manifest.json"
    manifest.write_text(_nest(100_000))
    _assert_one_line_error(_cli("inspect", str(saved)), str(manifest), "JSON nested more than 100 levels deep")
    _assert_one_line_error(_cli("to-universal", str(saved), str(saved.parent / "out")), str(manifest))


def test_manifest_value_nested_deep_enough_to_break_decoding(saved):
    """950 levels parse with json.loads but overflow the stack of a recursive decoder."""
    manifest = saved / "step7" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["extra"]["deep"] = "@@"
    manifest.write_text(json.dumps(data).replace('"@@"', _nest(950)))
    _assert_one_line_error(_cli("inspect", str(saved)), str(manifest), "nested more than 100 levels")


def test_safetensors_header_nested_too_deeply(tmp_path):
    from zeroshard.io.safetensors_io import read_header

    path = tmp_path / "deep.safetensors"
    header = _nest(5000).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match=f"{path}: corrupted: JSON nested more than"):
        read_header(path, path.stat().st_size)


def test_json_depth_limit_is_the_same_for_writing_and_reading():
    deepest = nested = []
    for _ in range(jsonvalue.MAX_VALUE_DEPTH - 1):
        nested.append([])
        nested = nested[0]
    text = json.dumps({"extra": jsonvalue.encode(deepest)})
    assert jsonvalue.decode(jsonvalue.loads(text, "manifest")["extra"]) == deepest
    with pytest.raises(ValueError, match=r"extra: nested more than 90 levels"):
        jsonvalue.encode([deepest], "extra")
    with pytest.raises(ValueError, match=r"m.json: corrupted: JSON nested more than 100 levels"):
        jsonvalue.loads(_nest(101), "m.json")
    assert jsonvalue.loads(_nest(100), "m.json") is not None


def test_unreadable_manifest(saved, monkeypatch, capsys):
    """Tests run as root, so chmod cannot make a file unreadable: opening it is made to fail."""
    manifest = saved / "step7" / "manifest.json"
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(path).name == "manifest.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    for command in (["inspect", str(saved)], ["to-fp32", str(saved), str(saved.parent / "out")]):
        code = main(command)
        _assert_one_line_error((code, capsys.readouterr().err), f"{manifest}: Permission denied")


def test_a_directory_where_a_rank_file_should_be(saved, capsys):
    rank_file = saved / "step7" / "rank-00000-of-00002.safetensors"
    rank_file.unlink()
    rank_file.mkdir()
    code = main(["to-universal", str(saved), str(saved.parent / "out"), "--no-progress"])
    _assert_one_line_error((code, capsys.readouterr().err), str(rank_file))


def test_conversions_run_with_the_collector_paused_and_set_it_back(saved, monkeypatch, capsys):
    import gc

    from zeroshard.cli import convert_cmd

    seen = []
    real = convert_cmd.to_fp32
    monkeypatch.setattr(convert_cmd, "to_fp32", lambda *args, **kw: seen.append(gc.isenabled()) or real(*args, **kw))
    assert gc.isenabled()
    assert main(["to-fp32", str(saved), str(saved.parent / "out"), "--no-progress"]) == 0
    assert seen == [False] and gc.isenabled()
    code = main(["to-fp32", str(saved / "missing"), str(saved.parent / "out2"), "--no-progress"])
    _assert_one_line_error((code, capsys.readouterr().err), "missing")
    assert seen == [False, False] and gc.isenabled()


def test_full_disk_names_the_file(saved, monkeypatch, capsys):
    """ENOSPC comes from write(), which knows no path: the error must still say where."""
    from zeroshard.io import safetensors_io
    from zeroshard.checkpoint.universal import write as universal_write

    writes = []

    def write_all(out, data, hasher):
        writes.append(len(data))
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        out.write(data)

    out = saved.parent / "out"
    with monkeypatch.context() as patch:
        patch.setattr(safetensors_io, "_write_all", write_all)
        code = main(["to-universal", str(saved), str(out), "--no-progress"])
    line = _assert_one_line_error((code, capsys.readouterr().err), "No space left on device")
    # the file being written, in OUT's staging directory (published as OUT only when complete)
    staged_file = re.escape(str(out.parent)) + r"/\.out\.tmp-[0-9a-f]{12}/universal-00001-of-00001\.safetensors: "
    assert re.search("error: " + staged_file, line), line
    assert not (out / "universal.json").exists()

    def write_manifest(path, text):  # where no file names itself, the output directory is named
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(universal_write, "write_file_durably", write_manifest)
    code = main(["to-universal", str(saved), str(out), "--no-progress"])
    _assert_one_line_error((code, capsys.readouterr().err), f"error: {out}: No space left on device")
    assert not (out / "universal.json").exists()


def test_full_disk_at_the_publish_or_the_lock_names_one_file(saved, monkeypatch, capsys):
    """A rename's ENOSPC names its source and target; the one being written is OUT. The
    lock's record is written through its descriptor: the lock file is named, not OUT."""
    out = saved.parent / "out"
    real_rename, real_pwrite = os.rename, os.pwrite

    def rename(src, dst, **kwargs):
        if Path(dst) == out:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))
        return real_rename(src, dst, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename)
        code = main(["to-universal", str(saved), str(out), "--no-progress"])
    _assert_one_line_error((code, capsys.readouterr().err), f"error: {out}: No space left on device")

    def pwrite(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".out.lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", pwrite)
        code = main(["to-universal", str(saved), str(out), "--no-progress"])
    lock = saved.parent / ".out.lock"
    _assert_one_line_error((code, capsys.readouterr().err), f"error: {lock}: No space left on device")
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["demo", "--steps", "-3"], "argument --steps: must be at least 2, got -3"),
        (["demo", "--steps", "1"], "argument --steps: must be at least 2, got 1"),
        (["demo", "--world-size", "0"], "argument --world-size: must be at least 1"),
        (["demo", "--lr", "nan"], "argument --lr: must be a positive number"),
        (["demo", "--world-size", "5"], "--global-batch 24 does not split into 5 ranks"),
        (["layout", "--world-size", "2", "-1"], "argument --world-size: must be at least 1, got -1"),
        (["layout", "--bucket-numel", "x"], "argument --bucket-numel: not an integer: 'x'"),
        (["to-fp32", "a"], "the following arguments are required: out"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["to-fp32", "a", "b", "--max-shard-size", "9" * 400], "argument --max-shard-size: size '999"),
        (["to-universal", "a", "b", "--max-shard-size", "9223372036854775808"], "is more than 2**63 - 1 bytes"),
        (["to-fp32", "a", "b", "--max-shard-size", "0.5"], "size must be at least one byte"),
    ],
)
def test_bad_arguments_are_one_line(args, expected, capsys):
    try:
        code = main(args)  # a check made after parsing returns
    except SystemExit as exit_:  # argparse exits
        code = exit_.code
    _assert_one_line_error((code, capsys.readouterr().err), expected)


def test_bad_demo_arguments_fail_before_spawning_anything(tmp_path, monkeypatch, capsys):
    """In a subprocess: the check is quick (no rank started, nothing trained)."""
    _assert_one_line_error(_cli("demo", "--steps", "-3"), "zeroshard demo: error: argument --steps")
    _assert_one_line_error(_cli("demo", "--global-batch", "10"), "does not split into 3 ranks")
    from zeroshard import launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    (tmp_path / "file").write_text("")
    (tmp_path / "earlier" / "checkpoints" / "step-00000003").mkdir(parents=True)  # a Checkpointer never saves over it
    earlier = f"{tmp_path / 'earlier' / 'checkpoints'} holds an earlier run's checkpoints (step-00000003, ...)"
    for args, expected in (
        (["demo", "--out", tmp_path / "file"], "exists and is not a directory"),
        (["demo", "--moe", "--out", tmp_path / "file" / "sub"], f"lies under {tmp_path / 'file'}, which is not a directory"),
        (["demo", "--out", tmp_path / "earlier"], earlier),
        (["demo", "--moe", "--out", tmp_path / "earlier"], earlier),
    ):
        _assert_one_line_error((main([str(a) for a in args]), capsys.readouterr().err), f"--out {args[-1]}", expected)


def _model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.json"
    path.write_text(json.dumps([[97, 36], [36], [36, 36]]))
    return path


def test_layout_at_any_world_size_answers_at_once(tmp_path):
    """It counted the ranks with padding one rank at a time: D = 10**12 never finished."""
    done = _cli("layout", "--model", str(_model_file(tmp_path)), "--world-size", "1000000000000", "7")
    assert done.returncode == 0, done.stderr
    rows = [line.split()[-5:-3] for line in done.stdout.splitlines() if line.strip().startswith(("1000000000000 ", "7 "))]
    # Parameters of 3492, 36 and 1296 bf16 elements at 16-byte starts: 0, 3496, 3536; content ends
    # at 4832. D=10**12: partitions of 8 elements; ranks 436 and 441 hold a gap, ranks 604 and up
    # nothing but padding. D=7: partitions of 696; rank 5 holds both gaps, rank 6 the tail.
    assert rows == [["999999999398", "(999999999396"], ["2", "(0"]], done.stdout


def test_layout_refuses_a_fifo_model_without_waiting(tmp_path):
    fifo = tmp_path / "model.json"
    os.mkfifo(fifo)
    _assert_one_line_error(_cli("layout", "--model", str(fifo)), f"{fifo}: not a regular file")


# ---- bugs: exit 3, one line, and how to see the traceback ------------------------------------


def test_unexpected_error_says_how_to_see_the_traceback(saved, monkeypatch, capsys):
    from zeroshard.cli import inspect_report

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(inspect_report, "_layout_lines", broken)
    monkeypatch.delenv("ZEROSHARD_DEBUG", raising=False)
    code = main(["inspect", str(saved)])
    _assert_one_line_error(
        (code, capsys.readouterr().err), "internal error: TypeError: unsupported operand", "--debug", "ZEROSHARD_DEBUG=1", code=3
    )
    for args in (["--debug", "inspect", str(saved)], ["inspect", str(saved), "--debug"]):
        with pytest.raises(TypeError, match="unsupported operand"):
            main(args)
    monkeypatch.setenv("ZEROSHARD_DEBUG", "1")
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["inspect", str(saved)])


def test_debug_flag_shows_the_traceback_of_a_user_error(tmp_path):
    quiet = _cli("inspect", str(tmp_path / "missing"))
    _assert_one_line_error(quiet, "no such checkpoint directory")
    missing = str(tmp_path / "missing")
    for loud in (_cli("--debug", "inspect", missing), _cli("inspect", missing, env={"ZEROSHARD_DEBUG": "1"})):
        assert loud.returncode != 0 and "Traceback" in loud.stderr and "no such checkpoint directory" in loud.stderr


def test_debug_flag_before_the_command_keeps_torch_out(saved):
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from zeroshard.cli.main import main\n"
        f"sys.exit(main(['--debug', 'inspect', {str(saved)!r}]))\n"
    )
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr
    assert "world size: 2" in done.stdout


def test_a_spawned_ranks_traceback_is_cut_to_its_last_line():
    from zeroshard.cli.errors import describe_error

    error = RuntimeError('rank 1 failed:\nTraceback (most recent call last):\n  File "x.py", line 3\nValueError: bad\n')
    assert describe_error(error) == "rank 1 failed: ValueError: bad"


def _nesting(value) -> int:
    if isinstance(value, (list, dict)):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((_nesting(child) for child in children), default=0)
    return 0


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9'),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='[]{}"\\k'), inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_the_nesting_limit_counts_brackets_of_the_value_not_of_its_strings(value):
    """The depth check reads the text, not the parsed value: brackets and escaped quotes
    inside strings must not count, nested containers must."""
    text = json.dumps(value, ensure_ascii=False)
    depth = _nesting(value)
    wrapped = "[" * (jsonvalue.MAX_DEPTH - depth) + text + "]" * (jsonvalue.MAX_DEPTH - depth)
    assert jsonvalue.loads(wrapped.encode(), "f") == json.loads(wrapped)  # exactly at the limit: read
    with pytest.raises(ValueError, match="f: corrupted: JSON nested more than"):
        jsonvalue.loads("[" + wrapped + "]", "f")  # one deeper: refused
