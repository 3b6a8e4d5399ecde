"""The program sandbox.SandboxPool runs (never imports): a fork server whose workers run each
snippet in namespaces, with seccomp, rlimits and cgroups (sandbox.py; docs/sandbox.md).

Process tree (one per pool; the caller's end is sandbox.SandboxPool):

  caller (may have imported torch, may have threads)
   `- helper: a fresh `sys.executable -I machinery/sandbox_server.py --serve`, empty environment;
      imports numpy/sympy/z3 once
      `- launcher (one per worker): joins its cgroups, unshares user?/mount/pid/network namespaces
         `- worker: pid 1 of its pid namespace; builds the read-only file system view once, then
            loops: hand code to the waiting snippet process -> collect output -> kill all in the
            namespace -> reply -> clean up and fork the next snippet process while idle
            `- snippet: own session, rlimits, no privileges, /dev/null stdin, stdout/stderr pipes

Isolation modes (`SandboxPool(isolation=...)`, "auto" picks the first that the OS allows):

  root    started as root: mount/pid/network namespaces; the snippet runs as nobody, no groups
  userns  ordinary user: the same namespaces inside a user namespace; the snippet has no
          capabilities
  none    no namespaces: own process group + subreaper, seccomp blocks sockets, uid switch if root

Seccomp refuses the keyring and System V memory calls, new namespaces, mounts and ptrace in every
mode (x86-64, aarch64). Run by path with -I (no environment, no script folder on sys.path), it imports
only the standard library, and numpy, sympy and z3 to warm them; replies are plain dicts of
Result's fields (sandbox.py's Result).
"""
import atexit
import ctypes
import dataclasses
import errno
import fcntl
import json
import math
import os
import platform
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

NOBODY = 65534
FILE_BYTES = 16 << 20        # largest file a snippet may write
OPEN_FILES = 64
PROCESSES = 64               # processes (threads count too) a snippet may have at once
SCRATCH_BYTES = 64 << 20     # size of the private tmpfs holding the snippet's folder
SNIPPET_PATH = "/usr/local/bin:/usr/bin:/bin"
CGROUP_PREFIX = "t3rl-sandbox-"
CONTROLLERS = ("pids", "memory")  # the cgroups a worker gets, where the system gives them
# a worker's memory cgroup holds a snippet's processes together to the pool's memory_bytes, plus
# the worker's own share: the helper's pages it and the waiting snippet process copy (13-16 MiB)
WORKER_BYTES = 64 << 20
SCRATCH = "/tmp/sandbox"     # in the worker's private /tmp: a tmpfs that holds the snippet's folder

# --------------------------------------------------------------------------------------------------
# Linux system calls that the standard library of Python 3.11 lacks.

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MNT_DETACH, IPC_RMID = 2, 0
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                      "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 22, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
# per architecture: seccomp audit arch, the numbers of capset, socket, io_uring_setup, clone,
# clone3, and of the calls no snippet may make: add_key, request_key, keyctl (a uid's keyring
# outlives the program, on the host), shmget, msgget (System V memory outside the address-space
# limit), unshare, setns, mount, pivot_root and the new mount API (open_tree .. fspick,
# mount_setattr): in a user namespace of its own a snippet could mount a tmpfs, memory the
# address-space limit does not count; ptrace, process_vm_readv, process_vm_writev, pidfd_getfd:
# another process's memory or files (in mode "none", the caller's, of the same uid)
_MOUNT_API = (428, 429, 430, 431, 432, 433, 442)
ARCH = {"x86_64": (0xC000003E, 126, 41, 425, 56, 435,
                   (248, 249, 250, 29, 68, 272, 308, 165, 155, *_MOUNT_API, 101, 310, 311, 438)),
        "aarch64": (0xC00000B7, 91, 198, 425, 220, 435,
                    (217, 218, 219, 194, 186, 97, 268, 40, 41, *_MOUNT_API, 117, 270, 271, 438)),
        }.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4


def _check(ret, what):
    if ret == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return ret


def _bytes(s):
    return None if s is None else s.encode()


def _unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def _umount(target):
    _check(_libc.umount2(_bytes(target), MNT_DETACH), f"umount {target}")


