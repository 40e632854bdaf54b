r"""The mutual information of every pair of checkpoints, for the functional-collapse study (book: chapter
"Functional collapse"; paper §5.1, App. D.2).

For ``N`` models with predicted probabilities ``P (N, n_inputs, C)``, :func:`pairwise_mi` gives, for each
of the ``N (N - 1) / 2`` pairs, the mutual information of the two-member ensemble averaged over the
inputs, :math:`I_{ij} = \frac1n \sum_x H(\tfrac12 (p_i + p_j)) - \tfrac12 (H(p_i) + H(p_j))`, with no
Python loop over pairs: the pairwise term :math:`\sum q \log q` of :math:`q = \tfrac12 (p_i + p_j)` is
computed by blocks of pairs (numpy and BLAS, or the compiled kernel of :mod:`symlib.kernels`), on worker
threads. ``benchmarks/pairwise_mi.py`` times it against a per-pair loop.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import torch

from symlib import progress as _progress
from symlib.stats.metrics import SUM_ATOL, check_probs

__all__ = ["CPU_MAX_WIDTH", "pairwise_mi"]

CPU_MAX_WIDTH = 2_500
"""Most features per chunk on the CPU: bounds the length of one float32 dot product, whose rounding
is about one ulp of its result (against float64 blocks, on randomly initialised OptuNets: 3.7e-7 nats of
MI with 10,000 features in one chunk, 1.8e-7 in chunks of 2,500, at the same speed), and stays below
OpenBLAS's threading threshold."""


def _write_rows(out, acc, r0: int, n: int) -> None:
    """Rows ``i = r0, r0 + 1, ...`` of ``acc`` (columns ``j = r0 + 1, ..., n - 1``) into ``out``, the
    condensed vector in ``scipy.spatial.distance.squareform`` order: pairs ``(i, j > i)`` start at
    ``n i - i (i + 1) / 2``."""
    for k in range(acc.shape[0]):
        i = r0 + k
        s = n * i - i * (i + 1) // 2
        out[s : s + n - i - 1] = acc[k, k:]


