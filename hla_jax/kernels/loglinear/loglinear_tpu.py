"""Log-linear Mamba-2 in the block form for TPU (Mosaic).  NEVER RUN ON TPU HARDWARE: the
tests run these in interpret mode on CPU and check the Mosaic lowering.

Same interface and chunk math as ``loglinear_triton`` (``loglinear_chunk.py``),
one value tile (``bv``/``num_warps`` are ignored):

- ``half_states``: grid ``(B, H, nb, 2^j)``, the last axis sequential ("arbitrary"): step ``m``
  gets chunk ``m`` of the block's half by the pipeline's DMA (its index map computes the chunk,
  clamped to the last one, whose weight then counts 0) and adds to a float32 VMEM accumulator,
  written at the last step;
- ``forward`` and ``backward`` (the query side, then the key/value side): grid ``(B, H, N)``,
  all parallel; level ``j``'s state ``H_j[n >> (j+1)]`` (and ``dH_j``) is its own input whose
  index map computes that block, so the pipeline fetches it only when it changes.

Inputs are moved to ``[B,H,Tp,·]``; the gate comes as ``[B,H,N,1,c]``, ``lam`` as
``[B,H,lc+1,Tp]`` and ``lw`` as ``[B,H,P,Tp]`` (a ``[rows, c]`` block per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.la.la_chunk import F32
from hla_jax.kernels.loglinear.loglinear_chunk import (
    chunk_backward_kv,
    chunk_backward_q,
    chunk_forward,
    half_state,
    live,
)
from hla_jax.kernels.mosaic_tpu import compiler_params, heads_first

STATIC = ("c", "bv", "num_warps", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC + ("j", "side"))
def half_states(x, y, lw, *, j, side, c, bv=None, num_warps=None, interpret=False):
    """As ``loglinear_triton.half_states``: ``[B,H,nb,dx,dy]`` in ``x``'s dtype."""
    B, Tp, H, dx = x.shape
    dy = y.shape[-1]
    N, span, P = Tp // c, 1 << j, lw.shape[2]
    nb = -(-N // (2 * span))
    chunk = lambda blk, m: blk * 2 * span + side * span + m     # noqa: E731
    at = lambda blk, m: jnp.minimum(chunk(blk, m), N - 1)       # noqa: E731

    def kernel(x_ref, y_ref, lw_ref, o_ref, acc):
        blk, m = pl.program_id(2), pl.program_id(3)

        @pl.when(m == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        w = jnp.where(chunk(blk, m) < N, lw_ref[j], 0.0)
        acc[...] = half_state(x_ref[...], y_ref[...], w, acc[...])

        @pl.when(m == span - 1)
        def _():
            o_ref[...] = acc[...].astype(o_ref.dtype)

    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, blk, m: (i, h, at(blk, m), 0))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((B, H, nb, dx, dy), x.dtype), grid=(B, H, nb, span),
        in_specs=[tile(dx), tile(dy),
                  pl.BlockSpec((None, None, P, c), lambda i, h, blk, m: (i, h, 0, at(blk, m)))],
        out_specs=pl.BlockSpec((None, None, None, dx, dy), lambda i, h, blk, m: (i, h, blk, 0, 0)),
        scratch_shapes=[pltpu.VMEM((dx, dy), F32)],
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(heads_first(x), heads_first(y), lw)


def _operands(q, k, v, b, lam, lw, Hs, c):
    """``(in_specs, args, rows)`` of what every per-chunk kernel reads (q, k, v heads first,
    the gate, λ and ``lw`` rows, one state per level), and ``rows(n)``: a ``[n, c]`` block."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n, 0))
    rows = lambda r: pl.BlockSpec((None, None, r, c), lambda i, h, n: (i, h, 0, n))
    states = [pl.BlockSpec((None, None, None, d, dv), lambda i, h, n, j=j: (i, h, n >> (j + 1), 0, 0))
              for j in range(len(Hs))]
    specs = [tile(d), tile(d), tile(dv),
             pl.BlockSpec((None, None, None, 1, c), lambda i, h, n: (i, h, n, 0, 0)),
             rows(lam.shape[2]), rows(lw.shape[2]), *states]
    args = [heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), lam, lw, *Hs]
    return specs, args, tile, rows, states


def _chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref):
    return (q_ref[...], k_ref[...], v_ref[...], b_ref[0],
            [lam_ref[lev] for lev in range(lam_ref.shape[0])],
            [lw_ref[j] for j in range(lw_ref.shape[0])])


def _call(kernel, out_shape, grid, in_specs, out_specs, interpret, *args):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs,
                          compiler_params=compiler_params(interpret, sequential=False),
                          interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=STATIC)
def forward(q, k, v, b, lam, lw, Hs, *, c, bv=None, num_warps=None, interpret=False):
    """As ``loglinear_triton.forward``: ``O [B,Tp,H,dv]`` float32."""
    B, Tp, H, _ = q.shape
    dv, P = v.shape[-1], len(Hs)
    specs, args, tile, _, _ = _operands(q, k, v, b, lam, lw, Hs, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, *refs):
        *h_refs, o_ref = refs
        n = pl.program_id(2)
        o_ref[...] = chunk_forward(*_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref),
                                   lambda j: h_refs[j][...], [live(n, j) for j in range(P)])

    o = _call(kernel, jax.ShapeDtypeStruct((B, H, Tp, dv), F32), (B, H, Tp // c), specs,
              tile(dv), interpret, *args)
    return heads_first(o)


@functools.partial(jax.jit, static_argnames=STATIC)
def backward(q, k, v, b, lam, lw, Hs, dHs, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``loglinear_triton.backward`` with one value tile (share axes of length 1)."""
    B, Tp, H, d = q.shape
    dv, N, P, Li = v.shape[-1], Tp // c, len(Hs), lam.shape[2]
    specs, args, tile, rows, states = _operands(q, k, v, b, lam, lw, Hs, c)
    S = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
    gate = pl.BlockSpec((None, None, None, 1, c), lambda i, h, n: (i, h, n, 0, 0))

    def kq(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, *refs):
        h_refs, (do_ref, dq_ref, db_ref, dlam_ref, dlw_ref) = refs[:P], refs[P:]
        n = pl.program_id(2)
        dq_ref[...], db, dlams, dlw = chunk_backward_q(
            *_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref), lambda j: h_refs[j][...],
            [live(n, j) for j in range(P)], do_ref[...])
        db_ref[...] = db[None, :]
        dlam_ref[...] = jnp.stack(dlams)
        dlw_ref[...] = jnp.stack(dlw)

    def kkv(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, *refs):
        dh_refs, (do_ref, dk_ref, dv_ref, dlw_ref) = refs[:P], refs[P:]
        n = pl.program_id(2)
        dk_ref[...], dv_ref[...], dlw = chunk_backward_kv(
            *_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref), lambda j: dh_refs[j][...],
            [live(n, j) for j in range(P)], do_ref[...])
        dlw_ref[...] = jnp.stack(dlw)

    do = heads_first(do)
    dq, db, dlam, dlw1 = _call(
        kq, [S(B, H, Tp, d), S(B, H, N, 1, c), S(B, H, Li, Tp), S(B, H, P, Tp)], (B, H, N),
        specs + [tile(dv)], [tile(d), gate, rows(Li), rows(P)], interpret, *args, do)
    dk, dvv, dlw2 = _call(
        kkv, [S(B, H, Tp, d), S(B, H, Tp, dv), S(B, H, P, Tp)], (B, H, N),
        specs[:6] + states + [tile(dv)], [tile(d), tile(dv), rows(P)], interpret,
        *args[:6], *dHs, do)
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp), dlam[None], (dlw1 + dlw2)[None])
