"""Log-linear Mamba-2 chunked kernels for NVIDIA GPUs: ``pallas_call`` lowered through Triton.

Layout (a) of DESIGN.md: one program per (batch, head, value tile) walks the chunks in order;
the lazy binary counter of chunk-level states (``P`` float32 ``d×bv`` slot states, ``P = max(1,
bit_length(N−1))`` for ``N`` chunks; ``kernels/loglinear_chunk.py``) is the ``lax.fori_loop``
carry, i.e. on chip: no per-level launch, no ``T×T`` or per-chunk level tables (the intra-chunk
levels come from ``τ XOR σ`` on chip).  Inputs stay in the caller's ``[B,Tp,H,·]`` layout;
``lam`` arrives as ``[B,H,Ln,Tp]`` (``Ln = lc + 1 + P`` levels, one contiguous ``[c]`` row per
level and chunk), the slot decays ``s`` as ``[B,H,N,P]`` (scalar loads).

- ``forward``: the outputs ``O``; ``states``: instead, every chunk's merged state
  ``W: [B,H,N,d,dv]`` (input dtype): chunk ``n``'s slot ``j`` is ``W[block_end(n, j)]``, so N
  states checkpoint the whole counter.
- ``dstates``: walks the chunks in reverse with the slots' cotangents (``take`` transposes
  ``place``) and one scalar per slot accumulating the cotangent of its decay, and writes what
  each chunk needs from the walk: the cotangent of its merged state and that scalar (only
  these are kept of the chunk backward; the rest is dead code, removed by the compiler).
- ``grads``: chunk-parallel (one program per batch, head, chunk and value tile, no carry):
  value tile ``v`` of chunk ``n`` yields its share of ``dq, dk, db, dlam`` (summed by the
  caller) and its slice of ``dv``; its value tile is not bound by the level stack.

Triton needs power-of-two tiles and matmul dimensions >= 16: ``c``, ``d`` and ``bv`` are powers
of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32, at_end
from hla_jax.kernels.loglinear_chunk import (
    block_end,
    chunk_backward,
    chunk_forward,
    counter_flags,
    num_slots,
    place,
    take,
)

STATIC = ("c", "bv", "num_warps", "interpret")


def _walk(q, k, v, b, lam, s, *, c, bv, outputs, states, num_warps, interpret):
    """The forward walk writing ``O`` (``outputs``) and/or every chunk's merged state (``states``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N = Tp // c
    Ln = lam.shape[2]
    P = num_slots(Ln, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, *out_refs):
        i, h, jv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(jv * bv, bv), bv)

        def body(n, Ws):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            lives, merges, ats = counter_flags(n, P)
            O, merged = chunk_forward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
                [lam_ref[i, h, lev, ts] for lev in range(Ln)], lambda j: Ws[j],
                [s_ref[i, h, n, j] for j in range(P)], lives, merges)
            if outputs:
                out_refs[0][i, ts, h, vs] = O
            if states:
                out_refs[-1][i, h, n, :, vs] = merged.astype(out_refs[-1].dtype)
            return tuple(place(list(Ws), merged, ats))

        jax.lax.fori_loop(0, N, body, tuple(jnp.zeros((d, bv), F32) for _ in range(P)))

    out_shape = ([jax.ShapeDtypeStruct((B, Tp, H, dv), F32)] if outputs else []) + (
        [jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype)] if states else [])
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, dv // bv),
                         compiler_params=compiler_params(num_warps, interpret),
                         interpret=interpret)(q, k, v, b, lam, s)
    return out[0]


@functools.partial(jax.jit, static_argnames=STATIC)
def forward(q, k, v, b, lam, s, *, c, bv, num_warps=8, interpret=False):
    """``q, k: [B,Tp,H,d]``, ``v: [B,Tp,H,dv]``, ``b: [B,H,Tp]`` (local cumulative log-decay per
    chunk), ``lam: [B,H,Ln,Tp]``, ``s: [B,H,N,P]`` -> ``O [B,Tp,H,dv]`` float32."""
    return _walk(q, k, v, b, lam, s, c=c, bv=bv, outputs=True, states=False, num_warps=num_warps,
                 interpret=interpret)


