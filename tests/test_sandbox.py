"""sandbox.py: the pool that runs untrusted programs, and what it protects."""
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from sandbox import SandboxPool, run_snippet

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def _processes():
    """{pid: (ppid, cmdline)} of every process on the host."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                    table[int(name)] = (ppid, cmdline)
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return table


def _descendants(pid, depth=1, exact=False):
    """Processes at least (exact: exactly) `depth` generations below `pid`, from one look at the
    process table."""
    table = _processes()
    found, frontier, generation = set(), {pid}, 0
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier}
        generation += 1
        found |= frontier if generation == depth or (generation > depth and not exact) else set()
    return found


def _spawned_by_snippets(pool):
    """Below the helper: launcher, worker, snippet process, then whatever a snippet spawned."""
    return _descendants(pool.helper.pid, depth=4)


def _eventually(condition, patience=10.0):
    """Killed processes are reaped right after the reply; wait for that (not a speed test)."""
    deadline = time.monotonic() + patience
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _with_marker(marker):
    return [pid for pid, (_, cmdline) in _processes().items() if marker in cmdline]


def _mounts():
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


def _cgroups(helper):
    found = []
    for _, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [d for d in dirs if d.startswith(f"t3rl-sandbox-{helper}-")]
    return found


@pytest.mark.parametrize("code, expected", [
    ("from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))",
     "[2, 3]\n"),
    ("import numpy as np\nprint(int(np.linalg.det(np.array([[2, 1], [1, 3]])).round()))", "5\n"),
    ("from fractions import Fraction\nprint(sum(Fraction(1, n * (n + 1)) for n in range(1, 10)))",
     "9/10\n"),
])
def test_math_programs_print_the_right_value(pool, code, expected):
    result = pool.run(code)
    assert (result.status, result.stdout, result.returncode) == ("ok", expected, 0)


def test_syntax_error_is_an_error_with_traceback(pool):
    result = pool.run("print(1 +")
    assert result.status == "error" and "SyntaxError" in result.stderr and result.returncode == 1


def test_exception_is_an_error_with_traceback(pool):
    result = pool.run("def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    assert result.stderr.startswith("Traceback") and "in f" in result.stderr
    assert "ZeroDivisionError" in result.stderr


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_endless_programs_time_out_within_the_limit(pool, code):
    result = pool.run(code, timeout=1.0)
    assert result.status == "timeout" and result.duration < 1.0 + 0.5


def test_memory_bomb_is_stopped_and_reported(pool):
    result = pool.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", timeout=30)
    assert result.status == "memory" and "MemoryError" in result.stderr


def _may_make_memory_cgroups():
    """Whether this process may make a memory cgroup below its own (v1 or v2), as the helper."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            control = f"/sys/fs/cgroup{path}/cgroup.subtree_control"
            if "memory" in controllers.split(","):  # v1
                base = f"/sys/fs/cgroup/memory{path}"
            elif controllers == "" and os.path.exists(control) and "memory" in open(control).read():
                base = f"/sys/fs/cgroup{path}"  # v2, the controller enabled below this cgroup
            else:
                continue
            try:
                os.mkdir(f"{base}/t3rl-probe-{os.getpid()}")
            except OSError:
                return False
            os.rmdir(f"{base}/t3rl-probe-{os.getpid()}")
            return True
    return False


@pytest.fixture(scope="module")
def gib_pool():
    """A pool whose programs have 1 GiB, in a memory cgroup wherever this process could make one."""
    if not _may_make_memory_cgroups():
        pytest.skip("this process may make no memory cgroup, so the pool has none")
    with SandboxPool(workers=1, memory_bytes=1 << 30, timeout=20.0) as pool:
        assert "memory cgroup" in pool.protections["memory"], pool.report
        yield pool


def test_a_programs_processes_together_stay_within_its_memory(gib_pool):
    """Four children of 400 MiB each: the address-space limit allows each, the cgroup (1 GiB + the
    worker's share) at most two at once; the others are killed, the program goes on."""
    code = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n"
            "    if pid == 0:\n        x = b'x' * (400 << 20)\n        time.sleep(1)\n"
            "        os._exit(0)\n    kids.append(pid)\n"
            "print(*[os.waitpid(kid, 0)[1] for kid in kids])")
    result = gib_pool.run(code)
    statuses = [int(s) for s in result.stdout.split()]
    assert result.status == "ok" and len(statuses) == 4
    assert statuses.count(0) <= 2 and set(statuses) == {0, signal.SIGKILL}


