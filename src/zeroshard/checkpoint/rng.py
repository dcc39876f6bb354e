"""Random state of one process as plain data: what an exact resume restores on every rank.

A rank's random streams are torch's CPU generator, the CUDA generator of every visible
device (once CUDA is initialised: before that nothing has drawn from them), Python's
``random`` and NumPy's global generator. :func:`capture_rng` takes them as a dict of numpy
arrays and numbers (stored as JSON through :mod:`.io.jsonvalue`, no pickle);
:func:`restore_rng` puts them back, checking every field first, so a damaged or hostile
value is a one-line ValueError and no stream is half set.

At another world size a new rank ``r`` takes saved rank ``r mod D_old``'s streams
(:func:`saved_rank_for`); a rank that has no saved rank of its own (``r >= D_old``, when the
world grows) seeds each generator from SHA-256 of that saved state and ``r``
(:func:`derived_rng`), so no two ranks share a stream and every resume derives the same.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import numpy as np

from ..io import jsonvalue

_TORCH_STATE_BYTES = 5056  # torch's CPU generator: mt19937 state, position and cached normals
_CUDA_STATE_BYTES = 16  # a CUDA (Philox) generator: seed and offset
_MT_WORDS = 624  # an mt19937 state
_PYTHON_INTERNAL = _MT_WORDS + 1  # random.getstate()[1]: the words and the position
_DERIVATION = b"zeroshard.rng.derive.v1"

RngState = dict[str, Any]


def capture_rng() -> RngState:
    """This process's random state: torch CPU, CUDA per device (when initialised), Python, NumPy."""
    import torch

    # About 0.15 ms, on the training thread at every save: NumPy's legacy tuple is its
    # quickest form, and np.fromiter reads Python's 625 words without a list of them.
    bit_generator, key, pos, has_gauss, gauss = np.random.get_state()
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(device).numpy().copy() for device in range(torch.cuda.device_count())]
    return {
        "torch": torch.get_rng_state().numpy().copy(),
        "cuda": cuda,
        "python": _python_state(random.getstate()),
        "numpy": {
            "bit_generator": bit_generator,
            "key": np.array(key, dtype=np.uint32),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }


def rng_fingerprint(state: RngState) -> int:
    """A 31-bit digest of a random state, as captured or as read back (equal states, equal
    fingerprints): what the resume audit compares, summed over ranks."""
    digest = hashlib.sha256()
    for words in (state["torch"], *state["cuda"], state["python"]["internal"], state["numpy"]["key"]):
        digest.update(np.ascontiguousarray(words).tobytes())
    python, numpy_state = state["python"], state["numpy"]
    scalars = (len(state["cuda"]), python["version"], python["gauss_next"], numpy_state["pos"])
    digest.update(repr((*scalars, numpy_state["has_gauss"], numpy_state["gauss"])).encode())
    return int.from_bytes(digest.digest()[:4], "little") >> 1


def restore_rng(state: Any, where: str) -> None:
    """Set this process's random streams to ``state`` (as :func:`capture_rng` gave, or as read
    back). Every field is checked before any stream is set: ValueError naming ``where``.
    CUDA devices beyond those saved keep their streams; saved devices beyond those visible are
    ignored."""
    import torch

    torch_state, cuda, python, numpy_state = _checked(state, where)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    torch.set_rng_state(torch.from_numpy(torch_state.copy()))
    for device, saved in enumerate(cuda[:visible]):
        torch.cuda.set_rng_state(torch.from_numpy(saved.copy()), device)
    random.setstate(python)
    np.random.set_state(numpy_state)


def derived_rng(state: Any, rank: int, where: str) -> RngState:
    """Fresh streams for ``rank`` seeded from SHA-256 of ``state`` (a saved rank's) and
    ``rank``: the same on every resume, distinct for every rank. CUDA streams are seeded
    per device when restored (``"cuda_seeds"``)."""
    import torch

    _checked(state, where)
    seeds = hashlib.sha256(_DERIVATION + _canonical(state) + rank.to_bytes(8, "little")).digest()
    torch_seed, python_seed, cuda_seed = (int.from_bytes(seeds[i : i + 8], "little") >> 1 for i in (0, 8, 16))
    numpy_state = np.random.RandomState(np.frombuffer(seeds[24:32], dtype=np.uint32)).get_state(legacy=False)
    derived = {
        "torch": torch.Generator().manual_seed(torch_seed).get_state().numpy().copy(),
        "cuda": [],
        "cuda_seeds": [cuda_seed + device for device in range(len(state["cuda"]))],
        "python": _python_state(random.Random(python_seed).getstate()),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": 0,
            "gauss": 0.0,
        },
    }
    return derived


