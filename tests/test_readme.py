"""The README's shell commands, as written: every program they name is one the setup installs
(or a file of the repository), every option they pass is one the program takes, and the cheap
ones run. The demo and the test suite themselves are run by tests/test_demo.py and by CI.

Commands are the README's indented code blocks (outside fenced ones) and the inline code spans
that start with a program (``zeroshard``, ``.venv/bin/...``, ``torchrun``, ``source``).
Placeholders (CKPT, OUT, shapes.json, AUTOEP_CKPT) stand for a real checkpoint, a fresh folder,
a shape file made here and a DeepSpeed AutoEP checkpoint (tests/autoep_fixtures.py); ``[...]``
marks options, each of which is passed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint import Checkpointer
from zeroshard.cli.main import build_parser, main
from zeroshard.engine import ZeroOptimizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent  # what scripts/setup.sh makes as .venv/bin
PROGRAMS = ("bash ", "zeroshard ", ".venv/bin/", "torchrun ", "source ")
CHEAP = ("--version", "layout", "inspect", "to-universal", "to-fp32")  # zeroshard commands that run in a second


def readme_commands() -> list[str]:
    commands, fenced = [], False
    lines = README.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif (
            not fenced
            and line.startswith("    ")
            and line.strip()
            and (index == 0 or not lines[index - 1].strip() or lines[index - 1].startswith("    "))
        ):
            commands.append(line.strip())
    for span in re.findall(r"`([^`\n]+)`", README.read_text()):
        if span.startswith(PROGRAMS) and " " in span:
            commands.append(span)
    parts = [part.strip() for command in commands for part in command.split("&&")]
    return [part for part in parts if part.startswith(PROGRAMS)]


def words(command: str, placeholders: dict[str, str]) -> list[str]:
    command = re.sub(r"\s+#.*$", "", command)
    command = re.sub(r"\[([^\]]+)\]", r"\1", command)  # every optional part is passed
    return [placeholders.get(word, word) for word in shlex.split(command)]


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("readme")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    with Checkpointer(engine, base / "ckpt", async_save=False) as ckpt:
        model(torch.randn(2, 4)).sum().backward()
        engine.step()
        ckpt.save(0)
    (base / "shapes.json").write_text(json.dumps([[4096, 11], [11]]))
    return {"CKPT": str(base / "ckpt"), "shapes.json": str(base / "shapes.json")}


def test_the_readme_has_the_commands_a_new_user_runs():
    commands = readme_commands()
    assert "bash scripts/setup.sh" in commands
    assert any(command.startswith(".venv/bin/torchrun ") for command in commands), "torchrun as the setup installs it"
    assert not any(command.startswith("torchrun ") for command in commands), "a bare torchrun needs an activated venv"


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_names_what_the_setup_installs_and_options_that_exist(
    command, placeholders, tmp_path, request
):
    placeholders = {**placeholders, "OUT": str(tmp_path / "out")}
    if "AUTOEP_CKPT" in command:  # a real DeepSpeed AutoEP checkpoint (made once per session)
        placeholders["AUTOEP_CKPT"] = str(request.getfixturevalue("autoep_runs")["w2_ep2_s2"].save_dir)
    argv = words(command, placeholders)
    program, args = argv[0], argv[1:]
    if program == "bash":
        assert (ROOT / args[0]).is_file(), args[0]
        return
    if program == "source":
        assert args == [".venv/bin/activate"] and (VENV_BIN / "activate").is_file()
        return
    assert program.startswith(".venv/bin/") or program == "zeroshard", f"{program}: say where it is (.venv/bin/)"
    name = program.removeprefix(".venv/bin/")
    assert (VENV_BIN / name).is_file(), f"the setup installs no {name}"
    if name == "python" and args[:2] == ["-m", "pytest"]:
        assert importlib.util.find_spec("pytest")
    elif name == "python":
        _check_script(args[0], args[1:])
    elif name == "torchrun":
        _check_torchrun(args, placeholders)
    else:
        _check_zeroshard(args)


def _check_torchrun(args: list[str], placeholders: dict[str, str]) -> None:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    script, script_args = parsed.training_script, parsed.training_script_args
    if script == ".venv/bin/zeroshard":
        _check_zeroshard(script_args, run_cheap=False)
        return
    _check_script(script, script_args)


def _check_script(script: str, script_args: list[str]) -> None:
    """``script`` is a file of the repository whose ``parse_args()`` takes ``script_args``."""
    assert (ROOT / script).is_file(), script
    spec = importlib.util.spec_from_file_location("readme_script", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = sys.argv
    try:
        sys.argv = [script, *script_args]
        module.parse_args()  # exits on an unknown option
    finally:
        sys.argv = saved


def _check_zeroshard(args: list[str], run_cheap: bool = True) -> None:
    if args == ["--version"]:
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 0
        return
    if len(args) == 1 and any(action.required for action in _subcommand(args[0])._actions):
        return  # a command named in prose ("`zeroshard inspect` prints ..."): it exists
    build_parser(args[0]).parse_args(args)  # an unknown option or a bad value exits here
    if run_cheap and args[0] in CHEAP:
        assert main(args) == 0, args


def _subcommand(name: str):
    """The parser of ``zeroshard NAME``; fails when there is no such command."""
    commands = next(action for action in build_parser(name)._actions if action.dest == "command")
    assert name in commands.choices, f"zeroshard has no command {name!r}"
    return commands.choices[name]