def test_a_program_its_cgroup_kills_for_memory_is_reported_as_memory(gib_pool):
    """700 MiB in the program, then 600 MiB in its child: the cgroup kills the larger one."""
    code = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.read(r, 1)\n"
            "    x = b'x' * (600 << 20)\n    time.sleep(5)\n    os._exit(0)\n"
            "y = b'y' * (700 << 20)\nos.write(w, b'1')\ntime.sleep(5)\nprint('survived')")
    result = gib_pool.run(code)
    assert (result.status, result.returncode, result.stdout) == ("memory", -signal.SIGKILL, "")
    assert gib_pool.run("print(2)").stdout == "2\n"


def test_programs_are_the_first_an_out_of_memory_kill_takes(pool):
    """On the host too, without a memory cgroup: the caller (a trainer, say) outlives them."""
    assert pool.run("print(open('/proc/self/oom_score_adj').read())").stdout == "1000\n\n"


def test_fork_bomb_fails_and_leaves_nothing(pool):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = pool.run(bomb, timeout=1.0)
    assert result.status == "timeout"
    assert pool.run("print(2)").stdout == "2\n"
    assert _eventually(lambda: _spawned_by_snippets(pool) == set())


def test_os_system_and_subprocess_leave_no_process(pool):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = (f"import os, subprocess\nos.system('sleep {marker} &')\n"
            f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nprint('spawned')")
    result = pool.run(code)
    assert result.stdout == "spawned\n"
    assert _with_marker(f"sleep {marker}") == []


def test_background_child_is_gone_afterwards(pool):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
            "print('left running')")
    assert pool.run(code).stdout == "left running\n"
    assert _with_marker(f"sleep {marker}") == []
    assert _eventually(lambda: _spawned_by_snippets(pool) == set())


def test_files_written_outside_its_folder_do_not_appear(pool, tmp_path):
    name = f"t3rl-escape-{uuid.uuid4().hex}"
    targets = [os.path.join(d, name)
               for d in ("/tmp", os.path.expanduser("~"), os.getcwd(), str(tmp_path), "/")]
    code = (f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
            "    except OSError as e:\n        print(type(e).__name__)")
    pool.run(code)
    assert [t for t in targets if os.path.exists(t)] == []


def test_callers_files_survive_a_snippet_deleting_them(pool, tmp_path):
    kept = tmp_path / "results.jsonl"
    kept.write_text("precious")
    code = (f"import os, shutil\nfor path in [{str(kept)!r}, {__file__!r}]:\n    try:\n"
            "        os.remove(path)\n    except OSError:\n        pass\n"
            f"shutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
            f"shutil.rmtree({HERE!r}, ignore_errors=True)")
    pool.run(code)
    assert kept.read_text() == "precious" and os.path.exists(__file__)


def test_secret_file_in_callers_working_folder_is_unreadable(pool):
    secret = uuid.uuid4().hex
    path = os.path.join(os.getcwd(), f".t3rl-secret-{secret[:8]}")
    with open(path, "w") as f:
        f.write(secret)
    try:
        code = (f"import glob\nfor p in [{path!r}] + "
                f"glob.glob('/proc/*/cwd/{os.path.basename(path)}') + "
                f"glob.glob('/proc/*/root{path}'):\n    try:\n        print(open(p).read())\n"
                "    except OSError as e:\n        print(type(e).__name__)")
        result = pool.run(code)
    finally:
        os.remove(path)
    assert result.status == "ok" and secret not in result.stdout


def test_secret_in_parents_environment_is_unreadable(tmp_path):
    secret = uuid.uuid4().hex
    probe = ("import glob, os\nprint(dict(os.environ))\n"
             "for p in ['/proc/%d/environ' % PARENT] + glob.glob('/proc/*/environ'):\n    try:\n"
             "        print(p, open(p, 'rb').read())\n    except OSError as e:\n"
             "        print(p, type(e).__name__)")
    parent = ("import os, sys\nsys.path.insert(0, sys.argv[1])\nfrom sandbox import SandboxPool\n"
              "with SandboxPool(workers=1) as pool:\n"
              "    result = pool.run(sys.argv[2].replace('PARENT', str(os.getpid())))\n"
              "print(result.status)\nprint(result.stdout)")
    out = subprocess.run([sys.executable, "-c", parent, HERE, probe], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "T3RL_PLANTED_SECRET": secret}, cwd=tmp_path)
    assert out.stdout.startswith("ok\n") and "environ" in out.stdout and secret not in out.stdout


