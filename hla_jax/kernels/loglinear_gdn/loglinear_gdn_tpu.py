"""Log-linear Gated DeltaNet kernels for TPU (Mosaic).  NEVER RUN ON TPU HARDWARE: the tests
run these in interpret mode on CPU and check the Mosaic lowering.

Same interface as ``loglinear_gdn_triton`` (``bv``/``num_warps`` are ignored: one value tile,
Mosaic wants the last dim a multiple of 128 or the full extent).  Inputs move to ``[B,H,Tp,·]``
so that every block's last two dims are ``(c, ·)``; the intermediates ``Q̂, W, U, O_intra`` and
the shares ``dQ̂, dW`` stay in that layout (the caller only passes them between these kernels).
Per-token vectors come as ``[B,H,N,1,c]`` blocks, the level weights as ``[B,H,N,Lp,c]``.

- ``ut_forward`` / ``ut_backward``: grid ``(B, H, N)``, every step independent.
- ``walk_forward`` / ``walk_dstates``: grid ``(B, H, N)`` with the chunk axis last and
  sequential ("arbitrary", reversed for ``walk_dstates``); the S float32 level states ``d×dv``
  (or their cotangents) persist across the chunk axis in VMEM scratch, reset at the first chunk.
  The saved states are one ``[S,d,dv]`` block per chunk (the levels read at that chunk are
  written), and so are the level cotangents.
- ``walk_grads``: grid ``(B, H, N)``, every chunk independent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.la.la_chunk import F32
from hla_jax.kernels.loglinear_gdn import loglinear_gdn_chunk as chunk
from hla_jax.kernels.mosaic_tpu import compiler_params, heads_first, rows_by_chunk, rows_from_chunks


def specs(c, N, rev=False):
    n_of = (lambda n: N - 1 - n) if rev else (lambda n: n)
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n_of(n), 0))
    rows = lambda r: pl.BlockSpec((None, None, None, r, c), lambda i, h, n: (i, h, n_of(n), 0, 0))
    return tile, rows


def _levels(lam, c):
    lc = c.bit_length() - 1
    return lc, lam.shape[2] - lc - 1


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def ut_forward(q, k, v, b, beta, lam, *, c, num_warps=None, interpret=False):
    """As ``loglinear_gdn_triton.ut_forward``, outputs in ``[B,H,Tp,·]``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, (lc, _) = Tp // c, _levels(lam, c)
    tile, rows = specs(c, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, lam_ref, qh_ref, w_ref, u_ref, o_ref):
        lam_n = lam_ref[...]
        Qh, W, U, o_ref[...] = chunk.ut_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                                beta_ref[0], tuple(lam_n[l] for l in range(lc + 1)))
        qh_ref[...], w_ref[...], u_ref[...] = (x.astype(q.dtype) for x in (Qh, W, U))

    shape = lambda w, dt: jax.ShapeDtypeStruct((B, H, Tp, w), dt)
    return tuple(pl.pallas_call(
        kernel, out_shape=[shape(d, q.dtype), shape(d, q.dtype), shape(dv, q.dtype), shape(dv, F32)],
        grid=(B, H, N), in_specs=[tile(d), tile(d), tile(dv), rows(1), rows(1), rows(lam.shape[2])],
        out_specs=[tile(d), tile(d), tile(dv), tile(dv)],
        compiler_params=compiler_params(interpret, False), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), rows_by_chunk(b[:, :, None], c),
      rows_by_chunk(beta[:, :, None], c), rows_by_chunk(lam, c)))


