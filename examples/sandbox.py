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
small helper (this file run as a script) before it executes the interpreter, so nothing runs
between ``fork`` and ``exec`` of a possibly multi-threaded caller.

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

__all__ = ["SandboxResult", "run_isolated", "run_sandboxed"]

OUTPUT_CHARS = 800  # run_isolated returns this much of the output's tail (the agents read it)
OUTPUT_BYTES = 64 << 10  # stdout+stderr kept; the rest is read and dropped
MEMORY_BYTES = 1 << 30  # address space of each process
FILE_BYTES = 1 << 20  # the largest file a process may write
WORK_BYTES = 16 << 20  # the working folder, where it is a tmpfs
OPEN_FILES = 64
PROCESSES = 32  # processes and threads at once (the script included)
SANDBOX_UIDS = range(61000, 61100)  # uids (gid = uid) for the code when running as root
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/root", "/home")  # covered by empty tmpfs on Linux
ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
LINUX = sys.platform.startswith("linux")
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
            [sys.executable, "-I", os.path.abspath(__file__), json.dumps(config)], stdin=subprocess.DEVNULL,
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


def _task(pid: int) -> tuple[int, str, int] | None:
    """(real uid, state letter, threads) of a process, from /proc; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), fields["State"].strip()[:1], int(fields.get("Threads", "1"))


def _processes(uid: int | None = None) -> list[tuple[int, int, str, int]]:
    """(pid, real uid, state, threads) of the processes in /proc, of ``uid`` only if given."""
    found = []
    for entry in os.listdir("/proc"):
        task = _task(int(entry)) if entry.isdigit() else None
        if task is not None and (uid is None or task[0] == uid):
            found.append((int(entry), *task))
    return found


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

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_NO_NEW_PRIVS = 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1


class _Setup:
    """What the helper did; sent to the parent as one JSON line on the status pipe."""

    def __init__(self, status_fd: int):
        self.status_fd, self.isolation, self.missing = status_fd, [], []
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True) if LINUX else None

    def send(self, **fields) -> None:
        os.write(self.status_fd, (json.dumps(fields) + "\n").encode())

    def call(self, name: str, *args) -> None:
        if getattr(self.libc, name)(*args) != 0:
            code = self.ctypes.get_errno()
            raise OSError(code, f"{name}{args[:2]}: {os.strerror(code)}")

    def mount(self, source, target: str, fstype, flags: int, data=None) -> None:
        encode = lambda s: None if s is None else s.encode()  # noqa: E731
        self.call("mount", encode(source), target.encode(), encode(fstype), self.ctypes.c_ulong(flags), encode(data))


def _helper(config: dict) -> int:
    """Runs as ``python -I sandbox.py CONFIG`` in the new session, as the caller's user: sets up
    namespaces, limits and the uid, then executes ``python -I candidate.py``."""
    setup = _Setup(config["status_fd"])
    os.set_inheritable(setup.status_fd, False)  # closed by exec
    os.umask(0o022)
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the helper re-raises the script's fatal signal
    script = Path(config["script"])
    source = script.read_bytes()
    root, uid = os.geteuid() == 0, config["uid"]
    gid = uid
    setup.isolation += ["timeout", "output cap", "new session (process group killed)"]
    namespaces = False
    if LINUX and not config["namespaces"]:
        setup.missing.append("namespaces (turned off): network, files and detached processes not isolated")
    elif LINUX:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID | (0 if root else CLONE_NEWUSER)
        try:
            outer_uid, outer_gid = os.getuid(), os.getgid()
            setup.call("unshare", flags)
            if not root:
                Path("/proc/self/setgroups").write_text("deny")
                Path("/proc/self/uid_map").write_text(f"{outer_uid} {outer_uid} 1")
                Path("/proc/self/gid_map").write_text(f"{outer_gid} {outer_gid} 1")
                setup.isolation.append("user namespace (no capabilities)")
            namespaces = True
            setup.isolation += ["network namespace", "PID namespace", "IPC namespace"]
        except OSError as e:
            setup.missing.append(f"namespaces ({e.strerror}): network, files and detached processes not isolated")
    else:
        setup.missing += ["namespaces (not Linux): network, files and detached processes not isolated"]
    if not namespaces:
        return _finish(setup, script.parent, script, root, uid, gid, config["timeout"], in_pid_namespace=False)
    pid = os.fork()
    if pid == 0:  # init of the new PID namespace: sets up the files, runs the script, reaps orphans
        code = 126
        try:
            work = Path("/tmp") / script.parent.name
            _filesystem(setup, work, source, uid if root else os.getuid(), gid if root else os.getgid(), root)
            child = os.fork()
            if child == 0:
                try:
                    _finish(setup, work, work / script.name, root, uid, gid, config["timeout"], in_pid_namespace=True)
                except BaseException as e:  # noqa: BLE001 - report and leave: nothing may run unisolated
                    _failed(setup, e)
                os._exit(126)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the script may signal its init (same uid without root)
            code = _reap_until(child)
            setup.send(returncode=code)  # init cannot die of its own signal: the status line carries it
        except BaseException as e:  # noqa: BLE001
            _failed(setup, e)
        os._exit(code if 0 <= code < 256 else 128 + abs(code) % 128)  # the kernel then kills the rest
    setup.send(init_pid=pid)
    os.close(setup.status_fd)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # init was killed (the timeout): die of the same signal
        if os.WTERMSIG(status) != signal.SIGKILL:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status)


def _failed(setup: _Setup, error: BaseException) -> None:
    setup.send(error=f"{type(error).__name__}: {error}")
    print(f"sandbox setup failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def _reap_until(child: int) -> int:
    """As init: reap every orphan until ``child`` exits; its exit code (negative: a signal)."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 126
        if pid == child:
            return os.waitstatus_to_exitcode(status)