def _layout(feats: int, block: int, max_width: int) -> tuple[int, int, int, int]:
    """``(chunks, width, rows, cols)``: the features in ``chunks`` chunks of equal ``width`` (at most
    ``max_width`` and ``block``; the last one padded), and square blocks of ``rows`` x ``cols`` pairs of
    at most ``block`` elements (each column block read from memory once for ``rows`` rows)."""
    chunks = -(-feats // min(feats, max_width, block))
    width = -(-feats // chunks)
    side = max(1, math.isqrt(block // width))
    return chunks, width, side, side


def _chunked_halves(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int) -> torch.Tensor:
    r"""``(chunks, N, width)`` contiguous: the halved probabilities of each model, feature chunk first.

    Zeros are floored at the smallest normal number so that :math:`\log q` is finite: a zero probability
    contributes :math:`\mathrm{tiny} \log \mathrm{tiny} \approx 10^{-36}` (float32) instead of
    :math:`0 \log 0 = 0`, far below rounding. The last chunk is padded with halves 1/2: there
    :math:`q = 1` and :math:`q \log q = 0` exactly.
    """
    n = p.shape[0]
    half = torch.full((n, chunks * width), 0.5, dtype=dtype, device=p.device)
    half[:, : p[0].numel()] = (p.reshape(n, -1).to(dtype) * 0.5).clamp_min_(torch.finfo(dtype).tiny)
    return half.view(n, chunks, width).transpose(0, 1).contiguous()


def _row_block_np(hc: np.ndarray, r0: int, r1: int, bufs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
    r"""Write :math:`\sum_{x, c} q \log q` of the pairs ``(i, j)``, ``r0 <= i < r1``, ``j > i``, into their
    condensed positions of ``out`` (numpy: the CPU path).

    ``hc`` is the ``(chunks, N, width)`` array of halves (:func:`_chunked_halves`); ``bufs`` are a thread's
    buffers ``q`` and ``log_q`` of shape ``(rows, cols, width)`` and ``dots`` ``(rows, cols, 1, 1)``. The
    columns ``j > r0`` are taken ``cols`` at a time; each block and chunk is one broadcast addition into
    ``q``, one base-2 logarithm into ``log_q`` (numpy's float32 ``log2`` is 1.5x the speed of ``log``) and
    one BLAS dot product :math:`(1, w) \times (w, 1)` per pair (matmul: no product pass), accumulated in
    float64; the sums are multiplied by :math:`\ln 2` at the end.
    """
    chunks, n, _ = hc.shape
    rows, c_first = r1 - r0, r0 + 1
    q, log_q, dots = (b[:rows] for b in bufs)
    cols = q.shape[1]
    full = q, log_q, dots, q[:, :, None, :], log_q[:, :, :, None]
    acc = np.zeros((rows, n - c_first))
    for c0 in range(c_first, n, cols):
        m = min(cols, n - c0)
        if m == cols:
            qq, ll, dd, q4, l4 = full
        else:
            qq, ll, dd = q[:, :m], log_q[:, :m], dots[:, :m]
            q4, l4 = qq[:, :, None, :], ll[:, :, :, None]
        dst = acc[:, c0 - c_first : c0 - c_first + m]
        for k in range(chunks):
            hk = hc[k]
            np.add(hk[r0:r1, None], hk[None, c0 : c0 + m], out=qq)
            np.log2(qq, out=ll)
            np.matmul(q4, l4, out=dd)
            dst += dd[:, :, 0, 0]
    acc *= math.log(2)
    _write_rows(out, acc, r0, n)


def _row_block_torch(hc: torch.Tensor, r0: int, r1: int, cols: int, q: torch.Tensor, log_q: torch.Tensor,
                     out: torch.Tensor) -> None:
    """:func:`_row_block_np` in torch (the CUDA path): natural logarithm, product and float32 sum (pairwise
    summation) per chunk, accumulated in float64; ``q`` and ``log_q`` are flat buffers."""
    chunks, n, width = hc.shape
    c_first = r0 + 1
    acc = hc.new_zeros((r1 - r0, n - c_first), dtype=torch.float64)
    for c0 in range(c_first, n, cols):
        c1 = min(c0 + cols, n)
        shape = (r1 - r0, c1 - c0, width)
        size = math.prod(shape)
        qq, ll = q[:size].view(shape), log_q[:size].view(shape)
        for k in range(chunks):
            hk = hc[k]
            torch.add(hk[r0:r1, None], hk[None, c0:c1], out=qq)
            torch.log(qq, out=ll)
            acc[:, c0 - c_first : c1 - c_first] += torch.mul(qq, ll, out=ll).sum(-1).double()
    _write_rows(out, acc, r0, n)


@torch.no_grad()
def pairwise_mi(
    p: torch.Tensor,
    square: bool = False,
    block: int | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    workers: int | None = None,
    native: bool = True,
) -> torch.Tensor:
    r"""Mutual information of every two-member ensemble, averaged over the inputs (§5.1, App. D.2).

    For models :math:`i < j` with probabilities :math:`p_i, p_j` on inputs :math:`x_1..x_n`,

    .. math:: \mathrm{MI}_{ij} = \frac1n \sum_x \Big[ H\Big(\frac{p_i(x) + p_j(x)}{2}\Big)
              - \frac{H(p_i(x)) + H(p_j(x))}{2} \Big]
              = -\frac1n \sum_{x, c} q \log q \,\Big|_{q = \frac{p_i + p_j}{2}} - \frac{h_i + h_j}{2},

    where :math:`h_i = \frac1n \sum_x H(p_i(x))` is computed once per model (float64). The pairwise term
    is computed for blocks of rows :math:`i` times columns :math:`j > i` (upper triangle only) and
    chunks of the flattened ``(input, class)`` axis: one broadcast addition of the halved probabilities
    (halving is exact; zeros are floored at the smallest normal number), one logarithm and one reduction
    per block, on at most ``block`` elements (two buffers: memory bounded), the chunk sums accumulated in
    float64. No Python loop runs over pairs.

    The cost is one logarithm per pair, input and class. On the CPU in float32 (the default for float32
    ``p``) the pairwise term is the compiled kernel of :mod:`symlib.kernels` where it builds: one pass per
    pair with the addition, a vectorised logarithm (Cephes' ``logf``, about one ulp) and the product-sum in
    registers, summed in float32 over 256 values and then in float64, rows in blocks of 8 over ``workers``
    threads. Otherwise (float64, ``native=False``, no compiler) the blocks are numpy arrays:
    numpy's vectorised float32 logarithm (AVX-512) is about three times as fast as torch's, in base 2
    four times (:math:`\sum q \log q = \ln 2 \sum q \log_2 q`, the factor applied to the float64 sums;
    numpy's float32 ``log2`` is also within one ulp), and the product and the sum are one BLAS dot
    product per pair and chunk (no product pass). The models' halves and mean entropies, then the blocks
    of rows, are split over ``workers`` threads (numpy releases the GIL), each with its own buffers; a
    pair's value does not depend on the thread that computes it, so the result is the same for every
    ``workers``. numpy's ``matmul`` keeps the GIL (about a sixth of the work), so on the 2-core machine
    of the book two workers are about 1.3x one. The input check runs as three fast passes, deferring to
    :func:`check_probs` unless ``p`` is plainly valid. On CUDA the same blocks run in torch.
    ``benchmarks/pairwise_mi.py`` times it against a per-pair loop.

    Args:
        p: ``(N, n, C)`` probabilities of ``N >= 2`` models on ``n`` inputs.
        square: return the symmetric ``(N, N)`` matrix (zero diagonal) instead of the condensed vector.
        block: elements per block (default :math:`2^{17}` on CPU, :math:`2^{24}` on CUDA); a feature chunk
            holds at most ``block`` (and on the CPU :data:`CPU_MAX_WIDTH`) features.
        dtype: the dtype of the blocks (default: ``p``'s); float64 for exact checks.
        progress: show a progress bar over row blocks.
        workers: CPU threads (default ``torch.get_num_threads()``); ignored on CUDA.
        native: use the compiled CPU kernel for float32 where available (``False``: the numpy blocks).

    Returns:
        float64 tensor on ``p``'s device: the condensed vector of the :math:`N(N-1)/2` pairs in
        ``scipy.spatial.distance.squareform`` order (``(0,1), (0,2), ..., (1,2), ...``), or the square matrix.
    """
    _check_probs_quick(p)
    n_models, n_inputs, n_classes = p.shape
    if n_models < 2:
        raise ValueError(f"pairwise_mi needs at least two models, got p of shape {tuple(p.shape)}")
    dtype = dtype or p.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    on_cpu = p.device.type == "cpu"
    if block is None:
        block = 2**17 if on_cpu else 2**24
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer (elements per block), got {block!r}")
    if workers is None:
        workers = torch.get_num_threads()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer (CPU threads), got {workers!r}")
    dev = p.device
    feats = n_inputs * n_classes
    chunks, width, rows, cols = _layout(feats, block, CPU_MAX_WIDTH if on_cpu else feats)
    sums = torch.empty(n_models * (n_models - 1) // 2, dtype=torch.float64, device=dev)
    total = len(range(0, n_models - 1, rows))
    if on_cpu and dtype == torch.float32 and native and _native_kernels():
        total = len(range(0, n_models - 1, NATIVE_ROWS))
    with _progress.bar(total=total, desc="pairwise MI", enabled=progress) as pbar:
        if on_cpu and dtype == torch.float32 and native and _native_kernels():
            h = _pairwise_sums_native(p, sums, workers, pbar)
        elif on_cpu:
            h = _pairwise_sums_cpu(p, dtype, chunks, width, rows, cols, sums.numpy(), workers, pbar)
            h = torch.from_numpy(h)
        else:
            h = _pairwise_sums_torch(p, dtype, chunks, width, rows, cols, sums, pbar)
    iu = torch.triu_indices(n_models, n_models, 1, device=dev)
    out = -sums / n_inputs - (h[iu[0]] + h[iu[1]]) / 2
    if not square:
        return out
    mat = torch.zeros(n_models, n_models, dtype=torch.float64, device=dev)
    mat[iu[0], iu[1]] = out
    return mat + mat.T


NATIVE_ROWS = 8  # rows of the upper triangle per task of the compiled path


def _native_kernels() -> bool:
    from symlib import kernels

    return kernels.available()


def _mean_entropies(flat: np.ndarray, n_inputs: int) -> np.ndarray:
    r""":math:`h_i = -\frac1n \sum_f p_{if} \log p_{if}` of the rows of ``flat`` (``(N, n C)``), in
    float64, one dot product per row (zeros floored at the smallest normal number: :math:`0 \log 0 = 0`)."""
    x = flat.astype(np.float64)
    logs = np.log(np.maximum(x, np.finfo(np.float64).tiny))
    return -np.matmul(x[:, None, :], logs[:, :, None])[:, 0, 0] / n_inputs


def _pairwise_sums_native(p: torch.Tensor, out: torch.Tensor, workers: int, pbar) -> torch.Tensor:
    r"""The compiled CPU path of :func:`pairwise_mi` (float32): the halves in one ``(N, F')`` array
    (floored at the smallest normal float, padded with 1/2 to whole vectors), then
    :func:`symlib.kernels.pairwise_xlogx_rows` on blocks of :data:`NATIVE_ROWS` rows spread over
    ``workers`` threads (the library call releases the GIL). Returns the models' mean entropies (float64).
    """
    from symlib import kernels

    n_models, n_inputs = p.shape[:2]
    flat = p.detach().reshape(n_models, -1)
    half = _chunked_halves(flat, torch.float32, 1, -(-flat.shape[1] // 16) * 16)[0]
    h = _mean_entropies(flat.numpy(), n_inputs)

    def rows(r0: int) -> None:
        kernels.pairwise_xlogx_rows(half, r0, min(r0 + NATIVE_ROWS, n_models), out)

    _in_threads(rows, list(range(0, n_models - 1, NATIVE_ROWS)), workers, pbar)
    return torch.from_numpy(h)


def _pairwise_sums_torch(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int, rows: int, cols: int,
                         out: torch.Tensor, pbar) -> torch.Tensor:
    r"""The torch path of :func:`pairwise_mi` (CUDA): as :func:`_pairwise_sums_cpu`, on ``p``'s device, one
    row block after the other."""
    n_models, n_inputs = p.shape[:2]
    hc = _chunked_halves(p, dtype, chunks, width)
    p64 = p.reshape(n_models, -1).double()
    h = -torch.special.xlogy(p64, p64).sum(1) / n_inputs
    q, log_q = torch.empty(2, rows * cols * width, dtype=dtype, device=p.device)
    for r0 in range(0, n_models - 1, rows):
        _row_block_torch(hc, r0, min(r0 + rows, n_models), cols, q, log_q, out)
        pbar.update(1)
    return h


def _check_probs_quick(p: torch.Tensor) -> None:
    """:func:`check_probs` ``(p, "p")``, in three fast passes (numpy minimum, maximum, float32 row sums by
    BLAS) when ``p`` is a plainly valid CPU tensor; anything else, and row sums within rounding of the
    tolerance, goes to :func:`check_probs` itself (same decisions, same messages)."""
    if (p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and p.ndim == 3
            and p.numel() > 0 and p.shape[-1] >= 2 and p.is_contiguous()):
        a = p.detach().numpy().reshape(-1, p.shape[-1])
        lo, hi = a.min(), a.max()  # NaN propagates: then lo >= 0 is false
        if lo >= 0 and np.isfinite(hi):
            dev = float(np.abs(a @ np.ones(a.shape[1], a.dtype) - 1).max())
            # a sum of C non-negative terms near 1 is off by at most C eps from the float64 sum
            if dev + 2 * a.shape[1] * np.finfo(a.dtype).eps <= SUM_ATOL:
                return
    check_probs(p, "p")


def _blas_one_thread():
    """One BLAS thread while the worker threads run (``threadpoolctl``, where installed): numpy's dot
    products inside them (the entropies' rows exceed OpenBLAS's threading threshold) would otherwise each
    start OpenBLAS's own threads, ``workers x cores`` threads on the cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # not a dependency of symlib itself
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _in_threads(fn, items: list, workers: int, pbar=None) -> None:
    """``fn(item)`` for every item, on ``workers`` threads (one: this thread); ``pbar`` counts the items."""
    if workers == 1 or len(items) == 1:
        for item in items:
            fn(item)
            if pbar is not None:
                pbar.update(1)
        return
    with _blas_one_thread(), ThreadPoolExecutor(
        max_workers=min(workers, len(items)), thread_name_prefix="pairwise_mi"
    ) as pool:
        for future in as_completed([pool.submit(fn, item) for item in items]):
            future.result()  # re-raises a worker's error
            if pbar is not None:
                pbar.update(1)


def _pairwise_sums_cpu(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int, rows: int, cols: int,
                       out: np.ndarray, workers: int, pbar) -> np.ndarray:
    r"""The CPU path of :func:`pairwise_mi`, numpy on ``workers`` threads: write the pairs'
    :math:`\sum_{x, c} q \log q` into ``out`` (condensed) and return the models' mean entropies
    :math:`h` (float64).

    Two passes, each split over the threads: per block of 8 models, their halves (as
    :func:`_chunked_halves`) and :math:`h_i = -\frac1n p_i \cdot \log p_i` (float64, one dot product);
    then :func:`_row_block_np` per block of ``rows`` rows, each thread with its own two buffers.
    """
    n_models, n_inputs = p.shape[:2]
    flat = p.detach().reshape(n_models, -1)
    flat = (flat if flat.dtype in (torch.float32, torch.float64) else flat.to(dtype)).numpy()
    feats = flat.shape[1]
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    hc = np.empty((chunks, n_models, width), dtype=np_dtype)
    hc[-1, :, feats - (chunks - 1) * width :] = 0.5  # padding: q = 1, q log q = 0
    h = np.empty(n_models)
    tiny = np.finfo(np_dtype).tiny

    def prepare(m0: int) -> None:
        m1 = min(m0 + 8, n_models)
        h[m0:m1] = _mean_entropies(flat[m0:m1], n_inputs)
        for k in range(chunks):
            f0, f1 = k * width, min((k + 1) * width, feats)
            dst = hc[k, m0:m1, : f1 - f0]
            np.multiply(flat[m0:m1, f0:f1], 0.5, out=dst)
            np.maximum(dst, tiny, out=dst)

    local = threading.local()

    def row_block(r0: int) -> None:
        if not hasattr(local, "bufs"):
            shapes = [(rows, cols, width)] * 2 + [(rows, cols, 1, 1)]  # q, log_q, the dot products
            local.bufs = tuple(np.empty(shape, np_dtype) for shape in shapes)
        _row_block_np(hc, r0, min(r0 + rows, n_models), local.bufs, out)

    _in_threads(prepare, list(range(0, n_models, 8)), workers)
    _in_threads(row_block, list(range(0, n_models - 1, rows)), workers, pbar)
    return h
