"""The chunk walks of LA and the HLA family for NVIDIA GPUs: ``pallas_call`` lowered through
Triton (jax 0.11.2).

Generic over a family's chunk step (``kernels/<family>_chunk.py``) and its state ``layout``: a
tuple of ``DD`` (a ``d×d`` state, shared by every value tile) and ``DV`` (a ``d×bv`` state of
one value tile).  Inputs stay in the caller's ``[B,Tp,H,·]`` layout (strided tile loads).

Two kinds of kernel.  The *walks* (layout (a) of DESIGN.md) run one program per (batch, head,
value tile) over the chunks in order, float32 states in registers (``lax.fori_loop`` carry):

- ``forward``: the outputs ``O``;
- ``states``: every chunk's incoming states (``DD: [B,H,N,d,d]``, written by value tile 0,
  ``DV: [B,H,N,d,dv]``), in the input dtype, without ``O``;
  both start from given states (``init``, float32) or zeros, and can also write the last
  chunk's outgoing states (``final``, float32): state passing between calls;
- ``dstates``: in reverse, the cotangent of every chunk's outgoing states (``DD``: one share per
  value tile, ``[nv,B,H,N,d,d]``; ``DV: [B,H,N,d,dv]``): the chunk backward, of which only the
  state cotangents are kept (the rest is dead code, removed by the compiler).  LA, HLA2 and AHLA
  are linear in their states, so their state cotangents do not depend on the states (zeros stand
  in); HLA3's ``F`` update is bilinear in ``S`` and ``P``, so its walk reads the saved states.

The *chunk-parallel* kernels (layout (b)) run one program per (batch, head, chunk, value tile)
from the saved states, with no carry:

- ``outputs``: ``O`` from the incoming states;
- ``grads``: ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value tile), ``dv [B,Tp,H,dv]``,
  ``db [nv,B,H,Tp]``, float32, from the incoming states, ``do`` and the outgoing cotangents.

Triton needs power-of-two tiles and every matmul dimension >= 16: ``c``, ``d`` and ``bv`` are
powers of two >= 16 (the caller pads).  Runs in interpret mode on CPU (the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.la_chunk import F32

DD, DV = "dd", "dv"
STATIC = ("c", "bv", "num_warps", "interpret")


def compiler_params(num_warps, interpret):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _zeros(layout, d, bv, dtype=F32):
    return tuple(jnp.zeros((d, d if kind == DD else bv), dtype) for kind in layout)


def _state_shapes(layout, B, H, N, d, dv, dtype, nv=None):
    """Saved per-chunk states; a ``DD`` state gets a leading value-tile axis when ``nv``."""
    return [jax.ShapeDtypeStruct(((nv,) if nv and kind == DD else ()) + (B, H, N, d, d if kind == DD
                                                                            else dv), dtype)
            for kind in layout]


def _last_shapes(layout, B, H, d, dv, final):
    """The walks' last outgoing states (float32, one chunk), when ``final``."""
    return _state_shapes(layout, B, H, 1, d, dv, F32) if final else []


def _read(layout, refs, i, h, n, vs, j=None):
    """Chunk ``n``'s saved states for value tile ``vs`` (``j``: the per-tile share of ``DD``)."""
    return [(ref[i, h, n] if j is None else ref[j, i, h, n]) if kind == DD else ref[i, h, n, :, vs]
            for kind, ref in zip(layout, refs)]


def _initial(layout, init_refs, i, h, vs, d, bv, j=None):
    """A walk's starting states: chunk 0 of ``init_refs`` in float32 (as ``_read``), or zeros."""
    if not init_refs:
        return _zeros(layout, d, bv)
    return tuple(x.astype(F32) for x in _read(layout, init_refs, i, h, 0, vs, j))


def _write(layout, refs, xs, i, h, n, vs, j, shared):
    """Store chunk ``n``'s states; a ``DD`` state is written once (tile 0) when ``shared``, else
    as tile ``j``'s share."""
    for kind, ref, x in zip(layout, refs, xs):
        if kind == DV:
            ref[i, h, n, :, vs] = x.astype(ref.dtype)
        elif not shared:
            ref[j, i, h, n] = x.astype(ref.dtype)
        else:
            @pl.when(j == 0)
            def _(ref=ref, x=x):
                ref[i, h, n] = x.astype(ref.dtype)


