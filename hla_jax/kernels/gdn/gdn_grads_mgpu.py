"""The chunk-parallel part of Gated DeltaNet's walk backward on Hopper: one Mosaic GPU CTA per
(batch, head, chunk, block of 64 keys), every product on the tensor cores (``wgmma``, 16-bit
operands, float32 accumulation), the math of ``gdn_chunk.walk_products`` and ``walk_grads``
(``ρ = 2^{b2}``, ``ρ_c`` its value at the chunk end, ``γ̄ = ρ_c/ρ``, ``Γ[t,s] = ρ_t/ρ_s`` on
``s ≤ t``)::

    D = dO V'ᵀ,   dQ = diag(ρ) dO Sᵀ + (D ∘ Γ) K,   dK = diag(γ̄) V' dSᵀ + (D ∘ Γ)ᵀ Q,   dW = −dV' Sᵀ
    ∂L/∂b ⊇ q·(ρ∘dO Sᵀ) − k·(γ̄∘V' dSᵀ) + rows(M) − cols(M) + [Σ k·(γ̄∘V' dSᵀ) + ρ_c⟨S, dS⟩]_c
    M = D ∘ Γ ∘ (Q Kᵀ)

from the states the walks wrote per chunk (``gdn_walk_mgpu.walk``: ``Sᵀ`` entering the chunk, ``dSᵀ``
leaving it).  The values go in tiles of 128 columns (64 when ``dv`` is an odd multiple of 64),
``D``, the three ``[C, 64]`` products and ``⟨S, dS⟩`` (the trace of ``S dSᵀ``'s block, on the
tensor cores too) summed over them; a block of keys recomputes ``D``.
Column sums are float32 reductions over rows, so each pair's term cancels in the gate's
cumulative sum.  The value tiles and the outputs share shared memory (the tiles are dead when the
outputs are written): 105 KiB a CTA at ``dv = 128``, two CTAs an SM.

Inputs in the caller's layout: ``q, k [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``, ``V', dO, −dV'
[B,Tp,H,dv]`` with ``dv`` a multiple of 64, ``s, ds [B,H,N,dv,d]`` 16-bit, ``b2 [B,H,Tp]`` the
local log2-decay.  Returns ``dQ``, ``dK`` (the walks' part) and ``dW`` ``[B,Tp,H,d]`` in ``q``'s
dtype and ``∂L/∂b [d/64,B,H,Tp]`` float32, one share per block of keys.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.mosaic_gpu import (
    COLS,
    F32,
    ROWS,
    WGMMA,
    C,
    bcast_rows,
    build,
    causal_decay,
    products,
    smem_tile,
    value_tiles,
)

KB = 64  # keys per CTA


def backward(q, k, vn, do, ndvn, s, ds, b2, *, interpret=None):
    """``(dQ, dK, dW, ∂L/∂b)`` (module docstring)."""
    B, Tp, H, d = q.shape
    dv, dt, N = vn.shape[-1], q.dtype, Tp // C
    kb = min(KB, d)
    bv, nv = value_tiles(dv)
    _mm, _ = products(interpret)

    def tile(rows, cols):
        return smem_tile((rows, cols), dt)

    scratch = dict(
        q_s=tile(C, kb), k_s=tile(C, kb), p_s=tile(C, C),
        io=plgpu.RefUnion([tile(C, bv)] * 3 + [tile(bv, kb)] * 2,   # V', dO, −dV', Sᵀ, dSᵀ
                          [tile(C, kb)] * 3),                      # then dQ, dK, dW out
        vecs=plgpu.SMEM((3, C), F32),     # b2 (read as rows, as columns); then ∂L/∂b out
        bar=plgpu.Barrier(num_arrivals=4), vbar=plgpu.Barrier(num_arrivals=5))

    def body(q_ref, k_ref, vn_ref, do_ref, nd_ref, s_ref, ds_ref, b_ref,
             dq_ref, dk_ref, dw_ref, db_ref, *, q_s, k_s, p_s, io, vecs, bar, vbar):
        bi, hi, n, j = (lax.axis_index(a) for a in ("b", "h", "n", "j"))
        rows, keys = pl.ds(n * C, C), pl.ds(j * kb, kb)
        (vn_s, do_s, nd_s, sT_s, dsT_s), outs = io

        def load_values(t):
            cols = pl.ds(t * bv, bv)
            for ref, buf in ((vn_ref, vn_s), (do_ref, do_s), (nd_ref, nd_s)):
                plgpu.copy_gmem_to_smem(ref.at[bi, rows, hi, cols], buf, vbar)
            for ref, buf in ((s_ref, sT_s), (ds_ref, dsT_s)):
                plgpu.copy_gmem_to_smem(ref.at[bi, hi, n, cols, keys], buf, vbar)

        plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi, keys], q_s, bar)
        plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi, keys], k_s, bar)
        for i in range(2):
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], vecs.at[i], bar)
        load_values(0)

        diag = (plgpu.broadcasted_iota(jnp.int32, (kb, kb), 0, layout=WGMMA)
                == plgpu.broadcasted_iota(jnp.int32, (kb, kb), 1, layout=WGMMA))

        def products(t, acc):                                      # value tile t's shares
            D, dOS, VdS, dW, SdS = acc
            plgpu.barrier_wait(vbar)
            D = _mm(do_s, vn_s.T, (C, C), init=D)
            dOS = _mm(do_s, sT_s, (C, kb), init=dOS)
            VdS = _mm(vn_s, dsT_s, (C, kb), init=VdS)
            dW = _mm(nd_s, sT_s, (C, kb), init=dW)
            SdS = SdS + jnp.where(diag, _mm(sT_s.T, dsT_s, (kb, kb)), 0.0).sum(1).sum()  # ⟨S, dS⟩

            @pl.when(t + 1 < nv)
            def _next():
                plgpu.commit_smem()
                load_values(t + 1)
            return D, dOS, VdS, dW, SdS

        plgpu.barrier_wait(bar)
        zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)  # noqa: E731
        D, dOS, VdS, dW, SdS = lax.fori_loop(
            0, nv, products, (zeros((C, C)), zeros((C, kb)), zeros((C, kb)), zeros((C, kb)),
                              jnp.zeros((), F32)))
        b_row, b_col = plgpu.load(vecs.at[0], layout=ROWS), plgpu.load(vecs.at[1], layout=COLS)
        b_last = vecs[0, C - 1]
        DG = D * causal_decay(b_row, b_col, (C, C))
        plgpu.commit_smem()
        p_s[...] = DG.astype(dt)
        M = DG * _mm(q_s, k_s.T, (C, C))
        vecs[2] = M.sum(0)                                         # column sums, as rows
        db = M.sum(1)
        plgpu.commit_smem()

        def unpacked(ref):
            return plgpu.load(ref, layout=WGMMA).astype(F32)

        dq_inter = dOS * bcast_rows(jnp.exp2(b_row), (C, kb))                # ρ ∘ dO Sᵀ
        db = db + (unpacked(q_s) * dq_inter).sum(1) - plgpu.load(vecs.at[2], layout=ROWS)
        outs[0][...] = _mm(p_s, k_s, (C, kb), init=dq_inter).astype(dt)      # dQ
        dk_inter = VdS * bcast_rows(jnp.exp2(b_last - b_row), (C, kb))       # γ̄ ∘ V' dSᵀ
        kdk = (unpacked(k_s) * dk_inter).sum(1)
        outs[1][...] = _mm(plgpu.load(p_s.T, layout=WGMMA), q_s, (C, kb),
                           init=dk_inter).astype(dt)                         # dK
        outs[2][...] = dW.astype(dt)
        plgpu.commit_smem()
        last = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWS) == C - 1
        db = db - kdk + jnp.where(last, kdk.sum() + jnp.exp2(b_last) * SdS, 0.0)
        vecs[2] = db
        plgpu.commit_smem()
        for buf, ref in zip(outs, (dq_ref, dk_ref, dw_ref)):
            plgpu.copy_smem_to_gmem(buf, ref.at[bi, rows, hi, keys], commit_group=False)
        plgpu.copy_smem_to_gmem(vecs.at[2], db_ref.at[j, bi, hi, rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    out_type = 3 * [jax.ShapeDtypeStruct(q.shape, dt)] + [
        jax.ShapeDtypeStruct((d // kb, B, H, Tp), F32)]
    return build(body, out_type, scratch, (B, H, N, d // kb), ("b", "h", "n", "j"), interpret,
                 "gdn_grads")(q, k, vn, do, ndvn, s, ds, b2)
