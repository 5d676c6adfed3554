"""Run model-written code isolated, with what the operating system offers.

``run_sandboxed(source, timeout=...)`` runs ``source`` as a script under ``python -I -u`` in a fresh
working folder and returns a :class:`SandboxResult`; ``run_isolated`` is the two-value form the
coding example uses. Every platform gets:

* a wall-clock timeout, and stdout+stderr read as they come (one pipe, in order) with at most
  ``OUTPUT_BYTES`` kept (the first quarter and the last three quarters; the rest is read and
  dropped, never buffered, and the result says how much was dropped);
* a minimal environment (``PATH``, ``HOME`` and ``TMPDIR`` = the working folder), stdin from
  ``/dev/null``, no inherited file descriptors.

POSIX adds a new session and process group (killed as a whole with SIGKILL on timeout and after
every run) and resource limits (CPU seconds, address space, file size, open files, no core
dumps, and RLIMIT_NPROC processes). The limits, namespaces and the change of user are set by a
small helper (``sandbox_helper.py``, run as a script) before it executes the interpreter, so
nothing runs between ``fork`` and ``exec`` of a possibly multi-threaded caller.

Linux, as root (the case the tests check):

* **user**: the code runs as an unprivileged uid/gid of its own (``SANDBOX_UIDS``: the first uid
  that is not in the user database and has no process, held with a lock file while the run
  lasts), with no supplementary groups, no capabilities and ``no_new_privs`` (set-uid programs do
  not raise it). Root ignores RLIMIT_NPROC; this uid does not, and as no other process has that
  uid the limit counts exactly the sandbox's processes and threads.
* **processes**: a new PID namespace whose init (a fork of the helper, still root, which reaps
  orphans) runs the script; when the script exits, or on timeout when init is killed, the kernel
  kills every process left in the namespace (double forks and ``setsid`` included), and nothing
  is left for the host's init to reap. After each run any process of the sandbox uid is killed
  too (with pidfds, so a recycled pid is never hit).
* **network**: a new network namespace with only a loopback device that is down: every
  ``connect`` (to the host's loopback as well) fails. Unix sockets in the filesystem are files:
  the uid reaches only those whose permissions let any user connect.
* **files**: a new mount namespace in which every mount is read-only; ``/tmp``, ``/var/tmp``,
  ``/dev/shm``, ``/root``, ``/home`` and any directory the uid could not traverse on the way to
  the interpreter are covered with empty read-only tmpfs (the interpreter's folders are bound
  back, read-only); ``/proc`` shows only the sandbox's processes; the working folder is a tmpfs
  of ``WORK_BYTES`` owned by the uid, the only writable place (besides devices such as
  ``/dev/null``; ``/dev/shm`` is read-only too, so no POSIX shared memory). The script is copied
  in before the code starts; what the code writes there is gone when the run ends. A new IPC
  namespace hides System V IPC. Everything world-readable on the machine outside the covered
  folders stays readable.

Linux, not root: the same namespaces in a new user namespace (the uid maps to itself, so the
code has no capabilities) where the kernel allows unprivileged user namespaces, and RLIMIT_NPROC
counts only the sandbox's processes there. Where it does not: resource limits (RLIMIT_NPROC then
counts all of your processes, so it is set to their number plus ``PROCESSES``), the session kill
(a process that calls ``setsid`` can survive), no network or file isolation: the code can write
wherever you can. Root that cannot create namespaces (a container without CAP_SYS_ADMIN) gets
rlimits, the session kill, and the uid (with its process limit and the kill of every process of
that uid) only where other users can reach the interpreter and the temporary folder; otherwise
the code runs as root, with no process limit.

macOS and other POSIX systems: resource limits (RLIMIT_NPROC is set to the user's processes plus
``PROCESSES``; root ignores it), the session kill, no network or file isolation, no change of
user.
Windows: the timeout (the process tree is killed with ``taskkill /T``) and the output cap only.

``SandboxResult.isolation`` lists what was in effect for that run and ``missing`` what was not
and why. Even with everything in effect this is the kernel's isolation, not a VM: a kernel bug
is an escape. Run code you distrust in a container or VM as well.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .sandbox_helper import (  # noqa: F401 - the limits are part of this module's interface
    ENV, FILE_BYTES, HIDDEN, LINUX, MEMORY_BYTES, OPEN_FILES, PROCESSES, WORK_BYTES, _processes, _task,
)

__all__ = ["SandboxResult", "run_isolated", "run_sandboxed"]

OUTPUT_CHARS = 800  # run_isolated returns this much of the output's tail (the agents read it)
OUTPUT_BYTES = 64 << 10  # stdout+stderr kept; the rest is read and dropped
SANDBOX_UIDS = range(61000, 61100)  # uids (gid = uid) for the code when running as root
HELPER = Path(__file__).resolve().with_name("sandbox_helper.py")  # run as a script, not imported
NAMESPACES = True  # False: do not try Linux namespaces (to see what the fallback gives)


@dataclass(frozen=True)
class SandboxResult:
    passed: bool  # exit status 0 before the timeout
    returncode: int | None  # negative: killed by that signal; None: timed out
    timed_out: bool
    output: str  # stdout+stderr in order, at most OUTPUT_BYTES of it (see truncated)
    dropped_bytes: int  # output read and dropped beyond OUTPUT_BYTES
    isolation: tuple[str, ...]  # mechanisms in effect for this run
    missing: tuple[str, ...]  # mechanisms not in effect, with the reason
    uid: int | None  # the uid the code ran as, where it was changed
    seconds: float

    @property
    def truncated(self) -> bool:
        return self.dropped_bytes > 0


def run_isolated(source: str, *, timeout: float = 10.0) -> tuple[bool, str]:
    """Run ``source`` as a script; returns (exit status 0, the tail of stdout+stderr)."""
    result = run_sandboxed(source, timeout=timeout)
    output = result.output[-OUTPUT_CHARS:]
    if result.truncated:
        output = f"[output truncated: {result.dropped_bytes} bytes dropped]\n{output}"
    if result.timed_out:
        return False, f"timed out after {timeout:.0f} s" + (f"; output:\n{output}" if output else "")
    return result.passed, output or "(no output)"


def run_sandboxed(source: str, *, timeout: float = 10.0, output_bytes: int = OUTPUT_BYTES) -> SandboxResult:
    """Run ``source`` as a script under ``python -I``, isolated as the module docstring says."""
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="kvcomm-sandbox-")
    try:
        script = Path(folder) / "candidate.py"
        script.write_text(source)
        if os.name != "posix":
            return _run_windows(script, timeout, output_bytes, started)
        with _sandbox_uid() as uid:
            return _run_posix(script, timeout, output_bytes, uid, started)
    finally:
        _remove(folder)


# ---------------------------------------------------------------- parent side (POSIX)

class _Capture:
    """Keeps the first quarter and the last three quarters of ``limit`` bytes."""

    def __init__(self, limit: int):
        self.head_limit, self.tail_limit = limit // 4, limit - limit // 4
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        middle = f"\n[... {self.dropped} bytes dropped ...]\n".encode() if self.dropped else b""
        return (self.head + middle + self.tail).decode("utf-8", "replace").strip()


def _run_posix(script: Path, timeout: float, output_bytes: int, uid: int | None, started: float) -> SandboxResult:
    status_r, status_w = os.pipe()
    config = {"script": str(script), "timeout": timeout, "uid": uid, "status_fd": status_w, "namespaces": NAMESPACES}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(HELPER), json.dumps(config)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            pass_fds=(status_w,), env=ENV, cwd=str(script.parent))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    capture, status = _Capture(output_bytes), bytearray()
    deadline = started + timeout
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in (proc.stdout.fileno(), status_r):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        try:
            while not _exited(proc.pid):
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                _read(selector, proc.stdout.fileno(), status_r, capture, status, min(left, 0.02))
            info = _status(status)
            if timed_out and "init_pid" in info:  # the PID namespace's init: the kernel kills the rest
                _signal(info["init_pid"], signal.SIGKILL)
                end = time.monotonic() + 2.0
                while not _exited(proc.pid) and time.monotonic() < end:
                    _read(selector, proc.stdout.fileno(), status_r, capture, status, 0.02)
            _killpg(proc.pid)  # the helper is a zombie (not reaped) here, so its pid names this group
            if uid is not None:
                _kill_uid(uid)
            end = time.monotonic() + 1.0  # drain: every writer is gone unless one left the session
            while selector.get_map() and time.monotonic() < end:
                _read(selector, proc.stdout.fileno(), status_r, capture, status, 0.05)
        finally:
            if proc.poll() is None:
                _killpg(proc.pid)
                proc.kill()
            proc.wait()
            proc.stdout.close()
            os.close(status_r)
    info = _status(status)
    returncode = None if timed_out else info.get("returncode", proc.returncode)
    missing = tuple(info.get("missing", ())) + (() if "isolation" in info else ("sandbox setup did not finish",))
    if "error" in info:
        missing += (f"sandbox setup failed: {info['error']}",)
    return SandboxResult(
        passed=returncode == 0, returncode=returncode, timed_out=timed_out, output=capture.text(),
        dropped_bytes=capture.dropped, isolation=tuple(info.get("isolation", ())), missing=missing,
        uid=info.get("uid"), seconds=time.monotonic() - started)


def _read(selector, out_fd: int, status_fd: int, capture: _Capture, status: bytearray, wait: float) -> None:
    for key, _ in selector.select(wait):
        while True:
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                selector.unregister(key.fd)
                break
            if key.fd == out_fd:
                capture.add(data)
            elif len(status) < 1 << 16:
                status += data


def _exited(pid: int) -> bool:
    """Whether the child exited, without reaping it (its pid stays ours until proc.wait())."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _status(data: bytearray) -> dict:
    info: dict = {}
    for line in bytes(data).decode("utf-8", "replace").splitlines():
        try:
            info.update(json.loads(line))
        except ValueError:
            pass
    return info


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int, seconds: float = 2.0) -> bool:
    """SIGKILL every live process of ``uid`` (race-free with pidfds where the kernel has them)."""
    end = time.monotonic() + seconds
    while True:
        live = [pid for pid, _, state, _ in _processes(uid) if state not in "ZX"]
        if not live:
            return True
        for pid in live:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                _signal(pid, signal.SIGKILL)
                continue
            try:
                task = _task(pid)
                if task is not None and task[0] == uid:  # the pidfd holds the process: not a recycled pid
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


