"""Log-linear Gated DeltaNet kernels for NVIDIA GPUs: ``pallas_call`` lowered through Triton.

Four kernels over the chunk pieces of ``loglinear_gdn_chunk.py``; inputs and outputs
stay in the caller's ``[B,Tp,H,·]`` layout (strided tile loads), per-token vectors (``b``,
``beta``) are ``[B,H,Tp]`` and the level weights ``lam`` are ``[B,H,Lp,Tp]`` float32 with
``Lp = log2 c + 1 + S`` (S chunk levels).

- ``ut_forward``: grid ``(B, H, N)``, parallel over chunks: ``Q̂, W, U`` (input dtype) and
  ``O_intra`` (float32).
- ``walk_forward``: grid ``(B, H, nv)``, one program per value tile walks the chunks
  (``lax.fori_loop``) with the S float32 level states ``d×bv`` as the loop carry; a level is
  touched only at the chunks where it is non-empty (``lax.cond``).  With ``save_states`` it also
  writes, transiently for the backward, each level state at the chunks that read it, packed per
  level: level m is read at the chunks with bit m−1 set, ``⌊N/2⌋`` at most, ``[B,H,S,⌊N/2⌋,d,dv]``
  in the input dtype.
- ``walk_dstates``: the reverse walk with the cotangent level states (only these are kept of the
  chunk backward; the rest is dead code, removed by the compiler), writing per chunk the
  cotangent of its merged block and, packed as the states, those of the levels it reads.
- ``walk_grads``: chunk-parallel (grid ``(B, H, N, nv)``, no carry, its own value tile): value
  tile ``j`` of chunk ``n`` yields its share of ``dQ̂, dW, dK, db, dλ`` (summed by the caller)
  and its slice of ``dU``.
- ``ut_backward``: grid ``(B, H, N)``: ``dq, dk, dv, db, dβ, dλ`` (intra levels) of the UT part.

Triton needs power-of-two tiles and matmul dimensions >= 16 (``c, d, bv``; the caller pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.la.la_chunk import F32
from hla_jax.kernels.loglinear_gdn import loglinear_gdn_chunk as chunk
from hla_jax.kernels.triton import compiler_params


def _slot(n, m: int):
    """Index of chunk ``n`` among the chunks reading level ``m`` (those with bit m−1 set)."""
    return ((n >> m) << (m - 1)) + (n & ((1 << (m - 1)) - 1))


def _levels(lam, c):
    lc = c.bit_length() - 1
    return lc, lam.shape[2] - lc - 1


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def ut_forward(q, k, v, b, beta, lam, *, c, num_warps=8, interpret=False):
    """``(Q̂, W [B,Tp,H,d], U [B,Tp,H,dv])`` in the input dtype and ``O_intra [B,Tp,H,dv]``."""
    B, Tp, H, _ = q.shape
    lc, _ = _levels(lam, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, lam_ref, qh_ref, w_ref, u_ref, o_ref):
        i, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        Qh, W, U, O = chunk.ut_forward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, :], b_ref[i, h, ts],
            beta_ref[i, h, ts], tuple(lam_ref[i, h, l, ts] for l in range(lc + 1)))
        qh_ref[i, ts, h, :] = Qh.astype(qh_ref.dtype)
        w_ref[i, ts, h, :] = W.astype(w_ref.dtype)
        u_ref[i, ts, h, :] = U.astype(u_ref.dtype)
        o_ref[i, ts, h, :] = O

    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(v.shape, F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, beta, lam))


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def walk_forward(qh, w, k, u, o_intra, b, lam, *, c, bv, save_states=False, num_warps=8,
                 interpret=False):
    """``O = O_intra + Σ_m λ^{(log2 c + m)} ∘ (Q̂ H[m]) [B,Tp,H,dv]`` float32 (plus the packed
    level states when ``save_states``)."""
    B, Tp, H, d = qh.shape
    dv = u.shape[-1]
    N = Tp // c
    lc, S = _levels(lam, c)

    def kernel(qh_ref, w_ref, k_ref, u_ref, oi_ref, b_ref, lam_ref, o_ref, *s_ref):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, Hs):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            Kt, gc = chunk.chunk_end(k_ref[i, ts, h, :], b_ref[i, h, ts])

            def save(m, Hm):
                s_ref[0][i, h, m - 1, _slot(n, m), :, vs] = Hm.astype(s_ref[0].dtype)

            O, Hs = chunk.walk_forward(
                qh_ref[i, ts, h, :], w_ref[i, ts, h, :], Kt, u_ref[i, ts, h, vs],
                gc, tuple(lam_ref[i, h, lc + m, ts] for m in range(1, S + 1)), Hs, n,
                save if save_states else None)
            o_ref[i, ts, h, vs] = oi_ref[i, ts, h, vs] + O
            return Hs

        jax.lax.fori_loop(0, N, body, tuple(jnp.zeros((d, bv), F32) for _ in range(S)))

    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, dv), F32)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, S, max(N // 2, 1), d, dv), qh.dtype))
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                         compiler_params=compiler_params(num_warps, interpret),
                         interpret=interpret)(qh, w, k, u, o_intra, b, lam)
    return tuple(out) if save_states else out[0]


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def walk_dstates(qh, w, k, u, b, lam, states, do, *, c, bv, num_warps=8, interpret=False):
    """The reverse walk of the level cotangents (given the packed ``states``), writing what
    each chunk's gradients need: ``dOwn [B,H,N,d,dv]`` (the cotangent of its merged block) and
    ``dlev [B,H,S,⌊N/2⌋,d,dv]`` (those of the levels it reads, packed as ``states``), input dtype."""
    B, Tp, H, d = qh.shape
    dv = u.shape[-1]
    N = Tp // c
    lc, S = _levels(lam, c)

    def kernel(qh_ref, w_ref, k_ref, u_ref, b_ref, lam_ref, s_ref, do_ref, down_ref, dlev_ref):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(r, dHs):
            n = N - 1 - r
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            Kt, gc = chunk.chunk_end(k_ref[i, ts, h, :], b_ref[i, h, ts])
            dOwn, dH = chunk.carry_backward(dHs, n)
            down_ref[i, h, n, :, vs] = dOwn.astype(down_ref.dtype)
            for m in range(1, S + 1):
                @pl.when(chunk.read_at(n, m))
                def _(m=m):
                    dlev_ref[i, h, m - 1, _slot(n, m), :, vs] = dH[m - 1].astype(dlev_ref.dtype)

            *_, dHs = chunk.walk_backward(
                qh_ref[i, ts, h, :], w_ref[i, ts, h, :], Kt, u_ref[i, ts, h, vs],
                gc, tuple(lam_ref[i, h, lc + m, ts] for m in range(1, S + 1)),
                do_ref[i, ts, h, vs],
                lambda m: s_ref[i, h, m - 1, _slot(n, m), :, vs].astype(F32), dOwn, dH, n)
            return dHs

        jax.lax.fori_loop(0, N, body, tuple(jnp.zeros((d, bv), F32) for _ in range(S)))

    out_shape = [jax.ShapeDtypeStruct((B, H, N, d, dv), qh.dtype),
                 jax.ShapeDtypeStruct((B, H, S, max(N // 2, 1), d, dv), qh.dtype)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(qh, w, k, u, b, lam, states, do))


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def walk_grads(qh, w, k, u, b, lam, states, dOwn, dlev, do, *, c, bv, num_warps=8, interpret=False):
    """Cotangents of ``walk_forward``, every chunk at once (grid ``(B, H, N, nv)``) from the
    saved states and ``walk_dstates``: ``(dqh, dw, dk) [nv,B,Tp,H,d]`` (one share per value
    tile), ``du [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``, ``dlam [nv,B,H,S,Tp]`` (the chunk levels),
    float32."""
    B, Tp, H, d = qh.shape
    dv = u.shape[-1]
    N, nv = Tp // c, dv // bv
    lc, S = _levels(lam, c)

    def kernel(qh_ref, w_ref, k_ref, u_ref, b_ref, lam_ref, s_ref, down_ref, dlev_ref, do_ref,
               dqh_ref, dw_ref, dk_ref, du_ref, db_ref, dlam_ref):
        i, h, n, j = (pl.program_id(a) for a in range(4))
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        K, bb = k_ref[i, ts, h, :], b_ref[i, h, ts]
        Kt, gc = chunk.chunk_end(K, bb)
        dQh, dW, dKt, dU, dgc, dlam, _ = chunk.walk_backward(
            qh_ref[i, ts, h, :], w_ref[i, ts, h, :], Kt, u_ref[i, ts, h, vs],
            gc, tuple(lam_ref[i, h, lc + m, ts] for m in range(1, S + 1)), do_ref[i, ts, h, vs],
            lambda m: s_ref[i, h, m - 1, _slot(n, m), :, vs].astype(F32),
            down_ref[i, h, n, :, vs].astype(F32), [jnp.zeros((d, bv), F32)] * S, n,
            dload=lambda m: dlev_ref[i, h, m - 1, _slot(n, m), :, vs].astype(F32))
        dK, db = chunk.chunk_end_backward(K, bb, dKt, dgc)
        dqh_ref[j, i, ts, h, :] = dQh
        dw_ref[j, i, ts, h, :] = dW
        dk_ref[j, i, ts, h, :] = dK
        du_ref[i, ts, h, vs] = dU
        db_ref[j, i, h, ts] = db
        for m, dl in enumerate(dlam):
            dlam_ref[j, i, h, m, ts] = dl

    share = jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32)
    out_shape = [share, share, share, jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32),
                 jax.ShapeDtypeStruct((nv, B, H, S, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, N, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(qh, w, k, u, b, lam, states, dOwn, dlev, do))


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def ut_backward(q, k, v, b, beta, lam, do, dqh, dw, du, *, c, num_warps=8, interpret=False):
    """Cotangents of ``ut_forward``: ``dq, dk [B,Tp,H,d]``, ``dv [B,Tp,H,dv]``, ``db, dbeta
    [B,H,Tp]``, ``dlam [B,H,log2 c + 1,Tp]`` (the intra levels), float32."""
    B, Tp, H, _ = q.shape
    lc, _ = _levels(lam, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, lam_ref, do_ref, dqh_ref, dw_ref, du_ref,
               dq_ref, dk_ref, dv_ref, db_ref, dbeta_ref, dlam_ref):
        i, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        dQ, dK, dV, db, dbeta, dlam = chunk.ut_backward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, :], b_ref[i, h, ts],
            beta_ref[i, h, ts], tuple(lam_ref[i, h, l, ts] for l in range(lc + 1)),
            dqh_ref[i, ts, h, :], dw_ref[i, ts, h, :], du_ref[i, ts, h, :], do_ref[i, ts, h, :])
        dq_ref[i, ts, h, :] = dQ
        dk_ref[i, ts, h, :] = dK
        dv_ref[i, ts, h, :] = dV
        db_ref[i, h, ts] = db
        dbeta_ref[i, h, ts] = dbeta
        for l, dl in enumerate(dlam):
            dlam_ref[i, h, l, ts] = dl

    vec = jax.ShapeDtypeStruct((B, H, Tp), F32)
    out_shape = [jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct(q.shape, F32),
                 jax.ShapeDtypeStruct(v.shape, F32), vec, vec,
                 jax.ShapeDtypeStruct((B, H, lc + 1, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, beta, lam, do, dqh, dw, du))
