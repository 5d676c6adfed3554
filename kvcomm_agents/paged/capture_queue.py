"""Captures run off a runtime's request path, in the order its requests finished.

A serving runtime calls :meth:`~.broker.KVCommBroker.finish` on the thread that schedules every
request, so whatever the capture costs (cutting segments, storing exact prefixes, own-text KV and
anchor observations) delays the finished request's output and every running request's next step.
Queued here, it runs on one worker thread while the runtime goes on (on a GPU, while its forwards
run; the heavy parts are tensor ops, which release the GIL).

A request planned later waits for the queued captures it could read (:meth:`CaptureQueue.settle`):
those of the same agent (its own-text KV and anchors), those whose prompt starts as its prompt
does (an exact prefix), and those whose reply or shared texts it holds (the reply's segment, the
versions recorded of those texts; probed as 8-id windows, one a token into the text, so that a
reply re-tokenized at its first word is still found). So a graph's next agent sees its
predecessor's reply as if the capture had run inline; what a request could have reused from a
capture it did not wait for costs it speed, never correctness.

The capture holds the broker's lock while it runs (the store, anchors and versions are updated
as one step), so a plan that arrives meanwhile waits for the rest of it: what leaves the
scheduler's path is the capture's overlap with the runtime's forwards, not with its plans.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["CaptureQueue", "CaptureTouch"]

logger = logging.getLogger("kvcomm_agents.capture")

#: ids compared to decide whether a later prompt starts as a captured one
PREFIX_IDS = 16
#: ids of each window probed for a captured text inside a later prompt (``min_match_tokens``)
WINDOW_IDS = 8
#: seconds the process waits at exit for captures under way
EXIT_WAIT_S = 10.0


def _packed(ids: Sequence[int] | torch.Tensor) -> bytes:
    """``ids`` as little-endian int32 bytes (for ``startswith`` and ``in``)."""
    return torch.as_tensor(ids, dtype=torch.int64).to(torch.int32).numpy().tobytes()


@dataclass(frozen=True)
class CaptureTouch:
    """What a later request must share with a captured one to wait for it: its agent, its
    prompt's first :data:`PREFIX_IDS` ids, or one of its texts' windows (the reply and the
    shared texts its plan found)."""

    agent: str
    prompt_head: bytes
    windows: tuple[bytes, ...]

    @classmethod
    def of(cls, agent: str, prompt_ids: Sequence[int] | torch.Tensor, reply_ids: Sequence[int],
           shared_spans: Sequence[tuple[int, int]] = ()) -> "CaptureTouch":
        """``shared_spans``: ``[start, end)`` prompt spans of the shared texts the request read."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.int64)
        texts = [torch.as_tensor(list(reply_ids), dtype=torch.int64)] + [prompt[a:b] for a, b in shared_spans]
        windows = {_packed(text[k:k + WINDOW_IDS]) for text in texts for k in _window_starts(text.numel())}
        return cls(agent, _packed(prompt[:PREFIX_IDS]), tuple(sorted(windows)))

    def reads(self, agent: str, packed_prompt: bytes) -> bool:
        """Whether a request of ``agent`` with this prompt (:func:`_packed`) could reuse what the
        capture keeps. A match across ids' byte boundaries only makes it wait for nothing."""
        return (agent == self.agent or packed_prompt.startswith(self.prompt_head)
                or any(window in packed_prompt for window in self.windows))


