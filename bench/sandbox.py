"""Benchmark of sandbox.py: the warm pool against a fresh `python -c` per snippet (p50/p95 latency one at a
time, throughput of a batch); --selftest checks each protection on the machine it runs on.

    python -m bench.sandbox
    python -m bench.sandbox --selftest
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

import sandbox
from sandbox import SandboxPool

SYMPY_SOLVE = "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))"

SELFTEST = [  # (name, code, timeout, check on Result)
    ("sympy", SYMPY_SOLVE, 5, lambda r: r.ok and r.stdout == "[2, 3]\n"),
    ("numpy", "import numpy as np\nprint(int(np.arange(10).sum()))", 5, lambda r: r.ok and r.stdout == "45\n"),
    ("z3", "import z3\nx = z3.Bool('x')\ns = z3.Solver()\ns.add(x)\nprint(s.check())", 5, lambda r: r.ok and r.stdout == "sat\n"),
    ("fractions", "from fractions import Fraction\nprint(Fraction(1, 3) + Fraction(1, 6))", 5,
     lambda r: r.stdout == "1/2\n"),
    ("syntax error", "print(", 5, lambda r: r.status == "error" and "SyntaxError" in r.stderr),
    ("exception", "1/0", 5, lambda r: r.status == "error" and "ZeroDivisionError" in r.stderr),
    ("infinite loop", "while True: pass", 1, lambda r: r.status == "timeout" and r.duration < 2),
    ("sleep", "import time\ntime.sleep(60)", 1, lambda r: r.status == "timeout" and r.duration < 2),
    ("memory bomb", "b = []\nwhile True: b.append(bytearray(1 << 24))", 10, lambda r: r.status == "memory"),
    ("fork bomb", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", 1,
     lambda r: r.status == "timeout"),
    ("3-process memory", "import os, time\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n"
     "    if pid == 0:\n        x = b'x' * (1200 << 20)\n        time.sleep(1)\n        os._exit(0)\n"
     "    kids.append(pid)\nprint(sum(os.waitpid(kid, 0)[1] == 0 for kid in kids))", 20,
     lambda r: r.ok and r.stdout == "1\n"),  # the memory cgroup holds them to 2 GiB together
    ("stdin at EOF", "import sys\nprint(repr(sys.stdin.read()))", 5, lambda r: r.stdout == "''\n"),
    ("empty environment", "import os\nprint(sorted(os.environ))", 5,
     lambda r: r.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"),
    ("write /tmp", "open('/tmp/t3rl-sandbox-selftest', 'w')", 5,
     lambda r: r.status == "error" and not os.path.exists("/tmp/t3rl-sandbox-selftest")),
    ("network", "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", 5,
     lambda r: r.status == "error" and ("Error" in r.stderr)),
    ("100 MB output", "print('x' * 100_000_000)", 10, lambda r: r.status == "output_limit"),
    ("segfault", "import ctypes\nctypes.string_at(0)", 5, lambda r: r.status == "killed"),
    ("kill parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')", 5,
     lambda r: r.status in ("ok", "error")),
    ("own namespace", "import ctypes\nprint(ctypes.CDLL(None).unshare(0x10000000))", 5,  # CLONE_NEWUSER
     lambda r: r.stdout == "-1\n"),
    ("ptrace", "import ctypes\nprint(ctypes.CDLL(None).ptrace(0, 0, 0, 0))", 5,  # PTRACE_TRACEME
     lambda r: r.stdout == "-1\n"),
    ("invalid UTF-8", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok')", 5,
     lambda r: r.stdout == "\ufffd\ufffd ok"),
]


def selftest():
    with SandboxPool() as pool:
        print(pool.report, "\n")
        failures = 0
        for name, code, timeout, check in SELFTEST:
            result = pool.run(code, timeout=timeout)
            passed = bool(check(result))
            failures += not passed
            print(f"{'PASS' if passed else 'FAIL'}  {name:<18} {result.status:<12} {result.duration * 1000:8.1f} ms")
        print(f"\n{len(SELFTEST) - failures}/{len(SELFTEST)} checks passed")
    return 1 if failures else 0


def _naive_run(code):
    """The baseline: a fresh interpreter per snippet. Returns the wall time."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, env={}, cwd=tempfile.gettempdir(),
                   check=True)
    return time.monotonic() - start


def _pool_run(pool, code):
    start = time.monotonic()
    result = pool.run(code)
    if not result.ok:
        raise RuntimeError(f"benchmark snippet failed in the pool: {result}")
    return time.monotonic() - start


def _measure(run_one, run_batch, runs, batch, label):
    """p50 and p95 of one-at-a-time latency in ms, and snippets per second for a batch run at once."""
    latencies = sorted(run_one() for _ in tqdm(range(runs), desc=label, leave=False))
    start = time.monotonic()
    run_batch(batch)
    percentile = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
    return percentile(0.5), percentile(0.95), batch / (time.monotonic() - start)


def bench(naive_runs=10, pool_runs=100, pool_batch=200):
    cases = [("print(1)", "print(1)"), ("sympy solve", SYMPY_SOLVE)]
    rows = []
    with SandboxPool() as pool:
        print(pool.report, "\n")
        cpus = pool.workers
        for name, code in cases:
            def naive_batch(n):
                with ThreadPoolExecutor(cpus) as executor:
                    list(executor.map(_naive_run, [code] * n))
            naive = _measure(lambda: _naive_run(code), naive_batch, naive_runs, 4 * cpus, f"naive {name}")
            fast = _measure(lambda: _pool_run(pool, code), lambda n: pool.run_many([code] * n), pool_runs, pool_batch,
                            f"pool {name}")
            rows.append((name, naive, fast))
    print(f"{cpus} workers. Latency: caller's wall time per snippet, one at a time ({naive_runs} naive, "
          f"{pool_runs} pool runs). Throughput: a batch at once ({4 * cpus} naive over {cpus} threads, "
          f"{pool_batch} through run_many).\n")
    print(f"{'snippet':<12} {'method':<6} {'p50 ms':>9} {'p95 ms':>9} {'snippets/s':>11}")
    for name, naive, fast in rows:
        for method, (p50, p95, rate) in (("naive", naive), ("pool", fast)):
            print(f"{name:<12} {method:<6} {p50:9.1f} {p95:9.1f} {rate:11.1f}")
        ratios = naive[0] / fast[0], naive[1] / fast[1], fast[2] / naive[2]
        print(f"{name:<12} {'ratio':<6} {ratios[0]:8.1f}x {ratios[1]:8.1f}x {ratios[2]:10.1f}x")


def main():
    parser = argparse.ArgumentParser(description=sandbox.__doc__.split("\n")[0])
    parser.add_argument("--selftest", action="store_true", help="check the protections on this machine "
                        "(default: naive `python -c` vs pool latency and throughput)")
    args = parser.parse_args()
    if args.selftest:
        sys.exit(selftest())
    else:
        bench()


if __name__ == "__main__":
    main()
