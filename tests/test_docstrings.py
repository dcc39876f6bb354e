"""Every public module, class, function, method and property of zeroshard has a docstring;
the collective entry points say that they are; the API reference builds without a warning.

Public: a module whose dotted name has no part starting with ``_``, and in it every class
and function defined there (``__module__`` is the module) whose name does not start with
``_``, with the methods and properties in the class's own ``__dict__`` (dataclass fields
aside). A dataclass's or namedtuple's generated signature line is no docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import importlib
import importlib.util
import inspect
import pkgutil
import re
import warnings
from pathlib import Path

import zeroshard

ROOT = Path(__file__).resolve().parents[1]

# Entry points that communicate (directly or through what they call): a rank that calls one
# alone blocks or fails, so their docstrings say "collective" (and not "not collective").
COLLECTIVE = (
    "zeroshard.engine.optimizer:ZeroOptimizer",  # its construction
    "zeroshard.engine.optimizer:ZeroOptimizer.backward",  # stage 2 reduces during backward
    "zeroshard.engine.optimizer:ZeroOptimizer.step",
    "zeroshard.engine.optimizer:ZeroOptimizer.load_state_dict",
    "zeroshard.engine.optimizer:ZeroOptimizer.import_state",
    "zeroshard.engine.optimizer:ZeroOptimizer.sync_params_from_masters",
    "zeroshard.engine.fragments:FragmentAccess.get_full_fp32_param",
    "zeroshard.engine.fragments:FragmentAccess.set_full_fp32_param",
    "zeroshard.engine.fragments:FragmentAccess.get_full_grad",
    "zeroshard.engine.fragments:FragmentAccess.set_full_grad",
    "zeroshard.engine.fragments:FragmentAccess.get_full_optimizer_state",
    "zeroshard.engine.fragments:FragmentAccess.set_full_optimizer_state",
    "zeroshard.engine.fragments:FragmentAccess.get_local_grad",  # finishes a stage-1 reduction
    "zeroshard.engine.fragments:FragmentAccess.set_local_grad",
    "zeroshard.engine.state_io:import_state",
    "zeroshard.engine.gradients:GradientReducer",
    "zeroshard.engine.gradients:GradientReducer.reduce",
    "zeroshard.engine.gradients:GradientReducer.finish_backward",
    "zeroshard.engine.setup:check_same_layout_on_every_rank",
    "zeroshard.engine.setup:initial_values",
    "zeroshard.comm:Collectives",
    "zeroshard.comm:Collectives.reduce_scatter_sum",
    "zeroshard.comm:Collectives.reduce_scatter_widened",
    "zeroshard.comm:Collectives.all_gather_into",
    "zeroshard.comm:Collectives.all_reduce_",
    "zeroshard.comm:Collectives.broadcast_",
    "zeroshard.comm:Collectives.all_gather_object",
    "zeroshard.comm:Collectives.barrier",
    "zeroshard.comm:Collectives.checked",
    "zeroshard.comm:Collectives.agree",
    "zeroshard.launch:init_from_env",
    "zeroshard.moe.groups:new_expert_groups",
    "zeroshard.moe.dispatch:dispatch",
    "zeroshard.moe.dispatch:combine",
    "zeroshard.moe.layer:MoEFeedForward",
    "zeroshard.moe.layer:MoEFeedForward.forward",
    "zeroshard.moe.model:MoEBlock.forward",
    "zeroshard.moe.model:MoEGPT",
    "zeroshard.moe.model:MoEGPT.forward",
    "zeroshard.moe.parallel:expert_parallel",  # the forward it installs
    "zeroshard.deepspeed.config:from_deepspeed_config",
    "zeroshard.deepspeed.config:DeepSpeedRun.step",
    "zeroshard.deepspeed.config:DeepSpeedRun.checkpointer",
    "zeroshard.checkpoint.engine_io:save_checkpoint",
    "zeroshard.checkpoint.engine_io:load_checkpoint",
    "zeroshard.checkpoint.engine_io:load_checkpoint_attested",
    "zeroshard.checkpoint.native.save:save_sharded",
    "zeroshard.checkpoint.native.save:plan_save",
    "zeroshard.checkpoint.native.save:commit_save",
    "zeroshard.checkpoint.native.load:load_sharded",  # given a coordinator
    "zeroshard.checkpoint.universal.load:load_universal",  # given a coordinator
    "zeroshard.checkpoint.attest.attested:load_from",  # given a coordinator
    "zeroshard.checkpoint.attest.attested:load_attested",
    "zeroshard.checkpoint.attest.attested:attested_load",
    "zeroshard.checkpoint.coordinator:Coordinator.barrier",
    "zeroshard.checkpoint.coordinator:Coordinator.broadcast_object",
    "zeroshard.checkpoint.coordinator:Coordinator.all_gather_object",
    "zeroshard.checkpoint.coordinator:TorchDistributedCoordinator.barrier",
    "zeroshard.checkpoint.coordinator:TorchDistributedCoordinator.broadcast_object",
    "zeroshard.checkpoint.coordinator:TorchDistributedCoordinator.all_gather_object",
    "zeroshard.checkpoint.coordinator:ThreadCoordinator.barrier",  # among the threads of run_ranks
    "zeroshard.checkpoint.coordinator:ThreadCoordinator.broadcast_object",
    "zeroshard.checkpoint.coordinator:ThreadCoordinator.all_gather_object",
    "zeroshard.checkpoint.checkpointer:Checkpointer",  # its construction makes a process group
    "zeroshard.checkpoint.checkpointer:Checkpointer.save",
    "zeroshard.checkpoint.checkpointer:Checkpointer.load",
    "zeroshard.checkpoint.checkpointer:Checkpointer.close",
)
# Engine methods a user may take for collective that are not: their docstrings say so.
NOT_COLLECTIVE = (
    "zeroshard.engine.optimizer:ZeroOptimizer.zero_grad",
    "zeroshard.engine.optimizer:ZeroOptimizer.state_dict",
    "zeroshard.engine.optimizer:ZeroOptimizer.memory_report",
    "zeroshard.engine.optimizer:ZeroOptimizer.export_state",
    "zeroshard.engine.optimizer:ZeroOptimizer.state_views",
    "zeroshard.engine.fragments:FragmentAccess.get_local_fp32_param",
    "zeroshard.engine.fragments:FragmentAccess.set_local_fp32_param",
    "zeroshard.engine.fragments:FragmentAccess.get_local_optimizer_state",
    "zeroshard.engine.fragments:FragmentAccess.set_local_optimizer_state",
    "zeroshard.moe.pretrained:load_pretrained",
    "zeroshard.launch:spawn",
    "zeroshard.checkpoint.native.save:write_rank_files",  # between plan_save and commit_save
)
SAYS_COLLECTIVE = re.compile(r"(?<!not )\bcollective\b", re.IGNORECASE)
SAYS_NOT_COLLECTIVE = re.compile(r"\bnot collective\b", re.IGNORECASE)


def public_modules() -> list[str]:
    walked = pkgutil.walk_packages(zeroshard.__path__, "zeroshard.")
    names = [info.name for info in walked]
    return ["zeroshard"] + [name for name in names if not any(part.startswith("_") for part in name.split("."))]


def own_docstring(obj: object) -> str:
    """The docstring written for ``obj`` itself: not inherited, not generated."""
    if not inspect.isclass(obj):
        return (getattr(obj, "__doc__", None) or "").strip()
    doc = (obj.__dict__.get("__doc__") or "").strip()
    generated = dataclasses.is_dataclass(obj) or (issubclass(obj, tuple) and hasattr(obj, "_fields"))
    return "" if generated and doc.startswith(f"{obj.__name__}(") else doc


def documented_members(cls: type) -> dict[str, object]:
    """The public functions, methods and properties ``cls`` defines itself, unwrapped."""
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    members = {}
    for name, member in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        elif isinstance(member, property):
            member = member.fget
        elif isinstance(member, functools.cached_property):
            member = member.func
        if inspect.isfunction(member):
            members[name] = member
    return members


def public_objects(module_name: str):
    """(qualified name, object) of the module and of everything public defined in it."""
    module = importlib.import_module(module_name)
    yield module_name, module
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module_name:
            continue  # imported: checked where it is defined
        yield name, obj
        if inspect.isclass(obj):
            for member_name, member in documented_members(obj).items():
                yield f"{name}.{member_name}", member


def resolve(target: str) -> object:
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return obj.fget if isinstance(obj, property) else obj


def test_every_public_module_class_function_method_and_property_has_a_docstring():
    missing: dict[str, list[str]] = {}
    checked = set()
    for module_name in public_modules():
        for name, obj in public_objects(module_name):
            checked.add(f"{module_name}:{name}")
            if not own_docstring(obj):
                missing.setdefault(module_name, []).append("(module)" if name == module_name else name)
    kinds = {  # a method, a property, a classmethod, a function, a generated-docstring dataclass
        "zeroshard.engine.optimizer:ZeroOptimizer.step",
        "zeroshard.layout.group:ParamSlot.numel",
        "zeroshard.layout.policy:LayoutPolicy.native",
        "zeroshard.moe.groups:new_expert_groups",
        "zeroshard.models:GPTConfig",
    }
    assert kinds <= checked, f"the walk missed {sorted(kinds - checked)}"
    lines = [f"{module}: {', '.join(names)}" for module, names in sorted(missing.items())]
    assert not missing, f"{sum(map(len, missing.values()))} public objects without a docstring:\n" + "\n".join(lines)


def test_collective_entry_points_say_so_and_the_others_say_they_are_not():
    wrong = []
    for target in COLLECTIVE:
        if not SAYS_COLLECTIVE.search(inspect.getdoc(resolve(target)) or ""):
            wrong.append(f"{target}: its docstring does not say it is collective")
    for target in NOT_COLLECTIVE:
        if not SAYS_NOT_COLLECTIVE.search(inspect.getdoc(resolve(target)) or ""):
            wrong.append(f"{target}: its docstring does not say it is not collective")
    assert not wrong, "\n".join(wrong)


def _api_reference():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docstring_html(page: Path, qualname: str) -> str:
    """The rendered docstring of ``qualname`` on ``page``, as text."""
    text = page.read_text(encoding="utf-8")
    found = re.search(rf'id="{re.escape(qualname)}".*?<div class="docstring">(.*?)</div>', text, re.DOTALL)
    assert found, f"{page.name} documents no {qualname}"
    return html.unescape(re.sub(r"<[^>]+>", " ", found.group(1)))


def test_the_api_reference_builds_without_warnings_a_page_per_public_module(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pages = _api_reference().build(tmp_path, search=False)
    expected = {tmp_path / f"{name.replace('.', '/')}.html" for name in public_modules()}
    assert set(pages) == expected
    assert {path for path in tmp_path.rglob("*.html")} == expected | {tmp_path / "index.html"}
    optimizer = tmp_path / "zeroshard" / "engine" / "optimizer.html"
    step = _docstring_html(optimizer, "ZeroOptimizer.step")
    assert "Collective" in step and "Raises" in step and "MinimumLossScaleError" in step
    assert "Collective" in _docstring_html(tmp_path / "zeroshard" / "engine.html", "ZeroOptimizer.step")
    # ZeroOptimizer's page links its inherited collective accessors to where they are documented.
    assert 'href="fragments.html#FragmentAccess.get_full_fp32_param"' in optimizer.read_text(encoding="utf-8")
    fragments = tmp_path / "zeroshard" / "engine" / "fragments.html"
    assert "Collective" in _docstring_html(fragments, "FragmentAccess.get_full_fp32_param")
