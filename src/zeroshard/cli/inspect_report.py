"""The report ``zeroshard inspect`` prints for each kind of checkpoint, line by line.

Every report has the same first lines (``checkpoint``, ``kind``, ``step``, ``world size``,
``ZeRO stage``, ``layout policy``, ``optimizer``), then the groups, the padding and the files.
Only headers and small scalars are read; no tensor is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..checkpoint.audit import read_record
from ..checkpoint.format import MANIFEST_FILE, MODEL_FILE, rank_file_name, scalar_key
from ..io.block_reader import array_view
from ..io.safetensors_io import VerifiedRanges, read_header
from ..checkpoint.native.handle import Checkpoint
from ..checkpoint.universal.format import MANIFEST_FILE as UNIVERSAL_MANIFEST_FILE
from ..checkpoint.universal.read import UniversalCheckpoint
from ..layout import Layout, LayoutPolicy, build_layout
from .expert_report import every_expert_numel, group_partitioning, shard_group_lines, universal_expert_lines

OPTIMIZER_STEP_KEYS = ("global_steps", "global_step")  # counted by the engine / DeepSpeed: optimizer steps taken
SAVED_AFTER_KEY = "step"  # the Checkpointer's: the training-loop step the checkpoint was saved after
LISTED_FILES = 8
# universal.json's "source.kind" -> what the report calls it
_SOURCE_KINDS = {
    "zeroshard.checkpoint": "zeroshard",
    "DeepSpeedSource": "DeepSpeed ZeRO",
    "DeepSpeedAutoEPSource": "DeepSpeed AutoEP ZeRO",
}
_SAME_STAGES = "not recorded (stage 1 and stage 2 save the same state, and either loads it)"


def _digests_line(digests, bound: str) -> str:
    """What a load attests against: the digests the checkpoint records, or none."""
    if digests is None:
        return "digests: none (written before digests): loads are attested against the values they read"
    logical = len(digests.keys())
    scalars = sum(len(group) for group in digests.scalars)
    return (
        f"digests ({digests.algorithm}): {logical} logical tensors, {scalars} scalars, {len(digests.model)} module "
        f"tensors; {bound}"
    )


def describe_native(ckpt: Checkpoint, *, list_all_files: bool = False) -> list[str]:
    """The report's lines for an opened native checkpoint: kind, step, world size, layout,
    model state, padding, digests and files (each of them with ``list_all_files``). Reads the
    manifest and, for the step, rank 0's ``step`` scalar (CheckpointDamagedError if its
    blocks do not match their checksums)."""
    manifest = ckpt.manifest
    lines = [
        f"checkpoint {ckpt.directory}",
        f"kind: zeroshard checkpoint (tag {manifest.tag!r}, format version {manifest.format_version}, {manifest.created_by})",
        f"step: {_step(manifest.extra) or _native_optimizer_step(ckpt)}",
        f"world size: {manifest.world_size}",
        f"ZeRO stage: {manifest.extra.get('zero_stage', _SAME_STAGES)}",
        *_layout_lines(
            manifest.layout,
            manifest.optimizer_class,
            len(manifest.param_groups),
            [list(record.states) for record in manifest.groups],
            [list(record.scalars) for record in manifest.groups],
        ),
    ]
    frozen = sum(1 for t in manifest.model_tensors.values() if t.kind != "trainable")
    lines += [
        f"{_trainable(manifest.layout)}; model state: {len(manifest.model_tensors)} tensors stored "
        f"({frozen} not trainable), {len(manifest.aliases)} tied alias(es)",
        _padding_line(manifest.layout),
        _digests_line(manifest.digests, "every rank file bound to its place (layout digest, rank, experts)"),
        _resume_line(ckpt),
        _audit_line(ckpt.directory),
    ]
    manifest_size = ckpt.path(MANIFEST_FILE).stat().st_size
    sizes = {name: record.size for name, record in manifest.files.items()}
    configs = {name: record.size for name, record in manifest.config_files.items()}
    lines += file_lines(
        {MANIFEST_FILE: manifest_size, MODEL_FILE: sizes[MODEL_FILE], **configs},
        {name: sizes[name] for name in manifest.rank_files()},
        "rank files",
        list_all_files,
        {"resume files": {name: sizes[name] for name in manifest.resume_files()}},
    )
    return lines


def _resume_line(ckpt: Checkpoint) -> str:
    """What a resume restores besides the state: random states and the script's states."""
    resume = ckpt.manifest.resume
    if resume is None:
        return "resume: no random state or data position saved (a resume goes on from its own)"
    rng = "every rank's random state (torch CPU and CUDA, Python, NumPy)"
    rng = rng if resume.rng else "no random state (rng=False)"
    scope = {"rank": "per rank", "global": "global"}
    states = ", ".join(f"{name!r} ({scope[kind]})" for name, kind in sorted(resume.states.items()))
    return f"resume: {rng}; states: {states or 'none'}"