def _window_starts(length: int) -> list[int]:
    """Where the windows of a text of ``length`` ids start: its first id, the next (a quote
    re-tokenized at its first word), its middle; the whole text when shorter than a window."""
    if length <= WINDOW_IDS:
        return [0] if length else []
    return sorted({0, 1, min(length // 2, length - WINDOW_IDS)})


class _Shared:
    """What a queue's worker thread holds: the jobs and their condition, never the queue itself,
    so that a queue nobody holds any more is collected and its worker (:func:`_work`) stops."""

    def __init__(self) -> None:
        self.jobs: deque[tuple[CaptureTouch, Callable[[], None]]] = deque()
        self.running: CaptureTouch | None = None
        self.changed = threading.Condition()  # reentrant: stop() may run from a collection anywhere
        #: no job comes any more: the worker runs those queued and exits
        self.stopped = False

    def idle(self) -> bool:
        return not self.jobs and self.running is None

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()


def _run(job: Callable[[], None]) -> None:
    try:
        job()
    except BaseException:  # noqa: BLE001 - a capture failure costs later reuse, never a request
        logger.exception("KVCOMM capture failed; later requests compute what it would have kept")


def _work(shared: _Shared) -> None:
    while True:
        with shared.changed:
            shared.changed.wait_for(lambda: shared.jobs or shared.stopped)
            if not shared.jobs:
                return
            shared.running, job = shared.jobs.popleft()
        try:
            _run(job)
        finally:
            job = None  # its request's KV copy goes now, not when the next capture arrives
            with shared.changed:
                shared.running = None
                shared.changed.notify_all()


#: queues whose worker has started, waited for at exit; weak, so that it keeps none of them
_started: "weakref.WeakSet[CaptureQueue]" = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hook_registered = False


def _finish_all_at_exit(timeout_s: float = EXIT_WAIT_S) -> None:
    """Give every live queue's captures under way one shared ``timeout_s`` (they run side by side)."""
    deadline = time.monotonic() + timeout_s
    for queue in list(_started):
        queue._finish_at_exit(max(0.0, deadline - time.monotonic()))


class CaptureQueue:
    """One daemon worker thread running submitted captures first in, first out.

    A capture that raises is logged and skipped: it costs later requests their reuse of that
    request's KV, never a request's output.

    The worker holds only the jobs, not the queue: a queue dropped without :meth:`close` is
    collected once its queued captures have run, and its worker then exits, so that a process
    creating brokers one after another keeps no thread per broker.
    """

    def __init__(self, name: str = "kvcomm-capture") -> None:
        self._name = name
        self._shared = _Shared()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Collected: the worker runs what is queued (nothing can reach it) and exits. Not at exit:
        # there _finish_all_at_exit waits, and the worker must not be told to stop before it.
        weakref.finalize(self, self._shared.stop).atexit = False

    def submit(self, touch: CaptureTouch, job: Callable[[], None]) -> None:
        """Queue ``job`` behind every capture submitted before it.

        After :meth:`close`, ``job`` runs here, on the caller's thread, before this returns (a
        failure still only logged): a runtime finishing its last requests while it shuts down
        keeps their captures and never sees an error in their output."""
        shared = self._shared
        with shared.changed:
            if not self._closed:
                self._start()
                shared.jobs.append((touch, job))
                shared.changed.notify_all()
                return
        _run(job)

    def _start(self) -> None:
        """Start the worker unless it runs (again after a fork, which keeps only the forking thread)."""
        global _exit_hook_registered
        if self._thread is not None and self._thread.is_alive():
            return
        with _exit_hook:
            if not _exit_hook_registered:
                atexit.register(_finish_all_at_exit)
                _exit_hook_registered = True
        _started.add(self)
        self._thread = threading.Thread(target=_work, args=(self._shared,), name=self._name, daemon=True)
        self._thread.start()

    def settle(self, agent: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Block until no pending capture is one a request of ``agent`` with ``prompt_ids``
        could read (:class:`CaptureTouch`); without them, until every pending capture has run.
        Never call it from inside a capture."""
        packed = None if prompt_ids is None else _packed(prompt_ids)
        shared = self._shared

        def waiting() -> bool:
            pending = [touch for touch, _ in shared.jobs] + ([shared.running] if shared.running else [])
            if agent is None or packed is None:
                return bool(pending)
            return any(touch.reads(agent, packed) for touch in pending)

        with shared.changed:
            shared.changed.wait_for(lambda: not waiting())

    def close(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """Run the captures queued so far, then stop the worker thread and wait for it to end.

        Those still queued after ``timeout_s`` are dropped (logged), as at interpreter exit: an
        owner that is done with the queue does not wait on a stuck capture, and one still
        running then ends on its own daemon thread. Later :meth:`submit` calls run their job
        inline. A second call does nothing; called from inside a capture, it only stops the
        worker after the queued captures."""
        shared = self._shared
        deadline = time.monotonic() + timeout_s
        with shared.changed:
            if self._closed:
                return
            self._closed = True
            shared.stopped = True
            shared.changed.notify_all()
            thread = self._thread
            if thread is threading.current_thread():
                return
            if not shared.changed.wait_for(shared.idle, timeout=timeout_s):
                if shared.jobs:
                    logger.warning("KVCOMM capture queue closed with %d captures not run; later requests "
                                   "compute what they would have kept", len(shared.jobs))
                    shared.jobs.clear()
                    shared.changed.notify_all()
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (jobs then run on the thread submitting them)."""
        return self._closed

    def _finish_at_exit(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """At interpreter exit, let the captures under way finish (a daemon thread stopped inside
        a tensor op aborts the process) for at most ``timeout_s``; what is left is lost."""
        with self._shared.changed:
            self._shared.changed.wait_for(self._shared.idle, timeout=timeout_s)

    @property
    def pending(self) -> int:
        """Captures submitted and not yet finished."""
        with self._shared.changed:
            return len(self._shared.jobs) + (self._shared.running is not None)
