"""Run the verifier's untrusted Python programs fast, each in a fork of a warm, locked-down process.

A pool of workers forks each program from an interpreter that already imported math, fractions,
numpy, sympy and z3. Linux only. This is the caller's end; the fork server is a program of its own,
machinery/sandbox_server.py, never imported here (design and speed: docs/sandbox.md).

What is covered (isolation "root" or "userns"; `pool.report` says what is active on this machine):
- the caller: a program never runs in the caller's process, which survives anything it does; a
  worker that dies anyway is replaced and its program reported as "killed"
- hangs and resources: wall-clock timeout, CPU time, address space (2 GiB) and all its processes'
  memory (cgroup), file size, open files, processes, output (64 KiB per stream); stdin at EOF
- files: the host is read-only; /tmp, /var/tmp, /dev/shm, /run, /home, /root, this project and the
  caller's HOME, working and temp folders are hidden; each program gets a fresh private folder
- secrets, network, leftovers: an empty environment, its own /proc, no network; what it spawned is
  killed, its folder and IPC emptied; no keyring, SysV memory, POSIX queue, namespace, mount, ptrace
What is not covered (docs/sandbox.md):
- kernel exploits and hardware side channels (the program shares the kernel)
- denial of service through CPU, memory bandwidth or page cache within the limits; without a
  memory cgroup (pool.report says), memory in 64 processes
- world-readable host files outside the hidden places (/etc, /usr, /work/shared)
- mode "userns": files the caller may read stay readable (not writable); mode "none": the file
  system beyond Unix permissions, /proc of processes of the same uid, and signals to them

    with SandboxPool(timeout=5.0) as pool:     # results = pool.run_many(codes), in their order
        r = pool.run("print(1)")               # r.status, .stdout, .stderr, .returncode, .duration
"""
import atexit
import dataclasses
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
ISOLATIONS = ("auto", "root", "userns", "none")
PROJECT = Path(__file__).resolve().parent  # hidden too, wherever the caller runs from
HELPER = PROJECT / "machinery" / "sandbox_server.py"
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/home", "/root")  # and HOME, cwd, the temp dir
WORKER_GRACE = 30.0  # a worker silent this long past the program's timeout is dead


@dataclasses.dataclass
class Result:
    status: str              # one of STATUSES
    stdout: str              # decoded as UTF-8 (invalid bytes replaced), at most the output cap
    stderr: str
    returncode: int | None   # exit code, or -signal; None when the worker died
    duration: float          # seconds of wall-clock time the snippet ran

    @property
    def ok(self):
        return self.status == "ok"


