"""The chunk walks of first-order LA (``la_chunk.py``) for NVIDIA GPUs: ``pallas_call``
lowered through Triton (jax 0.11.2).

The state is one float32 ``S: d×bv`` per (batch, head, value tile of ``bv`` columns).  Inputs
``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` stay in the caller's layout (strided tile loads), with
``b [B,H,Tp]`` the chunk-local cumulative log-decay.

The *walks* run one program per (batch, head, value tile) over the chunks in order, ``S`` in
registers (``lax.fori_loop`` carry):

- ``forward``: the outputs ``O [B,Tp,H,dv]`` float32;
- ``states``: the incoming ``S`` of every ``every``-th chunk, ``[B,H,⌈N/every⌉,d,dv]``, in the
  input dtype (float32 checkpoints when ``every > 1``), without ``O``;
  both start from ``h0 [B,H,d,dv]`` (float32; zeros if None) and with ``final`` also return the
  last chunk's outgoing ``S`` (float32 ``[B,H,d,dv]``): state passing between calls;
- ``dstates``: in reverse from ``dhT``, the cotangent of every chunk's outgoing ``S``
  (``[B,H,N,d,dv]``, input dtype) and of the first chunk's incoming one (float32): the chunk
  backward, of which only ``dS0`` is kept (the rest is dead code, removed by the compiler).  LA
  is linear in ``S``, so zeros stand in for it.

The *chunk-parallel* kernels run one program per (batch, head, chunk, value tile) from the saved
states, with no carry:

- ``outputs``: ``O`` from every chunk's incoming ``S``;
- ``grads``: ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile), ``dv [B,Tp,H,dv]``,
  ``db [nv,B,H,Tp]``, float32, from the incoming states, ``do`` and the outgoing cotangents.

Triton needs power-of-two tiles and every matmul dimension >= 16: ``c``, ``d`` and ``bv`` are
powers of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.la.la_chunk import F32, chunk_backward, chunk_forward
from hla_jax.kernels.triton import compiler_params
from hla_jax.kernels.wrap import given, jit, unpack

NUM_WARPS = 8


def _call(kernel, out_shape, grid, interpret, *args):
    """``pallas_call`` on ``grid``: ``(B, H, nv)`` for a walk, ``(B, H, N, nv)`` chunk-parallel."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                          compiler_params=compiler_params(NUM_WARPS, interpret),
                          interpret=interpret)(*args)


def _slice(n, size):
    """Block ``n`` of ``size``: chunk ``n`` (of ``c`` tokens) or value tile ``n`` (of ``bv``)."""
    return pl.ds(pl.multiple_of(n * size, size), size)


def _start(ref, i, h, vs, d, bv):
    """The carry a walk starts from: ``ref[i, h, :, vs]`` in float32, zeros if no ``ref``."""
    return jnp.zeros((d, bv), F32) if ref is None else ref[i, h, :, vs].astype(F32)


