"""Log-linear Mamba-2 in the block form for NVIDIA GPUs: ``pallas_call`` lowered through Triton.

Every kernel is chunk-parallel (no walk, no carry across chunks; ``loglinear_chunk.py``):

- ``half_states``: per chunk level ``j``, one program per (batch, head, block of ``2^(j+1)``
  chunks, piece, value tile) sums ``(lw_j ∘ X)ᵀ Y`` over the chunks of one half of its block
  (``side`` 0: the left half, ``X, Y = K, V``: the states ``H_j``; ``side`` 1: the right half,
  ``X, Y = Q, dO``: their cotangents).  A half of more than ``piece`` chunks is cut into pieces
  whose float32 sums are added, so the top levels still fill the GPU;
- ``forward``: one program per (batch, head, chunk, value tile): the intra-chunk levels and the
  states of the levels whose right half holds the chunk, ``O [B,Tp,H,dv]`` float32;
- ``backward``: two kernels on the same grid, the query side and the key/value side:
  ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile), ``dv [B,Tp,H,dv]``,
  ``db [nv,B,H,Tp]``, ``dlam [nv,B,H,lc+1,Tp]``, ``dlw [nv,B,H,P,Tp]``.

Settings (the fastest in tuning runs at bf16, H=16, d=dv=128): 4 warps and value tiles of 128
everywhere; ``half_states`` sums ``PIECE = 32`` chunks per program at most, software-pipelined
(``NUM_STAGES``).

Inputs stay in the caller's ``[B,Tp,H,·]`` layout; ``b [B,H,Tp]`` is the chunk-local cumulative
log-decay, ``lam [B,H,lc+1,Tp]`` the intra-chunk λ rows, ``lw [B,H,P,Tp]`` the tokens' level
weights (``core.block_levels.token_weights``), ``Hs`` one ``[B,H,nb_j,d,dv]`` per level.
Triton needs power-of-two tiles and matmul dimensions >= 16: ``c``, ``d`` and ``bv`` are powers
of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.la.la_chunk import F32
from hla_jax.kernels.loglinear.loglinear_chunk import (
    chunk_backward_kv,
    chunk_backward_q,
    chunk_forward,
    half_state,
    live,
)

STATIC = ("c", "bv", "num_warps", "interpret")
PIECE = 32  # chunks summed by one half_states program at most
NUM_STAGES = 3  # half_states' software pipeline


def _call(kernel, out_shape, grid, num_warps, interpret, *args, num_stages=1):
    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, compiler_params=params,
                          interpret=interpret)(*args)


def _rows(n, size):
    return pl.ds(pl.multiple_of(n * size, size), size)


@functools.partial(jax.jit, static_argnames=STATIC + ("j", "side", "piece", "num_stages"))
def half_states(x, y, lw, *, j, side, c, bv, num_warps=4, interpret=False, piece=PIECE,
                num_stages=NUM_STAGES):
    """``[B,H,nb,dx,dy]`` in ``x``'s dtype: per aligned block of ``2^(j+1)`` chunks, the sum of
    ``(lw_j ∘ x)ᵀ y`` over the chunks of its ``side`` half (chunks past the end count 0)."""
    B, Tp, H, dx = x.shape
    dy = y.shape[-1]
    N, span = Tp // c, 1 << j
    nb, pieces = -(-N // (2 * span)), max(1, span // piece)
    steps = span // pieces

    def kernel(x_ref, y_ref, lw_ref, o_ref):
        i, h, blk, p, jv = (pl.program_id(a) for a in range(5))
        vs = _rows(jv, bv)
        first = blk * 2 * span + side * span + p * steps

        def body(m, acc):
            n = first + m
            ts = _rows(jnp.minimum(n, N - 1), c)
            w = jnp.where(n < N, lw_ref[i, h, j, ts], 0.0)
            return half_state(x_ref[i, ts, h, :], y_ref[i, ts, h, vs], w, acc)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((dx, bv), F32))
        o_ref[i, h, blk, p, :, vs] = acc.astype(o_ref.dtype)

    dt = x.dtype if pieces == 1 else F32
    out = _call(kernel, jax.ShapeDtypeStruct((B, H, nb, pieces, dx, dy), dt),
                (B, H, nb, pieces, dy // bv), num_warps, interpret, x, y, lw,
                num_stages=num_stages)
    return out[:, :, :, 0] if pieces == 1 else out.sum(3).astype(x.dtype)


def _chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, i, h, ts, vs):
    """The chunk's tiles: ``Q, K, V, bb``, the intra λ rows and the level weights."""
    return (q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
            [lam_ref[i, h, lev, ts] for lev in range(lam_ref.shape[2])],
            [lw_ref[i, h, j, ts] for j in range(lw_ref.shape[2])])


