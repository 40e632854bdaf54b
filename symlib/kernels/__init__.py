r"""Compiled CPU kernels (book: chapters "Checkpoint zoos" and "Functional collapse").

Two C++ kernels, compiled together into one library:

* ``optunet_step.cpp``, the stacked trainer's CPU step (:func:`symlib.training.stacked.loss_and_grads`,
  ``impl="native"``). It processes every model on its own with its batch laid out image-innermost, so
  that the SIMD lanes are the batch's images and one model's working set stays in the core's cache, and
  computes exactly the function of :func:`symlib.training.optunet.optunet_loss_grads` (tested equal to
  autograd in float64).
* ``pairwise_xlogx.cpp``, the pairwise term of :func:`symlib.stats.pairwise_mi.pairwise_mi`,
  :math:`\sum_f q_f \log q_f` with :math:`q = h_i + h_j` for every pair of models: one pass per pair
  with the addition, a vectorised logarithm (Cephes' ``logf``) and the product-sum in registers.

The sources are compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``, else ``c++``)
for the machine it runs on (``-O3 -march=native``) into the kernel cache, ``$SYMLIB_KERNEL_CACHE`` or
``~/.cache/symlib/kernels``, keyed by a hash of the source, the flags, the compiler and the CPU, written
atomically; later calls and processes load the cached library. ``$SYMLIB_KERNEL_MARCH`` replaces
``native`` with another ``-march`` target (``x86-64-v3``: AVX2 and FMA without AVX-512, the code an AVX2
machine builds; useful for a library shared by the nodes of a mixed cluster). Where no compiler works,
:func:`available` is ``False`` (with the reason in :func:`unavailable_reason`) and the callers fall back
to their PyTorch (trainer) or numpy (pairwise MI) paths. ``SYMLIB_NATIVE=0`` disables the kernels.

The library is called through :mod:`ctypes`, which releases the GIL during the call, so the trainer's
worker threads (one group of models each) run side by side.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = (Path(__file__).with_name("optunet_step.cpp"), Path(__file__).with_name("pairwise_xlogx.cpp"))
HEADERS = (Path(__file__).with_name("vector_width.h"),)  # included by the sources: part of the cache key
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC"]
MARCH_ENV = "SYMLIB_KERNEL_MARCH"
KERNEL_VERSION = 2


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SYMLIB_KERNEL_CACHE``, else ``~/.cache/symlib/kernels``."""
    env = os.environ.get("SYMLIB_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "symlib" / "kernels"


def flags() -> list[str]:
    """The compiler flags: :data:`FLAGS`, with ``-march=$SYMLIB_KERNEL_MARCH`` where that is set."""
    march = os.environ.get(MARCH_ENV, "").strip()
    if not march:
        return list(FLAGS)
    if not all(c.isalnum() or c in "-_." for c in march):
        raise RuntimeError(f"{MARCH_ENV}={march!r} is not a -march target (e.g. x86-64-v3 or native)")
    return [f"-march={march}" if f == "-march=native" else f for f in FLAGS]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(cxx: str) -> Path:
    """Compile :data:`SOURCES` into one library (or find it compiled) and return its path."""
    src = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    opts = flags()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(opts).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    out = cache_dir() / f"symlib-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *opts, *map(str, SOURCES), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {[p.name for p in SOURCES]}:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("SYMLIB_NATIVE", "1") == "0":
        return None, "disabled by SYMLIB_NATIVE=0"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, g++ or c++); install g++ to enable the fused CPU step"
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if os.environ.get(MARCH_ENV, "").strip():  # asked for by name: a refusal, not a silent fallback
            raise RuntimeError(f"the kernels could not be built with {MARCH_ENV}="
                               f"{os.environ[MARCH_ENV]!r}: {e}; unset it to build for this machine") from e
        return None, f"could not build or load the kernel: {e}"
    if lib.symlib_kernel_version() != KERNEL_VERSION:
        return None, f"kernel version {lib.symlib_kernel_version()} != {KERNEL_VERSION}"
    for name in ("symlib_optunet_step_f32", "symlib_optunet_step_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [_I, _I, _P, _P, _I] + [_P] * 11
        fn.restype = None
    lib.symlib_pairwise_xlogx_f32.argtypes = [_I, _I, _P, _I, _I, _P]
    lib.symlib_pairwise_xlogx_f32.restype = None
    lib.symlib_vlog_f32.argtypes = [_I, _P, _P]
    lib.symlib_vlog_f32.restype = None
    return lib, ""


def available() -> bool:
    """Whether the compiled kernels can be used here (builds them on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is ``False`` (empty when it is ``True``)."""
    return _load()[1]


def optunet_loss_grads(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, feat_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`symlib.training.optunet.optunet_loss_grads` computed by the fused kernel (same arguments and
    results).

    CPU tensors of one floating dtype (float32 or float64); ``x`` is ``(M, B, 1, 28, 28)``, ``y`` ``(M, B)``.
    """
    m, b = x.shape[0], x.shape[1]
    if x.ndim != 5 or x.shape[2:] != (1, 28, 28):
        raise ValueError(f"expected images (M, B, 1, 28, 28), got {tuple(x.shape)}")
    start = torch.arange(m * b, dtype=torch.int64).mul_(784).view(m, b)
    return _call(params, x.contiguous(), start, 28, y, feat_mask)


def optunet_loss_grads_crop(
    params: dict[str, torch.Tensor],
    xpad: torch.Tensor,
    idx: torch.Tensor,
    aug: torch.Tensor,
    y: torch.Tensor,
    feat_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same, with the random crop fused into the kernel's copy of the images: model ``m``'s image ``b`` is
    the 28 x 28 window of the padded image ``xpad[idx[m, b], 0]`` at offset ``(aug[m, b, 0], aug[m, b, 1])``
    (:func:`symlib.training.plans.crop` without flips), and ``y`` its ``(M, B)`` labels.
    """
    if xpad.ndim != 4 or xpad.shape[1] != 1 or min(xpad.shape[2:]) < 28:
        raise ValueError(
            f"expected padded one-channel images (N, 1, H, W), H, W >= 28; got {tuple(xpad.shape)}"
        )
    if aug.shape[:2] != idx.shape or aug.shape[-1] < 2:
        raise ValueError(f"aug must be (M, B, 2 or 3) for idx {tuple(idx.shape)}, got {tuple(aug.shape)}")
    if aug.shape[-1] > 2 and bool(aug[..., 2].any()):
        raise ValueError("the fused crop does not flip images; use symlib.training.plans.crop for flips")
    hp, wp = xpad.shape[2], xpad.shape[3]
    if bool((aug[..., 0] > hp - 28).any() | (aug[..., 1] > wp - 28).any() | (aug[..., :2] < 0).any()):
        raise ValueError(f"crop offsets must lie in [0, {hp - 28}] x [0, {wp - 28}]")
    if bool((idx < 0).any() | (idx >= xpad.shape[0]).any()):
        raise ValueError(f"image indices must lie in [0, {xpad.shape[0]}), got {idx.min()}..{idx.max()}")
    start = idx.to(torch.int64) * (hp * wp) + aug[..., 0].to(torch.int64) * wp + aug[..., 1].to(torch.int64)
    return _call(params, xpad.contiguous(), start.contiguous(), wp, y, feat_mask)


def _call(params, x, start, row, y, feat_mask):
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the native OptuNet kernel is unavailable: {why}")
    w1, w2, fw, fb = (params[k] for k in ("conv1.weight", "conv2.weight", "fc.weight", "fc.bias"))
    m, b = start.shape
    dt = w1.dtype
    if dt not in (torch.float32, torch.float64):
        raise ValueError(f"the native kernel takes float32 or float64 parameters, got {dt}")
    tensors = [x, w1, w2, fw, fb] + ([feat_mask] if feat_mask is not None else [])
    if any(t.device.type != "cpu" for t in tensors + [y]):
        raise ValueError("the native kernel runs on CPU tensors; use impl='conv' or 'matmul' on CUDA")
    if any(t.dtype != dt for t in tensors):
        raise ValueError(
            f"parameters, images and mask must share one dtype, got {[t.dtype for t in tensors]}"
        )
    bad_mask = feat_mask is not None and feat_mask.shape != (m, 10, b)
    if tuple(y.shape) != (m, b) or w1.shape[0] != m or bad_mask:
        raise ValueError(f"expected y (M, B), M models and a mask (M, 10, B) for M, B = {m}, {b}; got y "
                         f"{tuple(y.shape)}, {w1.shape[0]} models, mask "
                         f"{None if feat_mask is None else tuple(feat_mask.shape)}")
    if bool((y < 0).any() | (y >= 10).any()):
        raise ValueError("labels must lie in 0..9")
    y = y.to(torch.int64).contiguous()
    w1, w2, fw, fb = (t.contiguous() for t in (w1, w2, fw, fb))
    mask = None if feat_mask is None else feat_mask.contiguous()
    loss = torch.empty(m, dtype=dt)
    g1, g2, gfw, gfb = (torch.empty_like(t) for t in (w1, w2, fw, fb))
    fn = lib.symlib_optunet_step_f32 if dt == torch.float32 else lib.symlib_optunet_step_f64
    ptrs = [t.data_ptr() for t in (w1, w2, fw, fb)] + [None if mask is None else mask.data_ptr()]
    ptrs += [t.data_ptr() for t in (loss, g1, g2, gfw, gfb)]
    fn(m, b, x.data_ptr(), start.data_ptr(), row, y.data_ptr(), *ptrs)
    grads = {"conv1.weight": g1, "conv2.weight": g2, "fc.weight": gfw, "fc.bias": gfb}
    return loss, grads


def pairwise_xlogx_rows(half: torch.Tensor, i0: int, i1: int, out: torch.Tensor) -> None:
    r"""Write :math:`S_{ij} = \sum_f q_f \log q_f`, :math:`q = h_i + h_j`, for the rows ``i0 <= i < i1`` and
    every ``j > i`` into ``out`` (float64, the condensed ``N (N - 1) / 2`` vector of
    :func:`scipy.spatial.distance.squareform`).

    ``half``: ``(N, F)`` contiguous float32 CPU tensor of halved probabilities, floored at the smallest
    normal float, ``F`` a multiple of 16 (pad with 1/2, where :math:`q \log q = 0`).
    """
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the native pairwise kernel is unavailable: {why}")
    n, f = half.shape
    if half.dtype != torch.float32 or half.device.type != "cpu" or not half.is_contiguous() or f % 16:
        raise ValueError(f"half must be a contiguous float32 CPU tensor with F % 16 == 0, got "
                         f"{half.dtype} on {half.device}, shape {tuple(half.shape)}")
    if out.dtype != torch.float64 or out.numel() != n * (n - 1) // 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float64 vector of {n * (n - 1) // 2} pairs")
    if not 0 <= i0 <= i1 <= n:
        raise ValueError(f"rows {i0}..{i1} outside 0..{n}")
    lib.symlib_pairwise_xlogx_f32(n, f, half.data_ptr(), i0, i1, out.data_ptr())


def vlog(x: torch.Tensor) -> torch.Tensor:
    """The kernels' float32 natural logarithm (Cephes' ``logf``) of a CPU tensor (for tests)."""
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"the native kernels are unavailable: {why}")
    flat = x.detach().to(torch.float32).reshape(-1)
    n = flat.numel()
    pad = torch.ones((-n) % 16, dtype=torch.float32)
    src = torch.cat([flat, pad]).contiguous()
    out = torch.empty_like(src)
    lib.symlib_vlog_f32(src.numel(), src.data_ptr(), out.data_ptr())
    return out[:n].view(x.shape)
