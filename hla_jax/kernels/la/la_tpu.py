"""The chunk walks of first-order LA for TPU (Mosaic).  NEVER RUN ON TPU HARDWARE: the tests run
them in interpret mode on CPU and check that they lower through Mosaic.

The TPU way of ``la_triton.py`` (same five kernels, same interface; ``bv`` is ignored and
there is one value tile, ``nv = 1``): grid ``(B, H, N)``, each step's ``[c, d]`` tiles arriving
by the pipeline's DMA.  In the walks (``forward``, ``states``, ``dstates``) the chunk axis is last
and sequential ("arbitrary") and the float32 state ``S: d×dv`` persists across it in VMEM scratch
(``pltpu.VMEM``), set at the first chunk; in ``outputs`` and ``grads`` every axis is parallel.
Inputs are moved to ``[B,H,Tp,·]`` so every block's last two dims are ``(c, d)`` with ``c >= 8``;
the gate comes as ``[B,H,N,1,c]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.la.la_chunk import F32, chunk_backward, chunk_forward
from hla_jax.kernels.mosaic_tpu import (
    chunk_specs,
    compiler_params,
    end_state,
    heads_first,
    start_carry,
    state_blocks,
    store_last,
)
from hla_jax.kernels.wrap import given, jit, unpack


def _call(kernel, out_shape, in_specs, out_specs, c, sequential, interpret, q, k, v, b, *rest):
    """``pallas_call`` on the grid ``(B, H, N)`` (with the state in VMEM scratch when
    ``sequential``) of heads-first ``q, k, v`` and the gate as ``[B,H,N,1,c]``."""
    B, H, Tp = b.shape
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, Tp // c), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((q.shape[-1], v.shape[-1]), F32)] if sequential else [],
        compiler_params=compiler_params(interpret, sequential), interpret=interpret,
    )(heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, Tp // c, 1, c), *rest)


def _walk(q, k, v, b, h0, *, outputs, every, final, c, interpret):
    """As ``la_triton._walk``: ``O`` (``outputs``), the incoming ``S`` of every
    ``every``-th chunk (``every``: None for none) and the last outgoing ``S`` (``final``)."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile, gate = chunk_specs(c, N)
    end_shape, end_block = end_state(B, H, d, dv)
    out_shape, out_specs = [], []
    if outputs:
        out_shape.append(jax.ShapeDtypeStruct((B, H, Tp, dv), F32))
        out_specs.append(tile(dv))
    if every is not None:  # n >= 0: lax.div needs no floor fix-up
        shape, block = state_blocks(B, H, -(-N // every), d, dv, F32 if every > 1 else q.dtype,
                               lambda n: jax.lax.div(n, every))
        out_shape.append(shape)
        out_specs.append(block)
    if final:
        out_shape.append(end_shape)
        out_specs.append(end_block)

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        h0_ref, o_ref, s_ref, hT_ref, S_ref = unpack(refs, h0 is not None, outputs,
                                                     every is not None, final, True)
        start_carry(S_ref, h0_ref)
        S = S_ref[...]
        if every is not None:
            @pl.when(jax.lax.rem(pl.program_id(2), every) == 0)
            def _():
                s_ref[...] = S.astype(s_ref.dtype)

        O, S_ref[...] = chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0], S)
        if outputs:
            o_ref[...] = O
        if final:
            store_last(S_ref, hT_ref, N)

    in_specs = [tile(d), tile(d), tile(dv), gate] + [end_block] * len(given(h0))
    out = list(_call(kernel, out_shape, in_specs, out_specs, c, True, interpret, q, k, v, b,
                     *given(h0)))
    if outputs:
        out[0] = heads_first(out[0])
    return tuple(out) if final else out[0]


@jit("final")
def forward(q, k, v, b, h0=None, *, final=False, c, bv=None, interpret=False):
    """As ``la_triton.forward``: ``O [B,Tp,H,dv]`` float32 from ``h0``; with ``final``
    ``(O, hT)``."""
    return _walk(q, k, v, b, h0, outputs=True, every=None, final=final, c=c, interpret=interpret)


