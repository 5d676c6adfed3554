"""CaptureQueue: captures kept off a runtime's request path; a later plan waits only for those it
could read (the broker's use of it is in tests/test_broker.py)."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import pytest

from kvcomm_agents.paged.capture_queue import CaptureQueue, CaptureTouch

PROMPT = list(range(100, 140))
REPLY = list(range(7, 27))
SHARED = (10, 30)  # a shared text the captured request read: PROMPT[10:30]


def _blocked(queue: CaptureQueue):
    """A capture of agent "a" (``PROMPT``, ``REPLY``) that runs until released; returns
    ``(release, done)``."""
    release, done = threading.Event(), threading.Event()

    def job():
        release.wait(10)
        done.set()

    queue.submit(CaptureTouch.of("a", PROMPT, REPLY, [SHARED]), job)
    return release, done


def test_an_unrelated_request_is_planned_while_a_capture_runs():
    queue = CaptureQueue()
    release, done = _blocked(queue)
    queue.settle("b", list(range(500, 560)))  # another agent, another start, no quote: at once
    assert not done.is_set() and queue.pending == 1
    release.set()
    queue.settle()
    assert done.is_set() and queue.pending == 0


@pytest.mark.parametrize("agent, prompt", [
    ("b", [1, 2] + REPLY + [3]),        # the next agent, quoting the reply
    ("b", [1, 2, 999] + REPLY[1:]),     # quoting it re-tokenized at its first word
    ("b", [1, 2] + REPLY[:9]),          # quoting its start only
    ("a", list(range(500, 560))),       # the same agent (its own text, its anchors)
    ("b", PROMPT + [1, 2, 3]),          # the same start (an exact prefix)
    ("b", [1, 2] + PROMPT[SHARED[0]:SHARED[1]]),  # a text it read (versions recorded of it)
])
def test_a_request_that_could_read_a_capture_waits_for_it(agent, prompt):
    queue = CaptureQueue()
    release, done = _blocked(queue)
    threading.Timer(0.2, release.set).start()
    queue.settle(agent, prompt)
    assert done.is_set()


def test_a_failed_capture_is_logged_and_the_next_one_runs(caplog):
    queue = CaptureQueue()
    ran = []
    queue.submit(CaptureTouch.of("a", PROMPT, REPLY), lambda: 1 / 0)
    queue.submit(CaptureTouch.of("a", PROMPT, REPLY), lambda: ran.append(1))
    queue.settle()
    assert ran == [1] and "capture failed" in caplog.text


def test_a_process_exiting_lets_the_capture_under_way_finish(tmp_path):
    """A daemon thread stopped inside a tensor op at exit aborts the process; the queue waits."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import time, torch\n"
        "from kvcomm_agents.paged.capture_queue import CaptureQueue, CaptureTouch\n"
        "queue = CaptureQueue()\n"
        "def job():\n"
        "    time.sleep(0.5)\n"
        "    torch.ones(64, 64) @ torch.ones(64, 64)\n"
        "    print('kept', flush=True)\n"
        "queue.submit(CaptureTouch.of('a', [1, 2, 3], [4, 5]), job)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "kept" in done.stdout, done.stderr


