"""Spawn D local ranks (gloo on 127.0.0.1, or NCCL with one GPU each) and run a function.

Used by ``zeroshard demo`` and by the multi-process tests. Under torchrun, call
``init_from_env()`` instead: it reads the variables torchrun sets.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """"nccl" where CUDA and NCCL are available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


# Modules whose functions take ``group=group.WORLD`` as a default argument, evaluated when
# the module is first imported. torch.optim imports them (through torch._dynamo) the first
# time an optimizer is built; if the default group exists by then, those defaults keep it
# alive after destroy_process_group(), and it is torn down during interpreter shutdown,
# where gloo sometimes aborts ("terminate called without an active exception").
# Imported before the group exists, they bind None (the default group at call time).
_MODULES_BINDING_THE_WORLD_GROUP = (
    "torch.distributed.nn",
    "torch.distributed._shard.sharded_tensor",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops",
)


def import_group_binding_modules() -> None:
    """Import the torch modules that capture the default process group at import time.

    Call it before ``init_process_group`` (``init_from_env`` does), so that
    ``destroy_process_group`` really frees the group. About 0.1 s.
    """
    for name in _MODULES_BINDING_THE_WORLD_GROUP:
        try:
            importlib.import_module(name)
        except ImportError:  # another torch release: nothing of that name binds the group
            pass


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from RANK/WORLD_SIZE/MASTER_* (torchrun's); with
    NCCL, first select GPU ``LOCAL_RANK``.

    Collective: every rank of the job calls it (``init_process_group``'s rendezvous).

    Raises:
        ValueError: (torch's) a variable the env:// rendezvous needs is not set.
        RuntimeError: (torch's ``DistStoreError`` and others) the other ranks did not join
            within ``timeout_s``, or the backend could not start.
    """
    import datetime

    import_group_binding_modules()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


# What every rank imports before it runs anything: the forkserver imports it once, and each
# rank is forked from it with these already loaded (about 3 s of imports per rank saved,
# torch and the dynamo that torch.optim pulls in at the first optimizer).
_PRELOADED = ("torch", "torch.distributed", *_MODULES_BINDING_THE_WORLD_GROUP, "torch._dynamo", "zeroshard.engine")


_also_preloaded: list[str] = []  # see preload
_spawned: list[bool] = []  # whether a spawn started the forkserver already


def preload(*modules: str) -> None:
    """Have the forkserver that :func:`spawn`'s ranks fork from import ``modules`` too, so
    every rank starts with them imported: a model library or trainer the ranks import costs
    each rank its import otherwise (transformers' ``Trainer`` 2.8 s, Lightning 3.9 s on a
    2-core VM). A module that cannot be imported there is skipped, as by multiprocessing.

    Raises:
        RuntimeError: a module not preloaded yet, once a spawn has started the forkserver
            (call this before the first spawn).
    """
    new = [name for name in dict.fromkeys(modules) if name not in _also_preloaded]
    if new and _spawned:
        raise RuntimeError(f"zeroshard.launch.preload({', '.join(new)}): the ranks' forkserver is running already; call it before the first spawn")
    _also_preloaded.extend(new)


def _rank_context() -> Any:
    """Processes forked from a forkserver that has imported :data:`_PRELOADED` and what
    :func:`preload` named (started on first use, once per parent; it never initialises a
    process group or CUDA). Each child still gets the parent's current sys.path, working
    directory and main module, as spawn does; the environment travels with the worker's
    arguments."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([*_PRELOADED, *_also_preloaded])
    _spawned[:] = [True]
    return context


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results, environ: dict[str, str]
) -> None:
    os.environ.clear()  # the parent's, as it is now (the forkserver's is as it was at its start)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        init_from_env(backend)
        try:
            payload = _to_bytes(rank, fn(rank, world_size, *args))
        finally:
            if dist.is_initialized():  # fn may have destroyed it itself
                dist.destroy_process_group()
        results.put((rank, "ok", payload))
    except BaseException:  # report it to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))


def _to_bytes(rank: int, value: Any) -> bytes:
    """The result as self-contained bytes.

    The queue's own pickler would share tensors through file descriptors that the parent
    fetches from this process after it has exited (FileNotFoundError, ConnectionResetError),
    so tensors travel by value instead: plain pickle copies their storage into the bytes.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:
        problem = f"rank {rank}'s result cannot be sent to the parent ({type(err).__name__}: {err})"
        raise TypeError(f"{problem}; return plain values or tensors") from err


class _PortTaken(RuntimeError):
    pass


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    attempts: int = 3,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return their results.

    ``fn`` must be importable (a module-level function); its return value comes back pickled,
    tensors copied by value (never shared through file descriptors). The rendezvous port is
    picked free but can be taken before rank 0 binds it; then it tries another, up to
    ``attempts`` times. Not collective: the parent calls it; each child initialises the
    process group, runs ``fn`` and destroys the group.

    Raises:
        RuntimeError: with the failing rank's traceback (a result that cannot be pickled
            included); a rank exited without a result; or ``timeout_s`` passed (every
            process is killed first). Also when every attempt found its port taken.
    """
    for attempt in range(attempts):
        try:
            return _spawn_once(fn, world_size, args, backend or default_backend(), timeout_s)
        except _PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout_s: float) -> list[Any]:
    context = _rank_context()
    results = context.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, results, environ), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish in {timeout_s:.0f} s")
            if results.empty():
                if any(p.exitcode not in (None, 0) for p in processes) and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        codes = {r: p.exitcode for r, p in enumerate(processes)}
                        raise RuntimeError(f"a rank exited without a result (exit codes {codes})")
                time.sleep(0.01)
                continue
            rank, status, value = results.get()
            if status == "error" and ("EADDRINUSE" in value or "address already in use" in value.lower()):
                raise _PortTaken(value)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()) if len(collected) == world_size else 1.0)
            if process.is_alive():
                process.kill()
                process.join()
    return [collected[rank] for rank in range(world_size)]
