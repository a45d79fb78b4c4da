"""Quadratic reference operators: the oracles every fast path is tested against.

Each materialises T×T matrices (or, for Gated DeltaNet, a scan over a ``[T, d]`` matrix of
propagated keys) straight from the definitions in docs/math.md, with none of the algebra of the fast
forms.  Inputs ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``, ``lam: [B,T,H,L]``;
outputs ``[B,T,H,dv]`` in the state dtype (float32, or float64 under x64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.core.documents import doc_positions, same_doc
from hla_jax.core.state import state_dtype
from hla_jax.ops.common import HIGHEST as _HI
from hla_jax.ops.common import clamp_signed, decay_matrix


def _ein(spec, *xs):
    """The oracle's einsum: exact float32 products whatever the context."""
    return jnp.einsum(spec, *xs, precision=_HI)


def _heads_first(x, dtype):
    """``[B,T,H,...] -> [B,H,T,...]`` in ``dtype``."""
    return jnp.moveaxis(x, 2, 1).astype(dtype)


def _prepare(q, k, v, g, *extra):
    dt = state_dtype(q, k, v, g, *extra)
    B, T, H = q.shape[:3]
    Q, K, V = (_heads_first(x, dt) for x in (q, k, v))
    G = jnp.zeros((B, H, T), dt) if g is None else jnp.moveaxis(g, 2, 1).astype(dt)
    return dt, Q, K, V, decay_matrix(G)  # Γ: [B,H,T,T]


def _out(o):
    return jnp.moveaxis(o, 1, 2)  # [B,H,T,dv] -> [B,T,H,dv]


def _ratio(num_fn, V, normalize, eps):
    """``num_fn(V)`` or, normalised, ``num_fn(V) / clamp_signed(num_fn(1), eps)``."""
    num = num_fn(V)
    if not normalize:
        return num
    den = num_fn(jnp.ones_like(V[..., :1]))
    return num / clamp_signed(den, eps)


def linear_attention(q, k, v, g=None):
    """``o = (Γ ∘ QKᵀ) V`` (first order; Mamba-2's SSD core when g is given)."""
    _, Q, K, V, Gam = _prepare(q, k, v, g)
    return _out(_ein("bhts,bhsv->bhtv", Gam * _ein("bhtd,bhsd->bhts", Q, K), V))


