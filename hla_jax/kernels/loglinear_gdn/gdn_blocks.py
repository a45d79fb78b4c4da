"""The kernel parts of log-linear Gated DeltaNet's block form (``ops.xla.loglinear_gdn_blocks``):
its per-chunk terms (``chunk_terms``) from the first-order kernel's UT transform and its backward
(``gdn/gdn_ut_mgpu.py``, Mosaic GPU) and one Triton program per chunk for the rest
(``gdn_terms_triton.py``) instead of XLA's batched triangular solve and einsums
(``loglinear_chunked.chunk_terms``); and the output (``output``: the up-sweep a Triton program
per pair of nodes, ``gdn_sweep_triton.py``; then one program per chunk forming its window
and carrying its running query up the levels, writing ``o`` tokens first; the reads' backward
and the up-sweep's one launch per level carrying its cotangent down,
``gdn_levels_triton.py``) instead of XLA's window, its batched products and pass per level
over every token, and the moves of ``V`` and ``o`` between layouts.

Per chunk of ``C = 64`` tokens, with ``ρ = exp(b)`` (``b`` the chunk-local cumulative log-decay,
floored at ``wrap.LOG_DECAY_FLOOR``), ``Γ[τ,σ] = ρ_τ/ρ_σ`` (``τ ≥ σ``), ``K̃ = (ρ_c/ρ)∘K``::

    T = (I + strict_tril(diag(β)(K Kᵀ) ∘ Γ))⁻¹ diag(β),   W = T(ρ∘K),   U = T V    (gdn_ut_mgpu)
    P = (Q Kᵀ) ∘ Γ,   M = P T,   Q̂ = ρ∘Q − P W,   A_c = ρ_c I − K̃ᵀ W,   Z = K̃ᵀ U   (gdn_terms_triton)

(as ``loglinear_chunked.delta_terms`` in XLA).  Their backward is a Mosaic GPU kernel
(``gdn_terms_mgpu.py``: ``dQ``, the terms' share of ``dK``, ``dW``, ``−dU``, ``T``'s
own cotangent and the terms' share of ``∂L/∂b``), then the first-order kernel's UT backward,
handed those to add to the ``dT = dW (ρ∘K)ᵀ + dU Vᵀ`` and ``dK`` it forms; it gives the UT
transform's share of ``∂L/∂b``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.block_levels import chunk_window
from hla_jax.kernels import wrap
from hla_jax.kernels.gdn import gdn_ut_mgpu
from hla_jax.kernels.loglinear_gdn import (
    gdn_levels_triton,
    gdn_sweep_triton,
    gdn_terms_mgpu,
    gdn_terms_triton,
)
from hla_jax.kernels.mosaic_gpu import F32, LOG2E, C


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def terms(q, k, v, b, beta, interpret):
    """``(M [B,H,Tp,C]`` float32, ``Q̂ [B,H,Tp,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in
    ``q``'s dtype) from ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (``dv`` a multiple of 64), ``b, beta
    [B,H,Tp]`` float32: the UT transform, then ``gdn_terms_triton``."""
    return _terms_fwd(q, k, v, b, beta, interpret)[0]


def _terms_fwd(q, k, v, b, beta, interpret):
    b2 = b * LOG2E
    w, u, x = gdn_ut_mgpu.forward(k, v, b2, beta, interpret=interpret)
    out = gdn_terms_triton.forward(q, k, w, u, x, beta, b, interpret=interpret)
    return out, (q, k, v, b2, beta, w, u, x)


def _terms_bwd(interpret, res, cts):
    """``gdn_terms_mgpu.backward``, then the UT backward handed its ``dW``, ``−dU``, ``dK`` and
    ``T``'s own cotangent."""
    q, k, v, b2, beta, w, u, x = res
    dq, dk, dw, ndu, dt, db = gdn_terms_mgpu.backward(q, k, w, u, x, beta, b2, *cts,
                                                      interpret=interpret)
    dk, dv, dbeta, db_ut = gdn_ut_mgpu.backward(k, v, b2, beta, x, dw, ndu, dk, dt_own=dt,
                                                interpret=interpret)
    return dq, dk, dv, db + db_ut, dbeta


terms.defvjp(_terms_fwd, _terms_bwd)


def chunk_terms(q, k, v, g, beta, Tp: int, interpret=None):
    """``(M [B,H,N,C,C]`` float32, ``Q̂ [B,H,N,C,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in
    ``q``'s dtype) per chunk, heads first, for ``q, k [B,T,H,d]``, ``v [B,T,H,dv]``,
    ``g, beta [B,T,H]`` zero-padded to ``Tp`` tokens (a multiple of ``C``): the UT transform,
    then ``P``, ``M``, ``Q̂``, ``A_c``, ``Z`` (``gdn_terms_triton.py``; their backward
    ``gdn_terms_mgpu.py``'s, then the UT's).  ``interpret=None``: the GPU and
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
    """The up-sweep's nodes of levels ``0..P−1`` (``gdn_sweep_triton.py``), level 0 the
    chunks' ``(pi, z)``."""
    nodes = [(pi, z)] if P else []
    for _ in range(P - 1):
        nodes.append(gdn_sweep_triton.forward(*nodes[-1], interpret=interpret))
    return nodes


def _split(nodes):
    """``(Π's, Z's)`` of the up-sweep's nodes, level by level."""
    return tuple(n[0] for n in nodes), tuple(n[1] for n in nodes)


def _widen(x, *widths):
    """``x`` zero-padded on its last ``len(widths)`` axes to ``widths``."""
    lead = [(0, 0)] * (x.ndim - len(widths))
    return jnp.pad(x, lead + [(0, w - n) for w, n in zip(widths, x.shape[x.ndim - len(widths):])])


def _num_levels(qh, lc):
    """``P``, the chunk levels of ``Tp = N·2^lc`` tokens (``fenwick.num_levels(N) − 1``)."""
    return fenwick.num_levels(qh.shape[2] >> lc) - 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _output(m, v, qh, pi, z, lam, lc, interpret):
    """``o [B,Tp,H,dv]`` float32 (``output``, padded inputs)."""
    nodes = _sweep(pi, z, _num_levels(qh, lc), interpret)
    return gdn_levels_triton.forward(m, v, qh, *_split(nodes), lam, lc=lc, interpret=interpret)


def _output_fwd(m, v, qh, pi, z, lam, lc, interpret):
    nodes = _sweep(pi, z, _num_levels(qh, lc), interpret)
    out = gdn_levels_triton.forward(m, v, qh, *_split(nodes), lam, lc=lc, save=bool(nodes),
                             interpret=interpret)
    o, r = out if nodes else (out, None)
    return o, (m, v, qh, pi, z, nodes, r, lam)


def _output_bwd(lc, interpret, res, do):
    """The window's by XLA, then down the levels, each the reads' backward (``δ``, ``∂λ``, the
    left nodes' own cotangents) and the up-sweep's (each node's from its combined node's and its
    own), ``gdn_levels_triton``."""
    m, v, qh, pi, z, nodes, r, lam = res
    do = jnp.moveaxis(do, 1, 2)
    dm, dv, dlam = jax.vjp(chunk_window, m, v, lam)[1](do)
    if not nodes:
        return dm, dv, jnp.zeros_like(qh), jnp.zeros_like(pi), jnp.zeros_like(z), dlam
    top_pi, top_z = nodes[-1]
    do = do.astype(r.dtype)
    delta = jnp.zeros(do.shape[:3] + r.shape[-1:], r.dtype)
    dpi = jnp.zeros(top_pi.shape[:2] + (-(-top_pi.shape[2] // 2),) + top_pi.shape[3:], top_pi.dtype)
    dz = jnp.zeros(top_z.shape[:2] + dpi.shape[2:3] + top_z.shape[3:], top_z.dtype)
    for i in reversed(range(len(nodes))):
        delta, dlam, dpi, dz = gdn_levels_triton.backward(r, *nodes[i], lam, do, delta, dlam, dpi, dz, i=i,
                                                   lc=lc, interpret=interpret)
    return dm, dv, delta, dpi, dz, dlam


_output.defvjp(_output_fwd, _output_bwd)


def output(m, v, qh, pi, z, lam, lc: int, interpret=None):
    """The output of ``ops.xla.loglinear_gdn_blocks``: the window ``(Λ ∘ M) V`` inside each chunk and
    the chunk levels, the up-sweep of the chunks' ``(Π, Z)`` (one Triton program per pair and
    level, forward and backward), then the reads ``Σ_i λ_{lc+1+i} ∘ (r_i Z_i)``,
    ``r_{i+1} = r_i Π_i`` over the levels ``i`` at which a token's chunk lies in a right half (one
    Triton program per chunk, the window's product first; backward: the window's by XLA, the
    reads' one launch per level, one program per run of a right half,
    ``gdn_levels_triton.py``): ``m [B,H,Tp,c]`` float32 (``c = 2^lc``, ``Tp = N c``),
    ``v [B,Tp,H,dv]``, ``qh [B,H,Tp,d]``, ``pi [B,H,N,d,d]``, ``z [B,H,N,d,dv]`` in ``qh``'s dtype,
    ``lam [B,H,Tp,L]`` float32 (level ``ℓ``'s weight in column ``ℓ``,
    ``L ≥ lc + fenwick.num_levels(N)``) -> ``o [B,Tp,H,dv]`` float32; ``d``, ``dv`` zero-padded
    to powers of two ≥ 16.  ``interpret=None``: the Triton interpreter on CPU."""
    interpret = bool(jax.default_backend() == "cpu" if interpret is None else interpret)
    d, dv = qh.shape[-1], z.shape[-1]
    dp, dvp = wrap.pow2_at_least(max(d, 16)), wrap.pow2_at_least(max(dv, 16))
    return _output(m, _widen(v, dvp), _widen(qh, dp), _widen(pi, dp, dp), _widen(z, dp, dvp), lam,
                   lc, interpret)[..., :dv]
