"""Log-linear Mamba-2 chunked kernels for TPU (Mosaic).  UNTESTED ON TPU HARDWARE: no TPU was
available; the tests run these in interpret mode on CPU and check the Mosaic lowering.

The TPU way of layout (a), as ``kernels/tpu/walk.py``: grid ``(B, H, N)`` with the chunk axis last
and sequential ("arbitrary"); each step's ``[c, ·]`` tiles arrive by the pipeline's DMA, and the
lazy counter's ``P`` float32 ``d×dv`` slot states (``kernels/loglinear_chunk.py``) persist across
the chunk axis in VMEM scratch ``[P, d, dv]``, reset at the first chunk; a chunk reads its live
slots and writes one (``forward``, ``states``, ``dstates``); ``grads`` runs every chunk at once
(all grid axes parallel).  No value tiling (``dv`` is one tile).  Inputs are moved to
``[B,H,Tp,·]``; the gate comes as ``[B,H,N,1,c]``, ``lam`` as ``[B,H,Ln,Tp]`` (an ``[Ln, c]``
block per chunk), the slot decays ``s`` as ``[B,H,N,1,P]`` blocks in SMEM.  In ``dstates`` and
``grads``, chunk ``n``'s slot-``j`` checkpoint ``W[block_end(n, j)]`` is its own input whose index map
computes that chunk, so the pipeline fetches it (again only when the block changes), and the
slots' decay accumulators are SMEM scratch.  Same interface as ``kernels.gpu.loglinear``
(``bv``/``num_warps`` are ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hla_jax.kernels.la_chunk import F32, at_end
from hla_jax.kernels.loglinear_chunk import (
    block_end,
    chunk_backward,
    chunk_forward,
    counter_flags,
    num_slots,
    take,
)
from hla_jax.kernels.tpu.walk import compiler_params, heads_first


def specs(c, N, Ln, rev):
    """Per-chunk blocks: ``tile(w)`` of ``[B,H,Tp,w]``, the ``[Ln, c]`` λ rows, ``chunk(rows, w)``
    of a ``[B,H,N,rows,w]`` array (``smem``: in SMEM); ``rev`` walks the chunks backwards."""
    n_of = (lambda n: N - 1 - n) if rev else (lambda n: n)
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n_of(n), 0))
    lams = pl.BlockSpec((None, None, Ln, c), lambda i, h, n: (i, h, 0, n_of(n)))
    chunk = lambda rows, w, smem=False: pl.BlockSpec(
        (None, None, None, rows, w), lambda i, h, n: (i, h, n_of(n), 0, 0),
        memory_space=pltpu.SMEM if smem else None)
    return tile, lams, chunk, n_of


STATIC = ("c", "bv", "num_warps", "interpret")


def _slots(d, dv, N, P, n_of):
    """Chunk ``n``'s slot-``j`` checkpoint ``W[block_end(n, j)]`` as its own input block."""
    return [pl.BlockSpec((None, None, None, d, dv),
                         lambda i, h, n, j=j: (i, h, jnp.minimum(block_end(n_of(n), j), N - 1), 0, 0))
            for j in range(P)]


def _operands(q, k, v, b, lam, s, c, rev):
    """What every kernel starts from: ``(N, Ln, P, tile, lams, chunk, n_of, in_specs, args)``,
    the chunk, level and slot counts, the blocks of ``specs`` and the specs and arrays of the
    inputs every kernel reads: ``q, k, v`` (heads first), the gate and ``s`` per chunk, ``lam``."""
    B, Tp, H, d = q.shape
    N, Ln = Tp // c, lam.shape[2]
    P = num_slots(Ln, c)
    tile, lams, chunk, n_of = specs(c, N, Ln, rev)
    return (N, Ln, P, tile, lams, chunk, n_of,
            [tile(d), tile(d), tile(v.shape[-1]), chunk(1, c), lams, chunk(1, P, True)],
            [heads_first(q), heads_first(k), heads_first(v), b.reshape(B, H, N, 1, c), lam,
             s.reshape(B, H, N, 1, P)])


def _walk(q, k, v, b, lam, s, *, c, outputs, interpret):
    """The forward walk writing ``O`` (``outputs``) or every chunk's merged state ``W``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, Ln, P, tile, lams, chunk, _, specs_in, args = _operands(q, k, v, b, lam, s, c, False)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, out_ref, w_scr):
        n = pl.program_id(2)

        @pl.when(n == 0)
        def _():
            w_scr[...] = jnp.zeros_like(w_scr)

        lives, merges, ats = counter_flags(n, P)
        O, merged = chunk_forward(q_ref[...], k_ref[...], v_ref[...], b_ref[0],
                                  [lam_ref[lev] for lev in range(Ln)], lambda j: w_scr[j],
                                  [s_ref[0, j] for j in range(P)], lives, merges)
        out_ref[...] = O if outputs else merged.astype(out_ref.dtype)
        for j, at in enumerate(ats):
            @pl.when(at)
            def _(j=j):
                w_scr[j] = merged

    shape = (jax.ShapeDtypeStruct((B, H, Tp, dv), F32) if outputs else
             jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype))
    return pl.pallas_call(
        kernel, out_shape=shape, grid=(B, H, N),
        in_specs=specs_in, out_specs=tile(dv) if outputs else chunk(d, dv),
        scratch_shapes=[pltpu.VMEM((P, d, dv), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(*args)


@functools.partial(jax.jit, static_argnames=STATIC)
def forward(q, k, v, b, lam, s, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.loglinear.forward``: ``O [B,Tp,H,dv]`` float32."""
    return heads_first(_walk(q, k, v, b, lam, s, c=c, outputs=True, interpret=interpret))


