"""The backward of log-linear Gated DeltaNet's per-chunk terms (``gdn_terms_triton.forward``) on Hopper:
one Mosaic GPU CTA per (batch, head, chunk), every product on the tensor cores (``wgmma``, 16-bit
operands, float32 accumulation).

With ``ρ = 2^{b2}``, ``ρ_c`` its value at the chunk end, ``e = ρ_c/ρ``, ``Γ[τ,σ] = ρ_τ/ρ_σ`` on
``σ ≤ τ``, the forward ``P = (Q Kᵀ) ∘ Γ``, ``M = P T``, ``Q̂ = ρ∘Q − P W``, ``A = ρ_c I − K̃ᵀ W``,
``Z = K̃ᵀ U`` (``K̃ = e∘K``) and the cotangents ``dM, dQ̂, dA, dZ``::

    dP = dM Tᵀ − dQ̂ Wᵀ,   dT = Pᵀ dM,   dS = dP ∘ Γ,   dK̃ = U dZᵀ − W dAᵀ
    dQ = dS K + ρ∘dQ̂,   dK = dSᵀ Q + e∘dK̃,   dW = −Pᵀ dQ̂ − e∘(K dA),   dU = e∘(K dZ)
    ∂L/∂b = rows(G) − cols(G) + ρ∘rows(dQ̂∘Q) − e∘rows(dK̃∘K) + [ρ_c tr(dA) + Σ e∘rows(dK̃∘K)]_c

with ``G = dP ∘ P`` (``K̃`` enters only as ``e∘(K ·)``, so it is never rounded).  The float32
factors ``T``, ``dM``, ``P`` and ``dS`` enter as two 16-bit halves (three products for a float32
pair, two with a 16-bit one; ``gdn_ut_mgpu.put``).  Column sums are float32 reductions over
rows, so each pair's term in ``rows(G) − cols(G)`` cancels in the gate's cumulative sum.  Every
input is loaded at the start; ``X`` and ``dM`` give way to ``T``'s and ``dM``'s halves (and
``T``'s to ``dT``), and each output is staged over an input it outlives (``dW`` over ``W``,
``dQ`` over ``dQ̂``, ``−dU`` over ``U``, ``dK`` over ``Q``): 208 KiB a CTA at ``d = dv = 128``,
one an SM.  The values go in tiles of 128 columns (64 when ``dv`` is an odd multiple of 64).

Inputs: ``q, k, w [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``, ``u [B,Tp,H,dv]`` (``dv`` a multiple
of 64), ``x, dm [B,H,Tp,C]`` float32 (``T = X diag(β)`` per chunk, formed as ``X`` is loaded),
``beta, b2 [B,H,Tp]`` float32, ``b2`` the local log2-decay, ``dqh [B,H,Tp,d]``,
``da [B,H,N,d,d]``, ``dz [B,H,N,d,dv]`` 16-bit.  Returns ``dq, dk, dw [B,Tp,H,d]`` and ``−dU
[B,Tp,H,dv]`` in ``q``'s dtype (``−dU`` as the UT backward takes it), ``dT [B,H,Tp,C]`` and
``∂L/∂b [B,H,Tp]`` float32 (``b`` in natural-log units).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.gdn.gdn_ut_mgpu import put
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


def backward(q, k, w, u, x, beta, b2, dm, dqh, da, dz, *, interpret=None):
    """``(dq, dk, dw, −du, dT, ∂L/∂b)`` (module docstring)."""
    B, Tp, H, d = q.shape
    dv, dt, N = u.shape[-1], q.dtype, Tp // C
    bv, nv = value_tiles(dv)
    _mm, _sum = products(interpret)
    cc = smem_tile((C, C), dt)
    f32 = plgpu.SMEM((C, C), F32)

    def tile(rows, cols):
        return smem_tile((rows, cols), dt)

    scratch = dict(
        q_s=tile(C, d), k_s=tile(C, d), w_s=tile(C, d), dqh_s=tile(C, d), u_s=tile(C, bv),
        da_s=tile(d, d), dz_s=tile(d, bv), ph_s=cc, pl_s=cc, dsh_s=cc, dsl_s=cc,
        t_x=plgpu.RefUnion(f32, (cc, cc)),     # X, then T's halves, then dT out
        m_x=plgpu.RefUnion(f32, (cc, cc)),     # dM, then its halves
        vecs=plgpu.SMEM((4, C), F32),     # b2 (read as rows, as columns); column sums, ∂L/∂b; β
        bar=plgpu.Barrier(num_arrivals=9), abar=plgpu.Barrier(num_arrivals=1),
        vbar=plgpu.Barrier(num_arrivals=2))

    def body(q_ref, k_ref, w_ref, u_ref, x_ref, beta_ref, b_ref, dm_ref, dqh_ref, da_ref, dz_ref,
             dq_ref, dk_ref, dw_ref, ndu_ref, dt_ref, db_ref, *, q_s, k_s, w_s, dqh_s, u_s,
             da_s, dz_s, ph_s, pl_s, dsh_s, dsl_s, t_x, m_x, vecs, bar, abar, vbar):
        bi, hi, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        (t_s, (th_s, tl_s)), (m_s, (mh_s, ml_s)) = t_x, m_x

        def load_values(i):
            cols = pl.ds(i * bv, bv)
            plgpu.copy_gmem_to_smem(u_ref.at[bi, rows, hi, cols], u_s, vbar)
            plgpu.copy_gmem_to_smem(dz_ref.at[bi, hi, n, :, cols], dz_s, vbar)

        def store(buf, dst):
            plgpu.copy_smem_to_gmem(buf, dst, commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        for ref, buf in ((q_ref, q_s), (k_ref, k_s), (w_ref, w_s)):
            plgpu.copy_gmem_to_smem(ref.at[bi, rows, hi], buf, bar)
        plgpu.copy_gmem_to_smem(dqh_ref.at[bi, hi, rows], dqh_s, bar)
        plgpu.copy_gmem_to_smem(x_ref.at[bi, hi, rows], t_s, bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[bi, hi, rows], vecs.at[3], bar)
        plgpu.copy_gmem_to_smem(dm_ref.at[bi, hi, rows], m_s, bar)
        for i in range(2):
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], vecs.at[i], bar)
        plgpu.copy_gmem_to_smem(da_ref.at[bi, hi, n], da_s, abar)
        load_values(0)
        plgpu.barrier_wait(bar)

        b_row, b_col = plgpu.load(vecs.at[0], layout=ROWS), plgpu.load(vecs.at[1], layout=COLS)
        rho, e = jnp.exp2(b_row), jnp.exp2(vecs[0, C - 1] - b_row)
        Gam = causal_decay(b_row, b_col, (C, C))
        P = _mm(q_s, k_s.T, (C, C)) * Gam
        put(P, ph_s, pl_s)
        beta = bcast_cols(plgpu.load(vecs.at[3], layout=COLS), (C, C))
        put(plgpu.load(t_s, layout=WGMMA) * beta, th_s, tl_s)              # T = X diag(β), over X
        put(plgpu.load(m_s, layout=WGMMA), mh_s, ml_s)                     # over dM
        dP = (_sum([(mh_s, th_s.T), (mh_s, tl_s.T), (ml_s, th_s.T)], (C, C))
              - _mm(dqh_s, w_s.T, (C, C)))                                  # dM Tᵀ − dQ̂ Wᵀ
        PhT, PlT = (plgpu.load(s_.T, layout=WGMMA) for s_ in (ph_s, pl_s))
        put(_sum([(PhT, mh_s), (PhT, ml_s), (PlT, mh_s)], (C, C)), t_s)    # dT = Pᵀ dM
        store(t_s, dt_ref.at[bi, hi, rows])
        G = dP * P
        vecs[2] = G.sum(0)                                                  # column sums, as rows
        put(dP * Gam, dsh_s, dsl_s)                                         # dS
        unpacked = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)    # noqa: E731
        db = G.sum(1) + rho * (unpacked(dqh_s) * unpacked(q_s)).sum(1)
        db = db - plgpu.load(vecs.at[2], layout=ROWS)
        plgpu.barrier_wait(abar)
        tr = 0.0
        for i in range(d // 64):                                            # tr(dA)
            blk = plgpu.load(da_s.at[pl.ds(i * 64, 64)], layout=WGMMA).astype(F32)
            r = plgpu.broadcasted_iota(jnp.int32, (64, d), 0, layout=WGMMA)
            c = plgpu.broadcasted_iota(jnp.int32, (64, d), 1, layout=WGMMA)
            tr = tr + jnp.where(r + i * 64 == c, blk, 0.0).sum(1).sum()
        dKt = -_mm(w_s, da_s.T, (C, d))                                     # − W dAᵀ
        KdA = _mm(k_s, da_s, (C, d)) * bcast_rows(e, (C, d))
        put(-_sum([(PhT, dqh_s), (PlT, dqh_s)], (C, d), init=KdA), w_s)    # dW over W
        store(w_s, dw_ref.at[bi, rows, hi])
        dQ = unpacked(dqh_s) * bcast_rows(rho, (C, d))
        put(_sum([(dsh_s, k_s), (dsl_s, k_s)], (C, d), init=dQ), dqh_s)    # dQ over dQ̂
        store(dqh_s, dq_ref.at[bi, rows, hi])

        def value_tile(i, dKt):                                             # dK̃ += U dZᵀ, −dU
            plgpu.barrier_wait(vbar)
            dKt = _mm(u_s, dz_s.T, (C, d), init=dKt)
            ndU = _mm(k_s, dz_s, (C, bv)) * bcast_rows(-e, (C, bv))
            put(ndU, u_s)                                                   # over U
            store(u_s, ndu_ref.at[bi, rows, hi, pl.ds(i * bv, bv)])

            @pl.when(i + 1 < nv)
            def _next():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_values(i + 1)
            return dKt

        dKt = lax.fori_loop(0, nv, value_tile, dKt)
        ede = e * (unpacked(k_s) * dKt).sum(1)                              # e∘rows(dK̃∘K)
        last = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWS) == C - 1
        db = db - ede + jnp.where(last, jnp.exp2(vecs[0, C - 1]) * tr + ede.sum(), 0.0)
        dShT, dSlT = (plgpu.load(s_.T, layout=WGMMA) for s_ in (dsh_s, dsl_s))
        dK = _sum([(dShT, q_s), (dSlT, q_s)], (C, d), init=dKt * bcast_rows(e, (C, d)))
        put(dK, q_s)                                                        # dK over Q
        vecs[2] = db
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, dk_ref.at[bi, rows, hi], commit_group=False)
        plgpu.copy_smem_to_gmem(vecs.at[2], db_ref.at[bi, hi, rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(q.shape, dt)] * 3 + [
        jax.ShapeDtypeStruct(u.shape, dt), jax.ShapeDtypeStruct((B, H, Tp, C), F32),
        jax.ShapeDtypeStruct((B, H, Tp), F32)]
    return build(body, out_type, scratch, (B, H, N), ("b", "h", "n"), interpret,
                 "gdn_terms_bwd")(q, k, w, u, x, beta, b2, dm, dqh, da, dz)
