r"""The exact GGN (and Hessian) of stacked OptuNets, written by hand (book: chapter "Table 1").

OptuNet's feature :math:`f_j` (``j = 5c + o``) depends only on conv 1's channel :math:`c` and on conv 2's
kernel :math:`j`, so its per-example Jacobian is 41 numbers (:func:`feature_jacobian`); the GGN blocks are
then a few batched products over a chunk of images (:func:`ggn_chunk`), mapped to OptuNet's flat
coordinates by :func:`assemble`. Float64, batched over the modes: seconds for 10 modes on 4,000 digits.
The conv-2 index pattern is the trainer's (:func:`symlib.training.optunet.conv_matrix_index`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from symlib.params import Params
from symlib.training.optunet import OPTUNET_SHAPES, conv_matrix_index

__all__ = ["assemble", "feature_jacobian", "ggn_chunk"]


@torch.no_grad()
def feature_jacobian(
    theta: Params, x: torch.Tensor, second: bool = False
) -> tuple[torch.Tensor, ...]:
    r"""Features of ``M`` stacked OptuNets on shared images and their exact per-example Jacobians.

    OptuNet's feature :math:`f_j`, :math:`j = 5c + o`, depends only on conv 1's channel :math:`c`
    (16 weights) and on conv 2's kernel :math:`j` (25 weights, group :math:`c`), so its Jacobian is
    stored compactly as 41 numbers: with the pooled maps :math:`a_c = \mathrm{relu}(\max_{3\times3} z_c)`,
    the conv-2 pre-activations :math:`u` and their patches :math:`P`,

    .. math:: \frac{\partial f_j}{\partial w^{(2)}_j} = \tfrac1{16} \sum_{pq} 1[u_{j,pq} > 0]\, P_{c,pq},
              \qquad
              \frac{\partial f_j}{\partial w^{(1)}_c} = \sum_{rs} \frac{\partial f_j}{\partial a_{c,rs}}\,
              1[a_{c,rs} > 0]\, X_{\arg\max(rs)},

    where :math:`X_{\arg\max(rs)}` is the 4x4 input patch under the maximum of pooling window
    :math:`rs` (the first maximum in row-major order, PyTorch's rule).

    Args:
        theta: stacked OptuNet parameters ``(M, ...)``.
        x: images ``(B, 1, 28, 28)``, shared by the models.

    With ``second=True`` it also returns the only second derivatives of the features that are not zero
    almost everywhere (OptuNet is piecewise linear in each layer's weights), the cross terms
    :math:`\partial^2 f_j / \partial w^{(2)}_{j,k} \partial w^{(1)}_c = \tfrac1{16} \sum_{pq}
    1[u_{j,pq} > 0]\, 1[a_{c,(pq)+k} > 0]\, X_{\arg\max((pq)+k)}`, as ``d2 (M, 10, B, 16, 25)``.

    Returns:
        ``(f (M, B, 10), jf (M, 10, B, 41), logits (M, B, 10)[, d2])``; ``jf[:, j, :, :16]`` is
        :math:`\partial f_j / \partial w^{(1)}_{c}`, ``jf[:, j, :, 16:]`` :math:`\partial f_j / \partial
        w^{(2)}_j`.
    """
    w1, w2, fw, fb = (theta[k] for k in OPTUNET_SHAPES)
    m, b = w1.shape[0], x.shape[0]
    # conv-1 patches ordered (image, pooling window (r, s), window entry (di, dj)): (B, 64, 9, 16)
    x1 = x[:, 0].unfold(1, 4, 1).unfold(2, 4, 1)[:, :24, :24].reshape(b, 8, 3, 8, 3, 16)
    x1 = x1.permute(0, 1, 3, 2, 4, 5).reshape(b, 64, 9, 16)
    z = (w1.reshape(m * 2, 16) @ x1.reshape(b * 576, 16).T).view(m, 2, b, 64, 9)
    zmax, arg = z.max(-1)  # first maximum (CPU and CUDA)
    a = zmax.clamp_min(0)  # (m, c, b, 64)
    # conv 2: patches of a_c, (m, c, b, 16 positions pq, 25 kernel entries)
    p2 = a.view(m, 2, b, 8, 8).unfold(3, 5, 1).unfold(4, 5, 1).reshape(m * 2, b * 16, 25)
    w2g = w2.reshape(m * 2, 5, 25)
    u = torch.bmm(p2, w2g.transpose(1, 2)).view(m * 2, b, 16, 5)
    mask = (u > 0).to(x.dtype).div_(16)
    f = u.clamp_min(0).sum(2).div_(16).view(m, 2, b, 5).permute(0, 2, 1, 3).reshape(m, b, 10)
    mask_t = mask.permute(0, 3, 1, 2)  # (m c, o, b, pq)
    p2b = p2.view(m * 2, b, 16, 25)
    jw2 = torch.einsum("nobp,nbpk->nobk", mask_t, p2b)  # (m c, o, b, 25)
    t2 = F.pad(w2g, (0, 1))[..., _conv2_index(str(x.device))]  # (m c, o, pq, rs): d u_pq / d a_rs
    dfa = torch.bmm(mask_t.reshape(m * 10, b, 16), t2.reshape(m * 10, 16, 64)).view(m * 2, 5, b, 64)
    dfa = dfa * (zmax > 0).to(x.dtype).view(m * 2, 1, b, 64)
    # sum over windows of dfa times the conv-1 patch under each window's maximum
    rows = arg + torch.arange(b, device=x.device).view(b, 1) * 576 + torch.arange(0, 576, 9, device=x.device)
    xsel = x1.reshape(b * 576, 16).index_select(0, rows.reshape(-1)).view(m * 2 * b, 64, 16)
    jw1 = torch.bmm(dfa.transpose(1, 2).reshape(m * 2 * b, 5, 64), xsel).view(m * 2, b, 5, 16).transpose(1, 2)
    jf = torch.cat([jw1, jw2], -1).view(m, 10, b, 41)
    logits = torch.baddbmm(fb[:, None, :], f, fw.transpose(1, 2))
    if not second:
        return f, jf, logits
    gate = xsel.view(m * 2, b, 8, 8, 16) * (zmax > 0).to(x.dtype).view(m * 2, b, 8, 8, 1)
    gp = gate.unfold(2, 5, 1).unfold(3, 5, 1).reshape(m * 2 * b, 16, 400)  # (pq, (w1 entry, w2 entry))
    d2 = torch.bmm(mask.transpose(2, 3).reshape(m * 2 * b, 5, 16), gp).view(m * 2, b, 5, 16, 25)
    return f, jf, logits, d2.transpose(1, 2).reshape(m, 10, b, 16, 25)


@functools.cache
def _conv2_index(device: str) -> torch.Tensor:
    """``(16, 64)``: entry of a 5x5 kernel (or 25: zero) linking conv-2 output ``pq`` to input ``rs``: the
    transpose of the trainer's dense conv-2 pattern (:func:`symlib.training.optunet.conv_matrix_index`)."""
    return conv_matrix_index(8, 5, 1).T.contiguous().to(device)


def compact_map(device: torch.device) -> torch.Tensor:
    """``(520, 392)`` 0/1 matrix from the compact coordinates of :func:`ggn_chunk` (10 features
    x 41, then the last layer's 10 x 11 ``[W | b]``) to OptuNet's flat parameter vector."""
    rows = []
    for j in range(10):
        c = j // 5
        rows += [c * 16 + q for q in range(16)] + [32 + j * 25 + q for q in range(25)]
    rows += [282 + k * 10 + i if i < 10 else 382 + k for k in range(10) for i in range(11)]
    p = torch.zeros(520, 392, dtype=torch.float64, device=device)
    p[torch.arange(520), torch.tensor(rows)] = 1.0
    return p


def ggn_chunk(
    theta: Params, x: torch.Tensor, y: torch.Tensor, hessian: str = "ggn"
) -> tuple[list[torch.Tensor], torch.Tensor]:
    r"""GGN of ``M`` stacked OptuNets on one chunk of images, in compact coordinates, and the summed loss.

    With :math:`\ell = W f + b`, :math:`\Lambda = \mathrm{diag}(p) - p p^\top` and the compact feature
    Jacobians :math:`F_n` (:func:`feature_jacobian`), the GGN blocks are
    :math:`\sum_n F_n^\top (W^\top \Lambda_n W) F_n` (convolutions),
    :math:`\sum_n F_n^\top W^\top \Lambda_n (I \otimes \bar f_n^\top)` (convolutions x last layer) and
    :math:`\sum_n \Lambda_n \otimes \bar f_n \bar f_n^\top` (last layer, :math:`\bar f = (f, 1)`), each
    one batched product over the chunk.

    ``hessian="full"`` adds the exact Hessian's remaining term :math:`\sum_n \sum_k r_{nk} \nabla^2
    \ell_{nk}` (:math:`r_n = p_n - e_{y_n}`): :math:`\partial^2 \ell_k / \partial W_{kj} \partial
    \theta_{conv} = \partial f_j / \partial \theta_{conv}` and :math:`\sum_j (W^\top r_n)_j\,
    \partial^2 f_j / \partial w^{(1)} \partial w^{(2)}` (the other second derivatives vanish a.e.).

    Returns:
        ``([cc (M, 410, 410), cf (M, 410, 110), ff (M, 110, 110), dd (M, 10, 11, 11)], loss (M,))``: the
        last-layer block is ``blockdiag(dd) - ff``; :func:`assemble` maps them to OptuNet's
        coordinates.
    """
    f, jf, logits, *d2 = feature_jacobian(theta, x, second=hessian == "full")
    m, b = f.shape[:2]
    fw = theta["fc.weight"]
    logp = torch.log_softmax(logits, -1)
    loss = -logp.gather(2, y.expand(m, b)[..., None]).squeeze(-1).sum(1)
    p = logp.exp()  # (m, b, 10)
    wp = torch.bmm(p, fw)  # W^T p, (m, b, 10 features)
    ww = (fw[:, :, :, None] * fw[:, :, None, :]).reshape(m, 10, 100)
    kk = (torch.bmm(p, ww).view(m, b, 10, 10) - wp[..., :, None] * wp[..., None, :]).transpose(1, 2)
    wl = p[:, :, None, :] * (fw.transpose(1, 2)[:, None] - wp[..., :, None])  # W^T Lambda, (m, b, j, l)
    jf_t = jf.reshape(m * 10, b, 41).transpose(1, 2)
    t = torch.mul(
        kk[..., None], jf.transpose(1, 2)[:, None], out=x.new_empty(m, 10, b, 10, 41)
    )  # (m j b k r)
    cc = torch.bmm(jf_t, t.view(m * 10, b, 410)).view(m, 410, 410)
    fbar = torch.cat([f, torch.ones_like(f[..., :1])], -1)  # (m, b, 11)
    r = torch.mul(wl.transpose(1, 2)[..., None], fbar[:, None, :, None, :], out=x.new_empty(m, 10, b, 10, 11))
    cf = torch.bmm(jf_t, r.view(m * 10, b, 110)).view(m, 410, 110)
    pf = (p[..., None] * fbar[:, :, None, :]).view(m, b, 110)
    ff = torch.bmm(pf.transpose(1, 2), pf)
    dd = torch.bmm(pf.transpose(1, 2), fbar).view(m, 10, 11, 11)
    if hessian == "full":
        r = p.scatter_add(2, y.expand(m, b)[..., None], -torch.ones_like(p[..., :1]))  # p - e_y
        u = torch.bmm(r, fw)  # (m, b, 10 features)
        rw = torch.einsum("mjbfk,mbj->mjfk", d2[0], u)  # (m, j, w1 entry, w2 entry)
        jj = torch.arange(10, device=x.device)
        cc5 = cc.view(m, 10, 41, 10, 41)
        cc5[:, jj, :16, jj, 16:] += rw.transpose(0, 1)
        cc5[:, jj, 16:, jj, :16] += rw.transpose(0, 1).transpose(2, 3)
        e = torch.bmm(jf_t, r[:, None].expand(m, 10, b, 10).reshape(m * 10, b, 10)).view(m, 10, 41, 10)
        cf.view(m, 10, 41, 10, 11)[:, jj, :, :, jj] += e.transpose(0, 1)
    return [cc, cf, ff, dd], loss


def assemble(cc: torch.Tensor, cf: torch.Tensor, ff: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """The GGN ``(M, 392, 392)`` in OptuNet's flat coordinates from the compact blocks."""
    last = _block_diag(dd) - ff
    c = torch.cat([torch.cat([cc, cf], 2), torch.cat([cf.transpose(1, 2), last], 2)], 1)
    p = compact_map(c.device)
    return p.T @ c @ p


def _block_diag(d: torch.Tensor) -> torch.Tensor:
    """``(M, K, n, n)`` -> ``(M, K n, K n)`` block-diagonal matrices."""
    m, k, n, _ = d.shape
    out = torch.zeros(m, k, n, k, n, dtype=d.dtype, device=d.device)
    idx = torch.arange(k, device=d.device)
    out[:, idx, :, idx, :] = d.transpose(0, 1)
    return out.reshape(m, k * n, k * n)