def test_output_flood_is_truncated_and_memory_stays_bounded(pool):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = pool.run("import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 100_000)",
                      timeout=30)
    assert result.status == "output_limit" and len(result.stdout) == 64 << 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 20 << 10  # KiB


def test_200_snippets_at_once_all_finish_correctly(pool):
    results = pool.run_many([f"print({i} * {i})" for i in range(200)])
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]


def test_code_arriving_at_any_moment_of_the_idle_prefault_runs_correctly(pool):
    # one at a time, so each request lands somewhere in the waiting process's prefault solve
    results = [pool.run(f"import signal, time\ntime.sleep({i % 7} / 1e4)\n"
                        f"print({i}, signal.getsignal(signal.SIGALRM) == signal.SIG_DFL)")
               for i in range(150)]
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i} True\n") for i in range(150)]


@pytest.mark.parametrize("code, statuses", [
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)",
     {"ok", "error"}),
    ("import os\nos.close(1)\nos.close(2)\nprint('gone')", {"ok", "error"}),
    ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
     {"timeout"}),
    ("import ctypes\nctypes.string_at(0)", {"killed"}),
    ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\xfd')", {"ok"}),
    ("def f(n):\n    return f(n + 1)\nf(0)", {"error"}),
    ("import sys\nsys.setrecursionlimit(10**9)\ndef f(n):\n    return f(n + 1)\nf(0)",
     {"timeout", "memory", "killed"}),
])
def test_the_pool_survives_anything_a_snippet_does(pool, code, statuses):
    assert pool.run(code, timeout=1.0).status in statuses
    assert [r.stdout for r in pool.run_many(["print(2)"] * 4)] == ["2\n"] * 4


def test_a_dead_worker_is_reported_and_replaced(pool):
    for worker in _descendants(pool.helper.pid, depth=2, exact=True):
        os.kill(worker, signal.SIGKILL)
    first = pool.run_many(["print(3)"] * 4)
    assert {r.status for r in first} <= {"ok", "killed"} and "killed" in {r.status for r in first}
    assert [r.stdout for r in pool.run_many(["print(3)"] * 4)] == ["3\n"] * 4


def test_invalid_utf8_output_is_replaced(pool):
    assert pool.run("import sys\nsys.stdout.buffer.write(b'\\xff ok')").stdout == "\ufffd ok"


def test_stdin_reads_eof_at_once(pool):
    assert pool.run("import sys\nprint(repr(sys.stdin.read()))", timeout=2).stdout == "''\n"


def test_environment_is_empty_and_home_is_its_own_folder(pool):
    result = pool.run("import os\nprint(sorted(os.environ))\n"
                      "print(os.environ['HOME'] == os.getcwd())")
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\nTrue\n"


def test_its_folder_is_writable_and_fresh_each_time(pool):
    code = "import os\nprint(os.listdir('.'))\nopen('scratch.txt', 'w').write('x')"
    assert [r.stdout for r in pool.run_many([code] * 4)] == ["[]\n"] * 4


def test_folders_nested_past_the_recursion_limit_leave_the_next_program_unharmed():
    """A program that nests 3,000 folders ran, and so does the next one in the same worker: removing its
    folder must not recurse past Python's limit (that killed the worker: the next program was "killed")."""
    deep = "import os\nfor _ in range(3000):\n    os.mkdir('a')\n    os.chdir('a')\nprint('deep')"
    with SandboxPool(workers=1) as one:
        assert [(r.status, r.stdout) for r in (one.run(deep), one.run("print(1)"))] == [("ok", "deep\n"), ("ok", "1\n")]


SHARED_MEMORY = ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
                 "segment = libc.shmget(4242, 16 << 20, 0o1666)\nprint(segment, flush=True)\naddress = libc.shmat(segment, None, 0)\n"
                 "ctypes.memset(address, 7, 16 << 20)\nlibc.shmdt(ctypes.c_void_p(address))")


