"""BackgroundWriter: the thread the Checkpointer's asynchronous saves are written on.

Its one job: run each save handed to it off the training loop, one at a time and in order,
and keep its outcome until the Checkpointer asks for it. What a save is (plan, write,
commit) and what its failure means to the run stay with the
:class:`~.checkpointer.Checkpointer`; the writer only runs it, holds the record that stands
for it while it is in flight, and catches what it raised.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, TypeVar

# The Checkpointer's logger: one logger to watch for everything a checkpointed run says.
log = logging.getLogger("zeroshard.checkpoint.checkpointer")

Record = TypeVar("Record")  # what stands for a save while it is in flight (its SaveStats)


class BackgroundWriter(Generic[Record]):
    """One long-lived writer thread: a save at a time, then the jobs queued behind it.

    :meth:`submit` hands it a save and the record that stands for it; :meth:`finish` waits
    for that save and returns the record with what the save raised; :meth:`after` runs a job
    once the save in flight is done; :meth:`stop` ends the thread. Not thread-safe: one
    caller (the training loop's thread) submits and finishes.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None  # started by the first save
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()  # the save in flight finished
        self._in_flight: Record | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> Record | None:
        """The record of the save submitted and not yet finished (None: there is none)."""
        return self._in_flight

    @property
    def writing(self) -> bool:
        """A save is submitted and the thread is still writing it."""
        return self._in_flight is not None and not self._done.is_set()

    def submit(self, record: Record, save: Callable[[], None]) -> None:
        """Run ``save`` on the writer thread (started now if it is not yet); ``record`` is
        :attr:`in_flight` until :meth:`finish`. The caller finishes the previous save first."""
        self._start()
        self._in_flight = record
        self._done.clear()
        self._jobs.put((save,))

    def finish(self) -> tuple[Record, BaseException | None] | None:
        """Wait for the save in flight; its record and what it raised (None if it did not),
        or None when no save was in flight."""
        if self._in_flight is None:
            return None
        self._done.wait()
        record, error = self._in_flight, self._error
        self._in_flight = self._error = None
        return record, error

    def after(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the save in flight (on the writer thread, where a failure of it
        is logged: no save's outcome depends on it), or now when the thread is not running."""
        if self._thread is not None:
            self._jobs.put(job)
        else:
            job()

    def stop(self) -> None:
        """End the thread once what is queued has run (the caller finished the save first)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        # One long-lived thread: starting a thread per save costs the training loop up to
        # tens of milliseconds of scheduling on a busy machine. A daemon, so that a script
        # that never closes its Checkpointer still exits; close() joins it, and an exit
        # with a save in flight waits for that save first (see the Checkpointer).
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="zeroshard-checkpoint-writer", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if callable(job):  # an audit record: no save's outcome depends on it
                try:
                    job()
                except Exception:  # noqa: BLE001 - the writer must go on
                    log.exception("writing an audit record failed")
                continue
            (save,) = job
            try:
                save()
            except BaseException as err:  # noqa: BLE001 - raised by the next save, wait or close
                self._error = err
            finally:
                self._done.set()
