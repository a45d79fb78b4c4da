"""Gated DeltaNet's UT transform, forward and backward, on Hopper: one Mosaic GPU CTA per (batch,
head, chunk), every product on the tensor cores (``wgmma``, 16-bit operands, float32
accumulation).

The forward (``gdn_chunk``'s math, ``ρ = 2^{b2}``): ``A = strict_tril(diag(β)(K Kᵀ) ∘ Γ)``, its
inverse ``X = (I + A)⁻¹`` from the inverses of its ``16×16`` diagonal blocks (forward
substitution in float32, ``block_solve.py``) by doubling them (for ``s = 16, 32``:
``X ← X − X (A_s X)``, ``A_s`` the entries coupling each pair of ``s×s`` blocks, as
``loglinear_gdn_chunk.unit_lower_inverse``; each product over only the ``s``-wide column ranges
of ``A_s`` and row ranges of ``A_s X`` that are not zero, so a quarter of a ``64×64×64`` one at
``s = 16``, half at ``s = 32``), ``W = X diag(β∘ρ) K`` and ``U = X diag(β) V``.
Every float32 factor enters a product as two 16-bit halves (``_halves``; three products for a
float32 pair, the ``lo·lo`` one dropped), so ``X`` comes out within about 2⁻¹⁶ of its float32
value and ``ρ∘K`` is never rounded to 16 bits.  ``X`` is kept for the backward.  ``K`` then
``W``, ``V`` then ``U``, the solve's ``X`` then ``X``'s halves, the solve's ``A`` then ``Y =
A_s X``'s halves then ``X`` share shared memory: 69 KiB a CTA at ``d = dv = 128``.

The backward (the math of ``gdn_chunk.ut_backward``, ``T = X diag(β)``), with ``(X diag β)ᵀ Y =
β∘(Xᵀ Y)`` so that only ``X`` enters a product, and ``dW (ρ∘K)ᵀ = (dW Kᵀ) diag(ρ)``::

    dT = (dW Kᵀ) diag(ρ) + dU Vᵀ [+ dT_own],   dV = β∘(Xᵀ dU),   dX = dT diag(β)
    E = strict_tril(−Xᵀ dX Xᵀ) ∘ Γ,   dβ = cols(X∘dT) + rows(E∘(K Kᵀ))
    dK = ρ∘β∘(Xᵀ dW) + (β∘E) K + (β∘E)ᵀ K [+ dK_walk]
    ∂L/∂b ⊇ rows(M) − cols(M) + k·(ρ∘β∘(Xᵀ dW)),   M = (β∘E) ∘ (K Kᵀ)

``X`` (float32 from the forward) enters as two 16-bit halves, ``X = X_hi + X_lo`` (a single 16-bit
``X`` is not accurate enough on ill-conditioned keys), and so do ``dX`` and ``Xᵀ dX``; ``dU``
comes from the reverse walk as ``−dV'`` in 16 bits.  Column sums are float32 reductions over the
rows, so each pair's term in ``rows(M) − cols(M)`` cancels in the gate's cumulative sum.  The
values go in tiles of 128 columns (64 when ``dv`` is an odd multiple of 64): a first pass sums
``dU Vᵀ`` over them, a second gives ``dV`` (one tile: it stays in shared memory between the
two).  Buffers whose lifetimes do not overlap share shared memory (``V`` then ``dK_walk``,
``dW`` then ``dV``, ``X`` then ``dX``, ``K`` then ``dK``), so at ``d = dv = 128`` a CTA takes
98 KiB and two share an SM.

Inputs in the caller's layout (the forward's ``k``, ``v``, ``b2``, ``β`` likewise, its ``W``, ``U``
and ``X`` in the layouts below): ``k, dW, dK_walk [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``,
``v, −dU [B,Tp,H,dv]`` with ``dv`` a multiple of 64, ``x [B,H,Tp,C]`` float32, ``b2`` (local
log2-decay) and ``β`` ``[B,H,Tp]`` float32; optional: ``dK_walk`` (the first-order kernel's walk
part of ``dK``) and ``dT_own [B,H,Tp,C]`` float32, the cotangent of ``T`` itself (log-linear
Gated DeltaNet's block form, ``loglinear_gdn/gdn_blocks.py``), read into ``X``'s float32 tile.
Returns ``dk [B,Tp,H,d]``, ``dv [B,Tp,H,dv]`` in the input dtype and ``dβ``, ``∂L/∂b``
``[B,H,Tp]`` float32.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.gdn import block_solve
from hla_jax.kernels.gdn.block_solve import BLOCK
from hla_jax.kernels.mosaic_gpu import (
    COLS,
    F32,
    ROWS,
    WGMMA,
    C,
    bcast_cols,
    bcast_rows,
    build,
    causal_decay,
    products,
    smem_tile,
    value_tiles,
)


def _halves(y, dt):
    """``y = hi + lo`` float32 as two ``dt`` (16-bit) arrays."""
    hi = y.astype(dt)
    return hi, (y - hi.astype(F32)).astype(dt)


def _split(a, bh_s, bl_s, j):
    """The products of ``(a_hi + a_lo)(b_hi + b_lo)`` less ``a_lo b_lo`` (``_halves``), ``b`` the
    rows ``j … j + s`` of the 16-bit tiles ``bh_s, bl_s`` (``a [C, s]`` float32)."""
    ah, al = _halves(a, bh_s.dtype)
    rows = pl.ds(j, a.shape[1])
    return [(ah, bh_s.at[rows]), (ah, bl_s.at[rows]), (al, bh_s.at[rows])]


def put(y, h_s, l_s=None):
    """``y`` into ``h_s`` in 16 bits (and what that leaves into ``l_s``, ``_halves``), between two
    warpgroup barriers: no warp overwrites a tile another still reads."""
    plgpu.commit_smem()
    hi, lo = _halves(y, h_s.dtype)
    h_s[...] = hi
    if l_s is not None:
        l_s[...] = lo
    plgpu.commit_smem()


def forward(k, v, b2, beta, *, keep=True, interpret=None):
    """``(W [B,Tp,H,d], U [B,Tp,H,dv])`` in ``k``'s dtype and ``X [B,H,Tp,C]`` float32 (module
    docstring; ``None`` unless ``keep``: only the backward reads it) from ``k [B,Tp,H,d]``,
    ``v [B,Tp,H,dv]``, ``b2, β [B,H,Tp]`` float32."""
    B, Tp, H, d = k.shape
    dv, dt, N = v.shape[-1], k.dtype, Tp // C
    bv, nv = value_tiles(dv)
    _, _sum = products(interpret)
    cc = plgpu.SMEM((C, C), dt, transforms=(   # 32-byte swizzle: products over 16-row slices
        plgpu.TilingTransform((8, 32 // jnp.dtype(dt).itemsize)), plgpu.SwizzleTransform(32)))
    scratch = dict(
        k_s=smem_tile((C, d), dt), v_s=smem_tile((C, bv), dt),     # K, V: then W, U
        x_hl=plgpu.RefUnion((cc, cc), block_solve.scratch()),     # the solve's X, then X's halves
        y_x=plgpu.RefUnion((cc, cc), plgpu.SMEM((C, C), F32),     # Y's halves, X out; the
                           block_solve.scratch()),                # solve's A before them
        vecs=plgpu.SMEM((4, C), F32),     # b2, b2, β, β (read as rows, as columns)
        bar=plgpu.Barrier(num_arrivals=5), vbar=plgpu.Barrier(num_arrivals=1))

    def body(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref, *x_ref, k_s, v_s, x_hl, y_x, vecs, bar,
             vbar):
        bi, hi, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        (xh_s, xl_s), xs_s = x_hl
        (yh_s, yl_s), x_s, as_s = y_x

        def values(ref, t):
            return ref.at[bi, rows, hi, pl.ds(t * bv, bv)]

        plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], k_s, bar)
        for i, ref in enumerate((b_ref, b_ref, beta_ref, beta_ref)):
            plgpu.copy_gmem_to_smem(ref.at[bi, hi, rows], vecs.at[i], bar)
        plgpu.copy_gmem_to_smem(values(v_ref, 0), v_s, vbar)
        plgpu.barrier_wait(bar)
        b_row, b_col = plgpu.load(vecs.at[0], layout=ROWS), plgpu.load(vecs.at[1], layout=COLS)
        beta_row, beta_col = plgpu.load(vecs.at[2], layout=ROWS), plgpu.load(vecs.at[3], layout=COLS)
        A = (_sum([(k_s, k_s.T)], (C, C)) * bcast_rows(beta_row, (C, C))
             * causal_decay(b_row, b_col, (C, C), strict=True))
        X = block_solve.inverse(A, as_s, xs_s, bool(interpret))
        row = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWS)
        s = BLOCK
        while s < C:       # X ← X − X (A_s X): A_s's columns j … j+s couple rows j+s … j+2s
            put(X, xh_s, xl_s)
            starts = range(0, C, 2 * s)
            a_s = [bcast_rows(jnp.where((row >= j + s) & (row < j + 2 * s), 1.0, 0.0), (C, s))
                   * A[:, j:j + s] for j in starts]
            put(_sum([p for j, a in zip(starts, a_s) for p in _split(a, xh_s, xl_s, j)], (C, C)),
                yh_s, yl_s)
            X = X - _sum([p for j in range(s, C, 2 * s) for p in _split(X[:, j:j + s], yh_s, yl_s, j)],
                         (C, C))
            s *= 2
        Th, Tl = _halves(X * bcast_cols(beta_col * jnp.exp2(b_col), (C, C)), dt)
        W = _sum([(Th, k_s), (Tl, k_s)], (C, d))                   # W = X diag(β∘ρ) K
        plgpu.commit_smem()
        if keep:
            x_s[...] = X                                          # over Y's halves
        k_s[...] = W.astype(dt)                                   # over K
        plgpu.commit_smem()
        if keep:
            plgpu.copy_smem_to_gmem(x_s, x_ref[0].at[bi, hi, rows], commit_group=False)
        plgpu.copy_smem_to_gmem(k_s, w_ref.at[bi, rows, hi], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        Th, Tl = _halves(X * bcast_cols(beta_col, (C, C)), dt)

        def value_tile(t, carry):                                 # U = X diag(β) V, tile t
            plgpu.barrier_wait(vbar)
            U = _sum([(Th, v_s), (Tl, v_s)], (C, bv))
            plgpu.commit_smem()
            v_s[...] = U.astype(dt)                               # over V
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, values(u_ref, t))

            @pl.when(t + 1 < nv)
            def _next():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(values(v_ref, t + 1), v_s, vbar)
            return carry

        lax.fori_loop(0, nv, value_tile, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(k.shape, dt), jax.ShapeDtypeStruct(v.shape, dt)] + [
        jax.ShapeDtypeStruct((B, H, Tp, C), F32)] * keep
    w, u, *x = build(body, out_type, scratch, (B, H, N), ("b", "h", "n"), interpret,
                     "gdn_ut_fwd")(k, v, b2, beta)
    return w, u, (x[0] if keep else None)


def backward(k, v, b2, beta, x, dw, ndu, dk_walk=None, *, dt_own=None, interpret=None):
    """``(dk, dv, dβ, ∂L/∂b)`` (module docstring); ``ndu = −dU``."""
    B, Tp, H, d = k.shape
    dv, dt, N = v.shape[-1], k.dtype, Tp // C
    bv, nv = value_tiles(dv)
    _mm, _sum = products(interpret)
    cc = smem_tile((C, C), dt)

    def tile(width):
        return smem_tile((C, width), dt)

    scratch = dict(
        k_s=tile(d), ndu_s=tile(bv), xh_s=cc, xl_s=cc,
        v_dkw=plgpu.RefUnion(tile(bv), tile(d)),                   # V, then dK_walk
        dw_dv=plgpu.RefUnion(tile(d), tile(bv)),                   # dW, then dV out
        x_cc=plgpu.RefUnion(plgpu.SMEM((C, C), F32), (cc, cc)),    # X, then two 16-bit tiles
        vecs=plgpu.SMEM((6, C), F32),     # b2, b2, β, β (read as rows, as columns); dβ, ∂L/∂b
        bar=plgpu.Barrier(num_arrivals=7), vbar=plgpu.Barrier(num_arrivals=2),
        nbar=plgpu.Barrier(num_arrivals=1))
    if dk_walk is not None:
        scratch["late"] = plgpu.Barrier(num_arrivals=1)
    if dt_own is not None:
        scratch["tbar"] = plgpu.Barrier(num_arrivals=1)
    extra = [a for a in (dk_walk, dt_own) if a is not None]

    def body(k_ref, v_ref, b_ref, beta_ref, x_ref, dw_ref, ndu_ref, *refs, k_s, ndu_s, xh_s,
             xl_s, v_dkw, dw_dv, x_cc, vecs, bar, vbar, nbar, late=None, tbar=None):
        *ins, dk_ref, dv_ref, dbeta_ref, db_ref = refs
        dkw_ref = ins.pop(0) if dk_walk is not None else None
        dt_ref = ins.pop(0) if dt_own is not None else None
        bi, hi, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        (v_s, dkw_s), (dw_s, dvo_s), (x_s, (p_s, q_s)) = v_dkw, dw_dv, x_cc

        def values(ref, t):
            return ref.at[bi, rows, hi, pl.ds(t * bv, bv)]

        def load_values(t):
            plgpu.copy_gmem_to_smem(values(v_ref, t), v_s, vbar)
            plgpu.copy_gmem_to_smem(values(ndu_ref, t), ndu_s, vbar)

        for ref, buf in ((k_ref, k_s), (dw_ref, dw_s)):
            plgpu.copy_gmem_to_smem(ref.at[bi, rows, hi], buf, bar)
        plgpu.copy_gmem_to_smem(x_ref.at[bi, hi, rows], x_s, bar)
        for i, ref in enumerate((b_ref, b_ref, beta_ref, beta_ref)):
            plgpu.copy_gmem_to_smem(ref.at[bi, hi, rows], vecs.at[i], bar)
        load_values(0)
        plgpu.barrier_wait(bar)

        b_row, b_col = plgpu.load(vecs.at[0], layout=ROWS), plgpu.load(vecs.at[1], layout=COLS)
        beta_row, beta_col = plgpu.load(vecs.at[2], layout=ROWS), plgpu.load(vecs.at[3], layout=COLS)
        rho = jnp.exp2(b_row)
        X = plgpu.load(x_s, layout=WGMMA)
        put(X, xh_s, xl_s)                                         # x_s is free from here
        if dt_ref is not None:
            plgpu.copy_gmem_to_smem(dt_ref.at[bi, hi, rows], x_s, tbar)
        dT = _mm(dw_s, k_s.T, (C, C)) * bcast_cols(jnp.exp2(b_col), (C, C))   # dW (ρ∘K)ᵀ

        def add_duv(t, dT):                                        # − (−dU) Vᵀ, tile t
            plgpu.barrier_wait(vbar)
            dT = dT - _mm(ndu_s, v_s.T, (C, C))

            @pl.when(t + 1 < nv)
            def _next():
                load_values(t + 1)
            return dT

        dT = lax.fori_loop(0, nv, add_duv, dT)
        if dt_ref is not None:
            plgpu.barrier_wait(tbar)
            dT = dT + plgpu.load(x_s, layout=WGMMA)
        if dkw_ref is not None:
            plgpu.copy_gmem_to_smem(dkw_ref.at[bi, rows, hi], dkw_s, late)   # over V
        vecs[4] = (X * dT).sum(0)                                  # column sums, as rows
        XhT, XlT = (plgpu.load(s_.T, layout=WGMMA) for s_ in (xh_s, xl_s))

        def xt_dot(y, width):
            """``Xᵀ y`` for a 16-bit tile ``y [C, width]`` in shared memory."""
            return _sum([(XhT, y), (XlT, y)], (C, width))

        put(dT * bcast_cols(beta_col, (C, C)), p_s, q_s)           # dX = dT diag(β)
        m = _sum([(XhT, p_s), (XlT, p_s), (XhT, q_s)], (C, C))     # Xᵀ dX
        put(m, p_s, q_s)
        dA = -_sum([(p_s, xh_s.T), (p_s, xl_s.T), (q_s, xh_s.T)], (C, C))
        E = dA * causal_decay(b_row, b_col, (C, C), strict=True)
        KK = _mm(k_s, k_s.T, (C, C))
        dbeta = (E * KK).sum(1)
        bE = bcast_rows(beta_row, (C, C)) * E
        M = bE * KK
        vecs[5] = M.sum(0)
        db = M.sum(1)
        put(bE, p_s)
        dbeta = dbeta + plgpu.load(vecs.at[4], layout=ROWS)
        dKW = xt_dot(dw_s, d) * bcast_rows(rho * beta_row, (C, d))
        db = (db - plgpu.load(vecs.at[5], layout=ROWS)
              + (plgpu.load(k_s, layout=WGMMA).astype(F32) * dKW).sum(1))

        def value_grad(t, carry):                                  # dV = β∘(Xᵀ dU), tile t
            if nv > 1:                                             # (one tile: still in ndu_s)
                plgpu.copy_gmem_to_smem(values(ndu_ref, t), ndu_s, nbar)
                plgpu.barrier_wait(nbar)
            dV = -xt_dot(ndu_s, bv) * bcast_rows(beta_row, (C, bv))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)       # tile t − 1's store
            dvo_s[...] = dV.astype(dt)                             # over dW
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dvo_s, values(dv_ref, t))
            return carry

        lax.fori_loop(0, nv, value_grad, 0)
        BeT = plgpu.load(p_s.T, layout=WGMMA)
        dK = _sum([(p_s, k_s), (BeT, k_s)], (C, d), init=dKW)
        if dkw_ref is not None:
            plgpu.barrier_wait(late)
            dK = dK + plgpu.load(dkw_s, layout=WGMMA).astype(F32)
        k_s[...] = dK.astype(dt)                                   # dK out over K
        plgpu.commit_smem()                                        # the column sums are read
        vecs[4] = dbeta
        vecs[5] = db
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, dk_ref.at[bi, rows, hi], commit_group=False)
        plgpu.copy_smem_to_gmem(vecs.at[4], dbeta_ref.at[bi, hi, rows], commit_group=False)
        plgpu.copy_smem_to_gmem(vecs.at[5], db_ref.at[bi, hi, rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(k.shape, dt), jax.ShapeDtypeStruct(v.shape, dt),
                jax.ShapeDtypeStruct((B, H, Tp), F32), jax.ShapeDtypeStruct((B, H, Tp), F32)]
    return build(body, out_type, scratch, (B, H, N), ("b", "h", "n"), interpret, "gdn_ut_bwd")(
        k, v, b2, beta, x, dw, ndu, *extra)
