"""answers.is_equiv's symbolic step: math-verify (sympy) in a helper process, one per Python
process, started on first use and killed when a comparison overruns its hard limit (sympy can hang;
a process can be killed, a thread cannot). A comparison that runs out of time counts as not equal
(docs/answers.md)."""
import json
import os
import select
import subprocess
import sys
import threading


def _symbolic_equal(pred_key, gold_key):
    from math_verify import parse, verify
    gold = parse(f"${gold_key}$", parsing_timeout=None)
    pred = parse(f"${pred_key}$", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def serve():
    """Body of the helper process: answer each '[pred_key, gold_key, seconds]' line with
    true/false."""
    import logging
    import signal
    # import before 'ready' so that the first comparison is not slow
    import math_verify  # noqa: F401
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print from a library must not corrupt the replies

    class Overrun(BaseException):
        """Not an Exception, so that math-verify's own `except Exception` cannot swallow it."""

    def interrupt(signum, frame):
        raise Overrun

    signal.signal(signal.SIGALRM, interrupt)
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        pred_key, gold_key, seconds = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                equal = _symbolic_equal(pred_key, gold_key)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        # out of time, or sympy choked on strange input: not shown equal
        except (Overrun, Exception):
            equal = False
        replies.write(json.dumps(equal) + "\n")
        replies.flush()


class _SymbolicWorker:
    """One helper process per Python process, started on first use, killed when it overruns."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process = None

    def _start(self):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (f"import sys; sys.path.insert(0, {repo!r}); import machinery.symbolic; "
                f"machinery.symbolic.serve()")
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0)
        if self._reply(timeout=120) != b"ready":
            self._stop()
            raise RuntimeError("the sympy helper process of answers.py did not start; "
                               "check that math-verify is installed (pip install math-verify)")

    def _stop(self):
        self.process.kill()
        self.process.wait()
        self.process = None

    def _reply(self, timeout):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        return self.process.stdout.readline().strip() if ready else None

    def equal(self, pred_key, gold_key, limit):
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            request = json.dumps([pred_key, gold_key, 0.75 * limit]) + "\n"
            try:
                self.process.stdin.write(request.encode())
            except BrokenPipeError:  # it died since the check above: once more with a fresh one
                self._stop()
                self._start()
                self.process.stdin.write(request.encode())
            reply = self._reply(limit)
            if reply is None or not reply:  # overran its limit (stuck in C code) or died
                self._stop()
                return False
            return reply == b"true"

    def forget_after_fork(self):
        """In a forked child the parent's helper is not ours: start a fresh one when needed."""
        self.lock = threading.Lock()
        self.process = None


worker = _SymbolicWorker()
os.register_at_fork(after_in_child=worker.forget_after_fork)