def _filesystem(setup: _Setup, work: Path, source: bytes, uid: int, gid: int, root: bool) -> None:
    """Mount namespace: private propagation, HIDDEN and untraversable folders covered (the
    interpreter's folders bound back), a private /proc, everything read-only, a tmpfs to work in."""
    setup.mount(None, "/", None, MS_REC | MS_PRIVATE)
    needed = _interpreter_folders()
    hidden = [h for h in HIDDEN if os.path.isdir(h) and not os.path.islink(h)]
    if root:  # the uid must reach the interpreter: cover each folder it cannot traverse
        hidden += [_untraversable(path) for path in needed if _untraversable(path)]
    hidden = _outermost(hidden)
    exposed = {path: os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
               for path in needed if any(_under(path, h) for h in hidden)}
    for folder in hidden:
        setup.mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=1024")
    for path, fd in exposed.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        setup.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.makedirs(work, mode=0o755)
    try:
        setup.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        setup.isolation.append("private /proc")
    except OSError as e:
        setup.missing.append(f"private /proc ({e.strerror}): the host's processes are listed")
    _read_only(setup)
    setup.mount("tmpfs", str(work), "tmpfs", MS_NOSUID | MS_NODEV,
                f"size={WORK_BYTES},nr_inodes=4096,mode=0700,uid={uid},gid={gid}")
    (work / "candidate.py").write_bytes(source)
    os.chown(work / "candidate.py", uid, gid)
    setup.isolation += ["mount namespace", f"writable: only the working folder ({WORK_BYTES >> 20} MiB tmpfs)",
                        "covered: " + " ".join(hidden)]


def _read_only(setup: _Setup) -> None:
    """Every mount of this namespace read-only: mount_setattr(AT_RECURSIVE) where the kernel has it
    (5.12+), else a read-only bind remount of each mount in /proc/self/mountinfo."""
    ctypes = setup.ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if setup.libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(b"/"),
                          ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        target = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= keep.get(option, 0)
        try:
            setup.mount(None, target, None, flags)
        except OSError as e:
            setup.missing.append(f"read-only {target} ({e.strerror})")


def _finish(setup: _Setup, work: Path, script: Path, root: bool, uid: int | None, gid: int | None,
            timeout: float, in_pid_namespace: bool) -> int:
    """Limits, no_new_privs, the uid, then exec; returns only if the exec fails."""
    import resource

    drop = root and uid is not None
    if drop and not in_pid_namespace:  # no mount namespace: the uid needs the folder and the interpreter
        unreachable = [p for p in [str(work.parent), *_interpreter_folders()] if _untraversable(p)]
        if unreachable:
            drop = False
            setup.missing.append(f"unprivileged uid ({unreachable[0]} is not reachable by other users)")
        else:
            os.chmod(work, 0o700)
            os.chown(work, uid, gid)
    processes = PROCESSES
    if not root and not any(s.startswith("user namespace") for s in setup.isolation):
        processes += _own_tasks()  # RLIMIT_NPROC counts all of this user's processes and threads
    cpu = int(timeout) + 1
    for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, MEMORY_BYTES),
                         (resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_NOFILE, OPEN_FILES),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, processes)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError) as e:
            setup.missing.append(f"limit {limit} ({e})")
    setup.isolation.append(f"limits: {cpu} CPU s, {MEMORY_BYTES >> 20} MiB address space, "
                           f"{FILE_BYTES >> 20} MiB files, {OPEN_FILES} open files, {processes} processes")
    if LINUX:
        setup.call("prctl", *map(setup.ctypes.c_ulong, (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)))
        setup.isolation.append("no_new_privs")
    if drop:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        setup.isolation.append(f"unprivileged uid {uid}")
    elif root:
        setup.missing.append("process limit (the code runs as root, which ignores RLIMIT_NPROC)")
    os.chdir(work)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    setup.send(isolation=setup.isolation, missing=setup.missing, uid=uid if drop else None)
    env = {**ENV, "HOME": str(work), "TMPDIR": str(work)}
    os.execve(sys.executable, [sys.executable, "-I", "-u", str(script)], env)  # -u: a timeout keeps the output
    return 126


def _own_tasks() -> int:
    """How many processes and threads this user runs (what RLIMIT_NPROC counts)."""
    if LINUX:
        return sum(threads for _, _, _, threads in _processes(os.getuid()))
    listed = subprocess.run(["ps", "-M", "-U", str(os.getuid())], capture_output=True, text=True)  # a line a thread
    return max(len(listed.stdout.splitlines()) - 1, 0) if listed.returncode == 0 else 1 << 12


def _interpreter_folders() -> list[str]:
    folders = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    folders.add(os.path.dirname(os.path.realpath(sys.executable)))
    return _outermost(folders)


def _untraversable(path: str) -> str | None:
    """The outermost folder on ``path`` that users other than its owner cannot search, if any."""
    current = "/"
    for part in Path(path).parts[1:]:
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if not mode & 0o001:
            return current
    return None


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(paths) -> list[str]:
    """The paths that are not inside another of them."""
    paths = sorted(set(paths))
    return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


if __name__ == "__main__":
    sys.exit(_helper(json.loads(sys.argv[1])))