def _audit_line(directory: Path) -> str:
    """The audit record beside the checkpoint: what the first step after the save saw."""
    record, note = read_record(directory)
    if record is None:
        return f"audit: {note}"
    taken = (
        f"gradient norm {record.grad_norm!r} (before clipping)" if record.stepped else "skipped (an overflow)"
    )
    loss = f"loss {record.loss!r}" + (f" over {record.terms:,} terms" if record.terms is not None else "")
    return (
        f"audit: the first step after the save (world size {record.world_size}): {taken}, lr "
        f"{', '.join(repr(lr) for lr in record.lrs)}, {loss if record.loss is not None else 'loss not reported'}; "
        f"{record.rng_drew} of {record.world_size} ranks drew random numbers"
    )


def describe_universal(ckpt: UniversalCheckpoint, *, list_all_files: bool = False) -> list[str]:
    """The report's lines for an opened universal checkpoint: kind, step, the run it was
    converted from, param groups, parameters, experts, digests and files (each of them with
    ``list_all_files``), from its manifest alone."""
    manifest = ckpt.manifest
    source = manifest.source
    scalars = manifest.param_groups[0].scalars if manifest.param_groups else {}
    stage = manifest.extra.get("zero_stage")
    lines = [
        f"checkpoint {ckpt.directory}",
        f"kind: zeroshard universal checkpoint (format version {manifest.format_version}, {manifest.created_by}), "
        f"converted from a {_SOURCE_KINDS.get(source.get('kind'), source.get('kind', 'unknown'))} run",
        f"step: {_step(manifest.extra) or _scalar_step(scalars.get('step'), 'the optimizer step count of param group 0')}",
        f"world size: any (converted from world size {source.get('world_size', 'unknown')})",
        "ZeRO stage: any" + (f" (the run used stage {stage})" if stage is not None else ""),
        "layout policy: none stored; parameters are kept whole, in their own shapes, with no padding",
        f"optimizer: {manifest.optimizer_class or '-'}, {len(manifest.param_groups)} param group(s)",
        "param groups:",
    ]
    for index, group in enumerate(manifest.param_groups):
        params = [manifest.params[name] for name in group.params]
        dtypes = sorted({param.dtype for param in params})
        states = params[0].states if params else ()
        lines.append(
            f"  group {index}: {len(params)} parameters, {sum(p.numel for p in params):,} elements "
            f"(trained in {', '.join(dtypes) or '-'}); state {', '.join(states) or '-'}; "
            f"scalars {', '.join(group.scalars) or '-'}"
        )
    lines.append(
        f"parameters: {len(manifest.params)} trainable ({sum(p.numel for p in manifest.params.values()):,} elements); "
        f"model state: {len(manifest.model_entries)} buffers or frozen tensors, {len(manifest.aliases)} tied alias(es)"
    )
    lines += universal_expert_lines(manifest.experts, manifest.expert_stacks)
    lines.append(_digests_line(manifest.digests, "carried from the run it was converted from"))
    if manifest.experts:  # the per-expert tensors do not give the source run's layout
        lines.append("padding overhead: none (the source run's expert parallelism is not recorded, nor its padding)")
    else:
        lines.append(_source_padding_line(manifest.param_specs(), source))
    manifest_size = (ckpt.directory / UNIVERSAL_MANIFEST_FILE).stat().st_size
    shards = {name: record.size for name, record in manifest.shards.items()}
    configs = {name: record.size for name, record in manifest.configs.items()}
    lines += file_lines({UNIVERSAL_MANIFEST_FILE: manifest_size, **configs}, shards, "shards", list_all_files)
    return lines