@contextmanager
def _sandbox_uid():
    """As root on Linux: a uid of SANDBOX_UIDS that no account and no process uses, locked for the
    run (a lock file per uid in a root-only folder); else None."""
    if not (LINUX and os.geteuid() == 0):
        yield None
        return
    import fcntl
    import grp
    import pwd

    locks = Path(tempfile.gettempdir()) / "kvcomm-sandbox-uids"
    locks.mkdir(mode=0o700, exist_ok=True)
    info = locks.lstat()
    if not os.path.isdir(locks) or os.path.islink(locks) or info.st_uid != 0 or info.st_mode & 0o077:
        raise RuntimeError(f"{locks} must be a directory owned by root with mode 0700")
    busy = {uid for _, uid, _, _ in _processes()}
    for uid in SANDBOX_UIDS:
        if uid in busy or _known(pwd.getpwuid, uid) or _known(grp.getgrgid, uid):
            continue
        fd = os.open(locks / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if any(True for _ in _processes(uid)):  # appeared between the scan and the lock
                continue
            yield uid
            return
        finally:
            os.close(fd)
    raise RuntimeError(f"no free sandbox uid in {SANDBOX_UIDS}")


def _known(lookup, uid: int) -> bool:
    try:
        lookup(uid)
        return True
    except KeyError:
        return False


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def _run_windows(script: Path, timeout: float, output_bytes: int, started: float) -> SandboxResult:
    import threading

    proc = subprocess.Popen(
        [sys.executable, "-I", "-u", str(script)], cwd=str(script.parent), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={"SYSTEMROOT": os.environ.get("SYSTEMROOT", ""), "PYTHONHASHSEED": "0", "TMP": str(script.parent),
             "TEMP": str(script.parent), "USERPROFILE": str(script.parent)},
        creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0))
    capture = _Capture(output_bytes)
    reader = threading.Thread(target=lambda: [capture.add(b) for b in iter(lambda: proc.stdout.read1(1 << 16), b"")],
                              daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(0.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True)
    proc.kill()
    proc.wait()
    reader.join(1.0)
    returncode = None if timed_out else proc.returncode
    return SandboxResult(
        passed=returncode == 0, returncode=returncode, timed_out=timed_out, output=capture.text(),
        dropped_bytes=capture.dropped, isolation=("timeout", "output cap", "process tree killed"),
        missing=("resource limits", "network isolation", "file isolation", "unprivileged user"),
        uid=None, seconds=time.monotonic() - started)


# ---------------------------------------------------------------- helper side (runs as a script)
