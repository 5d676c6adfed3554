"""The sandbox's helper: what runs between the launch and the model-written code.

:mod:`examples.sandbox` starts it as ``python -I sandbox_helper.py CONFIG`` (a JSON object: the
script, the timeout, the uid, the status pipe, whether to try namespaces) in a new session. It
sets up the namespaces, mounts, resource limits and the user (the module docstring of
:mod:`examples.sandbox` says what each platform gets), reports what took effect and what did
not as one JSON line on the status pipe, and executes ``python -I`` on the script. Nothing of
the caller runs between ``fork`` and ``exec`` this way.

Standard library only, on purpose: ``-I`` puts no package on the path. The sandbox's limits live
here, where they are set; :mod:`examples.sandbox` re-exports them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

MEMORY_BYTES = 1 << 30  # address space of each process
FILE_BYTES = 1 << 20  # the largest file a process may write
WORK_BYTES = 16 << 20  # the working folder, where it is a tmpfs
OPEN_FILES = 64
PROCESSES = 32  # processes and threads at once (the script included)
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/root", "/home")  # covered by empty tmpfs on Linux
ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
LINUX = sys.platform.startswith("linux")


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
    """Runs as ``python -I sandbox_helper.py CONFIG`` in the new session, as the caller's user: sets up
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
