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


class CaptureQueue:
    """One daemon worker thread running submitted captures first in, first out.

    A capture that raises is logged and skipped: it costs later requests their reuse of that
    request's KV, never a request's output.
    """

    def __init__(self, name: str = "kvcomm-capture") -> None:
        self._name = name
        self._jobs: deque[tuple[CaptureTouch, Callable[[], None]]] = deque()
        self._running: CaptureTouch | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, touch: CaptureTouch, job: Callable[[], None]) -> None:
        """Queue ``job`` behind every capture submitted before it."""
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(self._finish_at_exit)
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.append((touch, job))
            self._changed.notify_all()

    def settle(self, agent: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Block until no pending capture is one a request of ``agent`` with ``prompt_ids``
        could read (:class:`CaptureTouch`); without them, until every pending capture has run.
        Never call it from inside a capture."""
        packed = None if prompt_ids is None else _packed(prompt_ids)

        def waiting() -> bool:
            pending = [touch for touch, _ in self._jobs] + ([self._running] if self._running else [])
            if agent is None or packed is None:
                return bool(pending)
            return any(touch.reads(agent, packed) for touch in pending)

        with self._changed:
            self._changed.wait_for(lambda: not waiting())

    def _finish_at_exit(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """At interpreter exit, let the captures under way finish (a daemon thread stopped inside
        a tensor op aborts the process) for at most ``timeout_s``; what is left is lost."""
        with self._changed:
            self._changed.wait_for(lambda: not self._jobs and self._running is None, timeout=timeout_s)

    @property
    def pending(self) -> int:
        """Captures submitted and not yet finished."""
        with self._changed:
            return len(self._jobs) + (self._running is not None)

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._jobs))
                self._running, job = self._jobs.popleft()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a capture failure costs later reuse, never a request
                logger.exception("KVCOMM capture failed; later requests compute what it would have kept")
            finally:
                job = None  # its request's KV copy goes now, not when the next capture arrives
                with self._changed:
                    self._running = None
                    self._changed.notify_all()
