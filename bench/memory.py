"""Where a run's memory goes, per process: the run under a probe that reads this process's resident
memory (VmRSS) every 0.1 s and notes the phase it is in (load, evaluation, sample, verify, update,
and "other": checkpoints, the summary), beside what its tensors take by count (parameters x bytes).

    python -m bench.memory                         # the default job (python t3rl.py)
    python -m bench.memory --max-steps 1 --limit 3 # any t3rl.py options

Prints the peak per phase, the run's peak (VmHWM), the bytes it wrote to disk and its run folder's
size, then the tensors' sizes. docs/results.md#memory holds the measured table.
"""
import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import t3rl
from config import parse_config
from machinery import metrics
from machinery.model import load_model

PHASES = ("load", "evaluation", "sample", "verify", "update")


def status_bytes(field: str) -> int:
    """A VmRSS-like field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def written_bytes() -> int:
    """Bytes this process has caused to be written to storage (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


class Probe:
    """Samples VmRSS in a thread; `phase` names what the run is doing (set through the run's own
    Stopwatch, which times the same phases)."""

    def __init__(self, every: float = 0.1):
        self.every, self.phase, self.peaks, self.done = every, "other", {}, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self):
        while not self.done.wait(self.every):
            rss = status_bytes("VmRSS")
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    @contextlib.contextmanager
    def watching(self):
        real = metrics.Stopwatch.__call__

        @contextlib.contextmanager
        def timed(clock, phase):
            outer, self.phase = self.phase, phase if phase in PHASES else self.phase
            try:
                with real(clock, phase):
                    yield
            finally:
                self.phase = outer
        metrics.Stopwatch.__call__ = timed
        self.thread.start()
        try:
            yield self
        finally:
            self.done.set()
            self.thread.join()
            metrics.Stopwatch.__call__ = real


def tensor_sizes(cfg) -> list[tuple[str, float]]:
    """What the run's tensors take by count, in GB: the policy's float32 weights, gradients and AdamW
    moments, its sampling copy, the verifier's weights and their sampling copy (the linear layers,
    packed for the kv sampler)."""
    policy = load_model(cfg.model, dtype="float32")[0]
    n = sum(p.numel() for p in policy.parameters())
    sampling = torch.empty((), dtype=getattr(torch, cfg.sample_dtype)).element_size()
    rows = [(f"policy weights, float32 ({n / 1e9:.2f}B)", 4 * n), ("policy gradients", 4 * n),
            ("AdamW moments (2 x float32)", 8 * n),
            (f"policy sampling copy ({cfg.sample_dtype}, while sampling)", sampling * n)]
    del policy
    if cfg.verifier_model != "none":
        spec = cfg.model if cfg.verifier_model == "self" else cfg.verifier_model
        verifier = load_model(spec, dtype=cfg.sample_dtype)[0]
        v = sum(p.numel() for p in verifier.parameters())
        linear = sum(m.weight.numel() for m in verifier.modules() if isinstance(m, torch.nn.Linear))
        rows += [(f"verifier weights, {cfg.sample_dtype} ({v / 1e9:.2f}B)", sampling * v),
                 ("verifier sampling copy (its linear layers)", sampling * linear)]
    return [(name, size / 1e9) for name, size in rows]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(tempfile.mkdtemp(prefix="t3rl-memory-"))
    gpu = torch.cuda.is_available()
    cfg = parse_config(argv + ["--out-dir", str(out), "--run-name", "probe"], gpu)
    started, wrote = time.time(), written_bytes()
    with Probe().watching() as probe:
        run_dir = t3rl.train(cfg, gpu)
    wrote, wall = written_bytes() - wrote, time.time() - started
    folder = int(subprocess.run(["du", "-sb", str(run_dir)], capture_output=True, text=True)
                 .stdout.split()[0])
    print(f"\nmemory of `python t3rl.py {' '.join(argv)}` (this process; {wall / 60:.1f} min)")
    print(f"{'phase':<12}{'peak RSS GB':>12}")
    for phase in (*PHASES, "other"):
        if phase in probe.peaks:
            print(f"{phase:<12}{probe.peaks[phase] / 1e9:>12.2f}")
    print(f"{'run peak':<12}{status_bytes('VmHWM') / 1e9:>12.2f}  (VmHWM)")
    print(f"written to disk {wrote / 1e9:.1f} GB; run folder {folder / 1e9:.2f} GB")
    print("tensors by count:")
    for name, size in tensor_sizes(cfg):
        print(f"  {name:<44}{size:>6.2f} GB")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