def describe_deepspeed(source: Any, root: Path, files: Sequence[Path], *, list_all_files: bool = False) -> list[str]:
    """``source`` is an opened DeepSpeed source (:class:`~zeroshard.deepspeed.checkpoint.DeepSpeedSource`,
    or for an AutoEP run :class:`~zeroshard.deepspeed.checkpoint.AutoEPSource`, described in DeepSpeed's
    own layout with the model's names beside it); ``files`` its model-states file, then its rank
    files in rank order, then any AutoEP expert files."""
    view, source = source, getattr(source, "raw", source)
    info = source.info
    extra = info.extra
    layout = info.layout
    autoep = getattr(source, "autoep", None)
    named_by = f" (named by {root / 'latest'})" if root != source.path else ""
    version = extra.get("deepspeed_version")
    saved_step = source.scalars(0).get("step") if layout.groups else None
    lines = [
        f"checkpoint {source.path}{named_by}",
        f"kind: DeepSpeed ZeRO stage {extra.get('zero_stage')} checkpoint"
        + (f" (DeepSpeed {version})" if version else "")
        + (f" with AutoEP (preset {autoep.preset}, EP={autoep.ep_size})" if autoep else "")
        + "; read-only here: to-universal and to-fp32 convert it, load_checkpoint resumes from it",
        f"step: {_step(extra) or _scalar_step(saved_step, 'the optimizer step count of group 0')}",
        f"world size: {layout.world_size}",
        f"ZeRO stage: {extra.get('zero_stage')}",
        *_layout_lines(
            layout,
            info.optimizer_class,
            len(info.param_groups),
            info.state_keys,
            [list(source.scalars(group.index)) for group in layout.groups],
        ),
    ]
    entries = view.info  # an AutoEP run's: without AutoEP's aliases of its routers
    lines += [
        f"{_trainable(layout)}; model state: {len(entries.model_entries)} buffers or frozen tensors, "
        f"{len(entries.aliases)} tied alias(es)",
        _padding_line(layout),
    ]
    model_file, rank_files = files[0], files[1 : 1 + layout.world_size]
    fixed = {model_file.name: model_file.stat().st_size}
    if autoep:
        lines += autoep_lines(view)
        expert_files = files[1 + layout.world_size :]
        fixed[f"{len(expert_files)} expert files layer_L_expert_E_mp_rank_00_model_states.pt"] = sum(
            path.stat().st_size for path in expert_files
        )
    lines += file_lines(fixed, {path.name: path.stat().st_size for path in rank_files}, "rank files", list_all_files)
    return lines


def autoep_lines(view: Any) -> list[str]:
    """How an AutoEP run's tensors read in the transformers model's names (``view``: an
    :class:`~zeroshard.deepspeed.checkpoint.AutoEPSource`)."""
    names = view.names
    first = names.stacks[:2]
    def made_of(stack) -> str:
        weights = [part.source.rsplit(".", 1)[1] for part in stack.parts]
        return f"cat({', '.join(weights)})" if len(weights) > 1 else weights[0]

    stacks = ", ".join(f"{stack.name} {list(stack.shape())} = {made_of(stack)}" for stack in first)
    router = next(iter(names.renamed.items()), None)
    return [
        f"AutoEP: {len(view.raw.autoep.layers)} MoE layers of {first[0].num_experts} experts; read (to-fp32, "
        f"to-universal, load_checkpoint) in the transformers model's names: {stacks}"
        + (f", {router[1]} = {router[0]}" if router else "")
        + f"; likewise in every layer ({len(names.router_aliases)} AutoEP aliases of its routers left out)"
    ]


# ---- shared pieces -----------------------------------------------------------------------------


def _layout_lines(
    layout: Layout,
    optimizer_class: str,
    param_group_count: int,
    states: Sequence[Sequence[str]],
    scalars: Sequence[Sequence[str]],
) -> list[str]:
    """Policy, optimizer, and one line per layout group."""
    lines = [
        f"layout policy: {layout.policy.describe()}",
        f"optimizer: {optimizer_class or '-'}, {param_group_count} param group(s)",
        "groups:",
    ]
    for group in layout.groups:
        padding = group.inter_param_padding + group.tail_padding
        partitioning = group_partitioning(layout, group)
        lines.append(
            f"  group {group.index} ({group.dtype}{', ' + partitioning if partitioning else ''}): "
            f"{len(group.params)} parameters, {group.param_numel:,} elements, "
            f"{len(group.buckets)} bucket(s), {group.partition_numel:,} elements per rank, {padding:,} padding; "
            f"state {', '.join(states[group.index]) or '-'}; scalars {', '.join(scalars[group.index]) or '-'}"
        )
    return lines + shard_group_lines(layout)


def _trainable(layout: Layout) -> str:
    count = sum(len(group.params) for group in layout.groups)
    numel = layout.padding().param_numel
    if layout.is_dense:
        return f"parameters: {count} trainable ({numel:,} elements)"
    every = every_expert_numel(layout)
    return f"parameters: {count} trainable ({numel:,} elements with one EP rank's experts, {every:,} with all)"