def _mount(source, target, fstype, flags, data=None):
    ret = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data))
    _check(ret, f"mount {target}")


def _prctl(option, arg=0):
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


def _drop_capabilities():
    """Empty the bounding, effective, permitted and inheritable sets, so not even an exec regains
    any."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == -1:
            break  # EINVAL: past the last capability this kernel knows
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.syscall(ARCH[1], header, (ctypes.c_uint32 * 6)()), "capset")


def _seccomp(block_sockets):
    """Seccomp filter: the calls ARCH denies fail with EACCES, and so do clone with CLONE_NEWUSER
    and socket() unless the family is AF_UNIX (block_sockets: no network namespace); clone3, whose
    flags a filter cannot read, fails with ENOSYS, so that the C library falls back to clone;
    io_uring (which can open sockets) and other ABIs (x32, 32-bit) are refused outright."""
    audit_arch, _, nr_socket, nr_io_uring, nr_clone, nr_clone3, denied = ARCH
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    calls = [*denied, nr_io_uring] if block_sockets else list(denied)
    # (op, k, where it jumps when true, when false): a label below, or None for the next one
    code = [(ld, 4, None, None), (jeq, audit_arch, None, "deny"),  # another ABI
            (ld, 0, None, None), (jge, 0x40000000, "deny", None)]  # x32 system call numbers
    code += [(jeq, nr, "deny", None) for nr in calls]
    code += [(jeq, nr_clone3, "nosys", None), (jeq, nr_clone, None, "sockets"),
             (ld, 16, None, None), (jset, CLONE_NEWUSER, "deny", "allow")]  # 16: flags, low half
    labels = {"sockets": len(code)}
    if block_sockets:
        code += [(jeq, nr_socket, None, "allow"), (ld, 16, None, None),
                 (jeq, socket.AF_UNIX, "allow", "deny")]
    labels.update(allow=len(code), deny=len(code) + 1, nosys=len(code) + 2)
    code += [(ret, 0x7FFF0000, None, None), (ret, 0x00050000 | errno.EACCES, None, None),
             (ret, 0x00050000 | errno.ENOSYS, None, None)]
    jump = lambda i, label: 0 if label is None else labels[label] - i - 1  # noqa: E731
    words = [op | jump(i, t) << 16 | jump(i, f) << 24 | k << 32
             for i, (op, k, t, f) in enumerate(code)]
    filters = (ctypes.c_uint64 * len(words))(*words)
    fprog = struct.pack("HxxxxxxQ", len(words), ctypes.addressof(filters))
    buf = ctypes.create_string_buffer(fprog, len(fprog))
    _check(_libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(buf), 0, 0), "seccomp")


# --------------------------------------------------------------------------------------------------
# Messages: caller <-> worker over a stream socket (length-prefixed JSON); caller -> helper over a
# SOCK_SEQPACKET socket (one JSON message each, carrying the worker's socket as a passed file
# descriptor). sandbox.py's send_message and receive_message are the caller's end of _send and
# _recv.

def _send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock, n):
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def _recv(sock):
    header = _recv_exact(sock, 4)
    data = header and _recv_exact(sock, struct.unpack("!I", header)[0])
    return None if data is None else json.loads(data)


# --------------------------------------------------------------------------------------------------
# The snippet process: forked by the worker ahead of time, locked down, then it waits for its code.
# Status pipe protocol (child -> worker): b"m" when a MemoryError escaped, then b"x" + exit code as
# last words.

class _CodeArrived(BaseException):  # not an Exception: sympy's `except Exception` must miss it
    pass


def _prefault(request_fd):
    """Until the code arrives on request_fd, run a small solve like a verifier program's. A
    snippet's first solve after the fork spends most of its time in copy-on-write faults (refcount
    writes to pages it shares with the worker, more than the solve itself once they are paid);
    paying them while idle takes them off the request path. An interval timer looks at request_fd
    every 0.5 ms and abandons the solve once the code is there, so a request never waits for it.
    Symbols and numbers differ from any test's, so no result is served from sympy's cache."""
    armed = True

    def check(signum, frame):
        nonlocal armed
        if armed and select.select([request_fd], [], [], 0)[0]:
            armed = False
            raise _CodeArrived

    signal.signal(signal.SIGALRM, check)
    try:  # from the timer's start on, any line may raise _CodeArrived
        signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
        import sympy
        y = sympy.Symbol("y")
        sympy.solve(y ** 2 + 3 * y - 10, y)
        sympy.Rational(7, 12) + sympy.sqrt(12)
        armed = False  # the timer may fire before this line (the handler raises), never after it
    except _CodeArrived:
        pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # discards an alarm still pending
    signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _lock_down(cfg, folder, request_r, out_w, err_w, status_w):
    """Make this process the snippet's: own session, pipes on fds 0-4, privileges dropped, limits
    set, an empty environment in its own folder."""
    os.setsid()
    stdin = os.open("/dev/null", os.O_RDONLY)
    # lift the pipes above 4 first, so that no dup2 below overwrites one it still needs
    lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
              for fd in (stdin, out_w, err_w, status_w, request_r)]
    for target, fd in enumerate(lifted):
        os.dup2(fd, target, inheritable=target <= 2)
    os.closerange(5, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # the worker's socket, pidfds
    try:  # the first process an out-of-memory kill takes, in its cgroup and on the host
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # /proc hidden: the kernel picks by size alone
        pass
    os.chdir(folder)
    if cfg["as_nobody"]:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    elif cfg["mode"] == "userns":
        _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if ARCH:
        _seccomp(cfg["block_sockets"])
    limits = [(resource.RLIMIT_AS, cfg["memory_bytes"]), (resource.RLIMIT_FSIZE, FILE_BYTES),
              (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_MSGQUEUE, 0)]  # POSIX message queues would reach the next program
    if cfg["nproc_limit"]:
        limits.append((resource.RLIMIT_NPROC, PROCESSES))
    for kind, limit in limits:
        resource.setrlimit(kind, (limit, limit))
    os.environ.clear()
    os.environ.update(HOME=folder, TMPDIR=folder, PATH=SNIPPET_PATH, LANG="C.UTF-8")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _snippet(cfg, folder, request_r, out_w, err_w, status_w, prefault):
    """The snippet process, forked before its code arrives: lock down, wait for the code, run it as
    __main__, report its exit code on fd 3 and exit."""
    _lock_down(cfg, folder, request_r, out_w, err_w, status_w)
    import random
    import types

    import numpy
    import sympy.core.random
    random.seed()          # forked children would otherwise all draw the worker's random numbers
    numpy.random.seed()
    sympy.core.random.seed()
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    if prefault:
        _prefault(4)
    with os.fdopen(4, "rb") as requests:  # blocks until the worker hands over the code
        request = requests.read()
    if not request:
        os._exit(0)  # the worker is shutting down
    request = json.loads(request)
    cpu = max(1, math.ceil(request["timeout"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    exit_code, last_words, snippet_pid = 0, b"", os.getpid()
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:  # as the interpreter does: None is 0, a number the code, else printed
        exit_code = (e.code or 0) if e.code is None or isinstance(e.code, int) else 1
        if exit_code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        exit_code, last_words = 1, b"m" if isinstance(e, MemoryError) else b""
        try:
            tb = e.__traceback__.tb_next  # drop this function's frame (a SyntaxError has none)
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            pass
    for end in (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush):
        try:  # as the interpreter ends: join its threads, run its atexit functions, flush
            end()
        except BaseException:
            pass
    if os.getpid() != snippet_pid:  # a child it forked, ending as the interpreter would
        os._exit(exit_code & 0xFF)
    try:
        os.write(3, last_words + b"x" + bytes([exit_code & 0xFF]))
    except OSError:
        pass  # it closed the status pipe itself: its wait status tells the worker
    os._exit(exit_code & 0xFF)


# --------------------------------------------------------------------------------------------------
# The worker: builds the isolated view once, then runs snippets one at a time.

def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(paths):
    paths = sorted(set(paths), key=len)
    return [p for i, p in enumerate(paths) if not any(_inside(p, q) for q in paths[:i])]


def _mount_points():
    """(mount point, per-mount flags) of this process's mount namespace, from
    /proc/self/mountinfo."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            # octal escapes, e.g. \040 is a space
            point = re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            flags = sum(MOUNT_OPTION_FLAGS.get(opt, 0) for opt in fields[5].split(","))
            points.append((point, flags))
    return points


