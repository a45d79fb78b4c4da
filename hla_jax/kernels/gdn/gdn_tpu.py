"""The TPU backend of ``gdn_entry.py`` (Mosaic): first-order Gated DeltaNet's five steps, with
the interface of ``gdn_mgpu.py``, over the chunk math of ``gdn_chunk.py``.
NEVER RUN ON TPU HARDWARE: the tests run these in interpret mode on CPU and check that they
lower through Mosaic.

Grid ``(B, H, N)`` with the inputs moved to ``[B,H,Tp,·]`` (every block's last two dims
``(c, ·)``, ``kernels/mosaic_tpu.py``), one value tile.  ``ut_forward``, ``grads`` and
``ut_backward`` are parallel over chunks; ``walk_out`` and ``walk_rev`` walk the chunks in order
(in reverse) with the float32 state ``d×dv`` (its cotangent) in VMEM scratch, writing the state
met at every chunk (``[B,H,N,d,dv]`` in the inputs' dtype).  ``W, U, V', −dV'``, the
``dK``/``dW`` shares and ``X [B,H,Tp,c]`` stay heads-first between the steps; per-token rows
travel as ``[B,H,N,R,c]`` blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.gdn import gdn_chunk
from hla_jax.kernels.la.la_chunk import F32, dot
from hla_jax.kernels.mosaic_tpu import (
    chunk_specs,
    compiler_params,
    end_state,
    heads_first,
    rows_by_chunk,
    rows_from_chunks,
    start_carry,
    state_blocks,
    store_last,
)

C, CB = 64, 32   # chunk; row blocks of the UT transform's inverse


def _call(kernel, out_shape, in_specs, out_specs, grid, sequential, interpret, *args, state=None):
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM(state, F32)] if sequential else [],
        compiler_params=compiler_params(interpret, sequential), interpret=interpret)(*args)


def _rows_out(B, H, N, r):
    """Shape and block of per-token rows ``[B,H,N,r,c]`` (one ``[r,c]`` block per chunk)."""
    return (jax.ShapeDtypeStruct((B, H, N, r, C), F32),
            pl.BlockSpec((None, None, None, r, C), lambda i, h, n: (i, h, n, 0, 0)))


def ut_forward(k, v, b, beta, *, keep, interpret):
    """``(W, U, X)``: ``W [B,H,Tp,d]``, ``U [B,H,Tp,dv]`` in ``k``'s dtype, ``X [B,H,Tp,c]``
    (written with or without ``keep``, as the walk's residuals: one kernel per step here)."""
    B, Tp, H, d = k.shape
    dv, N = v.shape[-1], Tp // C
    tile, gate = chunk_specs(C, N)
    blocks = [pl.ds(m * CB, CB) for m in range(C // CB)]
    split = lambda x: [x[m * CB:(m + 1) * CB] for m in range(C // CB)]  # noqa: E731

    def kernel(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref, x_ref):
        bs, betas, Ks = split(b_ref[0]), split(beta_ref[0]), [k_ref[r, :] for r in blocks]
        fast = k.dtype == jnp.bfloat16
        X = gdn_chunk.ut_inverse(Ks, bs, betas)
        W = gdn_chunk.ut_apply(X, [(t * jnp.exp(e))[:, None] * K.astype(F32)
                                   for K, e, t in zip(Ks, bs, betas)], fast)
        U = gdn_chunk.ut_apply(X, [t[:, None] * v_ref[r, :].astype(F32)
                                   for r, t in zip(blocks, betas)], fast)
        for m, r in enumerate(blocks):
            w_ref[r, :], u_ref[r, :] = W[m].astype(w_ref.dtype), U[m].astype(u_ref.dtype)
            for j, x in enumerate(X[m]):
                x_ref[r, pl.ds(j * CB, CB)] = x

    shape = lambda w, dt: jax.ShapeDtypeStruct((B, H, Tp, w), dt)  # noqa: E731
    return tuple(_call(kernel, [shape(d, k.dtype), shape(dv, k.dtype), shape(C, F32)],
                       [tile(d), tile(dv), gate, gate], [tile(d), tile(dv), tile(C)], (B, H, N),
                       False, interpret, heads_first(k), heads_first(v), rows_by_chunk(b[:, :, None], C),
                       rows_by_chunk(beta[:, :, None], C)))


def _walk(step, q, k, w, x, b, s0, *, rev, interpret):
    """One walk over the chunks (in reverse when ``rev``) from ``s0``: per chunk
    ``step(Q, K, W, X, b, S) -> (the [c,dv] tiles, the next S)``: forward a float32 one and one in
    q's dtype (``gdn_chunk.walk_forward``), in reverse one in q's dtype (``walk_backward``); also
    writes the ``S`` met at every chunk ``[B,H,N,d,dv]`` in q's dtype and the last one
    ``[B,H,d,dv]`` float32."""
    B, H, Tp, d = w.shape
    dv, N = x.shape[-1], Tp // C
    tile, gate = chunk_specs(C, N, rev=rev)
    s_shape, s_block = state_blocks(B, H, N, d, dv, q.dtype, (lambda n: N - 1 - n) if rev else (lambda n: n))
    end_shape, end_block = end_state(B, H, d, dv)

    tiles = [q.dtype] if rev else [F32, q.dtype]

    def kernel(q_ref, k_ref, w_ref, x_ref, b_ref, s0_ref, *refs):
        *t_refs, s_ref, end_ref, S_ref = refs
        start_carry(S_ref, s0_ref)
        S = S_ref[...]
        s_ref[...] = S.astype(s_ref.dtype)
        out = step(q_ref[...], k_ref[...], w_ref[...], x_ref[...], b_ref[0], S)
        for ref, t in zip(t_refs, out[:-1]):
            ref[...] = t
        S_ref[...] = out[-1]
        store_last(S_ref, end_ref, N)

    value = lambda dt: jax.ShapeDtypeStruct((B, H, Tp, dv), dt)  # noqa: E731
    return _call(kernel, [*map(value, tiles), s_shape, end_shape],
                 [tile(d), tile(d), tile(d), tile(dv), gate, end_block],
                 [*(tile(dv) for _ in tiles), s_block, end_block], (B, H, N), True, interpret,
                 heads_first(q), heads_first(k), w, x, rows_by_chunk(b[:, :, None], C), s0,
                 state=(d, dv))


def walk_out(q, k, w, u, b, h0, *, keep, interpret):
    """``(O [B,Tp,H,dv] float32, H_T, V', S)`` by the forward walk from ``h0`` (``keep``: as
    ``ut_forward``)."""
    o, vn, s, hT = _walk(gdn_chunk.walk_forward, q, k, w, u, b, h0, rev=False, interpret=interpret)
    return heads_first(o), hT, vn, s


def walk_rev(q, k, w, do, b, dhT, *, interpret):
    """``(−dV', dS, dH0)`` by the reverse walk from ``dhT``; ``dS [B,H,N,d,dv]`` the cotangent
    of the state leaving each chunk."""
    return tuple(_walk(gdn_chunk.walk_backward, q, k, w, heads_first(do), b, dhT, rev=True,
                       interpret=interpret))


def grads(q, k, vn, do, ndu, s, ds, b, *, interpret):
    """``(dQ [B,Tp,H,d] in q's dtype, dK_walk, dW [B,H,Tp,d] float32, ∂L/∂b [B,H,Tp])`` (the
    walk's share, ``gdn_chunk.walk_grads``), every chunk at once."""
    B, Tp, H, d = q.shape
    dv, N = vn.shape[-1], Tp // C
    tile, gate = chunk_specs(C, N)
    _, s_block = state_blocks(B, H, N, d, dv, q.dtype, lambda n: n)
    rows_shape, rows_block = _rows_out(B, H, N, 1)

    def kernel(q_ref, k_ref, vn_ref, do_ref, nd_ref, s_ref, ds_ref, b_ref,
               dq_ref, dk_ref, dw_ref, sums_ref):
        D, dOS, VdS, dw_ref[...], SdS = gdn_chunk.walk_products(
            do_ref[...], vn_ref[...], nd_ref[...], s_ref[...].T, ds_ref[...].T)
        dQ, dk_ref[...], db = gdn_chunk.walk_grads(q_ref[...], k_ref[...], b_ref[0], D, dOS, VdS,
                                                   SdS)
        dq_ref[...] = dQ.astype(dq_ref.dtype)
        sums_ref[pl.ds(0, 1), :] = db[None, :]

    shape = lambda dt: jax.ShapeDtypeStruct((B, H, Tp, d), dt)  # noqa: E731
    dq, dk, dw, sums = _call(
        kernel, [shape(q.dtype), shape(F32), shape(F32), rows_shape],
        [tile(d), tile(d), tile(dv), tile(dv), tile(dv), s_block, s_block, gate],
        [tile(d), tile(d), tile(d), rows_block], (B, H, N), False, interpret,
        heads_first(q), heads_first(k), vn, heads_first(do), ndu, s, ds,
        rows_by_chunk(b[:, :, None], C))
    return heads_first(dq), dk, dw, rows_from_chunks(sums)[:, :, 0]


def ut_backward(k, v, b, beta, x, dw, ndu, dk, *, interpret):
    """``(dK [B,Tp,H,d] in k's dtype (the walk's part added), dV in v's, dβ, ∂L/∂b [B,H,Tp])``
    (the UT transform's share) from the forward's ``x`` and the cotangents ``dw``, ``ndu = −dU``
    and ``dk`` (the walk's part), every chunk at once."""
    B, Tp, H, d = k.shape
    dv, N = v.shape[-1], Tp // C
    tile, gate = chunk_specs(C, N)
    rows_shape, rows_block = _rows_out(B, H, N, 2)

    def kernel(k_ref, v_ref, b_ref, beta_ref, x_ref, dw_ref, ndu_ref, dkw_ref,
               dk_ref, dv_ref, rows_ref):
        K, V, X, bt, dU, dW = (k_ref[...], v_ref[...], x_ref[...], beta_ref[0],
                               -ndu_ref[...].astype(F32), dw_ref[...])
        fast = K.dtype == jnp.bfloat16
        dV = gdn_chunk.ut_backward_values(X, bt, dU, fast)
        dK, dbeta, db = gdn_chunk.ut_backward(K, b_ref[0], bt, X, dW,
                                              dot(dU.astype(K.dtype), V, tb=True))
        dk_ref[...], dv_ref[...] = (dK + dkw_ref[...]).astype(dk_ref.dtype), dV.astype(dv_ref.dtype)
        rows = (dbeta, db)
        for m, r in enumerate(rows):
            rows_ref[pl.ds(m, 1), :] = r[None, :]

    dk_, dv_, rows = _call(
        kernel, [jax.ShapeDtypeStruct((B, H, Tp, d), k.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), v.dtype), rows_shape],
        [tile(d), tile(dv), gate, gate, tile(C), tile(d), tile(dv), tile(d)],
        [tile(d), tile(dv), rows_block], (B, H, N), False, interpret,
        heads_first(k), heads_first(v), rows_by_chunk(b[:, :, None], C),
        rows_by_chunk(beta[:, :, None], C), x, dw, ndu, dk)
    return (heads_first(dk_), heads_first(dv_), *jnp.unstack(rows_from_chunks(rows), axis=2))