def _padding_line(layout: Layout) -> str:
    stats = layout.padding()
    return (
        f"padding overhead: {stats.padding_elements:,} elements, {stats.padding_bytes:,} bytes, "
        f"{100 * stats.fraction:.3f}% of parameter bytes"
    )


def _source_padding_line(specs: list, source: Mapping[str, Any]) -> str:
    """The padding the run it was converted from had (the layout is rebuilt from the shapes)."""
    try:
        layout = build_layout(specs, int(source["world_size"]), LayoutPolicy.from_dict(dict(source["policy"])))
    except (KeyError, TypeError, ValueError):
        return "padding overhead: none (the source run's layout is not recorded)"
    stats = layout.padding()
    return (
        f"padding overhead: none; the source run ({layout.policy.describe()}, world size {layout.world_size}) "
        f"had {stats.padding_elements:,} elements, {100 * stats.fraction:.3f}% of parameter bytes"
    )


def file_lines(
    fixed: Mapping[str, int],
    listed: Mapping[str, int],
    what: str,
    list_all: bool,
    summarised: Mapping[str, Mapping[str, int]] | None = None,
) -> list[str]:
    """The ``files:`` lines: the total, each of ``fixed``, a summary of ``listed`` (``what``
    they are) and the first few of them, or all with ``list_all``; a summary of each kind of
    ``summarised`` files too (listed only with ``list_all``)."""
    summarised = {kind: files for kind, files in (summarised or {}).items() if files}
    sizes = list(listed.values())
    others = sum(size for files in summarised.values() for size in files.values())
    lines = [f"files: {sum(fixed.values()) + sum(sizes) + others:,} bytes in all"]
    lines += [f"  {name}: {size:,} bytes" for name, size in fixed.items()]
    for kind, files in summarised.items():
        each = list(files.values())
        lines.append(f"  {len(each)} {kind}: {sum(each):,} bytes (smallest {min(each):,}, largest {max(each):,})")
        lines += [f"  {name}: {size:,} bytes" for name, size in files.items()] if list_all else []
    if sizes:
        lines.append(f"  {len(sizes)} {what}: {sum(sizes):,} bytes (smallest {min(sizes):,}, largest {max(sizes):,})")
    names = list(listed)
    shown = names if list_all else names[:LISTED_FILES]
    lines += [f"  {name}: {listed[name]:,} bytes" for name in shown]
    if len(shown) < len(names):
        lines.append(f"  ... {len(names) - len(shown)} more (--files lists them all)")
    return lines


def _step(extra: Mapping[str, Any]) -> str | None:
    """What the saved counters count: the training-loop step a Checkpointer saved after, and
    the optimizer steps taken (``global_steps``); None when neither is recorded."""
    parts = []
    saved_after = _plain_int(extra.get(SAVED_AFTER_KEY))
    if saved_after is not None:
        parts.append(
            f"{saved_after} (the training-loop step it was saved after, extra[{SAVED_AFTER_KEY!r}]: "
            f"Checkpointer.load() resumes at step {saved_after + 1})"
        )
    for key in OPTIMIZER_STEP_KEYS:
        taken = _plain_int(extra.get(key))
        if taken is not None:
            parts.append(f"{taken} optimizer steps taken (extra[{key!r}])")
            break
    return "; ".join(parts) or None


def _plain_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _scalar_step(value: Any, where: str) -> str:
    if value is None:
        return "unknown"
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return "unknown"
    return f"{array.item():g} optimizer steps taken ({where})" if array.size == 1 else "unknown"


def _native_optimizer_step(ckpt: Checkpoint) -> str:
    """The optimizer's ``step`` scalar of group 0, read from rank 0's file."""
    manifest = ckpt.manifest
    if not manifest.groups or "step" not in manifest.groups[0].scalars:
        return "unknown"
    name = rank_file_name(0, manifest.world_size)
    record = manifest.files[name]
    entry = read_header(ckpt.path(name), record.size).get(scalar_key(0, "step"))
    if entry is None:
        return "unknown (not in rank 0's file; --verify checks it)"
    data = VerifiedRanges(ckpt.path(name), record, [(entry.begin, entry.end)], None)
    dtype, shape = manifest.groups[0].scalars["step"]
    value = array_view(data.view(entry.begin, entry.end), dtype).reshape(shape)
    return _scalar_step(value, "the optimizer step count of group 0")