def _build_file_system(cfg):
    """Mount namespace of the worker: host read-only, private places hidden, Python mounted back, a
    private tmpfs for snippet folders, and a /proc of the worker's pid namespace. Returns report
    lines."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the host
    hidden = _outermost(os.path.realpath(p) for p in cfg["hide"]
                        if os.path.isdir(p) and os.path.realpath(p) != "/")
    python = _outermost(p for p in cfg["python_paths"] if any(_inside(p, h) for h in hidden))
    python_fds = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in python]
    for folder in hidden:
        _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=64k,nr_inodes=256,mode=755")
    for path, fd in python_fds:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.makedirs(SCRATCH, exist_ok=True)
    _mount_scratch()
    failed = []
    for point, flags in _mount_points():
        if point == SCRATCH or _inside(point, "/proc"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: under a hidden folder, out of reach anyway
                failed.append(point)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        proc = "own /proc of the pid namespace: the caller and its environment are invisible"
    except OSError:
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
        proc = "/proc hidden (the OS refused a new /proc): the caller is invisible"
    files = ("host read-only; " + ", ".join(hidden) + " hidden (Python's prefix mounted back "
             "read-only); fresh folder on a private tmpfs per snippet")
    if failed:
        files += f"; NOT read-only (remount refused): {', '.join(failed)}"
    return {"files": files, "proc": proc}


def _mount_scratch():
    _mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={SCRATCH_BYTES},nr_inodes=4096,mode=755")


def _worker_setup(cfg):
    """Runs once in the worker; returns the protections report."""
    mode = cfg["mode"]
    report = {"isolation": mode}
    if mode == "none":
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        report["files"] = ("NOT protected beyond Unix permissions" +
                           (" (snippet runs as nobody)" if cfg["as_nobody"] else "") +
                           "; fresh folder in /tmp")
        report["proc"] = "NOT protected: host /proc, processes of the snippet's uid are visible"
        report["cleanup"] = ("process group + subreaper: everything the snippet spawned is killed "
                             "and reaped")
    else:
        report.update(_build_file_system(cfg))
        report["cleanup"] = "pid namespace: everything the snippet spawned is killed and reaped"
    report["network"] = ("empty network namespace (no interface up)" if mode != "none" else
                         "sockets other than AF_UNIX blocked (seccomp)" if cfg["block_sockets"] else
                         "NOT blocked (no namespace, no seccomp on this architecture)")
    refused = "refused (seccomp)" if ARCH else "NOT refused (no seccomp on this architecture)"
    report["kernel"] = (f"keyrings, System V memory, new namespaces and mounts, ptrace {refused}, "
                        f"no POSIX message queues")
    report["user"] = ("nobody (65534), no groups, no capabilities" if cfg["as_nobody"] else
                      "caller's uid, no capabilities" if mode == "userns" else "caller's uid")
    report["processes"] = (f"at most {PROCESSES} ({cfg['process_cap']})" if cfg["process_cap"] else
                           "NOT capped (no pids cgroup, RLIMIT_NPROC ineffective); stopped by "
                           "timeout only")
    report["memory"] = (f"at most {(cfg['memory_bytes'] + WORKER_BYTES) >> 20} MiB in all its "
                        f"processes (memory cgroup), {cfg['memory_bytes'] >> 20} MiB of address "
                        "space each" if "oom_fd" in cfg else
                        f"NOT capped across processes (no memory cgroup): "
                        f"{cfg['memory_bytes'] >> 20} MiB of address space each; the first "
                        "processes the kernel's out-of-memory killer takes")
    report["limits"] = (f"wall-clock timeout + CPU time, address space "
                        f"{cfg['memory_bytes'] >> 20} MiB, file size {FILE_BYTES >> 20} MiB, "
                        f"{OPEN_FILES} open files, output {cfg['output_bytes'] >> 10} KiB per "
                        "stream, stdin at EOF, empty environment")
    return report


def _kill_all(pid, in_pid_namespace):
    """SIGKILL the snippet and everything it spawned (orphans, other sessions included)."""
    if in_pid_namespace:  # pid 1 of its namespace: kill(-1) reaches exactly the snippet's processes
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    for target in [pid] + _children():  # subreaper: the snippet's orphans become our children
        for kill in (os.killpg, os.kill):
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass


def _children():
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def _reap_all(pid, in_pid_namespace):
    """Kill and reap until no child is left (a dying fork bomb may still fork)."""
    while True:
        _kill_all(pid, in_pid_namespace)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _others_alive(pid, in_pid_namespace):
    """Is anything but the worker and the (killed, exiting) snippet process left? The main process's
    exit takes milliseconds (unmapping its copy of the worker), so the reply need not wait for it
    alone."""
    if not in_pid_namespace:
        return True  # no cheap census outside a pid namespace: always reap everything first
    return any(name.isdigit() and int(name) not in (1, pid) for name in os.listdir("/proc"))


def _read_some(fd, buf, cap):
    """Append what is readable now (keeping at most `cap` bytes); returns (eof, overflowed)."""
    data = os.read(fd, 65536)
    room = cap - len(buf)
    buf += data[:room]
    return not data, len(data) > room


@dataclasses.dataclass
class _Prepared:
    """A snippet process forked ahead of time, waiting for its code (so a request pays no fork)."""
    pid: int
    pidfd: int
    folder: str
    request_w: int
    out_r: int
    err_r: int
    status_r: int


def _finished(status):
    return status[-2:-1] == b"x"


def _prepare(cfg, prefault):
    folder = (tempfile.mkdtemp(dir=SCRATCH) if cfg["mode"] != "none" else
              tempfile.mkdtemp(prefix="t3rl-sandbox-"))
    if cfg["as_nobody"]:
        os.chown(folder, NOBODY, NOBODY)
    pipes = (os.pipe() for _ in range(4))
    (request_r, request_w), (out_r, out_w), (err_r, err_w), (status_r, status_w) = pipes
    pid = os.fork()
    if pid == 0:
        try:
            _snippet(cfg, folder, request_r, out_w, err_w, status_w, prefault)
        finally:
            os._exit(127)
    for fd in (request_r, out_w, err_w, status_w):
        os.close(fd)
    return _Prepared(pid, os.pidfd_open(pid), folder, request_w, out_r, err_r, status_r)


def _drain(buffers, cap):
    """The snippet flushed before its last words: read what is left in its pipes, still bounded."""
    for fd in buffers:
        os.set_blocking(fd, False)
        try:
            while not _read_some(fd, buffers[fd], cap)[0]:
                pass
        except BlockingIOError:
            pass


def _oom_kills(cfg):
    """How many processes the worker's memory cgroup has lost to its cap (0 without one)."""
    if "oom_fd" not in cfg:
        return 0
    kills = re.search(r"^oom_kill (\d+)$", os.pread(cfg["oom_fd"], 4096, 0).decode(), re.M)
    return int(kills.group(1)) if kills else 0  # v1 before Linux 4.13 does not count them


