"""CaptureQueue: captures kept off a runtime's request path; a later plan waits only for those it
could read (the broker's use of it is in tests/test_broker.py)."""

from __future__ import annotations

import threading

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