@jit("every", "final")
def states(q, k, v, b, h0=None, *, every=1, final=False, c, bv=None, interpret=False):
    """As ``la_triton.states``: the incoming ``S`` of every ``every``-th chunk from
    ``h0``; with ``final`` ``(per_chunk, hT)``."""
    return _walk(q, k, v, b, h0, outputs=False, every=every, final=final, c=c,
                 interpret=interpret)


@jit()
def dstates(q, k, v, b, do, dhT=None, *, c, bv=None, interpret=False):
    """As ``la_triton.dstates``: ``(dS [B,H,N,d,dv], dh0 [B,H,d,dv])`` by the reverse
    walk from ``dhT`` (zeros if None)."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile, gate = chunk_specs(c, N, rev=True)
    ds_shape, ds_block = state_blocks(B, H, N, d, dv, q.dtype, lambda n: N - 1 - n)
    end_shape, end_block = end_state(B, H, d, dv)

    def kernel(q_ref, k_ref, v_ref, b_ref, do_ref, *refs):
        dhT_ref, ds_ref, dh0_ref, S_ref = unpack(refs, dhT is not None, True, True, True)
        start_carry(S_ref, dhT_ref)
        dS = S_ref[...]
        ds_ref[...] = dS.astype(ds_ref.dtype)
        *_, S_ref[...] = chunk_backward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                        jnp.zeros((d, dv), q.dtype), do_ref[...], dS)
        store_last(S_ref, dh0_ref, N)

    in_specs = [tile(d), tile(d), tile(dv), gate, tile(dv)] + [end_block] * len(given(dhT))
    return tuple(_call(kernel, [ds_shape, end_shape], in_specs, [ds_block, end_block], c, True,
                       interpret, q, k, v, b, heads_first(do), *given(dhT)))


@jit()
def outputs(q, k, v, b, S, *, c, bv=None, interpret=False):
    """As ``la_triton.outputs``: every chunk at once, grid ``(B, H, N)`` all parallel."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile, gate = chunk_specs(c, N)
    _, s_block = state_blocks(B, H, N, d, dv, q.dtype, lambda n: n)

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, o_ref):
        o_ref[...], _ = chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0], s_ref[...])

    return heads_first(_call(kernel, jax.ShapeDtypeStruct((B, H, Tp, dv), F32),
                             [tile(d), tile(d), tile(dv), gate, s_block], tile(dv), c, False,
                             interpret, q, k, v, b, S))


@jit()
def grads(q, k, v, b, S, do, dS, *, c, bv=None, interpret=False):
    """As ``la_triton.grads`` with one value tile: every chunk at once, grid ``(B, H, N)``
    all parallel."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    tile, gate = chunk_specs(c, N)
    _, s_block = state_blocks(B, H, N, d, dv, q.dtype, lambda n: n)

    def kernel(q_ref, k_ref, v_ref, b_ref, s_ref, do_ref, ds_ref, dq_ref, dk_ref, dv_ref, db_ref):
        dq_ref[...], dk_ref[...], dv_ref[...], db, _ = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], s_ref[...], do_ref[...],
            ds_ref[...].astype(F32))
        db_ref[...] = db[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, w), F32) for w in (d, d, dv)] + [
        jax.ShapeDtypeStruct((B, H, N, 1, c), F32)]
    in_specs = [tile(d), tile(d), tile(dv), gate, s_block, tile(dv), s_block]
    dq, dk, dv_, db = _call(kernel, out_shape, in_specs, [tile(d), tile(d), tile(dv), gate], c,
                            False, interpret, q, k, v, b, S, heads_first(do), dS)
    return heads_first(dq)[None], heads_first(dk)[None], heads_first(dv_), db.reshape(1, B, H, Tp)
