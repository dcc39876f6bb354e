"""Pretrained weights into an expert-parallel model: each rank reads only its own experts.

:func:`load_pretrained` fills a model (after :func:`~.parallel.expert_parallel`) from a
transformers checkpoint: a safetensors folder (``model.safetensors`` or the shards of a
``model.safetensors.index.json``), one ``.safetensors`` file, or a state dict. An expert stack
``P.L`` is read in either form a checkpoint holds it (:mod:`zeroshard.layout.stacks`):

* stacked, ``P.L`` ``[E, ...]`` (transformers v5 in memory, zeroshard's exports): only the
  rows of this rank's experts, by ``safe_open(...).get_slice`` (a run of consecutive experts
  is one read);
* per expert, ``P.{g}.{part}.weight`` (what transformers' ``save_pretrained`` writes for
  Qwen3-MoE, Mixtral, DeepSeek-V3): only the tensors of this rank's experts, their parts
  concatenated by rows and, for an ``in_out`` stack, transposed back.

So no rank holds another rank's experts at any time. Every other entry of the model's
state_dict is read whole; a name tied to another (``lm_head.weight`` to the embedding) may
be absent. Not collective.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..io import jsonvalue
from ..io.members import name_problem, open_member, read_small_file
from ..layout.stacks import ExpertStack, exported_expert_shape, per_expert_tensors
from .contract import ExpertModule, expert_stacks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 << 20  # an index maps tensor names to shards: a few MB for the largest models


@dataclass
class LoadReport:
    """What :func:`load_pretrained` read: the model's names filled, by form."""

    dense: list[str] = field(default_factory=list)
    stacked: list[str] = field(default_factory=list)  # stacks read as [E, ...] rows
    per_expert: list[str] = field(default_factory=list)  # stacks assembled from per-expert tensors
    tied: list[str] = field(default_factory=list)  # names left to the tensor they share
    unused: list[str] = field(default_factory=list)  # checkpoint names no rank would read