def test_shared_memory_is_refused_so_none_outlives_a_program():
    """System V shared memory outlives its process: made by one program, it would be memory no limit
    counts, kept for the whole run, and a channel to the next program. Refused outright, none is made."""
    with SandboxPool(workers=1) as one:
        assert one.run(SHARED_MEMORY).stdout == "-1\n"
        assert one.run("import ctypes\nprint(ctypes.CDLL(None).shmget(4242, 0, 0))").stdout == "-1\n"
        with open("/proc/sysvipc/shm") as f:
            assert not [line for line in f.read().splitlines()[1:] if line.split()[0] == "4242"]


def test_network_is_unreachable_even_on_loopback(pool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = pool.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                          "timeout=2)\nprint('in')")
    assert result.status == "error" and "in" not in result.stdout


def test_report_names_every_protection(pool):
    assert set(pool.protections) == {"isolation", "files", "proc", "cleanup", "network", "kernel", "user",
                                     "processes", "memory", "limits"}
    assert pool.report.count("\n") == len(pool.protections) - 1


def test_user_namespace_isolation_runs_programs_and_protects_tmp():
    with SandboxPool(workers=1, isolation="userns") as pool:
        name = f"/tmp/t3rl-escape-{uuid.uuid4().hex}"
        results = pool.run_many(["import sympy\nprint(sympy.factorial(5))", f"open({name!r}, 'w')"])
        assert pool.protections["isolation"] == "userns"
    assert [r.status for r in results] == ["ok", "error"] and results[0].stdout == "120\n"
    assert not os.path.exists(name)


def test_without_namespaces_sockets_are_blocked_and_the_report_says_so():
    with pytest.warns(UserWarning, match="incomplete"):
        pool = SandboxPool(workers=1, isolation="none")
    with pool:
        result = pool.run("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)")
    assert result.status == "error" and "PermissionError" in result.stderr
    assert "NOT protected" in pool.report and "seccomp" in pool.report


def test_a_pool_starts_from_a_process_running_torch_threads():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # the intra-op thread pool is running now
    with SandboxPool(workers=1) as pool:
        assert pool.run("import numpy\nprint(numpy.ones(3).sum())").stdout == "3.0\n"


def test_two_pools_side_by_side_each_work():
    with SandboxPool(workers=1) as first, SandboxPool(workers=1) as second:
        assert (first.run("print(1)").stdout, second.run("print(2)").stdout) == ("1\n", "2\n")


def test_closing_leaves_no_process_mount_cgroup_or_folder():
    mounts, temp_before = _mounts(), set(os.listdir(tempfile.gettempdir()))
    pool = SandboxPool(workers=2, timeout=1.0)
    helper = pool.helper.pid
    pool.run_many(["import os\nos.system('sleep 100 &')\nwhile True:\n    pass",
                   "import os\nwhile True:\n    try:\n        os.fork()\n"
                   "    except OSError:\n        pass"])
    pool.close()
    assert _descendants(helper) == set() and helper not in _processes()
    assert _cgroups(helper) == [] and _mounts() == mounts
    assert [n for n in set(os.listdir(tempfile.gettempdir())) - temp_before if "sandbox" in n] == []


