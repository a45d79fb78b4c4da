"""The chunk levels of log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``) for
NVIDIA GPUs: ``pallas_call`` lowered through Triton, one program per (batch, head, chunk).

Chunk ``n``'s tokens carry their running query ``r`` (first ``Q̂``) up the levels: at each level
``i`` at which ``n`` lies in a right half (bit ``i`` of ``n`` set), with ``(Π_i, Z_i)`` that
block's left half (node ``off_i + (n >> (i+1))`` of the up-sweep's stacks),

    o += λ_i ∘ (r Z_i),      r ← r Π_i

(products accumulated in float32, ``r`` rounded back to ``Q̂``'s dtype), so ``r`` and ``o`` stay
on chip and every token is read and written once.  The backward walks down the same levels with
``δ`` the cotangent of ``r`` after level ``i`` and ``r_i`` the query it read (saved by the
forward's ``save``):

    X = ∂o Z_iᵀ,   ∂λ_i = rowsum(r_i ∘ X),   δ ← δ Π_iᵀ + λ_i ∘ X,

``∂Q̂`` the last ``δ``; it writes each ``δ`` after level ``i`` for the sums over a right half's
tokens, ``∂Z_i = r_iᵀ (λ_i ∘ ∂o)`` and ``∂Π_i = r_iᵀ δ``, which are batched matmuls
(``kernels.gdn_blocks.levels``).

Layouts, heads first: ``Q̂ [B,H,Tp,d]``, ``Π [B,H,S,d,d]``, ``Z [B,H,S,d,dv]`` (``S`` nodes over
the levels, level ``i``'s from ``off[i]``), ``λ [B,H,P,Tp]`` float32 (level ``i``'s weights in
row ``i``), ``o [B,H,Tp,dv]`` float32; ``d``, ``dv`` and ``c`` powers of two ≥ 16.  Rows of the
per-level outputs ``r_i``, ``δ`` at tokens in a left half are not written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32, dot


def _call(kernel, out_shape, c, interpret, *args):
    """One program per (batch, head, chunk) of ``out_shape[0] [B,H,Tp,·]``."""
    B, H, Tp, d = out_shape[0].shape
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(4 if d <= 128 else 8, interpret),
                                interpret=interpret)(*args))


def _levels(n, order, body, rest, carry):
    """``carry ← body(i, carry)`` at the levels ``i`` (in ``order``) where chunk ``n`` lies in a
    right half, ``rest(i, carry)`` at the others."""
    for i in order:
        carry = lax.cond((n >> i) & 1 == 1, functools.partial(body, i),
                         functools.partial(rest, i), carry)
    return carry


@functools.partial(jax.jit, static_argnames=("offsets", "c", "save", "interpret"))
def forward(qh, pis, zs, lam, *, offsets, c, save=False, interpret=False):
    """``(o,)``, with ``save`` also ``(r_i [B,H,P,Tp,d])``: the queries each level read."""
    P = lam.shape[2]
    acc = jnp.result_type(F32, qh.dtype)

    def kernel(qh_ref, pi_ref, z_ref, lam_ref, o_ref, *r_ref):
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)

        def level(i, carry):
            r, o = carry
            node = offsets[i] + (n >> (i + 1))
            if save:
                r_ref[0][b, h, i, ts, :] = r
            o = o + lam_ref[b, h, i, ts][:, None] * dot(r, z_ref[b, h, node, :, :])
            return dot(r, pi_ref[b, h, node, :, :]).astype(r.dtype), o

        init = (qh_ref[b, h, ts, :], jnp.zeros((c, zs.shape[-1]), acc))
        o_ref[b, h, ts, :] = _levels(n, range(P), level, lambda i, carry: carry, init)[1]

    B, H, Tp, d = qh.shape
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, zs.shape[-1]), acc)]
    if save:
        out_shape.append(jax.ShapeDtypeStruct((B, H, P, Tp, d), qh.dtype))
    return _call(kernel, out_shape, c, interpret, qh, pis, zs, lam)


@functools.partial(jax.jit, static_argnames=("offsets", "c", "interpret"))
def backward(r, pis, zs, lam, do, *, offsets, c, interpret=False):
    """``(∂Q̂ [B,H,Tp,d], δ [B,H,P,Tp,d], ∂λ [B,H,P,Tp])`` from the saved queries ``r`` and the
    output's cotangent ``do`` (module docstring); ``δ`` at level ``i`` is the cotangent of the
    query after that level."""
    B, H, P, Tp, d = r.shape
    acc = jnp.result_type(F32, r.dtype)

    def kernel(r_ref, pi_ref, z_ref, lam_ref, do_ref, dq_ref, dst_ref, dlam_ref):
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        g = do_ref[b, h, ts, :].astype(r.dtype)

        def level(i, delta):
            node = offsets[i] + (n >> (i + 1))
            ri = r_ref[b, h, i, ts, :]
            dst_ref[b, h, i, ts, :] = delta.astype(dst_ref.dtype)
            X = dot(g, z_ref[b, h, node, :, :], tb=True)
            dlam_ref[b, h, i, ts] = jnp.sum(ri.astype(acc) * X, axis=1)
            return (dot(delta.astype(r.dtype), pi_ref[b, h, node, :, :], tb=True)
                    + lam_ref[b, h, i, ts][:, None] * X)

        def rest(i, delta):
            dlam_ref[b, h, i, ts] = jnp.zeros((c,), acc)
            return delta

        dq_ref[b, h, ts, :] = _levels(n, reversed(range(P)), level, rest,
                                      jnp.zeros((c, d), acc)).astype(dq_ref.dtype)

    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, d), r.dtype),
                 jax.ShapeDtypeStruct((B, H, P, Tp, d), r.dtype),
                 jax.ShapeDtypeStruct((B, H, P, Tp), acc)]
    return _call(kernel, out_shape, c, interpret, r, pis, zs, lam, do)