def _run(snippet, request, cfg):
    """Hand the code to the prepared process, collect output until it is done, times out or
    floods."""
    cap, timeout = cfg["output_bytes"], request["timeout"]
    oom_kills = _oom_kills(cfg)
    buffers = {snippet.out_r: bytearray(), snippet.err_r: bytearray()}
    status = bytearray()
    start = time.monotonic()
    unsent = memoryview(json.dumps(request).encode())
    try:
        while unsent:
            unsent = unsent[os.write(snippet.request_w, unsent):]
    except BrokenPipeError:
        pass  # it died before reading; reported below from its wait status
    os.close(snippet.request_w)
    poller = select.poll()
    for fd in (snippet.out_r, snippet.err_r, snippet.status_r, snippet.pidfd):
        poller.register(fd, select.POLLIN)
    verdict, exited = None, False
    while verdict is None and not exited and not _finished(status):
        left = start + timeout - time.monotonic()
        if left <= 0:
            verdict = "timeout"
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == snippet.pidfd:
                exited = True
                continue
            eof, overflowed = _read_some(fd, buffers.get(fd, status), cap)
            if eof:
                poller.unregister(fd)
            if overflowed:
                verdict = "output_limit"
    duration = time.monotonic() - start
    in_pid_namespace = cfg["mode"] != "none"
    _kill_all(snippet.pid, in_pid_namespace)
    _drain(buffers, cap)
    if verdict is None and _finished(status):
        returncode = status[-1]
        verdict = "ok" if returncode == 0 else "memory" if status.startswith(b"m") else "error"
    else:  # killed: by us (timeout, output), by a signal of its own making, or by the kernel
        _, wait_status, usage = os.wait4(snippet.pid, 0)
        if os.WIFSIGNALED(wait_status):
            returncode = -os.WTERMSIG(wait_status)
            cpu_spent = usage.ru_utime + usage.ru_stime >= max(1, math.ceil(timeout))
            timed_out = returncode == -signal.SIGXCPU or cpu_spent
            out_of_memory = returncode == -signal.SIGKILL and _oom_kills(cfg) > oom_kills
            verdict = verdict or ("timeout" if timed_out else "memory" if out_of_memory
                                  else "killed")
        else:  # it called os._exit itself
            returncode = os.WEXITSTATUS(wait_status)
            verdict = verdict or ("ok" if returncode == 0 else "error")
    if _others_alive(snippet.pid, in_pid_namespace):
        _reap_all(snippet.pid, in_pid_namespace)  # nothing it spawned exists once the reply goes
    out, err = (bytes(buffers[fd]).decode("utf-8", errors="replace")
                for fd in (snippet.out_r, snippet.err_r))
    return {"status": verdict, "stdout": out, "stderr": err, "returncode": returncode,
            "duration": duration}