def load_pretrained(
    model: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> LoadReport:
    """Copy ``source``'s tensors into ``model`` (cast to each parameter's dtype), this rank's
    experts only. A model built on the meta device is first allocated on ``device``
    (default CPU) and, if it is a transformers model, initialised (for its computed buffers)
    before the copy. Not collective.

    Raises:
        ValueError: before anything is copied: a tensor of another shape than the model's
            (whatever ``strict``); with ``strict``, what the checkpoint lacks, or holds that
            nothing of the model is called (another rank's experts are not that); an index
            file without a proper weight map, naming a shard outside the folder or a tensor
            in a shard that does not hold it; a file that cannot be read (truncated, empty,
            not safetensors or not JSON, nested too deep, missing, a FIFO or a folder in its
            place: never waited on), in one line naming it; a meta model without
            ``initialize_weights()``.
        FileNotFoundError: ``source`` does not exist, or is a folder with neither
            ``model.safetensors`` nor an index.
    """
    with _open(source) as reader:
        plan = _plan(model, reader)
        if plan.reshaped:
            raise ValueError(f"{reader.where}: tensors of another shape than the model's: {plan.reshaped[:5]}")
        unused = sorted(set(reader.keys()) - plan.claimed)
        if strict and (plan.missing or unused):
            parts = [f"missing {plan.missing[:5]}" if plan.missing else "", f"unexpected {unused[:5]}" if unused else ""]
            raise ValueError(f"{reader.where}: does not fit {type(model).__name__}: " + "; ".join(p for p in parts if p))
        _materialise(model, device)
        targets = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, read in plan.reads.items():
                targets[name].copy_(read())
    plan.report.unused = unused
    return plan.report


@dataclass
class _Plan:
    reads: dict = field(default_factory=dict)  # model name -> a function reading its tensor
    claimed: set[str] = field(default_factory=set)  # checkpoint names some rank reads
    missing: list[str] = field(default_factory=list)
    reshaped: list[str] = field(default_factory=list)  # "name [checkpoint] != [expected]"
    report: LoadReport = field(default_factory=LoadReport)

    def expect(self, reader: _Reader, name: str, shape: tuple[int, ...]) -> None:
        found = reader.shape(name)
        if found != tuple(shape):
            self.reshaped.append(f"{name} {list(found)} != {list(shape)}")


def _plan(model: nn.Module, reader: _Reader) -> _Plan:
    """What to read for each tensor of the model's state_dict; names that share one tensor
    (tied weights) are read once, from whichever of them the checkpoint has."""
    plan = _Plan()
    stacks = expert_stacks(model)
    keys = set(reader.keys())
    names_of: dict[int, list[str]] = {}
    tensors = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    for names in names_of.values():
        name = next((n for n in names if n in keys or n in stacks), names[0])
        if name in stacks:
            stack, contract = stacks[name]
            _plan_stack(plan, keys, reader, name, tuple(tensors[name].shape), stack, contract)
        elif name in keys:
            plan.expect(reader, name, tuple(tensors[name].shape))
            plan.reads[name] = _whole(reader, name)
            plan.claimed.add(name)
            plan.report.dense.append(name)
        else:
            plan.missing.append(name)
            continue
        plan.report.tied += [other for other in names if other != name]
        plan.claimed.update(other for other in names if other in keys)  # a tied copy is no stranger
    return plan


def _plan_stack(
    plan: _Plan, keys: set[str], reader: _Reader, name: str, shape: tuple[int, ...], stack: ExpertStack, contract: ExpertModule
) -> None:
    if name in keys:
        plan.expect(reader, name, (contract.num_experts, *shape[1:]))
        plan.reads[name] = lambda: reader.rows(name, contract.expert_ids)
        plan.claimed.add(name)
        plan.report.stacked.append(name)
        return
    expert_shape = shape[1:]
    every = {g: per_expert_tensors(name, stack, g, expert_shape) for g in range(contract.num_experts)}
    if not all(t.name in keys for tensors in every.values() for t in tensors):
        plan.missing.append(name)
        return
    plan.claimed.update(t.name for tensors in every.values() for t in tensors)
    exported = exported_expert_shape(stack, expert_shape)
    for t in (t for g in contract.expert_ids for t in every[g]):  # this rank's: the tensors it reads
        plan.expect(reader, t.name, (t.row_end - t.row_start, *exported[1:]) if exported else ())
    plan.reads[name] = lambda: torch.stack([_one_expert(reader, every[g], stack) for g in contract.expert_ids])
    plan.report.per_expert.append(name)


def _one_expert(reader: _Reader, tensors: Sequence, stack: ExpertStack) -> torch.Tensor:
    """One expert's slice as the stack holds it, from its per-expert tensors ([out, in] each)."""
    expert = torch.cat([reader.get(t.name) for t in tensors]) if len(tensors) > 1 else reader.get(tensors[0].name)
    return expert.t() if stack.orientation == "in_out" else expert


def _whole(reader: _Reader, name: str):
    return lambda: reader.get(name)


def _materialise(model: nn.Module, device: torch.device | str | None) -> None:
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return
    model.to_empty(device=device or "cpu")
    initialise = getattr(model, "initialize_weights", None)  # transformers: computes rotary buffers & co.
    if initialise is None:
        raise ValueError(
            f"{type(model).__name__} is on the meta device and has no initialize_weights() to make its buffers; "
            "build it on a real device"
        )
    initialise()


# ---- readers ---------------------------------------------------------------------------------------


class _Reader:
    """Named tensors, read whole or by rows of the first dimension."""

    where: str

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor: ...

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass


class _StateDictReader(_Reader):
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state, self.where = state, "the state dict"

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        return self.state[name][torch.tensor(list(ids))]


class _SafetensorsReader(_Reader):
    """Safetensors files opened with ``safe_open``: one file (``named`` None: every tensor
    it holds) or the shards of an index (``named``: tensor name -> shard), each checked to
    hold the tensors the index puts in it. Rows are read by ``get_slice``, one read per run
    of consecutive ids. Every error of safetensors or the OS is a one-line ValueError naming
    the file."""

    def __init__(self, shards: Sequence[Path], where: str, named: dict[str, Path] | None = None) -> None:
        self.where = where
        self._handles = {path: _open_shard(path) for path in sorted(set(shards))}
        held = {path: set(handle.keys()) for path, handle in self._handles.items()}
        if named is None:
            named = {name: path for path, names in held.items() for name in names}
        stray = next((name for name, path in named.items() if name not in held[path]), None)
        if stray is not None:
            raise ValueError(f"{where}: {INDEX_FILE} puts {stray!r} in {named[stray].name}, which does not hold it")
        self._file_of = named

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        path = self._file_of[name]
        with _shard_errors(path, name):
            return tuple(self._handles[path].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        with _shard_errors(path, name):
            return self._handles[path].get_tensor(name)

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        path = self._file_of[name]
        with _shard_errors(path, name):
            sliced = self._handles[path].get_slice(name)
            return torch.cat([sliced[start:end] for start, end in _runs(ids)])

    def close(self) -> None:
        self._handles = {}


@contextmanager
def _shard_errors(path: Path, name: str | None = None) -> Iterator[None]:
    """safetensors' and the OS's errors reading ``path`` (tensor ``name``) as one ValueError line."""
    from safetensors import SafetensorError

    what = f" (tensor {name!r})" if name is not None else ""
    try:
        yield
    except SafetensorError as err:
        raise ValueError(f"{path}: not a readable safetensors file{what}: {' '.join(str(err).split())}") from None
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot be read{what}: {err.strerror or err}") from None


def _open_shard(path: Path):
    """``safe_open`` on ``path`` once it is a regular file: a FIFO or a folder in its place
    is refused, never waited on (safetensors would block opening a FIFO)."""
    from safetensors import safe_open

    with _shard_errors(path):
        os.close(open_member(path, follow_links=True))  # links are fine: the Hugging Face cache is made of them
        return safe_open(str(path), "pt")


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive ids, in order (3, 4, 5, 0 -> (3, 6), (0, 1))."""
    runs: list[list[int]] = []
    for expert in ids:
        if runs and runs[-1][1] == expert:
            runs[-1][1] += 1
        else:
            runs.append([expert, expert + 1])
    return [(start, end) for start, end in runs]


def _open(source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> _Reader:
    if isinstance(source, Mapping):
        return _StateDictReader(source)
    path = Path(source)
    if not path.is_dir():
        if not os.path.lexists(path):
            raise FileNotFoundError(f"{path}: no such file or folder (a transformers safetensors checkpoint)")
        return _SafetensorsReader([path], str(path))
    if os.path.lexists(path / INDEX_FILE):
        files = _index(path, path / INDEX_FILE)
        return _SafetensorsReader(list(files.values()), str(path), files)
    if os.path.lexists(path / SINGLE_FILE):
        return _SafetensorsReader([path / SINGLE_FILE], str(path))
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (a transformers safetensors checkpoint)")


def _index(folder: Path, index: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index file ``index`` (read without waiting on a
    FIFO, its size and nesting bounded); every shard a plain file name in ``folder``."""
    with _shard_errors(index):
        data = read_small_file(index, _MAX_INDEX_BYTES)
    try:
        parsed = jsonvalue.loads(data, index)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{index}: not valid JSON ({err})") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map of tensor names to shard files")
    files = {}
    for name, shard in weight_map.items():
        if name_problem(shard) is not None:
            raise ValueError(f"{index}: shard {shard!r} of {name!r} is not a file in {folder}")
        files[str(name)] = folder / shard
    return files