def default_workers() -> int:
    """This process's share of the cores it may run on: the processes of one node (LOCAL_WORLD_SIZE,
    set by torchrun and accelerate launch) verify at the same time, and a pool each of every core
    would run that many times more programs than cores, slowing right ones into their timeout."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(os.sched_getaffinity(0)) // processes)


class SandboxPool:
    """Warm sandbox workers; `run(code)` and `run_many(codes)` return `Result`s. Thread-safe; one
    pool per process (several processes on a machine may each have one). Close it or use `with`.
    Each worker is a socket to the helper's worker process: a request and its reply are one
    length-prefixed JSON message each."""

    def __init__(self, workers=None, *, timeout=5.0, memory_bytes=2 << 30, output_bytes=64 << 10,
                 isolation="auto"):
        if sys.platform != "linux":
            raise RuntimeError(f"sandbox.py needs Linux (namespaces, pidfd); this is "
                               f"{sys.platform}")
        self.workers = default_workers() if workers is None else workers
        self.timeout = check_settings(self.workers, timeout, memory_bytes, output_bytes,
                                      isolation)
        self.closed, self.protections, self._pid = False, None, os.getpid()
        self._lock, self._idle, self._all = threading.Lock(), queue.Queue(), []
        self._ctrl, helper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        settings = {"ctrl_fd": helper_end.fileno(), "isolation": isolation,
                    "memory_bytes": memory_bytes, "output_bytes": output_bytes,
                    "hide": [os.path.expanduser("~"), os.getcwd(), tempfile.gettempdir(),
                             str(PROJECT), *HIDDEN]}
        # a fresh interpreter, not a fork of the caller, which may hold threads (torch) and secrets
        self.helper = subprocess.Popen(
            [sys.executable, "-I", "-X", "utf8", str(HELPER), "--serve", json.dumps(settings)],
            env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            pass_fds=[helper_end.fileno()], start_new_session=True)
        helper_end.close()
        self._finalizer = weakref.finalize(self, _shutdown, self.helper, self._ctrl, self._all)
        try:
            for _ in range(self.workers):
                self._idle.put(self._spawn())
        except BaseException:
            self.close()
            raise
        if "NOT " in self.report:
            warnings.warn(f"sandbox protections are incomplete on this machine:\n{self.report}",
                          stacklevel=2)

    @property
    def report(self):
        """The protections active for this pool's snippets (as the first worker reported them), one
        per line."""
        return "\n".join(f"{key:>10}: {value}" for key, value in self.protections.items())

    def run(self, code, timeout=None):
        """Run one snippet in its own sandboxed process; a Result, never the snippet's error. A
        worker that died is replaced and its snippet reported as "killed"."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        if self.closed or os.getpid() != self._pid:
            raise RuntimeError("SandboxPool is closed (or was created in another process): "
                               "create a new one")
        worker, start = self._idle.get(), time.monotonic()
        try:
            worker.settimeout(timeout + WORKER_GRACE)
            send_message(worker, {"code": code, "timeout": timeout})
            reply = receive_message(worker)
        except OSError:
            reply = None
        if reply is not None:
            self._idle.put(worker)
            return Result(**reply)
        self._retire(worker)
        if not self.closed:
            self._idle.put(self._spawn())
        return Result("killed", "", "sandbox worker died; it was replaced", None,
                      time.monotonic() - start)

    def run_many(self, codes, timeout=None):
        """Run snippets concurrently on all workers; results in the order of `codes`."""
        codes = list(codes)
        with ThreadPoolExecutor(max_workers=self.workers) as executor:
            return list(executor.map(lambda code: self.run(code, timeout), codes))

    def close(self):
        """Stop all workers and the helper; no process, mount, cgroup or folder is left behind."""
        with self._lock:
            self.closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _spawn(self) -> socket.socket:
        """Ask the helper for one more worker and wait until it is ready."""
        mine, theirs = socket.socketpair()
        with self._lock:
            if self.closed:
                raise RuntimeError("SandboxPool is closed")
            self._all.append(mine)
            try:
                self._order("spawn", mine, [theirs.fileno()])
            except OSError as e:
                raise RuntimeError(f"sandbox helper is gone (exit code "
                                   f"{self.helper.poll()})") from e
            finally:
                theirs.close()
        mine.settimeout(120.0)  # the first worker waits for the helper's imports
        try:
            ready = receive_message(mine)
        except OSError:
            ready = None
        if ready is None:
            raise RuntimeError(f"sandbox worker did not start (helper exit code "
                               f"{self.helper.poll()}); see the error printed above")
        if "error" in ready:
            raise RuntimeError(ready["error"])
        self.protections = self.protections or ready["ready"]
        return mine

    def _retire(self, worker: socket.socket):
        with self._lock:
            worker.close()
            if not self.closed:
                try:
                    self._order("kill", worker, [])
                except OSError:
                    pass

    def _order(self, op: str, worker: socket.socket, fds: list):
        """One order to the helper: spawn the worker at the end of `fds`, or kill one; a worker is
        named by its position in the pool's list."""
        order = json.dumps({"op": op, "id": self._all.index(worker)}).encode()
        socket.send_fds(self._ctrl, [order], fds)


def check_settings(workers, timeout, memory_bytes, output_bytes, isolation) -> float:
    """SandboxPool's arguments, checked before anything starts; returns the timeout."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: give a positive number of worker processes "
                         "(or None)")
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}: choose one of {', '.join(ISOLATIONS)}")
    for name, value, least in (("memory_bytes", memory_bytes, 64 << 20),
                               ("output_bytes", output_bytes, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r}: give a whole number of bytes, at least {least}")
    return check_timeout(timeout)


def check_timeout(timeout) -> float:
    if not isinstance(timeout, (int, float)) or not 0 < timeout < 3600:
        raise ValueError(f"timeout={timeout!r}: give seconds, more than 0 and less than 3600")
    return float(timeout)


# The messages' format, written twice on purpose: the helper's _send and _recv
# (machinery/sandbox_server.py) are the other end, in a program that imports nothing of the project.

def send_message(sock, obj):
    """obj as JSON behind its length (4 bytes, network order)."""
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def receive_message(sock):
    """The next message on sock, or None when the other end closed it."""
    header = receive_bytes(sock, 4)
    data = header and receive_bytes(sock, struct.unpack("!I", header)[0])
    return None if data is None else json.loads(data)


def receive_bytes(sock, n: int) -> bytes | None:
    """Exactly n bytes from sock, or None when the other end closed it first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _shutdown(helper, ctrl, workers):
    for worker in workers:
        worker.close()
    ctrl.close()
    try:
        helper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(helper.pid, signal.SIGKILL)
        helper.wait()


_default_pool = None
_default_pool_lock = threading.Lock()


def default_pool():
    """A module-wide SandboxPool, created on first use and closed at exit."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None or _default_pool._pid != os.getpid():
            _default_pool = SandboxPool()
            atexit.register(_default_pool.close)
        return _default_pool


def run_snippet(code, timeout=5.0):
    """Run one untrusted Python program in the module-wide pool; returns a Result."""
    return default_pool().run(code, timeout)