def test_closed_pool_refuses_work():
    pool = SandboxPool(workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run("print(1)")


@pytest.mark.parametrize("make", [
    lambda: SandboxPool(workers=0), lambda: SandboxPool(timeout=0),
    lambda: SandboxPool(isolation="docker"), lambda: SandboxPool(memory_bytes=1024),
])
def test_bad_settings_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_code_must_be_text(pool):
    with pytest.raises(TypeError, match="str"):
        pool.run(b"print(1)")


def test_the_caller_runs_the_server_and_never_imports_it():
    """The fork server is a program the pool starts: the training process keeps none of its
    namespace and seccomp code in memory."""
    script = ("import sys; from sandbox import SandboxPool\n"
              "with SandboxPool(1) as pool:\n"
              "    print(pool.run('print(5)').stdout.strip(), pool.helper.args[4].endswith("
              "'sandbox_server.py'), 'machinery.sandbox_server' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.split() == ["5", "True", "False"], out.stderr


def test_run_snippet_uses_a_shared_pool():
    assert run_snippet("print(6 * 7)").stdout == "42\n"


def test_each_process_of_a_node_takes_its_share_of_the_cores(monkeypatch):
    """The processes of one node (LOCAL_WORLD_SIZE) verify at once: a pool each of every core
    would run that many programs per core and slow right ones into their timeout."""
    from sandbox import default_workers
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_workers() == 32
    for processes, workers in (("8", 4), ("3", 10), ("64", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
        assert default_workers() == workers
    monkeypatch.undo()
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # one process per core: one worker each
    with SandboxPool() as pool:
        assert pool.workers == 1 and pool.run("print(6 * 7)").stdout == "42\n"


def test_a_forked_child_that_ends_normally_does_not_end_the_program(pool):
    """A child that falls off the end of the program ends as the interpreter would; only the program's own
    process reports its end (the child reporting it cut the parent short)."""
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    print('child', flush=True)\nelse:\n"
            "    os.waitpid(pid, 0)\n    time.sleep(0.2)\n    print('parent done')")
    result = pool.run(code)
    assert (result.status, result.stdout) == ("ok", "child\nparent done\n")


def test_threads_and_atexit_functions_run_as_the_program_ends(pool):
    code = ("import atexit, threading, time\natexit.register(lambda: print('bye'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print(42))).start()\nprint('hi')")
    assert pool.run(code).stdout == "hi\n42\nbye\n"


KERNEL_STATE = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
                "key = libc.syscall({add_key}, b'user', b't3rl-test-key', b'secret', 6, -4)\n"
                "shm = libc.shmget(4243, 1 << 20, 0o1666)\nmsg = libc.msgget(4244, 0o1666)\n"
                "queue = rt.mq_open(b'/t3rl-test-queue', os.O_CREAT | os.O_RDWR, 0o666, None)\n"
                "print(key, shm, msg, queue)")


def test_keyrings_system_v_memory_and_message_queues_are_refused(pool):
    """A uid's keyring outlives the program (on the host, as nobody), System V memory escapes the address-space
    limit, a POSIX message queue would reach the next program: each call fails."""
    add_key = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
    assert pool.run(KERNEL_STATE.format(add_key=add_key)).stdout == "-1 -1 -1 -1\n"


def test_no_program_may_trace_or_read_another_process():
    """ptrace and process_vm_readv would reach the memory of processes of the same uid: without
    namespaces, the caller's. Both fail, and so does PTRACE_TRACEME, which needs no other process."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"  # PTRACE_TRACEME
            "print(libc.process_vm_readv(os.getppid(), 0, 0, 0, 0, 0), ctypes.get_errno())")
    with pytest.warns(UserWarning, match="incomplete"):
        unprotected = SandboxPool(workers=1, isolation="none")
    with SandboxPool(workers=1) as pool, unprotected:
        for one in (pool, unprotected):
            assert one.run(code).stdout == "-1 13\n-1 13\n"  # EACCES, from the seccomp filter


NAMESPACES = ("import ctypes, subprocess, sys, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "print(libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"  # CLONE_NEWUSER | CLONE_NEWNS
              "print(libc.mount(b'none', b'.', b'tmpfs', 0, None), ctypes.get_errno())\n"
              "print(libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"  # | SIGCHLD
              "t = threading.Thread(target=lambda: print('thread'))\nt.start()\nt.join()\n"
              "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True).stdout)")


def test_a_program_may_make_no_namespace_or_mount_but_threads_and_processes(pool):
    """In a user namespace of its own a program could mount a tmpfs and fill it, memory the address-space limit
    does not count: unshare, mount and clone with CLONE_NEWUSER fail (EACCES), while threads and child
    processes (glibc tries clone3, refused with ENOSYS, then clone) still start."""
    clone = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    result = pool.run(NAMESPACES.format(clone=clone))
    assert result.stdout == "-1 13\n-1 13\n-1 13\nthread\n7\n\n", result


def test_sympys_random_numbers_differ_between_programs(pool):
    code = "import sympy\nprint(sympy.core.random.randint(0, 10 ** 12))"
    assert len({pool.run(code).stdout for _ in range(3)}) == 3


def test_the_project_folder_is_hidden_from_a_caller_elsewhere(tmp_path, monkeypatch):
    """The caller's working folder is hidden; so is the project's, wherever the caller runs from."""
    monkeypatch.chdir(tmp_path)
    with SandboxPool(workers=1) as pool:
        result = pool.run(f"import os\nprint(sorted(os.listdir({HERE!r})))")
    assert (result.status, result.stdout) == ("ok", "[]\n")