def _walk(q, k, v, b, h0, *, outputs, every, final, c, bv, interpret):
    """The forward walk from ``h0``, writing ``O`` (``outputs``), the incoming ``S`` of every
    ``every``-th chunk (``every``: None for none) and the last outgoing ``S`` (``final``)."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    out_shape = []
    if outputs:
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H, dv), F32))
    if every is not None:
        out_shape.append(jax.ShapeDtypeStruct((B, H, -(-N // every), d, dv),
                                              F32 if every > 1 else q.dtype))
    if final:
        out_shape.append(jax.ShapeDtypeStruct((B, H, d, dv), F32))

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        h0_ref, o_ref, s_ref, hT_ref = unpack(refs, h0 is not None, outputs, every is not None,
                                              final)
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = _slice(j, bv)

        def save(n, S):
            s_ref[i, h, n, :, vs] = S.astype(s_ref.dtype)

        def body(n, S):
            ts = _slice(n, c)
            if every == 1:
                save(n, S)
            elif every is not None:
                # lax: jnp's % and // lower to mixed types
                pl.when(jax.lax.rem(n, every) == 0)(lambda: save(jax.lax.div(n, every), S))
            O, S = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                 b_ref[i, h, ts], S)
            if outputs:
                o_ref[i, ts, h, vs] = O
            return S

        S = jax.lax.fori_loop(0, N, body, _start(h0_ref, i, h, vs, d, bv))
        if final:
            hT_ref[i, h, :, vs] = S

    out = _call(kernel, out_shape, (B, H, dv // bv), interpret, q, k, v, b, *given(h0))
    return tuple(out) if final else out[0]


@jit("final")
def forward(q, k, v, b, h0=None, *, final=False, c, bv, interpret=False):
    """``O [B,Tp,H,dv]`` float32 by one walk from ``h0``; with ``final``, ``(O, hT)``."""
    return _walk(q, k, v, b, h0, outputs=True, every=None, final=final, c=c, bv=bv,
                 interpret=interpret)


@jit("every", "final")
def states(q, k, v, b, h0=None, *, every=1, final=False, c, bv, interpret=False):
    """The incoming ``S`` of every ``every``-th chunk from ``h0``; with ``final``,
    ``(per_chunk, hT)``."""
    return _walk(q, k, v, b, h0, outputs=False, every=every, final=final, c=c, bv=bv,
                 interpret=interpret)


@jit()
def dstates(q, k, v, b, do, dhT=None, *, c, bv, interpret=False):
    """``(dS, dh0)``: the cotangents of every chunk's outgoing ``S`` (``[B,H,N,d,dv]``, input
    dtype) and of ``h0`` (float32 ``[B,H,d,dv]``), by the reverse walk from ``dhT`` (zeros if
    None)."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c

    def kernel(q_ref, k_ref, v_ref, b_ref, do_ref, *refs):
        dhT_ref, ds_ref, dh0_ref = unpack(refs, dhT is not None, True, True)
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = _slice(j, bv)

        def body(m, dS):
            n = N - 1 - m
            ts = _slice(n, c)
            ds_ref[i, h, n, :, vs] = dS.astype(ds_ref.dtype)
            *_, dS = chunk_backward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                    b_ref[i, h, ts], jnp.zeros((d, bv), q.dtype),
                                    do_ref[i, ts, h, vs], dS)
            return dS

        dh0_ref[i, h, :, vs] = jax.lax.fori_loop(0, N, body, _start(dhT_ref, i, h, vs, d, bv))

    out_shape = [jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype),
                 jax.ShapeDtypeStruct((B, H, d, dv), F32)]
    return tuple(_call(kernel, out_shape, (B, H, dv // bv), interpret, q, k, v, b, do,
                       *given(dhT)))


@jit()
def outputs(q, k, v, b, S, *, c, bv, interpret=False):
    """``O [B,Tp,H,dv]`` float32, every chunk at once from its incoming ``S`` (``states``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, o_ref):
        i, h, n, j = (pl.program_id(a) for a in range(4))
        vs, ts = _slice(j, bv), _slice(n, c)
        o_ref[i, ts, h, vs], _ = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :],
                                               v_ref[i, ts, h, vs], b_ref[i, h, ts],
                                               s_ref[i, h, n, :, vs])

    return _call(kernel, jax.ShapeDtypeStruct((B, Tp, H, dv), F32), (B, H, Tp // c, dv // bv),
                 interpret, q, k, v, b, S)


@jit()
def grads(q, k, v, b, S, do, dS, *, c, bv, interpret=False):
    """Cotangents of the inputs, every chunk at once, from ``S`` (``states``), ``do`` and ``dS``
    (``dstates``, same ``bv``): ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile),
    ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``, all float32."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    nv = dv // bv

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, do_ref, ds_ref, dq_ref, dk_ref, dv_ref, db_ref):
        i, h, n, j = (pl.program_id(a) for a in range(4))
        vs, ts = _slice(j, bv), _slice(n, c)
        dQ, dK, dV, db, _ = chunk_backward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
            s_ref[i, h, n, :, vs], do_ref[i, ts, h, vs], ds_ref[i, h, n, :, vs].astype(F32))
        dq_ref[j, i, ts, h, :] = dQ
        dk_ref[j, i, ts, h, :] = dK
        dv_ref[i, ts, h, vs] = dV
        db_ref[j, i, h, ts] = db

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32)] * 2 + [
        jax.ShapeDtypeStruct((B, Tp, H, dv), F32), jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(_call(kernel, out_shape, (B, H, Tp // c, nv), interpret, q, k, v, b, S, do, dS))