def restore_derived(state: RngState) -> None:
    """:func:`restore_rng` of a :func:`derived_rng` state: CUDA devices seeded, not set."""
    import torch

    restore_rng({**state, "cuda": []}, "derived random state")
    if torch.cuda.is_available():
        for device, seed in enumerate(state["cuda_seeds"][: torch.cuda.device_count()]):
            torch.cuda.default_generators[device].manual_seed(seed)


def saved_rank_for(rank: int, saved_world_size: int) -> int:
    """The saved rank whose streams rank ``rank`` of a run at another world size takes."""
    return rank % saved_world_size


def _python_state(state: tuple) -> dict[str, Any]:
    version, internal, gauss_next = state
    words = np.fromiter(internal, dtype=np.uint32, count=len(internal))
    return {"version": version, "internal": words, "gauss_next": gauss_next}


def _canonical(state: Any) -> bytes:
    return json.dumps(jsonvalue.encode(state, "random state"), sort_keys=True, separators=(",", ":")).encode()


def _checked(state: Any, where: str) -> tuple[np.ndarray, list[np.ndarray], tuple, dict[str, Any]]:
    """The fields of a saved random state, each of the type and size its generator takes."""
    if not isinstance(state, dict) or not {"torch", "cuda", "python", "numpy"} <= set(state):
        raise ValueError(f"{where}: the random state is not an object with torch, cuda, python and numpy")
    torch_state = _array(state["torch"], np.uint8, _TORCH_STATE_BYTES, f"{where}: torch's CPU random state")
    if not isinstance(state["cuda"], list):
        raise ValueError(f"{where}: the CUDA random states are not a list")
    cuda = [
        _array(saved, np.uint8, _CUDA_STATE_BYTES, f"{where}: CUDA device {device}'s random state")
        for device, saved in enumerate(state["cuda"])
    ]
    python = state["python"]
    if not isinstance(python, dict) or python.get("version") != 3:
        raise ValueError(f"{where}: Python's random state is not a version 3 state")
    internal = _array(python.get("internal"), np.uint32, _PYTHON_INTERNAL, f"{where}: Python's random state")
    gauss_next = python.get("gauss_next")
    if gauss_next is not None and not isinstance(gauss_next, float) or int(internal[-1]) > _MT_WORDS:
        raise ValueError(f"{where}: Python's random state has an invalid position or cached value")
    numpy_state = state["numpy"]
    if not isinstance(numpy_state, dict) or numpy_state.get("bit_generator") != "MT19937":
        raise ValueError(f"{where}: NumPy's random state is not an MT19937 state")
    key = _array(numpy_state.get("key"), np.uint32, _MT_WORDS, f"{where}: NumPy's random state")
    pos, has_gauss, gauss = numpy_state.get("pos"), numpy_state.get("has_gauss"), numpy_state.get("gauss")
    if type(pos) is not int or not 0 <= pos <= _MT_WORDS or has_gauss not in (0, 1) or not isinstance(gauss, float):
        raise ValueError(f"{where}: NumPy's random state has an invalid position or cached value")
    legacy = {"bit_generator": "MT19937", "state": {"key": key.copy(), "pos": pos}}
    legacy.update(has_gauss=has_gauss, gauss=gauss)
    return torch_state, cuda, (3, tuple(int(word) for word in internal), gauss_next), legacy


def _array(value: Any, dtype: type, size: int, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != (size,):
        found = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise ValueError(f"{what} is {found}, expected {np.dtype(dtype).name} [{size}]")
    return value
