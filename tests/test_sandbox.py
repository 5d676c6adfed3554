"""examples/sandbox.py isolates for real: an infinite printer, a fork bomb, a detached child, a
write outside the working folder and a socket, each stopped by the mechanism meant for it.

A test is skipped only where the platform does not offer its mechanism (``isolation`` of a probe
run says what is in effect); on Linux as root (CI) every mechanism is expected and checked."""

from __future__ import annotations

import os
import resource
import socket
import sys
import uuid
from pathlib import Path

import pytest

from examples.sandbox import OUTPUT_BYTES, PROCESSES, run_isolated, run_sandboxed

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox's isolation tests are POSIX-only")


@pytest.fixture(scope="module")
def isolation() -> tuple[str, ...]:
    result = run_sandboxed("print('ok')", timeout=10)
    assert result.passed and result.output == "ok", result
    return result.isolation


def has(isolation, name: str) -> bool:
    return any(item.startswith(name) for item in isolation)


def leftovers(uid: int | None, marker: str = "kvcomm-sandbox-") -> list[str]:
    """Live processes of the sandbox's uid, or whose command line names the marker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].strip()[:1] in "ZX":
            continue
        if int(fields["Uid"].split()[0]) == uid or marker in cmdline:
            found.append(f"{entry}: {cmdline}")
    return found


def test_linux_as_root_gets_every_mechanism(isolation):
    if not (sys.platform.startswith("linux") and os.geteuid() == 0):
        pytest.skip("the full set is promised on Linux as root")
    result = run_sandboxed("import os; print(os.getuid())")
    assert result.missing == () and result.uid is not None and result.output == str(result.uid)
    for name in ("new session", "network namespace", "PID namespace", "IPC namespace", "mount namespace",
                 "private /proc", "writable: only the working folder", "limits:", "no_new_privs", "unprivileged uid"):
        assert has(isolation, name), (name, isolation)


def test_infinite_printer_is_capped_and_stopped():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_sandboxed("while True: print('x' * 1000)", timeout=1.5)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert result.timed_out and not result.passed and result.returncode is None
    assert result.truncated and result.dropped_bytes > 4 * OUTPUT_BYTES  # kept reading, kept little
    assert len(result.output.encode()) <= OUTPUT_BYTES + 100 and result.output.startswith("x" * 1000)
    assert grown_kib < 32 << 10, f"the parent grew {grown_kib} KiB"
    assert result.seconds < 4
    passed, text = run_isolated("import sys\nsys.stdout.write('y' * 200_000)\nraise SystemExit(1)")
    assert not passed and text.startswith("[output truncated:") and text.endswith("y" * 100)


def test_fork_bomb_is_bounded_by_the_process_limit_and_killed(isolation):
    if not (has(isolation, "PID namespace") or has(isolation, "unprivileged uid")):
        pytest.skip("no PID namespace and no uid of its own here: a fork bomb could outlive the run")
    if os.geteuid() == 0 and not has(isolation, "unprivileged uid"):
        pytest.skip("the code would run as root, which ignores RLIMIT_NPROC")
    # The bomb forks only after checking, in that very process, that the limit is in effect.
    bomb = f"""
import os, resource, time
soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
assert os.getuid() != 0 and 0 < soft <= {PROCESSES} and hard <= {PROCESSES}, (os.getuid(), soft, hard)
print("limit", soft, flush=True)
refused = 0
for _ in range(10000):
    try:
        os.fork()
    except OSError:
        refused += 1
        if refused == 1:
            print("refused", flush=True)
        time.sleep(0.01)
"""
    result = run_sandboxed(bomb, timeout=3)
    assert f"limit {PROCESSES}" in result.output and "refused" in result.output, result.output[:500]
    assert result.timed_out and result.seconds < 6
    assert not leftovers(result.uid)


def test_detached_children_do_not_outlive_the_run(isolation):
    if not (has(isolation, "PID namespace") or has(isolation, "unprivileged uid")):
        pytest.skip("no PID namespace and no uid of its own here: a process that calls setsid() survives")
    marker = f"987.{uuid.uuid4().int % 10**6:06d}"  # sleep's argument: how the test finds them
    source = f"""
import os, subprocess, time
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)  # a new session, the pipe still open
if os.fork() == 0:  # a double fork that leaves the group
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
def running():
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            count += "{marker}" in open(f"/proc/{{pid}}/cmdline").read()
        except OSError:
            pass
    return count
end = time.monotonic() + 3
while running() < 2 and time.monotonic() < end:
    time.sleep(0.01)
print("detached", running())
"""
    result = run_sandboxed(source, timeout=5)
    assert result.passed and result.output == "detached 2", result
    assert result.seconds < 4  # the sleepers held the output pipe: they were killed, not waited for
    assert not leftovers(result.uid, marker)


def test_writes_outside_the_working_folder_fail(isolation, tmp_path):
    token = uuid.uuid4().hex[:8]
    root_owned = [tmp_path / f"escape-{token}", Path.home() / f"kvcomm-escape-{token}",
                  Path(__file__).resolve().parent / f"escape-{token}"]
    shared = [Path(folder) / f"kvcomm-escape-{token}" for folder in ("/tmp", "/var/tmp", "/dev/shm")
              if os.path.isdir(folder)]
    if has(isolation, "mount namespace"):
        targets = root_owned + shared
    elif has(isolation, "unprivileged uid"):
        targets = root_owned  # world-writable folders stay writable without a mount namespace
    else:
        pytest.skip("no mount namespace and no uid of its own here: the code can write wherever you can")
    source = f"""
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("WROTE", path)
    except OSError as e:
        print("refused", path, e.errno)
with open("inside.txt", "w") as f:
    f.write("fine")
print("inside ok", open("inside.txt").read())
"""
    try:
        result = run_sandboxed(source, timeout=5)
        assert result.passed and "inside ok fine" in result.output, result
        assert "WROTE" not in result.output and result.output.count("refused") == len(targets), result.output
        assert not [t for t in targets if t.exists()]
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_socket_connections_fail(isolation):
    if not has(isolation, "network namespace"):
        pytest.skip("no network namespace here: the code has the machine's network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        source = f"""
import socket
for address in [("127.0.0.1", {port}), ("localhost", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("CONNECTED", address)
    except OSError as e:
        print("refused", address, e)
"""
        result = run_sandboxed(source, timeout=8)
        assert result.passed and "CONNECTED" not in result.output and result.output.count("refused") == 3, result
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the listening socket
