"""The kv sampler's fast path on a CPU: weights packed once for oneDNN, kept between calls of a
frozen model.

sampler.py's plain decode loop multiplies by each weight with F.linear. On a CPU in bfloat16,
F.linear reorders the weight into oneDNN's blocked layout on every call; decode calls it for every
layer at every token, with few rows, so the reorder costs more than the product. PackedLinear
reorders once per generate call and keeps only the packed copy: the same numbers, decode's products
1.4-3x faster (docs/sampler.md). kv_fast.model_weights builds them.

A model that never trains (the verifier) need not be cast, stacked and packed on every call either:
a packed 1.5B model takes 2-3 s to pack. kept_weights makes its sampling weights once and reuses
them until a parameter changes.

The packing ops are PyTorch internals (inductor's CPU linears use them) and their bfloat16 path runs
only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, hence packing_available's guard: elsewhere
(an AVX2 CPU) sampling takes F.linear.
"""
import ctypes
import ctypes.util
import functools
import weakref
from dataclasses import dataclass

import torch

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_LIBC = _LIBC if hasattr(_LIBC, "malloc_trim") else None  # glibc's; musl has none


def packing_available(dtype, device) -> bool:
    """Whether this PyTorch can pack weights of `dtype` on `device` for oneDNN (bfloat16, a CPU)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _packing_runs()


@functools.cache
def _packing_runs() -> bool:
    """Whether this PyTorch has the packing ops and this CPU runs them: tried once on a small weight
    (torch has no public query for the CPU features they need, and raises on a CPU without them)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    weight = torch.ones(16, 16, dtype=torch.bfloat16)
    try:
        out = PackedLinear.of(weight, None)(torch.ones(2, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return torch.equal(out, torch.full((2, 16), 16.0, dtype=torch.bfloat16))


@dataclass
class PackedLinear:
    """x W^T + b with W held only in oneDNN's blocked layout (out_features rows)."""
    out_features: int
    packed: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight, bias):
        """Pack `weight` (out_features, in_features); the caller drops its own copy, only this one
        is read."""
        return cls(len(weight), torch.ops.mkldnn._reorder_linear_weight(weight), bias)

    def __call__(self, x):
        # 2-D in: oneDNN runs a (rows, 1, hidden) decode input several times slower than its (rows,
        # hidden) view
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias,
                                                 "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


_KEPT = weakref.WeakKeyDictionary()  # model -> (key, its parameters' storage and versions, weights)


def parameter_versions(model) -> tuple | None:
    """The storage and version counter of every parameter: an in-place write (load_state_dict, an
    unfused optimizer step) bumps a version and a move (.to()) gives new storage, so a change of
    either shows here. None when a parameter is an inference tensor, which keeps no version
    counter."""
    parameters = list(model.parameters())
    if any(p.is_inference() for p in parameters):
        return None
    return tuple((p.data_ptr(), p._version) for p in parameters)


def forget_kept(model):
    """Drop the model's kept weights (made again on its next call)."""
    _KEPT.pop(model, None)


def release_freed_memory():
    """Hand what this process freed back to the system (glibc's malloc_trim): glibc keeps freed
    blocks below its mmap threshold for reuse, and they would count in the next phase's resident
    memory (1.4 GB after sampling the 0.5B policy, 2.2 GB after its update: bench.memory)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def kept_weights(model, key, make):
    """make(), made once per (model, key) and reused while parameter_versions(model) stays the same
    (always made anew when it is None)."""
    versions = parameter_versions(model)
    if versions is None:
        return make()
    kept = _KEPT.get(model)
    if kept is None or kept[:2] != (key, versions):
        _KEPT.pop(model, None)  # free the old copy before making the new one
        kept = _KEPT[model] = (key, versions, make())
    return kept[2]