def hla2(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """``o_t = Σ_{i≤j≤t} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j = ((W_g Wᵀ) ∘ Γ) V``."""
    _, Q, K, V, Gam = _prepare(q, k, v, g)
    A = _ein("bhtd,bhsd->bhts", Q, K)
    L = jnp.tril(jnp.ones(A.shape[-2:], A.dtype))
    M = _ein("bhti,bhji->bhtj", Gam * A, L * A) * Gam
    return _out(_ratio(lambda X: _ein("bhtj,bhjv->bhtv", M, X), V, normalize, eps))


def ahla(q, k, v, g=None, *, normalize=False, eps=1e-6):
    """``o_t = Σ_{j≤i≤t} D(t,j) (q_t·k_i)(q_i·k_j) v_j = (W_g W_g) V``."""
    _, Q, K, V, Gam = _prepare(q, k, v, g)
    Wg = Gam * _ein("bhtd,bhsd->bhts", Q, K)
    M = _ein("bhti,bhij->bhtj", Wg, Wg)
    return _out(_ratio(lambda X: _ein("bhtj,bhjv->bhtv", M, X), V, normalize, eps))


def hla3(q, k, v, g=None, *, mask="causal", normalize=False, eps=1e-6, same=None):
    """Third order.  ``causal``:
    ``o_t = Σ_{u≤t} Σ_{i,j≤u} D(t,i)D(t,u)D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j``,
    i.e. ``((W_g Wᵀ) ∘ Γ)(W_g V)``.  ``paper`` (no decay): the sum over index triples
    ``(i,u,j) ≤ t`` of ``(q_t·k_i)(k_i·q_u)(q_u·k_j) v_j`` whose largest index occurs at least
    twice, computed by splitting on which indices equal the maximum ``m``.  ``same: [B,T,T]``
    bool (packed documents, ``core.documents.same_doc``) zeroes the cross-document entries of ``QKᵀ``:
    every triple with an index outside ``t``'s document then vanishes.
    """
    if mask not in ("causal", "paper"):
        raise ValueError(f"mask={mask!r} is not one of ('causal', 'paper')")
    if mask == "paper" and g is not None:
        raise ValueError("hla3(mask='paper') is defined without decay: pass g=None")
    _, Q, K, V, Gam = _prepare(q, k, v, g)
    A = _ein("bhtd,bhsd->bhts", Q, K)
    if same is not None:
        A = A * same[:, None].astype(A.dtype)
    T = A.shape[-1]
    L = jnp.tril(jnp.ones((T, T), A.dtype))
    if mask == "causal":
        Wg = Gam * A
        M = _ein("bhti,bhui->bhtu", Wg, L * A) * Gam

        def num_fn(X):
            return _ein("bhtu,bhuv->bhtv", M, _ein("bhuj,bhjv->bhuv", Wg, X))

    else:
        Ls = jnp.tril(jnp.ones((T, T), A.dtype), -1)
        diag = jnp.diagonal(A, axis1=-2, axis2=-1)  # A[m, m]
        col_sq = _ein("bhum,bhum->bhm", Ls.T * A, A)  # Σ_{u<m} A[u,m]²
        # u = j = m > i: Σ_{i<m≤t} A[t,i] A[m,i] A[m,m] v_m
        N = _ein("bhti,bhmi->bhtm", A, Ls * A) * L

        def num_fn(X):
            same_m = (diag[..., None] * _ein("bhmj,bhjv->bhmv", Ls * A, X)  # i = u = m > j
                      + (col_sq + diag**2)[..., None] * X)  # i = j = m > u, and i = u = j = m
            return (_ein("bhtm,bhmv->bhtv", L * A, same_m)
                    + _ein("bhtm,bhmv->bhtv", N, diag[..., None] * X))

    return _out(_ratio(num_fn, V, normalize, eps))


def fenwick_levels(T: int) -> np.ndarray:
    """``ℓ[t, s] = bit_length(t XOR s)`` for ``s ≤ t`` (0 on the diagonal), -1 above; ``[T, T]``."""
    t = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    x = t ^ s
    lev = np.zeros((T, T), np.int64)
    nz = x > 0
    lev[nz] = np.floor(np.log2(x[nz])).astype(np.int64) + 1
    return np.where(s <= t, lev, -1)


def _level_weights(lam, T, dt, segment_ids=None):
    """``Λ[b,h,t,s] = λ_t^{ℓ(t,s)}`` (0 above the diagonal) from ``lam: [B,T,H,L]``.

    With ``segment_ids [B,T]`` the levels count from each document's first token,
    ``ℓ(t,s) = bit_length((t−t0) XOR (s−t0))``, and ``Λ = 0`` between documents.
    """
    lev = fenwick_levels(T)
    if lam.shape[-1] <= lev.max():
        raise ValueError(f"lam has {lam.shape[-1]} levels; T={T} needs {lev.max() + 1}")
    if segment_ids is not None:
        p = doc_positions(segment_ids)
        x = p[:, :, None] ^ p[:, None, :]
        bits = sum((x >> i) > 0 for i in range(int(lev.max()) + 1))  # bit_length(x)
        lev = jnp.where(same_doc(segment_ids) & jnp.asarray(lev >= 0), bits, -1)[:, None]
    lam = jnp.moveaxis(lam, 2, 1).astype(dt)  # [B,H,T,L]
    idx = jnp.maximum(lev, 0)
    W = jnp.take_along_axis(lam, jnp.broadcast_to(idx, lam.shape[:2] + idx.shape[-2:]), axis=-1)
    return jnp.where(lev >= 0, W, 0)


def loglinear_mamba2(q, k, v, g, lam, *, segment_ids=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s`` (``segment_ids``: within documents,
    levels from each document's start)."""
    dt, Q, K, V, Gam = _prepare(q, k, v, g, lam)
    Lam = _level_weights(lam, q.shape[1], dt, segment_ids)
    return _out(_ein("bhts,bhsv->bhtv", Lam * Gam * _ein("bhtd,bhsd->bhts", Q, K), V))


def _delta_scores(Q, K, G, Beta):
    """``P[t, s] = q_tᵀ (A_t ⋯ A_{s+1}) k_s`` for ``s ≤ t`` with ``A_r = a_r (I − β_r k_r k_rᵀ)``.

    A scan over t carries the matrix ``X[s] = (A_t ⋯ A_{s+1}) k_s`` of every propagated key
    (zero for ``s > t``): ``X ← a_t (X − β_t (X k_t) k_tᵀ)``, then ``X[t] = k_t``.
    ``Q, K: [T, d]``, ``G, Beta: [T]`` -> ``[T, T]``.
    """
    T, d = K.shape

    def step(X, inp):
        t, q_t, k_t, g_t, b_t = inp
        X = jnp.exp(g_t) * (X - b_t * jnp.outer(jnp.dot(X, k_t, precision=_HI), k_t))
        X = X.at[t].set(k_t)
        return X, jnp.dot(X, q_t, precision=_HI)

    _, P = jax.lax.scan(step, jnp.zeros((T, d), K.dtype), (jnp.arange(T), Q, K, G, Beta))
    return P


def _gated_deltanet(q, k, v, g, beta, lam=None, segment_ids=None):
    dt, Q, K, V, _ = _prepare(q, k, v, g, beta)
    G = jnp.moveaxis(g, 2, 1).astype(dt)
    Beta = jnp.moveaxis(beta, 2, 1).astype(dt)
    P = jax.vmap(jax.vmap(_delta_scores))(Q, K, G, Beta)  # [B,H,T,T]
    if lam is not None:
        P = P * _level_weights(lam, q.shape[1], dt, segment_ids)
    elif segment_ids is not None:
        P = jnp.where(same_doc(segment_ids)[:, None], P, 0)
    return _out(_ein("bhts,bhsv->bhtv", P * Beta[:, :, None, :], V))


def gated_deltanet(q, k, v, g, beta, *, segment_ids=None):
    """``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``, ``A_r = a_r (I − β_r k_r k_rᵀ)``
    (``segment_ids``: within documents)."""
    return _gated_deltanet(q, k, v, g, beta, segment_ids=segment_ids)


def loglinear_gated_deltanet(q, k, v, g, beta, lam, *, segment_ids=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s`` (``segment_ids`` as for
    ``loglinear_mamba2``)."""
    return _gated_deltanet(q, k, v, g, beta, lam, segment_ids)