def _discard_snippet(snippet, cfg):
    """After the reply: reap the snippet process, close the pipes, remove the folder (and all else
    written)."""
    _reap_all(snippet.pid, cfg["mode"] != "none")
    for fd in (snippet.out_r, snippet.err_r, snippet.status_r, snippet.pidfd):
        os.close(fd)
    if cfg["mode"] != "none":
        _remove_ipc()
    try:
        _empty_folder(SCRATCH) if cfg["mode"] != "none" else _remove_tree(snippet.folder)
    except RecursionError:  # folders nested past Python's recursion limit (shutil.rmtree recurses)
        if cfg["mode"] != "none":  # a fresh tmpfs (not every time: an unmount waits milliseconds)
            _umount(SCRATCH)
            _mount_scratch()
        else:
            subprocess.run(["rm", "-rf", "--", snippet.folder], check=False)


def _remove_ipc():
    """The System V shared memory, message queues and semaphores a snippet left in the worker's IPC
    namespace: they outlive their processes (memory no limit counts, a channel to the next one)."""
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                ids = [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]
        except OSError:  # /proc hidden (the OS refused a new one): they go with the worker
            return
        for ident in ids:
            if kind == "sem":
                _libc.semctl(ident, 0, IPC_RMID)
            else:
                getattr(_libc, f"{kind}ctl")(ident, IPC_RMID, None)


