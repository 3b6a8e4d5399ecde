"""Run the verifier's untrusted Python programs fast, each in a fork of a warm, locked-down process.

Tens of thousands of programs a run: a pool of workers (machinery/sandbox_server.py; design and
speed: docs/sandbox.md) forks each from a fresh interpreter that already imported math, fractions,
numpy, sympy and z3, so a program pays neither interpreter start-up nor imports. Linux only.

What is covered (isolation "root" or "userns"; `pool.report` says what is active on this machine):
- the caller: a program never runs in the caller's process, which survives anything it does; a
  worker that dies anyway is replaced and its program reported as "killed"
- hangs and resources: wall-clock timeout, CPU time, address space (2 GiB), file size, open files,
  processes (pids cgroup or RLIMIT_NPROC), output capped (64 KiB per stream), stdin at EOF
- files: the host is read-only; /tmp, /var/tmp, /dev/shm, /run, /home, /root and the caller's
  HOME, working and temp folders are hidden; each program gets a fresh folder on a private tmpfs
- secrets and network: an empty environment, its own /proc, an empty network namespace
- leftovers: whatever the program spawned is killed and reaped before its result is returned

What is not covered:
- kernel exploits and hardware side channels (the program shares the kernel)
- denial of service through CPU, memory bandwidth or page cache within the limits
- world-readable host files outside the hidden places (/etc, /usr, /work/shared)
- mode "userns": files the caller may read stay readable (not writable); mode "none": the file
  system beyond Unix permissions, /proc of processes of the same uid, and signals to them

    with SandboxPool(timeout=5.0) as pool:     # results = pool.run_many(codes), in their order
        r = pool.run("print(1)")               # r.status, .stdout, .stderr, .returncode, .duration
"""
import atexit
import dataclasses
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")


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
    pool per process (several processes on a machine may each have one). Close it or use `with`."""

    def __init__(self, workers=None, *, timeout=5.0, memory_bytes=2 << 30, output_bytes=64 << 10,
                 isolation="auto"):
        if sys.platform != "linux":
            raise RuntimeError(f"sandbox.py needs Linux (namespaces, pidfd); this is "
                               f"{sys.platform}")
        from machinery.sandbox_server import Server  # the fork server: namespaces, seccomp, limits
        self.workers = default_workers() if workers is None else workers
        self.timeout = Server.check_settings(self.workers, timeout, memory_bytes, output_bytes,
                                             isolation)
        self._pid = os.getpid()
        self._server = Server(self.workers, isolation=isolation, memory_bytes=memory_bytes,
                              output_bytes=output_bytes)
        if "NOT " in self.report:
            warnings.warn(f"sandbox protections are incomplete on this machine:\n{self.report}",
                          stacklevel=2)

    @property
    def protections(self):  # {protection: what is active}, as the first worker reported it
        return self._server.protections

    @property
    def report(self):
        """The protections active for this pool's snippets, one per line."""
        return "\n".join(f"{key:>10}: {value}" for key, value in self.protections.items())

    def run(self, code, timeout=None):
        """Run one snippet in its own sandboxed process; a Result, never the snippet's error."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        timeout = self.timeout if timeout is None else self._server.check_timeout(timeout)
        if self._server.closed or os.getpid() != self._pid:
            raise RuntimeError("SandboxPool is closed (or was created in another process): "
                               "create a new one")
        return Result(**self._server.run(code, timeout))

    def run_many(self, codes, timeout=None):
        """Run snippets concurrently on all workers; results in the order of `codes`."""
        codes = list(codes)
        with ThreadPoolExecutor(max_workers=self.workers) as executor:
            return list(executor.map(lambda code: self.run(code, timeout), codes))

    def close(self):
        """Stop all workers and the helper; no process, mount, cgroup or folder is left behind."""
        self._server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
