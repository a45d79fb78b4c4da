"""Chunked Gated DeltaNet, the UT/WY form (docs/math.md#loglinear-gdn-chunk):

    o_t = q_tᵀ H_t,     H_t = a_t (I − β_t k_t k_tᵀ) H_{t−1} + β_t k_t v_tᵀ,   a_t = exp(g_t)

Chunk n of ``c`` tokens (``Q, K: [c,d]``, ``V: [c,dv]``, ``G, β: [c]``; ``Γ``, ``γ`` the decays
of ``la_chunked.decays``, ``K̃ = Γ[c−1, :] ∘ K``) writes the effective values
``V' = U − W H_{n−1}`` given by the UT transform

    𝒯 = (I + strict_tril(diag(β)(K Kᵀ) ∘ Γ))⁻¹ diag(β),     W = 𝒯 (γ ∘ K),   U = 𝒯 V,

and then

    O_n = (γ ∘ Q) H_{n−1} + ((Q Kᵀ) ∘ Γ) V',        H_n = γ_c H_{n−1} + K̃ᵀ V'.

The inverse is formed by matmuls (``unit_lower_inverse``), ``W`` and ``U`` are batched products
over all chunks (``ut_transform``), one ``lax.scan`` carries ``V'`` and the state across chunks
(``states``), and the outputs are batched products again.  The inverse and the scan have their
own cotangents (two products for the inverse; a reverse scan that carries only ``∂H``), the
rest is differentiated by JAX.  Resets ``g = −∞`` stay finite as in ``la_chunked``.  Layout
``[N,B·H,c,…]`` (``core.layout.scan_chunks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core.layout import from_scan_chunks, scan_chunks
from hla_jax.ops import common, sequence
from hla_jax.ops.xla.la_chunked import decays, start_state


@jax.custom_vjp
def unit_lower_inverse(A):
    """``X = (I + A)⁻¹`` for strictly lower-triangular ``A [..., n, n]``, by matmuls
    (``_blocked_inverse``); its cotangent is ``∂A = −strict_tril(Xᵀ ∂X Xᵀ)``, two products
    instead of the transpose of every block product."""
    return _blocked_inverse(A)


def _blocked_inverse(A, base: int = 16):
    """Blocks of at most ``base`` rows invert as ``(I − A)(I + A²)(I + A⁴)⋯`` (``A`` is
    nilpotent), and two halves join as ``[[X₁, 0], [−X₂ A₂₁ X₁, X₂]]``."""
    n = A.shape[-1]
    if n <= base:
        P = -A
        X = jnp.eye(n, dtype=A.dtype) + P
        for _ in range(max(n - 1, 1).bit_length() - 1):
            P = common.mm(P, P)
            X = X + common.mm(X, P)
        return X
    h = n // 2
    X1 = _blocked_inverse(A[..., :h, :h], base)
    X2 = _blocked_inverse(A[..., h:, h:], base)
    X21 = -common.mm(X2, common.mm(A[..., h:, :h], X1))
    return jnp.concatenate([jnp.concatenate([X1, jnp.zeros_like(X21.mT)], -1),
                            jnp.concatenate([X21, X2], -1)], -2)


def _inverse_fwd(A):
    X = _blocked_inverse(A)
    return X, X


def _inverse_bwd(X, dX):
    return (-jnp.tril(common.mm(X.mT, common.mm(dX, X.mT)), -1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def ut_matrix(K, Beta, Gam):
    """``𝒯 = (I + strict_tril(diag(β)(KKᵀ) ∘ Γ))⁻¹ diag(β)`` ``[..., c, c]`` of one chunk
    (``K: [..., c, d]``, ``Beta: [..., c]``, ``Gam: [..., c, c]``)."""
    A = jnp.tril(Beta[..., :, None] * common.ein("...td,...sd->...ts", K, K) * Gam, -1)
    return unit_lower_inverse(A) * Beta[..., None, :]


def ut_transform(K, V, Beta, Gam, gamma):
    """``(W [..., c, d], U [..., c, dv]) = 𝒯 [γ ∘ K | V]`` for one chunk (``ut_matrix``;
    ``V: [..., c, dv]``, ``gamma: [..., c]``)."""
    Tm = ut_matrix(K, Beta, Gam)
    return (common.ein("...ts,...sd->...td", Tm, gamma[..., None] * K),
            common.ein("...ts,...sv->...tv", Tm, V))


@jax.custom_vjp
def states(W, U, Kt, a, h0):
    """``(H_{n−1} [N,B·H,d,dv], V' [N,B·H,c,dv], H_N)`` over chunks from ``h0 [B·H,d,dv]``:
    ``V'_n = U_n − W_n H_{n−1}``, ``H_n = a_n H_{n−1} + K̃_nᵀ V'_n`` (``W, K̃: [N,B·H,c,d]``,
    ``U: [N,B·H,c,dv]``, ``a: [N,B·H]``)."""
    return _states_fwd(W, U, Kt, a, h0)[0]


def _states_fwd(W, U, Kt, a, h0):
    def step(H, x):
        W_n, U_n, Kt_n, a_n = x
        Vp = U_n - common.ein("...cd,...dv->...cv", W_n, H)
        return a_n[..., None, None] * H + common.ein("...cd,...cv->...dv", Kt_n, Vp), (H, Vp)

    final, (prev, Vp) = jax.lax.scan(step, h0, (W, U, Kt, a))
    return (prev, Vp, final), (W, Kt, a, prev, Vp)


def _states_bwd(res, cts):
    """The reverse scan carries only ``∂H_n`` (``∂_o``: the cotangents of the outputs):
    ``∂V'_n = ∂_o V'_n + K̃_n ∂H_n``, ``∂H_{n−1} = a_n ∂H_n − W_nᵀ ∂V'_n + ∂_o H_{n−1}``; the
    other cotangents are batched products after it: ``∂W_n = −∂V'_n H_{n−1}ᵀ``, ``∂U_n = ∂V'_n``,
    ``∂K̃_n = V'_n ∂H_nᵀ``, ``∂a_n = ⟨H_{n−1}, ∂H_n⟩``."""
    W, Kt, a, prev, Vp = res
    d_prev, d_Vp, d_final = cts

    def step(dH, x):
        W_n, Kt_n, a_n, dprev_n, dVp_n = x
        dV = dVp_n + common.ein("...cd,...dv->...cv", Kt_n, dH)
        return a_n[..., None, None] * dH - common.ein("...cd,...cv->...dv", W_n, dV) + dprev_n, (dH, dV)

    dh0, (dH, dV) = jax.lax.scan(step, d_final, (W, Kt, a, d_prev, d_Vp), reverse=True)
    return (-common.ein("...cv,...dv->...cd", dV, prev), dV, common.ein("...cv,...dv->...cd", Vp, dH),
            jnp.sum(prev * dH, (-2, -1)), dh0)


states.defvjp(_states_fwd, _states_bwd)


def chunked(q, k, v, g, beta, chunk_size=64, seq_axis=None, initial_state=None):
    """``(o [B,T,H,dv], final_state [B,H,d,dv])`` for ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``,
    ``g, beta: [B,T,H]`` (log-decays, ``−∞`` a reset), from ``initial_state [B,H,d,dv]`` (None:
    zeros), any ``T``; in the state dtype (``common.state_dtype``).

    ``seq_axis`` (``ops.sequence``): a first pass carries ``[A | H]`` from ``[I | 0]`` through the
    shard (``states`` with values ``[0 | U]``: ``A`` the shard's transition, ``H`` its own
    state), ``la_chunked.start_state`` folds the earlier shards' totals, and the chunks run from
    the state they leave.
    """
    dt = common.state_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.astype(dt) for x in (q, k, v, g, beta))
    B, T, H, d = q.shape
    dv = v.shape[-1]
    Q, K, V, G, Beta = (scan_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    Gam, gamma = decays(G)
    W, U = ut_transform(K, V, Beta, Gam, gamma)
    Kt = Gam[..., -1, :, None] * K
    a = gamma[..., -1]
    h0 = None if initial_state is None else initial_state.astype(dt).reshape(B * H, d, dv)
    if seq_axis is not None:
        AH0 = jnp.concatenate([jnp.broadcast_to(jnp.eye(d, dtype=dt), (B * H, d, d)),
                               jnp.zeros((B * H, d, dv), dt)], -1)
        AH = states(W, jnp.concatenate([jnp.zeros_like(W), U], -1), Kt, a,
                    sequence.varying(AH0, seq_axis))[2]
        h0 = start_state((AH[..., :d], AH[..., d:]), h0, seq_axis)
    prev, Vp, final = states(W, U, Kt, a, jnp.zeros((B * H, d, dv), dt) if h0 is None else h0)
    o = (common.ein("...td,...dv->...tv", gamma[..., None] * Q, prev)
         + common.ein("...ts,...sv->...tv", common.ein("...td,...sd->...ts", Q, K) * Gam, Vp))
    return from_scan_chunks(o, T, B), final.reshape(B, H, d, dv)