def _remove_tree(path):
    def make_writable(func, failed, _):  # a snippet may leave folders without write/search rights
        os.chmod(os.path.dirname(failed), 0o700)
        os.chmod(failed, 0o700)
        func(failed) if func is not os.rmdir else shutil.rmtree(failed, onerror=make_writable)
    shutil.rmtree(path, onerror=make_writable)


def _empty_folder(folder):
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        _remove_tree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


def _worker(cfg, sock):
    try:
        report = _worker_setup(cfg)
    except Exception as e:
        _send(sock, {"error": f"sandbox worker setup failed ({cfg['mode']}): {e!r}"})
        os._exit(1)
    _send(sock, {"ready": report})
    snippet = _prepare(cfg, prefault=True)
    while (request := _recv(sock)) is not None:
        _send(sock, _run(snippet, request, cfg))
        _discard_snippet(snippet, cfg)  # while the caller reads the reply
        # prefault only when idle: with the next request already queued (run_many) it only adds work
        snippet = _prepare(cfg, prefault=not select.select([sock], [], [], 0)[0])
    os.close(snippet.request_w)  # the waiting snippet process reads EOF and exits
    _discard_snippet(snippet, cfg)
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# The helper: a clean interpreter that imports once, then forks a launcher + worker per request.

def _cgroup_bases():
    """{controller: folder under which this process may create cgroups with it}, for pids and
    memory (cgroup v2 or v1); a controller the system does not give us is absent."""
    bases = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                with open(f"/sys/fs/cgroup{path}/cgroup.subtree_control") as g:
                    enabled = g.read().split()
                for controller in CONTROLLERS:
                    if controller in enabled:
                        bases.setdefault(controller, f"/sys/fs/cgroup{path}")
            for controller in set(CONTROLLERS) & set(controllers.split(",")):
                bases.setdefault(controller, f"/sys/fs/cgroup/{controller}{path}")
    return bases


