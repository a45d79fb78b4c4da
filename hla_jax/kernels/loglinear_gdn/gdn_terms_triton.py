"""The per-chunk terms of log-linear Gated DeltaNet's block form after the UT transform, for
NVIDIA GPUs: ``pallas_call`` lowered through Triton, one program per (batch, head, chunk).

For ``c`` tokens with the local cumulative log-decay ``b`` (``ρ = exp(b)``, ``ρ_c`` its value at
the chunk's end, ``Γ[τ,σ] = ρ_τ/ρ_σ`` for ``τ ≥ σ``), the UT transform's ``T`` and ``W``, ``U``::

    P = (Q Kᵀ) ∘ Γ,   M = P T,   Q̂ = ρ∘Q − P W,   K̃ = (ρ_c/ρ)∘K,   A_c = ρ_c I − K̃ᵀ W,   Z = K̃ᵀ U

(``loglinear_chunked.delta_terms`` in XLA; the backward is ``gdn_terms_mgpu.backward``, on
Hopper's tensor cores: ``gdn_blocks.terms``).

Inputs stay in the caller's layout, ``q, k, w [B,Tp,H,d]``, ``u [B,Tp,H,dv]`` (``dv`` a
multiple of 64, taken 128 or 64 columns at a time), the inverse ``X [B,H,Tp,c]`` (``T = X diag(β)``),
``β`` and ``b [B,H,Tp]`` float32;
``M [B,H,Tp,c]`` float32, ``Q̂ [B,H,Tp,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in ``q``'s
dtype.  Products with ``P``, ``T`` or ``K̃`` take float32 operands (TF32 for 16-bit inputs),
as XLA's path does under ``common.matmul_precision``; ``Q Kᵀ`` and ``Z = Kᵀ((ρ_c/ρ)∘U)`` take
the inputs' dtype (``(ρ_c/ρ)∘U`` rounded to it, as the first-order walk's state step rounds
``γ̄∘V'``; ``A_c`` keeps ``K̃`` in float32: ``ρ_c I − K̃ᵀW`` removes a key direction only
when ``K̃`` matches ``W``'s keys, ``loglinear_gdn_chunk.walk_forward``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hla_jax.kernels.la.la_chunk import F32, decays, dot
from hla_jax.kernels.loglinear_gdn.loglinear_gdn_chunk import tri_dot
from hla_jax.kernels.triton import compiler_params


def _call(kernel, out_shape, c, num_warps, interpret, *args):
    B, Tp, H = args[0].shape[:3]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(*args))


def _over_value_tiles(dv, body, init):
    """``body(cols, carry)`` over the column slices of the value tiles (128 columns, or 64 when
    ``dv`` is an odd multiple of 64), in a loop (not unrolled: each tile's loads and products die
    with its step)."""
    bu = 128 if dv % 128 == 0 else min(dv, 64)
    return lax.fori_loop(0, dv // bu,
                         lambda t, carry: body(pl.ds(pl.multiple_of(t * bu, bu), bu), carry), init)


def _eye(d):
    return lax.broadcasted_iota(jnp.int32, (d, d), 0) == lax.broadcasted_iota(jnp.int32, (d, d), 1)


@functools.partial(jax.jit, static_argnames=("c", "num_warps", "interpret"))
def forward(q, k, w, u, x, beta, b, *, c=64, num_warps=4, interpret=False):
    """``(M, Q̂, A_c, Z)`` of every chunk (module docstring)."""
    def kernel(q_ref, k_ref, w_ref, u_ref, x_ref, beta_ref, b_ref, m_ref, qh_ref, a_ref, z_ref):
        i, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        Q, K, W = q_ref[i, ts, h, :], k_ref[i, ts, h, :], w_ref[i, ts, h, :]
        rho, rho_c, e, Gam, _ = decays(b_ref[i, h, ts])
        P, Kt = dot(Q, K, tb=True) * Gam, e[:, None] * K.astype(F32)
        fast = K.dtype == jnp.bfloat16
        m_ref[i, h, ts, :] = tri_dot(P, x_ref[i, h, ts, :] * beta_ref[i, h, ts][None, :], fast)
        qh_ref[i, h, ts, :] = (rho[:, None] * Q.astype(F32) - tri_dot(P, W, fast)).astype(qh_ref.dtype)
        A = jnp.where(_eye(K.shape[1]), rho_c, 0.0) - tri_dot(Kt, W, fast, ta=True)
        a_ref[i, h, n, :, :] = A.astype(a_ref.dtype)

        def z_tile(cols, carry):
            eU = (e[:, None] * u_ref[i, ts, h, cols].astype(F32)).astype(K.dtype)
            z_ref[i, h, n, :, cols] = dot(K, eU, ta=True).astype(z_ref.dtype)
            return carry

        _over_value_tiles(u.shape[-1], z_tile, 0)

    B, Tp, H, d = q.shape
    N, dt = Tp // c, q.dtype
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, c), F32), jax.ShapeDtypeStruct((B, H, Tp, d), dt),
                 jax.ShapeDtypeStruct((B, H, N, d, d), dt),
                 jax.ShapeDtypeStruct((B, H, N, d, u.shape[-1]), dt)]
    return _call(kernel, out_shape, c, num_warps, interpret, q, k, w, u, x, beta, b)
