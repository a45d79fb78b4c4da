"""Chunked first-order linear attention, Mamba-2's SSD core (docs/math.md#loglinear-gdn-chunk):

    o_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s,      D(t,s) = exp(g_{s+1} + … + g_t)

Chunk n of ``c`` tokens (``Q, K: [c,d]``, ``V: [c,dv]``, log-decays ``G: [c]``) reads the state
``H_{n−1}: [d,dv]`` that the chunks before it leave:

    O_n = ((Q Kᵀ) ∘ Γ) V + (γ ∘ Q) H_{n−1},        H_n = γ_c H_{n−1} + K̃ᵀ V,

``Γ[τ,σ] = D(τ,σ)`` (``τ ≥ σ``, else 0), ``γ_τ`` the decay from the chunk's start to ``τ``,
``K̃ = Γ[c−1, :] ∘ K`` the keys decayed to the chunk's end.  Matmuls inside chunks, one
``lax.scan`` of the ``d×dv`` state across them.  A reset ``g = −∞`` (a packed document's first
token) stays finite: the decays are formed in log space from the finite gates, and a reset
zeroes every decay across it (``decays``).

Layout: chunks are ``[N,B·H,c,…]`` (``core.layout.scan_chunks``): the chunk index first, as the scan takes it,
and batch and heads merged into one batch axis of the matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core.layout import from_scan_chunks, scan_chunks
from hla_jax.core.state import state_dtype
from hla_jax.ops import common, sequence
from hla_jax.ops.xla.ssm import combine, mul


def inclusive_sum(x):
    """``Σ_{σ≤τ} x_σ`` over the last axis, as a product with the lower-triangular ones (exact
    float32 products): XLA fuses a cumulative sum into each of its ``c²`` consumers and redoes it
    there."""
    c = x.shape[-1]
    return jnp.einsum("...s,ts->...t", x, jnp.tril(jnp.ones((c, c), x.dtype)),
                      precision=common.HIGHEST)


def decays(G):
    """``(Γ [..., c, c], γ [..., c])`` of a chunk's log-decays ``G [..., c]``: ``Γ[τ,σ] = D(τ,σ)``
    for ``σ ≤ τ`` (else 0) and ``γ_τ = D(τ, −1)``, the decay from the chunk's start.

    ``D(τ,σ) = exp(F_τ − F_σ)`` with ``F`` the inclusive sum of the finite gates, and 0 where a
    reset lies in ``(σ, τ]`` (its reset count ``Z_τ ≠ Z_σ``); the exponent is masked before
    ``exp``, so neither the values nor the gradients meet an infinity.
    """
    c = G.shape[-1]
    reset = jnp.isneginf(G)
    F = inclusive_sum(jnp.where(reset, 0, G))
    Z = inclusive_sum(reset.astype(G.dtype))
    live = jnp.tril(jnp.ones((c, c), bool)) & (Z[..., :, None] == Z[..., None, :])
    Gam = jnp.exp(jnp.where(live, F[..., :, None] - F[..., None, :], -jnp.inf))
    return Gam, jnp.where(Z == 0, jnp.exp(F), 0)


def states(a, S, h0):
    """``(H_{n−1} [N,B·H,d,dv], H_N)``: ``H_n = a_n H_{n−1} + S_n`` over chunks from ``h0``
    (``a: [N,B·H]`` the chunk decays, ``S: [N,B·H,d,dv]`` the chunks' own states)."""
    def step(H, x):
        a_n, S_n = x
        return a_n[..., None, None] * H + S_n, H

    final, prev = jax.lax.scan(step, h0, (a, S))
    return prev, final


def start_state(total, h0, seq_axis):
    """The state before this shard's first token: ``h0`` (None: zeros) carried across the earlier
    shards, whose totals ``total = (A_j, H_j)`` (transition ``[..., 1, 1]`` or ``[..., d, d]``,
    own state ``[..., d, dv]``) ``sequence.device_prefix`` folds with ``ssm.combine``."""
    A, H = total
    identity = (jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape), jnp.zeros_like(H))
    A_in, H_in = sequence.device_prefix(lambda _, acc, s: combine(acc, s), identity, total,
                                        seq_axis)
    return H_in if h0 is None else mul(A_in, h0) + H_in


def chunked(q, k, v, g, chunk_size=64, seq_axis=None, initial_state=None):
    """``(o [B,T,H,dv], final_state [B,H,d,dv])`` for ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``,
    ``g: [B,T,H]`` (log-decays, ``−∞`` a reset), from ``initial_state [B,H,d,dv]`` (None:
    zeros), any ``T``; in the state dtype (``core.state.state_dtype``).

    ``seq_axis`` (``ops.sequence``): a first pass gives this shard's total ``(∏_n a_n, H_N)``
    from a zero state, ``start_state`` folds the earlier shards' totals, and the chunks run from
    the state they leave.
    """
    dt = state_dtype(q, k, v, g)
    q, k, v, g = (x.astype(dt) for x in (q, k, v, g))
    B, T, H, d = q.shape
    dv = v.shape[-1]
    Q, K, V, G = (scan_chunks(x, chunk_size) for x in (q, k, v, g))
    Gam, gamma = decays(G)
    a = gamma[..., -1]
    S = common.ein("...cd,...cv->...dv", Gam[..., -1, :, None] * K, V)
    h0 = None if initial_state is None else initial_state.astype(dt).reshape(B * H, d, dv)
    if seq_axis is not None:
        zeros = sequence.varying(jnp.zeros((B * H, d, dv), dt), seq_axis)
        h0 = start_state((jnp.prod(a, 0)[..., None, None], states(a, S, zeros)[1]), h0, seq_axis)
    prev, final = states(a, S, jnp.zeros((B * H, d, dv), dt) if h0 is None else h0)
    o = (common.ein("...ts,...sv->...tv", common.ein("...td,...sd->...ts", Q, K) * Gam, V)
         + common.ein("...td,...dv->...tv", gamma[..., None] * Q, prev))
    return from_scan_chunks(o, T, B), final.reshape(B, H, d, dv)