def _limits(controller, folder, memory_cap):
    """(file, value) of a controller's limits in a new cgroup, in v2's names or v1's."""
    if controller == "pids":
        return [("pids.max", PROCESSES + 2)]  # + launcher and worker
    if os.path.exists(f"{folder}/memory.max"):  # v2: no swap, where the system accounts it
        limits = [("memory.max", memory_cap), ("memory.swap.max", 0)]
    else:  # v1: memsw caps memory and swap together
        limits = [("memory.limit_in_bytes", memory_cap),
                  ("memory.memsw.limit_in_bytes", memory_cap)]
    return limits[:1] + [limit for limit in limits[1:] if os.path.exists(f"{folder}/{limit[0]}")]


def _make_cgroups(bases, name, memory_cap):
    """A worker's cgroups, limits written: {controller: folder} (one folder for both on v2); a
    controller whose cgroup the system refuses is left out."""
    made = {}
    for controller, base in bases.items():
        folder = os.path.join(base, name)
        created = folder not in made.values()
        try:
            if created:
                os.mkdir(folder)
            for file, value in _limits(controller, folder, memory_cap):
                with open(os.path.join(folder, file), "w") as f:
                    f.write(str(value))
            made[controller] = folder
        except OSError:
            if created and os.path.isdir(folder):
                os.rmdir(folder)
    return made


def _remove_stale_cgroups(base):
    """Cgroups of helpers that were killed before they could clean up."""
    for name in os.listdir(base):
        helper = name[len(CGROUP_PREFIX):].split('-')[0]
        if name.startswith(CGROUP_PREFIX) and not os.path.exists(f"/proc/{helper}"):
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


def _enter_namespaces(mode):
    """Unshare in the launcher; the next child is pid 1 of a new pid namespace."""
    # IPC: System V objects its snippets make stay off the host (_remove_ipc clears them after each)
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
    if mode == "userns":
        uid, gid = os.geteuid(), os.getegid()
        _unshare(flags | CLONE_NEWUSER)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    elif mode == "root":
        _unshare(flags)


def _probe_isolation(wanted):
    """First isolation mode the OS allows, tried in a throwaway child so the helper stays
    unchanged."""
    auto = ["root", "userns", "none"] if os.geteuid() == 0 else ["userns", "none"]
    candidates = {"auto": auto}.get(wanted, [wanted])
    for mode in candidates:
        pid = os.fork()
        if pid == 0:
            try:
                _enter_namespaces(mode)
                os._exit(0)
            except BaseException:
                os._exit(1)
        if os.waitpid(pid, 0)[1] == 0:
            return mode
    raise RuntimeError(f"isolation {wanted!r} is not allowed here (unshare refused); "
                       "use isolation='auto'")


def _warm_up():
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # no BLAS threads: they would not survive a fork
    os.environ["OMP_NUM_THREADS"] = "1"
    import fractions  # noqa: F401
    import numpy
    import sympy
    x = sympy.symbols("x")
    sympy.solve(x ** 3 - 2 * x + 7, x)  # first use pulls in many sympy submodules; pay it once here
    sympy.solve(x ** 2 + 4 * x - 21, x)  # quadratics (most verifier programs) take another path
    sympy.simplify(sympy.sqrt(8) + sympy.Rational(1, 3))
    numpy.linalg.solve(numpy.eye(2), numpy.ones(2))
    numpy.random.seed()  # the first seeding loads its entropy machinery; snippets reseed
    try:  # the Knights-and-Knaves tool (smt_tool): loading libz3 is slow, a first solve slower
        import z3
    except ImportError:  # a machine without z3-solver runs math programs; knk's then fail to import
        z3 = None
    if z3 is not None:
        puzzle = "(declare-const p Bool)(declare-const q Bool)(assert (= p (not q)))"
        z3.Solver().check(z3.parse_smt2_string(puzzle))
    os.environ.clear()
    import gc
    gc.collect()
    gc.freeze()  # keep the warm objects out of the collector, so forks do not copy their pages