@functools.partial(jax.jit, static_argnames=STATIC)
def states(q, k, v, b, lam, s, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.loglinear.states``: ``W [B,H,N,d,dv]``."""
    return _walk(q, k, v, b, lam, s, c=c, outputs=False, interpret=interpret)


@functools.partial(jax.jit, static_argnames=STATIC)
def dstates(q, k, v, b, lam, s, W, do, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.loglinear.dstates`` with one value tile: ``d_merged [B,H,N,d,dv]``,
    ``carried [1,B,H,Tp]``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, Ln, P, tile, lams, chunk, n_of, specs_in, args = _operands(q, k, v, b, lam, s, c, True)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, *rest):
        w_refs = rest[:P]
        do_ref, dm_ref, carried_ref, dw_scr, acc_scr = rest[P:]
        n = n_of(pl.program_id(2))

        @pl.when(pl.program_id(2) == 0)
        def _():
            dw_scr[...] = jnp.zeros_like(dw_scr)
            for j in range(P):
                acc_scr[j] = jnp.zeros((), F32)

        lives, merges, ats = counter_flags(n, P)
        d_merged, dWs, acc = take([dw_scr[j] for j in range(P)], [acc_scr[j] for j in range(P)],
                                  ats)
        dm_ref[...] = d_merged.astype(dm_ref.dtype)
        carried_ref[...] = at_end(sum(acc), c)[None, :]
        *_, dWs, dlogs = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], [lam_ref[lev] for lev in range(Ln)],
            lambda j: w_refs[j][...].astype(F32), [s_ref[0, j] for j in range(P)], lives, merges,
            do_ref[...], d_merged, dWs, 0.0)
        for j in range(P):
            dw_scr[j] = dWs[j]
            acc_scr[j] = acc[j] + dlogs[j]

    dM, carried = pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((B, H, N, d, dv), q.dtype),
                           jax.ShapeDtypeStruct((B, H, N, 1, c), F32)], grid=(B, H, N),
        in_specs=[*specs_in, *_slots(d, dv, N, P, n_of), tile(dv)],
        out_specs=[chunk(d, dv), chunk(1, c)],
        scratch_shapes=[pltpu.VMEM((P, d, dv), F32), pltpu.SMEM((P,), F32)],
        compiler_params=compiler_params(interpret), interpret=interpret,
    )(*args, *([W] * P), heads_first(do))
    return dM, carried.reshape(1, B, H, Tp)


@functools.partial(jax.jit, static_argnames=STATIC)
def grads(q, k, v, b, lam, s, W, do, dM, *, c, bv=None, num_warps=None, interpret=False):
    """As ``kernels.gpu.loglinear.grads`` with one value tile: every chunk at once, grid
    ``(B, H, N)`` all parallel."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, Ln, P, tile, lams, chunk, n_of, specs_in, args = _operands(q, k, v, b, lam, s, c, False)

    def kernel(q_ref, k_ref, v_ref, b_ref, lam_ref, s_ref, *rest):
        w_refs = rest[:P]
        do_ref, dm_ref, dq_ref, dk_ref, dv_ref, db_ref, dlam_ref = rest[P:]
        lives, merges, _ = counter_flags(pl.program_id(2), P)
        dq_ref[...], dk_ref[...], dv_ref[...], db, dlams, *_ = chunk_backward(
            q_ref[...], k_ref[...], v_ref[...], b_ref[0], [lam_ref[lev] for lev in range(Ln)],
            lambda j: w_refs[j][...].astype(F32), [s_ref[0, j] for j in range(P)], lives, merges,
            do_ref[...], dm_ref[...].astype(F32), [jnp.zeros((d, dv), F32)] * P, 0.0)
        db_ref[...] = db[None, :]
        for lev, dl in enumerate(dlams):
            dlam_ref[lev:lev + 1, :] = dl[None, :]

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), F32), jax.ShapeDtypeStruct((B, H, Tp, d), F32),
                 jax.ShapeDtypeStruct((B, H, Tp, dv), F32),
                 jax.ShapeDtypeStruct((B, H, N, 1, c), F32),
                 jax.ShapeDtypeStruct((B, H, Ln, Tp), F32)]
    dq, dk, dvv, db, dlam = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, N),
        in_specs=[*specs_in, *_slots(d, dv, N, P, n_of), tile(dv), chunk(d, dv)],
        out_specs=[tile(d), tile(d), tile(dv), chunk(1, c), lams],
        compiler_params=compiler_params(interpret, sequential=False), interpret=interpret,
    )(*args, *([W] * P), heads_first(do), dM)
    return (heads_first(dq)[None], heads_first(dk)[None], heads_first(dvv),
            db.reshape(1, B, H, Tp), dlam[None])