def _ended(threads, deadline_s: float = 5.0) -> bool:
    """Whether every thread of ``threads`` ends within ``deadline_s`` (collecting meanwhile)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        gc.collect()
        if not any(t.is_alive() for t in threads) and not set(threads) & set(threading.enumerate()):
            return True
        time.sleep(0.02)
    return False


def test_queues_dropped_leave_no_worker_thread_behind():
    """The worker holds the jobs, not the queue: a queue nobody holds is collected and its thread
    ends, its queued captures run first."""
    ran, threads, queues = [], [], []
    for k in range(5):
        queue = CaptureQueue(name=f"kvcomm-capture-dropped-{k}")
        release, _ = _blocked(queue)
        queue.submit(CaptureTouch.of("a", PROMPT, REPLY), lambda k=k: ran.append(k))
        threads.append(queue._thread)
        queues.append(weakref.ref(queue))
        release.set()
        del queue, release
    assert _ended(threads), [t.name for t in threads if t.is_alive()]
    assert sorted(ran) == list(range(5)) and all(ref() is None for ref in queues)


def test_brokers_dropped_leave_no_capture_thread_behind(llama, tokenizer):
    from kvcomm_agents.testing import PrefixOnlyRuntime

    threads, brokers = [], []
    for _ in range(3):
        runtime = PrefixOnlyRuntime(llama, tokenizer, background_capture=True, method="exact_prefix")
        runtime.run(runtime.ids([{"role": "user", "content": "The river market opens at seven."}]), "a",
                    new_tokens=2)
        runtime.broker.settle()
        threads.append(runtime.broker._captures._thread)
        brokers.append((weakref.ref(runtime.broker), weakref.ref(runtime.broker._captures)))
        del runtime
    assert all(t is not None for t in threads)
    assert _ended(threads), [t.name for t in threads if t.is_alive()]
    assert all(b() is None and q() is None for b, q in brokers)


def test_close_runs_the_queued_captures_and_ends_the_worker_once():
    queue = CaptureQueue()
    release, done = _blocked(queue)
    ran = []
    queue.submit(CaptureTouch.of("b", [1, 2, 3], [4, 5]), lambda: ran.append(1))
    thread = queue._thread
    threading.Timer(0.2, release.set).start()
    queue.close()
    assert done.is_set() and ran == [1] and queue.pending == 0 and queue.closed
    assert not thread.is_alive()
    started = time.monotonic()
    queue.close()  # nothing left to do
    assert time.monotonic() - started < 0.1 and queue.closed


def test_close_drops_what_is_still_queued_after_its_timeout(caplog):
    queue = CaptureQueue()
    release, done = _blocked(queue)
    ran = []
    queue.submit(CaptureTouch.of("b", [1, 2, 3], [4, 5]), lambda: ran.append(1))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvcomm_agents.capture"):
        queue.close(timeout_s=0.2)
    assert time.monotonic() - started < 2 and "1 captures not run" in caplog.text
    thread = queue._thread
    release.set()
    thread.join(5)
    assert done.is_set() and not thread.is_alive() and ran == [] and queue.pending == 0


def test_a_capture_submitted_after_close_runs_inline(caplog):
    queue = CaptureQueue()
    queue.close()
    ran_on = []
    queue.submit(CaptureTouch.of("a", PROMPT, REPLY), lambda: ran_on.append(threading.current_thread()))
    assert ran_on == [threading.current_thread()] and queue.pending == 0 and queue._thread is None
    queue.submit(CaptureTouch.of("a", PROMPT, REPLY), lambda: 1 / 0)  # logged, not raised
    assert "capture failed" in caplog.text


def test_a_closed_broker_ends_its_thread_and_keeps_captures_inline(llama, tokenizer):
    from kvcomm_agents.testing import PrefixOnlyRuntime

    runtime = PrefixOnlyRuntime(llama, tokenizer, background_capture=True, method="exact_prefix")
    first = runtime.ids([{"role": "user", "content": "The river market opens at seven."}])
    runtime.run(first, "a", new_tokens=2)
    thread = runtime.broker._captures._thread
    runtime.broker.close()
    assert not thread.is_alive() and runtime.broker.pending_captures == 0
    runtime.broker.close()
    again = runtime.ids([{"role": "user", "content": "The river market opens at seven. Who sells apples?"}])
    _, reply_ids, _, claim, _ = runtime.run(again, "a", new_tokens=2)  # finished after close: kept inline
    assert claim.length > 0 and runtime.broker.pending_captures == 0
    follow = runtime.ids([{"role": "user", "content": "The river market opens at seven. Who sells apples?"},
                          {"role": "assistant", "content": tokenizer.decode(reply_ids)},
                          {"role": "user", "content": "And pears?"}])
    _, _, _, claim, _ = runtime.run(follow, "a", new_tokens=2)
    assert claim.length >= len(again)  # the capture kept inline serves it
    assert runtime.broker._captures._thread is thread and not thread.is_alive()  # no new worker