def _call(kernel, out_shape, grid, num_warps, interpret, *args):
    """``pallas_call`` on ``grid``: ``(B, H, nv)`` for a walk, ``(B, H, N, nv)`` chunk-parallel."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                          compiler_params=compiler_params(num_warps, interpret),
                          interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC + ("final",))
def forward(chunk_forward, layout, q, k, v, b, *, init=None, final=False, c, bv, num_warps=8,
            interpret=False):
    """``q, k: [B,Tp,H,d]``, ``v: [B,Tp,H,dv]``, ``b: [B,H,Tp]`` (local log cumulative decay per
    chunk) -> ``O [B,Tp,H,dv]`` float32, the walk starting from ``init`` (as in ``states``); with
    ``final``, ``(O, last)``: also the last chunk's outgoing states (float32, ``DD [B,H,1,d,d]``,
    ``DV [B,H,1,d,dv]``).  ``chunk_forward(Q, K, V, bb, *states) -> (O, *states)``."""
    B, Tp, H, d = q.shape
    dv, init = v.shape[-1], tuple(init or ())

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        init_refs, o_ref, last_refs = refs[:len(init)], refs[len(init)], refs[len(init) + 1:]
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, carry):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            o_ref[i, ts, h, vs], *carry = chunk_forward(
                q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts], *carry)
            return tuple(carry)

        last = jax.lax.fori_loop(0, Tp // c, body, _initial(layout, init_refs, i, h, vs, d, bv))
        _write(layout, last_refs, last, i, h, 0, vs, j, shared=True)

    O = jax.ShapeDtypeStruct((B, Tp, H, dv), F32)
    out = _call(kernel, [O] + _last_shapes(layout, B, H, d, dv, final), (B, H, dv // bv),
                num_warps, interpret, q, k, v, b, *init)
    return (out[0], tuple(out[1:])) if final else out[0]


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC + ("every", "final"))
def states(chunk_forward, layout, q, k, v, b, *, init=None, every=1, final=False, c, bv,
           num_warps=8, interpret=False):
    """The incoming states of every ``every``-th chunk (``DD [B,H,⌈N/every⌉,d,d]``, written by
    value tile 0, ``DV [B,H,⌈N/every⌉,d,dv]``), in the input dtype (float32 checkpoints when
    ``every > 1``), without ``O``; the walk starts from ``init`` (``DD [B,H,1,d,d]``,
    ``DV [B,H,1,d,dv]``, float32; zeros if None).  With ``final``, ``(per_chunk, last)``: also
    the last chunk's outgoing states, shaped as ``init``."""
    B, Tp, H, d = q.shape
    dv, N = v.shape[-1], Tp // c
    init = tuple(init or ())

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        init_refs, state_refs = refs[:len(init)], refs[len(init):len(init) + len(layout)]
        last_refs = refs[len(init) + len(layout):]
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(n, carry):
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            if every == 1:
                _write(layout, state_refs, carry, i, h, n, vs, j, shared=True)
            else:
                @pl.when(jax.lax.rem(n, every) == 0)  # lax: jnp's % and // lower to mixed types
                def _():
                    _write(layout, state_refs, carry, i, h, jax.lax.div(n, every), vs, j, shared=True)
            _, *carry = chunk_forward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                      b_ref[i, h, ts], *carry)
            return tuple(carry)

        last = jax.lax.fori_loop(0, N, body, _initial(layout, init_refs, i, h, vs, d, bv))
        _write(layout, last_refs, last, i, h, 0, vs, j, shared=True)

    dtype = F32 if every > 1 else q.dtype
    out = _call(kernel, _state_shapes(layout, B, H, -(-N // every), d, dv, dtype)
                + _last_shapes(layout, B, H, d, dv, final), (B, H, dv // bv), num_warps, interpret,
                q, k, v, b, *init)
    return (tuple(out[:len(layout)]), tuple(out[len(layout):])) if final else tuple(out)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def dstates(chunk_backward, layout, q, k, v, b, *saved_do, init=None, c, bv, num_warps=8,
            interpret=False):
    """Cotangents of every chunk's outgoing states given ``do [B,Tp,H,dv]`` (the last positional
    argument) and, before it, every chunk's incoming states (``states``) when the family's state
    cotangents depend on them (hla3's; hla2's and ahla's do not: pass none, zeros stand in).
    The reverse walk starts from ``init``, the cotangent of the last chunk's outgoing states
    (float32, ``DD [nv,B,H,1,d,d]``, ``DV [B,H,1,d,dv]``; zeros if None).  Returns
    ``(per_chunk, first)``: ``per_chunk`` in the input dtype, ``DD`` one share per value tile
    ``[nv,B,H,N,d,d]``, ``DV [B,H,N,d,dv]``; ``first``, the cotangent of the first chunk's
    incoming states, shaped as ``init`` (float32).
    ``chunk_backward(Q, K, V, bb, *states, dO, *dstates) -> (dQ, dK, dV, db, *dstates)``."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    N, nv, L, init = Tp // c, dv // bv, len(saved_do) - 1, tuple(init or ())

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, do_ref, init_refs = refs[:L], refs[L], refs[L + 1:L + 1 + len(init)]
        dstate_refs, first_refs = refs[-2 * len(layout):-len(layout)], refs[-len(layout):]
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)

        def body(m, carry):
            n = N - 1 - m
            ts = pl.ds(pl.multiple_of(n * c, c), c)
            _write(layout, dstate_refs, carry, i, h, n, vs, j, shared=False)
            saved = _read(layout, state_refs, i, h, n, vs) if L else _zeros(layout, d, bv, q.dtype)
            out = chunk_backward(q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs],
                                 b_ref[i, h, ts], *saved, do_ref[i, ts, h, vs], *carry)
            return tuple(out[4:])

        first = jax.lax.fori_loop(0, N, body, _initial(layout, init_refs, i, h, vs, d, bv, j))
        _write(layout, first_refs, first, i, h, 0, vs, j, shared=False)

    out = _call(kernel, _state_shapes(layout, B, H, N, d, dv, q.dtype, nv)
                + _state_shapes(layout, B, H, 1, d, dv, F32, nv), (B, H, nv), num_warps, interpret,
                q, k, v, b, *saved_do, *init)
    return tuple(out[:len(layout)]), tuple(out[len(layout):])


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def outputs(chunk_forward, layout, q, k, v, b, *saved, c, bv, num_warps=8, interpret=False):
    """``O [B,Tp,H,dv]`` float32, every chunk at once from its incoming states (``states``)."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, o_ref = refs[:-1], refs[-1]
        i, h, n, j = (pl.program_id(a) for a in range(4))
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        o_ref[i, ts, h, vs], *_ = chunk_forward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
            *_read(layout, state_refs, i, h, n, vs))

    return _call(kernel, jax.ShapeDtypeStruct((B, Tp, H, dv), F32), (B, H, Tp // c, dv // bv),
                 num_warps, interpret, q, k, v, b, *saved)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=STATIC)
def grads(chunk_backward, layout, q, k, v, b, *saved_do_dsaved, c, bv, num_warps=8, interpret=False):
    """Cotangents of the inputs, every chunk at once, from ``*states`` (``states``), ``do`` and
    ``*dstates`` (``dstates``, same ``bv``): ``(dq, dk) [nv,B,Tp,H,d]`` (one share per value
    tile), ``dv [B,Tp,H,dv]``, ``db [nv,B,H,Tp]``, all float32."""
    B, Tp, H, d = q.shape
    dv = v.shape[-1]
    nv, L = dv // bv, len(layout)

    def kernel(q_ref, k_ref, v_ref, b_ref, *refs):
        state_refs, do_ref, dstate_refs = refs[:L], refs[L], refs[L + 1:2 * L + 1]
        dq_ref, dk_ref, dv_ref, db_ref = refs[2 * L + 1:]
        i, h, n, j = (pl.program_id(a) for a in range(4))
        vs = pl.ds(pl.multiple_of(j * bv, bv), bv)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        dQ, dK, dV, db, *_ = chunk_backward(
            q_ref[i, ts, h, :], k_ref[i, ts, h, :], v_ref[i, ts, h, vs], b_ref[i, h, ts],
            *_read(layout, state_refs, i, h, n, vs), do_ref[i, ts, h, vs],
            *(x.astype(F32) for x in _read(layout, dstate_refs, i, h, n, vs, j)))
        dq_ref[j, i, ts, h, :] = dQ
        dk_ref[j, i, ts, h, :] = dK
        dv_ref[i, ts, h, vs] = dV
        db_ref[j, i, h, ts] = db

    out_shape = [jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((nv, B, Tp, H, d), F32),
                 jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
                 jax.ShapeDtypeStruct((nv, B, H, Tp), F32)]
    return tuple(_call(kernel, out_shape, (B, H, Tp // c, nv), num_warps, interpret,
                       q, k, v, b, *saved_do_dsaved))