@functools.partial(jax.jit, static_argnames=("c", "bv", "save_states", "num_warps", "interpret"))
def walk_forward(qh, w, k, u, o_intra, b, lam, *, c, bv=None, save_states=False, num_warps=None,
                 interpret=False):
    """As ``loglinear_gdn_triton.walk_forward``; the saved states are ``[B,H,N,S,d,dv]``."""
    B, H, Tp, d = qh.shape
    dv = u.shape[-1]
    N, (lc, S) = Tp // c, _levels(lam, c)
    tile, rows = specs(c, N)
    state = pl.BlockSpec((None, None, None, S, d, dv), lambda i, h, n: (i, h, n, 0, 0, 0))

    def kernel(qh_ref, w_ref, k_ref, u_ref, oi_ref, b_ref, lam_ref, o_ref, *rest):
        h_scr, n = rest[-1], pl.program_id(2)

        @pl.when(n == 0)
        def _():
            h_scr[...] = jnp.zeros_like(h_scr)

        def save(m, Hm):
            rest[0][m - 1] = Hm.astype(rest[0].dtype)

        Kt, gc = chunk.chunk_end(k_ref[...], b_ref[0])
        lam_n = lam_ref[...]
        O, Hs = chunk.walk_forward(qh_ref[...], w_ref[...], Kt, u_ref[...], gc,
                                   tuple(lam_n[lc + m] for m in range(1, S + 1)),
                                   tuple(h_scr[m] for m in range(S)), n,
                                   save if save_states else None)
        for m, Hm in enumerate(Hs):
            h_scr[m] = Hm
        o_ref[...] = oi_ref[...] + O

    out_shape, out_specs = [jax.ShapeDtypeStruct((B, H, Tp, dv), F32)], [tile(dv)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, S, d, dv), qh.dtype))
        out_specs.append(state)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(d), tile(dv), tile(dv), rows(1), rows(lam.shape[2])],
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM((S, d, dv), F32)],
        compiler_params=compiler_params(interpret, True), interpret=interpret,
    )(qh, w, heads_first(k), u, o_intra, rows_by_chunk(b[:, :, None], c), rows_by_chunk(lam, c))
    O = heads_first(out[0])
    return (O, out[1]) if save_states else O


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def walk_dstates(qh, w, k, u, b, lam, states, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``loglinear_gdn_triton.walk_dstates`` with one value tile: ``dOwn [B,H,N,d,dv]``
    and ``dlev [B,H,N,S,d,dv]`` (every level's cotangent per chunk, like the saved states)."""
    B, H, Tp, d = qh.shape
    dv = u.shape[-1]
    N, (lc, S) = Tp // c, _levels(lam, c)
    tile, rows = specs(c, N, rev=True)
    block = lambda *r: pl.BlockSpec((None, None, None, *r), lambda i, h, n: (i, h, N - 1 - n) + (0,) * len(r))

    def kernel(qh_ref, w_ref, k_ref, u_ref, b_ref, lam_ref, s_ref, do_ref, down_ref, dlev_ref, dh_scr):
        @pl.when(pl.program_id(2) == 0)
        def _():
            dh_scr[...] = jnp.zeros_like(dh_scr)

        n, lam_n = N - 1 - pl.program_id(2), lam_ref[...]
        Kt, gc = chunk.chunk_end(k_ref[...], b_ref[0])
        dOwn, dH = chunk.carry_backward(tuple(dh_scr[m] for m in range(S)), n)
        down_ref[...] = dOwn.astype(down_ref.dtype)
        for m, dHm in enumerate(dH):
            dlev_ref[m] = dHm.astype(dlev_ref.dtype)
        *_, dHs = chunk.walk_backward(
            qh_ref[...], w_ref[...], Kt, u_ref[...], gc,
            tuple(lam_n[lc + m] for m in range(1, S + 1)), do_ref[...],
            lambda m: s_ref[m - 1].astype(F32), dOwn, dH, n)
        for m, dHm in enumerate(dHs):
            dh_scr[m] = dHm

    return tuple(pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((B, H, N, d, dv), qh.dtype),
                           jax.ShapeDtypeStruct((B, H, N, S, d, dv), qh.dtype)],
        grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(d), tile(dv), rows(1), rows(lam.shape[2]), block(S, d, dv),
                  tile(dv)],
        out_specs=[block(d, dv), block(S, d, dv)], scratch_shapes=[pltpu.VMEM((S, d, dv), F32)],
        compiler_params=compiler_params(interpret, True), interpret=interpret,
    )(qh, w, heads_first(k), u, rows_by_chunk(b[:, :, None], c), rows_by_chunk(lam, c), states,
      heads_first(do)))