@functools.partial(jax.jit, static_argnames=STATIC)
def states(q, k, v, b, lam, s, *, c, bv, num_warps=8, interpret=False):
    """Every chunk's merged state ``W [B,H,N,d,dv]`` (input dtype), without ``O``."""
    return _walk(q, k, v, b, lam, s, c=c, bv=bv, outputs=False, states=True, num_warps=num_warps,
                 interpret=interpret)


@functools.partial(jax.jit, static_argnames=STATIC)
def dstates(q, k, v, b, lam, s, W, do, *, c, bv, num_warps=8, interpret=False):
    """The reverse walk of the slots' cotangents, given the checkpoints ``W`` (``states``):
    every chunk's ``d_merged [B,H,N,d,dv]`` (input dtype) and ``carried [nv,B,H,Tp]`` float32
    (one share per value tile: the cotangent of each chunk's total log-decay through the states
    that cross it, at the chunk's last position, i.e. already in ``db``'s layout)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv = Tp // c, dv // bv
    Ln = lam.shape[2]
    P = num_slots(Ln, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, w_ref, do_ref, dm_ref, carried_ref):
        i, h, jv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(jv * bv, bv), bv)

        def body(m, carry):
            n = N - 1 - m
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            lives, merges, ats = counter_flags(n, P)
            d_merged, dWs, acc = take(*map(list, carry), ats)
            dm_ref[i, h, n, :, vs] = d_merged.astype(dm_ref.dtype)
            carried_ref[jv, i, h, ts] = at_end(sum(acc), c)
            *_, dWs, dlogs = chunk_backward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
                [lam_ref[i, h, lev, ts] for lev in range(Ln)],
                lambda j: w_ref[i, h, block_end(n, j), :, vs].astype(F32),
                [s_ref[i, h, n, j] for j in range(P)], lives, merges, do_ref[i, ts, h, vs],
                d_merged, dWs, 0.0)
            return tuple(dWs), tuple(a + dl for a, dl in zip(acc, dlogs))

        zeros = (tuple(jnp.zeros((d, bv), F32) for _ in range(P)),
                 tuple(jnp.zeros((), F32) for _ in range(P)))
        jax.lax.fori_loop(0, N, body, zeros)

    out_shape = [jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, lam, s, W, do))


@functools.partial(jax.jit, static_argnames=STATIC)
def grads(q, k, v, b, lam, s, W, do, dM, *, c, bv, num_warps=8, interpret=False):
    """Every chunk at once (grid ``(B, H, N, nv)``) from the checkpoints ``W`` and the merged
    states' cotangents ``dM`` (``dstates``): ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value
    tile), ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]`` (without ``carried``), ``dlam [nv,B,H,Ln,Tp]``,
    all float32."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv = Tp // c, dv // bv
    Ln = lam.shape[2]
    P = num_slots(Ln, c)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, w_ref, do_ref, dm_ref,
               dq_ref, dk_ref, dv_ref, db_ref, dlam_ref):
        i, h, n, jv = (pl.program_id(a) for a in range(4))
        vs = pl.ds(pl.multiple_of(jv * bv, bv), bv)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        lives, merges, _ = counter_flags(n, P)
        dQ, dK, dV, db, dlams, *_ = chunk_backward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
            [lam_ref[i, h, lev, ts] for lev in range(Ln)],
            lambda j: w_ref[i, h, block_end(n, j), :, vs].astype(F32),
            [s_ref[i, h, n, j] for j in range(P)], lives, merges, do_ref[i, ts, h, vs],
            dm_ref[i, h, n, :, vs].astype(F32), [jnp.zeros((d, bv), F32)] * P, 0.0)
        dq_ref[jv, i, ts, h, :] = dQ
        dk_ref[jv, i, ts, h, :] = dK
        dv_ref[i, ts, h, vs] = dV
        db_ref[jv, i, h, ts] = db
        for lev, dl in enumerate(dlams):
            dlam_ref[jv, i, h, lev, ts] = dl

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Ln, Tp), F32)]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, N, nv),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(q, k, v, b, lam, s, W, do, dM))
