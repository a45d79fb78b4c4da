"""The chunk levels of log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``) for
NVIDIA GPUs: ``pallas_call`` lowered through Triton, one program per (batch, head, chunk).

Chunk ``n`` lies in the right half of its aligned block of ``2^(i+1)`` chunks at level ``i``
when bit ``i`` of ``n`` is set; its tokens then read that block's left half, the node
``(Π_i, Z_i)`` (its transition and its state), through the running query ``r``::

    r⁰ = Q̂,   o = Σ_i bit_i(n) λ_i ∘ (rⁱ Z_i),   rⁱ⁺¹ = rⁱ Π_i if bit_i(n) else rⁱ

``forward`` gives ``o``; ``backward``, from ``do``, recomputes the ``rⁱ`` going up and the
cotangents ``dr`` coming down::

    dλ_i = bit_i(n) · rowsum(do ∘ (rⁱ Z_i)),   drⁱ = drⁱ⁺¹ Π_iᵀ + (λ_i ∘ do) Z_iᵀ if bit_i(n)
    else drⁱ⁺¹,   dQ̂ = dr⁰

and writes ``rⁱ`` and ``drⁱ⁺¹`` per level, from which the caller forms the nodes' cotangents
(sums over the right halves' tokens, ``kernels/gdn_blocks.py``).

Inputs heads first: ``qh [B,H,Tp,d]``, ``lam [B,H,Lv,Tp]`` float32 (``λ`` at the ``Lv`` chunk
levels), the nodes of every level stacked, ``pi [B,H,Nn,d,d]`` and ``z [B,H,Nn,d,dv]``, level
``i``'s node for chunk ``n`` at ``offsets[i] + n // 2^(i+1)``; ``d``, ``dv`` powers of two ≥ 16.
Products take operands in ``qh``'s dtype (16-bit: float32 accumulation; float32 at full
precision, for the interpreter's tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32, dot

C = 64


def _call(kernel, out_shape, num_warps, interpret, *args):
    B, H, Tp = args[0].shape[:3]
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // C),
                          compiler_params=compiler_params(num_warps, interpret),
                          interpret=interpret)(*args)


def _level(n, i, offsets):
    """``(bit_i(n), node index)`` of chunk ``n`` at level ``i``."""
    return (n // 2 ** i) % 2 == 1, offsets[i] + n // 2 ** (i + 1)


@functools.partial(jax.jit, static_argnames=("offsets", "num_warps", "interpret"))
def forward(qh, lam, pi, z, *, offsets, num_warps=4, interpret=False):
    """``o [B,H,Tp,dv]`` float32 (module docstring)."""
    def kernel(q_ref, lam_ref, pi_ref, z_ref, o_ref):
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * C, C), C)
        r, o = q_ref[b, h, ts, :], jnp.zeros((C, z.shape[-1]), F32)
        for i in range(len(offsets)):
            bit, m = _level(n, i, offsets)
            o = o + jnp.where(bit, lam_ref[b, h, i, ts][:, None] * dot(r, z_ref[b, h, m, :, :]), 0.0)
            if i + 1 < len(offsets):
                r = jnp.where(bit, dot(r, pi_ref[b, h, m, :, :]).astype(r.dtype), r)
        o_ref[b, h, ts, :] = o

    B, H, Tp, _ = qh.shape
    out_shape = jax.ShapeDtypeStruct((B, H, Tp, z.shape[-1]), F32)
    return _call(kernel, out_shape, num_warps, interpret, qh, lam, pi, z)


@functools.partial(jax.jit, static_argnames=("offsets", "num_warps", "interpret"))
def backward(qh, lam, pi, z, do, *, offsets, num_warps=4, interpret=False):
    """``(dQ̂ [B,H,Tp,d]`` in ``qh``'s dtype, ``dλ [B,H,Lv,Tp]`` float32, ``rⁱ`` and ``drⁱ⁺¹``
    ``[Lv,B,H,Tp,d]`` in ``qh``'s dtype) from ``do [B,H,Tp,dv]`` float32 (module docstring)."""
    Lv = len(offsets)

    def kernel(q_ref, lam_ref, pi_ref, z_ref, do_ref, dq_ref, dlam_ref, rs_ref, drs_ref):
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * C, C), C)
        r, dO = q_ref[b, h, ts, :], do_ref[b, h, ts, :]
        dt = r.dtype
        for i in range(Lv):                                  # up: rⁱ and dλ_i
            bit, m = _level(n, i, offsets)
            rs_ref[i, b, h, ts, :] = r
            dlam_ref[b, h, i, ts] = jnp.where(bit, jnp.sum(dO * dot(r, z_ref[b, h, m, :, :]), 1), 0.0)
            if i + 1 < Lv:
                r = jnp.where(bit, dot(r, pi_ref[b, h, m, :, :]).astype(dt), r)
        dr = jnp.zeros(r.shape, F32)
        for i in reversed(range(Lv)):                        # down: drⁱ⁺¹ and drⁱ
            bit, m = _level(n, i, offsets)
            drs_ref[i, b, h, ts, :] = dr.astype(dt)
            new = dot((lam_ref[b, h, i, ts][:, None] * dO).astype(dt), z_ref[b, h, m, :, :], tb=True)
            if i + 1 < Lv:
                new = new + dot(dr.astype(dt), pi_ref[b, h, m, :, :], tb=True)
            dr = jnp.where(bit, new, dr)
        dq_ref[b, h, ts, :] = dr.astype(dq_ref.dtype)

    B, H, Tp, d = qh.shape
    per_level = jax.ShapeDtypeStruct((Lv, B, H, Tp, d), qh.dtype)
    out_shape = [jax.ShapeDtypeStruct(qh.shape, qh.dtype), jax.ShapeDtypeStruct(lam.shape, F32),
                 per_level, per_level]
    return tuple(_call(kernel, out_shape, num_warps, interpret, qh, lam, pi, z, do))