@functools.partial(jax.jit, static_argnames=("c", "bv", "num_warps", "interpret"))
def walk_grads(qh, w, k, u, b, lam, states, dOwn, dlev, do, *, c, bv=None, num_warps=None,
               interpret=False):
    """As ``loglinear_gdn_triton.walk_grads`` with one value tile: every chunk at once, grid
    ``(B, H, N)`` all parallel; ``dqh, dw`` in ``[1,B,H,Tp,d]``."""
    B, H, Tp, d = qh.shape
    dv = u.shape[-1]
    N, (lc, S) = Tp // c, _levels(lam, c)
    tile, rows = specs(c, N)
    block = lambda *r: pl.BlockSpec((None, None, None, *r), lambda i, h, n: (i, h, n) + (0,) * len(r))

    def kernel(qh_ref, w_ref, k_ref, u_ref, b_ref, lam_ref, s_ref, down_ref, dlev_ref, do_ref,
               dqh_ref, dw_ref, dk_ref, du_ref, db_ref, dlam_ref):
        K, bb, lam_n = k_ref[...], b_ref[0], lam_ref[...]
        Kt, gc = chunk.chunk_end(K, bb)
        dQh, dW, dKt, du_ref[...], dgc, dlam, _ = chunk.walk_backward(
            qh_ref[...], w_ref[...], Kt, u_ref[...], gc,
            tuple(lam_n[lc + m] for m in range(1, S + 1)), do_ref[...],
            lambda m: s_ref[m - 1].astype(F32), down_ref[...].astype(F32),
            [jnp.zeros((d, dv), F32)] * S, pl.program_id(2),
            dload=lambda m: dlev_ref[m - 1].astype(F32))
        dK, db = chunk.chunk_end_backward(K, bb, dKt, dgc)
        dqh_ref[...], dw_ref[...], dk_ref[...] = dQh, dW, dK
        db_ref[...] = db[None, :]
        for m, dl in enumerate(dlam):
            dlam_ref[pl.ds(m, 1), :] = dl[None, :]

    shape = lambda w: jax.ShapeDtypeStruct((B, H, Tp, w), F32)
    rows_shape = lambda r: jax.ShapeDtypeStruct((B, H, N, r, c), F32)
    dqh, dw, dk, du, db, dlam = pl.pallas_call(
        kernel, out_shape=[shape(d), shape(d), shape(d), shape(dv), rows_shape(1), rows_shape(S)],
        grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(d), tile(dv), rows(1), rows(lam.shape[2]), block(S, d, dv),
                  block(d, dv), block(S, d, dv), tile(dv)],
        out_specs=[tile(d), tile(d), tile(d), tile(dv), rows(1), rows(S)],
        compiler_params=compiler_params(interpret, False), interpret=interpret,
    )(qh, w, heads_first(k), u, rows_by_chunk(b[:, :, None], c), rows_by_chunk(lam, c), states, dOwn, dlev,
      heads_first(do))
    return (dqh[None], dw[None], heads_first(dk)[None], du, rows_from_chunks(db)[:, :, 0][None],
            rows_from_chunks(dlam)[None])


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def ut_backward(q, k, v, b, beta, lam, do, dqh, dw, du, *, c, num_warps=None, interpret=False):
    """As ``loglinear_gdn_triton.ut_backward`` (``dqh, dw, du`` in ``[B,H,Tp,·]``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, (lc, _) = Tp // c, _levels(lam, c)
    tile, rows = specs(c, N)

    def kernel(q_ref, k_ref, v_ref, b_ref, beta_ref, lam_ref, do_ref, dqh_ref, dw_ref, du_ref,
               dq_ref, dk_ref, dv_ref, db_ref, dbeta_ref, dlam_ref):
        lam_n = lam_ref[...]
        dq_ref[...], dk_ref[...], dv_ref[...], db, dbeta, dlam = chunk.ut_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], beta_ref[0],
            tuple(lam_n[l] for l in range(lc + 1)), dqh_ref[...], dw_ref[...], du_ref[...],
            do_ref[...])
        db_ref[...], dbeta_ref[...] = db[None, :], dbeta[None, :]
        for l, dl in enumerate(dlam):
            dlam_ref[pl.ds(l, 1), :] = dl[None, :]

    shape = lambda w: jax.ShapeDtypeStruct((B, H, Tp, w), F32)
    rows_shape = lambda r: jax.ShapeDtypeStruct((B, H, N, r, c), F32)
    dq, dk, dvv, db, dbeta, dlam = pl.pallas_call(
        kernel, out_shape=[shape(d), shape(d), shape(dv), rows_shape(1), rows_shape(1),
                           rows_shape(lc + 1)],
        grid=(B, H, N),
        in_specs=[tile(d), tile(d), tile(dv), rows(1), rows(1), rows(lam.shape[2]), tile(dv),
                  tile(d), tile(d), tile(dv)],
        out_specs=[tile(d), tile(d), tile(dv), rows(1), rows(1), rows(lc + 1)],
        compiler_params=compiler_params(interpret, False), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), rows_by_chunk(b[:, :, None], c),
      rows_by_chunk(beta[:, :, None], c), rows_by_chunk(lam, c), heads_first(do), dqh, dw, du)
    return (heads_first(dq), heads_first(dk), heads_first(dvv), rows_from_chunks(db)[:, :, 0],
            rows_from_chunks(dbeta)[:, :, 0], rows_from_chunks(dlam))
