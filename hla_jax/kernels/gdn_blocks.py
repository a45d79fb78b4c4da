"""The kernel parts of log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``):
its per-chunk terms (``chunk_terms``) from the first-order kernel's UT transform and its backward
(``kernels/gpu/gdn_ut_mgpu.py``, Mosaic GPU) and one Triton program per chunk for the rest
(``kernels/gpu/gdn_terms.py``) instead of XLA's batched triangular solve and einsums
(``loglinear_chunked.chunk_terms``); and the chunk levels (``levels``: the
up-sweep a Triton program per pair of nodes, ``kernels/gpu/gdn_sweep.py``; the reads one program
per chunk carrying its running query up the levels, their backward and the up-sweep's one
launch per level carrying its cotangent down, ``kernels/gpu/gdn_levels.py``) instead of XLA's
batched products and pass per level over every token.

Per chunk of ``C = 64`` tokens, with ``ρ = exp(b)`` (``b`` the chunk-local cumulative log-decay,
floored at ``wrap.LOG_DECAY_FLOOR``), ``Γ[τ,σ] = ρ_τ/ρ_σ`` (``τ ≥ σ``), ``K̃ = (ρ_c/ρ)∘K``::

    T = (I + strict_tril(diag(β)(K Kᵀ) ∘ Γ))⁻¹ diag(β),   W = T(ρ∘K),   U = T V    (gdn_ut_mgpu)
    P = (Q Kᵀ) ∘ Γ,   M = P T,   Q̂ = ρ∘Q − P W,   A_c = ρ_c I − K̃ᵀ W,   Z = K̃ᵀ U   (gdn_terms)

(as ``loglinear_chunked.delta_terms`` in XLA).  Their backward is a Mosaic GPU kernel
(``kernels/gpu/gdn_terms_mgpu.py``: ``dQ``, the terms' share of ``dK``, ``dW``, ``−dU``, ``T``'s
own cotangent and the terms' share of ``∂L/∂b``), then the first-order kernel's UT backward,
handed those to add to the ``dT = dW (ρ∘K)ᵀ + dU Vᵀ`` and ``dK`` it forms; it gives the UT
transform's share of ``∂L/∂b``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.kernels import wrap
from hla_jax.kernels.gpu import gdn_levels, gdn_sweep, gdn_terms, gdn_terms_mgpu, gdn_ut_mgpu
from hla_jax.kernels.gpu.la_mgpu import F32, LOG2E, C


def _t(x, beta):
    """``T = X diag(β)`` per chunk: ``x [B,H,Tp,C]``, ``beta [B,H,Tp]``."""
    B, H, Tp = beta.shape
    return (x.reshape(B, H, Tp // C, C, C) * beta.reshape(B, H, Tp // C, 1, C)).reshape(B, H, Tp, C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def terms(q, k, v, b, beta, interpret):
    """``(M [B,H,Tp,C]`` float32, ``Q̂ [B,H,Tp,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in
    ``q``'s dtype) from ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (``dv`` a multiple of 64), ``b, beta
    [B,H,Tp]`` float32: the UT transform, then ``gdn_terms``."""
    return _terms_fwd(q, k, v, b, beta, interpret)[0]


def _terms_fwd(q, k, v, b, beta, interpret):
    b2 = b * LOG2E
    w, u, x = gdn_ut_mgpu.forward(k, v, b2, beta, interpret=interpret)
    out = gdn_terms.forward(q, k, w, u, _t(x, beta), b, interpret=interpret)
    return out, (q, k, v, b2, beta, w, u, x)


def _terms_bwd(interpret, res, cts):
    """``gdn_terms_mgpu.backward``, then the UT backward handed its ``dW``, ``−dU``, ``dK`` and
    ``T``'s own cotangent."""
    q, k, v, b2, beta, w, u, x = res
    dq, dk, dw, ndu, dt, db = gdn_terms_mgpu.backward(q, k, w, u, _t(x, beta), b2, *cts,
                                                      interpret=interpret)
    dk, dv, dbeta, db_ut = gdn_ut_mgpu.backward(k, v, b2, beta, x, dw, ndu, dk, dt_own=dt,
                                                interpret=interpret)
    return dq, dk, dv, db + db_ut, dbeta


terms.defvjp(_terms_fwd, _terms_bwd)


def chunk_terms(q, k, v, g, beta, Tp: int, interpret=None):
    """``(M [B,H,N,C,C]`` float32, ``Q̂ [B,H,N,C,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in
    ``q``'s dtype) per chunk, heads first, for ``q, k [B,T,H,d]``, ``v [B,T,H,dv]``,
    ``g, beta [B,T,H]`` zero-padded to ``Tp`` tokens (a multiple of ``C``): the UT transform,
    then ``P``, ``M``, ``Q̂``, ``A_c``, ``Z`` (``kernels/gpu/gdn_terms.py``; their backward
    ``kernels/gpu/gdn_terms_mgpu.py``'s, then the UT's).  ``interpret=None``: the GPU and
    Triton interpreters on CPU (which also take float32 inputs)."""
    B, T, H, d = k.shape
    dv, N = v.shape[-1], Tp // C
    interpret = bool(jax.default_backend() == "cpu" if interpret is None else interpret)
    if not interpret and jnp.dtype(k.dtype).itemsize != 2:
        raise ValueError(f"gdn_blocks.chunk_terms: compiled, the kernels take 16-bit q, k, v "
                         f"(as kernels.gated_deltanet_pallas), got {k.dtype}")
    per_token = lambda x: jnp.swapaxes(jnp.pad(x.astype(F32), ((0, 0), (0, Tp - T), (0, 0))), 1, 2)
    G = jnp.maximum(per_token(g), wrap.LOG_DECAY_FLOOR).reshape(B, H, N, C)
    b = jnp.cumsum(G, -1).reshape(B, H, Tp)
    q, k, v = wrap.pad(q, Tp, d), wrap.pad(k, Tp, d), wrap.pad(v, Tp, -(-dv // 64) * 64)
    M, Qh, A_c, Z = terms(q, k, v, b, per_token(beta), interpret)
    chunk = lambda x: x.reshape(B, H, N, C, -1)                                 # noqa: E731
    return chunk(M), chunk(Qh), A_c, Z[..., :dv]


def _sweep(pi, z, P, interpret):
    """The up-sweep's nodes of levels ``0..P−1`` (``kernels/gpu/gdn_sweep.py``), level 0 the
    chunks' ``(pi, z)``."""
    nodes = [(pi, z)]
    for _ in range(P - 1):
        nodes.append(gdn_sweep.forward(*nodes[-1], interpret=interpret))
    return nodes


def _widen(x, *widths):
    """``x`` zero-padded on its last ``len(widths)`` axes to ``widths``."""
    lead = [(0, 0)] * (x.ndim - len(widths))
    return jnp.pad(x, lead + [(0, w - n) for w, n in zip(widths, x.shape[x.ndim - len(widths):])])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _levels(qh, pi, z, lam, c, interpret):
    """``o [B,H,Tp,dv]`` float32 of the up-sweep and the reads (``levels``, padded inputs)."""
    nodes = _sweep(pi, z, lam.shape[-1], interpret)
    return gdn_levels.forward(qh, *zip(*nodes), lam, c=c, interpret=interpret)


def _levels_fwd(qh, pi, z, lam, c, interpret):
    nodes = _sweep(pi, z, lam.shape[-1], interpret)
    o, r = gdn_levels.forward(qh, *zip(*nodes), lam, c=c, save=True, interpret=interpret)
    return o, (nodes, r, lam)


def _levels_bwd(c, interpret, res, do):
    """Down the levels, each the reads' backward (``δ``, ``∂λ``, the left nodes' own cotangents)
    and the up-sweep's (each node's from its combined node's and its own), ``gdn_levels``."""
    nodes, r, lam = res
    pi, z = nodes[-1]
    do = do.astype(r.dtype)
    delta, dlam = jnp.zeros(do.shape[:3] + r.shape[-1:], r.dtype), jnp.zeros_like(lam)
    dpi = jnp.zeros(pi.shape[:2] + (-(-pi.shape[2] // 2),) + pi.shape[3:], pi.dtype)
    dz = jnp.zeros(z.shape[:2] + dpi.shape[2:3] + z.shape[3:], z.dtype)
    for i in reversed(range(len(nodes))):
        delta, dlam, dpi, dz = gdn_levels.backward(r, *nodes[i], lam, do, delta, dlam, dpi, dz, i=i,
                                                   c=c, interpret=interpret)
    return delta, dpi, dz, dlam


_levels.defvjp(_levels_fwd, _levels_bwd)


def levels(qh, pi, z, lam, c: int, interpret=None):
    """The chunk levels of ``ops.loglinear_gdn_blocks``: the up-sweep of the chunks' ``(Π, Z)``
    (one Triton program per pair and level, forward and backward), then the reads
    ``Σ_i λ_i ∘ (r_i Z_i)``, ``r_{i+1} = r_i Π_i`` over the levels ``i`` at which a token's chunk
    lies in a right half (one Triton program per chunk; backward one launch per level, one
    program per run of a right half, ``kernels/gpu/gdn_levels.py``): ``qh [B,H,Tp,d]``
    (``Tp = N c``), ``pi [B,H,N,d,d]``, ``z [B,H,N,d,dv]`` in ``qh``'s dtype, ``lam [B,H,Tp,P]``
    float32 (level ``i``'s weight in column ``i``, ``P ≥ 1``) -> ``[B,H,Tp,dv]`` float32; ``d``,
    ``dv`` zero-padded to powers of two ≥ 16.  ``interpret=None``: the Triton interpreter on
    CPU."""
    interpret = bool(jax.default_backend() == "cpu" if interpret is None else interpret)
    d, dv = qh.shape[-1], z.shape[-1]
    dp, dvp = wrap.pow2_at_least(max(d, 16)), wrap.pow2_at_least(max(dv, 16))
    return _levels(_widen(qh, dp), _widen(pi, dp, dp), _widen(z, dp, dvp), lam, c, interpret)[..., :dv]