@functools.partial(jax.jit, static_argnames=STATIC)
def forward(q, k, v, b, lam, lw, Hs, *, c, bv, num_warps=4, interpret=False):
    """``O [B,Tp,H,dv]`` float32 (module docstring)."""
    B, Tp, H, _ = q.shape
    dv, N, P = v.shape[-1], Tp // c, len(Hs)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, *refs):
        *h_refs, o_ref = refs
        i, h, n, jv = (pl.program_id(a) for a in range(4))
        ts, vs = _rows(n, c), _rows(jv, bv)
        o_ref[i, ts, h, vs] = chunk_forward(
            *_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, i, h, ts, vs),
            lambda j: h_refs[j][i, h, n >> (j + 1), :, vs], [live(n, j) for j in range(P)])

    return _call(kernel, jax.ShapeDtypeStruct((B, Tp, H, dv), F32), (B, H, N, dv // bv),
                 num_warps, interpret, q, k, v, b, lam, lw, *Hs)


@functools.partial(jax.jit, static_argnames=STATIC)
def backward(q, k, v, b, lam, lw, Hs, dHs, do, *, c, bv, num_warps=4, interpret=False):
    """``(dq, dk, dv, db, dlam, dlw)`` float32 (module docstring), given the states ``Hs`` and
    their cotangents ``dHs`` (``half_states`` of ``q, do`` on the right halves): the query side,
    then the key/value side, each one program per chunk."""
    B, Tp, H, d = q.shape
    dv, N, P, Li = v.shape[-1], Tp // c, len(Hs), lam.shape[2]
    nv = dv // bv

    def kq(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, do_ref, *refs):
        h_refs, (dq_ref, db_ref, dlam_ref, dlw_ref) = refs[:P], refs[P:]
        i, h, n, jv = (pl.program_id(a) for a in range(4))
        ts, vs = _rows(n, c), _rows(jv, bv)
        dQ, db, dlams, dlw = chunk_backward_q(
            *_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, i, h, ts, vs),
            lambda j: h_refs[j][i, h, n >> (j + 1), :, vs], [live(n, j) for j in range(P)],
            do_ref[i, ts, h, vs])
        dq_ref[jv, i, ts, h, :] = dQ
        db_ref[jv, i, h, ts] = db
        for lev, x in enumerate(dlams):
            dlam_ref[jv, i, h, lev, ts] = x
        for j, x in enumerate(dlw):
            dlw_ref[jv, i, h, j, ts] = x

    def kkv(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, do_ref, *refs):
        dh_refs, (dk_ref, dv_ref, dlw_ref) = refs[:P], refs[P:]
        i, h, n, jv = (pl.program_id(a) for a in range(4))
        ts, vs = _rows(n, c), _rows(jv, bv)
        dK, dV, dlw = chunk_backward_kv(
            *_chunk(q_ref, k_ref, v_ref, b_ref, lam_ref, lw_ref, i, h, ts, vs),
            lambda j: dh_refs[j][i, h, n >> (j + 1), :, vs], [live(n, j) for j in range(P)],
            do_ref[i, ts, h, vs])
        dk_ref[jv, i, ts, h, :] = dK
        dv_ref[i, ts, h, vs] = dV
        for j, x in enumerate(dlw):
            dlw_ref[jv, i, h, j, ts] = x

    S = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
    dq, db, dlam, dlw1 = _call(kq, [S(nv, B, Tp, H, d), S(nv, B, H, Tp), S(nv, B, H, Li, Tp),
                                    S(nv, B, H, P, Tp)], (B, H, N, nv), num_warps, interpret,
                               q, k, v, b, lam, lw, do, *Hs)
    dk, dv_, dlw2 = _call(kkv, [S(nv, B, Tp, H, d), S(B, Tp, H, dv), S(nv, B, H, P, Tp)],
                          (B, H, N, nv), num_warps, interpret, q, k, v, b, lam, lw, do, *dHs)
    return dq, dk, dv_, db, dlam, dlw1 + dlw2