def _serve(cfg):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller; it closes the pool
    _warm_up()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # workers whose launcher died are reaped here
    ctrl = socket.socket(fileno=cfg.pop("ctrl_fd"))
    mode = _probe_isolation(cfg["isolation"])
    try:
        cgroup_bases = _cgroup_bases()
        for base in set(cgroup_bases.values()):
            _remove_stale_cgroups(base)
    except OSError:  # no cgroup file system we may read or write
        cgroup_bases = {}
    cfg.update(mode=mode, as_nobody=os.geteuid() == 0 and mode != "userns",
               block_sockets=mode == "none" and ARCH is not None,
               python_paths=[os.path.realpath(p) for p in
                             {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}
                             if os.path.isdir(p)])
    launchers = {}  # pid -> (worker id, its cgroup folders)
    ctrl.settimeout(1.0)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctrl, 65536, 1)
        except TimeoutError:
            _reap(launchers)
            continue
        if not data:
            break
        request = json.loads(data)
        if request["op"] == "spawn":
            name = f"{CGROUP_PREFIX}{os.getpid()}-{request['id']}"
            cgroups = _make_cgroups(cgroup_bases, name, cfg["memory_bytes"] + WORKER_BYTES)
            process_cap = ("pids cgroup" if "pids" in cgroups else
                           "RLIMIT_NPROC in the user namespace" if mode == "userns" else
                           "RLIMIT_NPROC as nobody" if cfg["as_nobody"] else None)
            worker_cfg = dict(cfg, process_cap=process_cap,
                              nproc_limit="pids" not in cgroups and process_cap is not None)
            launcher = _launch(worker_cfg, fds[0], cgroups, ctrl)
            launchers[launcher] = (request["id"], set(cgroups.values()))
            os.close(fds[0])
        elif request["op"] == "kill":
            for pid, (worker_id, _) in launchers.items():
                if worker_id == request["id"]:
                    os.kill(pid, signal.SIGKILL)
        _reap(launchers)
    _shutdown_launchers(launchers)


def _launch(cfg, worker_fd, cgroups, ctrl):
    pid = os.fork()
    if pid:
        return pid
    try:
        ctrl.close()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for folder in set(cgroups.values()):
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        if "memory" in cgroups:  # the worker reads its OOM kills here, past the mount namespace
            folder = cgroups["memory"]
            events = ("memory.events" if os.path.exists(f"{folder}/memory.events") else
                      "memory.oom_control")
            cfg["oom_fd"] = os.open(os.path.join(folder, events), os.O_RDONLY)
        _enter_namespaces(cfg["mode"])
        sock = socket.socket(fileno=worker_fd)
        worker = os.fork()
        if worker == 0:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _worker(cfg, sock)
        sock.close()
        os.waitpid(worker, 0)
    finally:
        os._exit(0)


def _reap(launchers):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for folder in launchers.pop(pid, (None, ()))[1]:
            _remove_cgroup(folder)


def _remove_cgroup(path, patience=2.0):
    deadline = time.monotonic() + patience
    while True:
        try:
            os.rmdir(path)
            return
        except OSError:  # EBUSY while killed processes are still being torn down
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _shutdown_launchers(launchers):
    """Workers exit when the caller closes their sockets; launchers follow. Stragglers get
    SIGKILL."""
    deadline = time.monotonic() + 3.0
    while launchers and time.monotonic() < deadline:
        _reap(launchers)
        time.sleep(0.01)
    for pid in list(launchers):
        os.kill(pid, signal.SIGKILL)  # its worker follows through PR_SET_PDEATHSIG
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        for folder in launchers.pop(pid, (None, ()))[1]:
            _remove_cgroup(folder)
    for _, folders in launchers.values():
        for folder in folders:
            _remove_cgroup(folder)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:  # the helper process a pool starts
    _serve(json.loads(sys.argv[2]))
