"""docs/math.md#chains: the masked HLA operators are chains of first-order scalar-gated linear attention

    LA(q, k, v; g)_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s          (Mamba-2's SSD core, ``ops.families.linear``)

    hla2(q,k,v,g) = LA(q, K̃, v; 2g)          K̃ = LA(q, k, k; g)                 (K̃_j = S_j q_j)
    ahla(q,k,v,g) = LA(q, k, Ṽ; g)           Ṽ = LA(q, k, v; g)                 (W_g (W_g V))
    hla3(q,k,v,g) = LA(q, K̃, Ṽ; 2g)          [K̃ | Ṽ] = LA(q, k, [k | v]; g)     (mask="causal")

Exact, not approximate: for ``i ≤ j ≤ t`` the decay factors, ``D(t,i) = D(t,j) D(j,i)``, so a
factor ``D(t,i)`` reaching past the middle index ``j`` splits there.  hla2:
``D(t,j)² D(j,i) = D(t,i) D(t,j)`` (outer gate 2g, ``D(t,j)²`` is the decay of ``2g``); ahla:
``D(t,i) D(i,j) = D(t,j)``; hla3: ``D(t,u)² D(u,i) D(u,j) = D(t,i) D(t,u) D(u,j)``.  With
``g = None`` (no decay) 2g is ``None`` too.  A reset ``g_r = −∞`` (a packed document's first
token, docs/math.md#packed-documents) zeroes every ``D(t,s)`` with ``s < r ≤ t`` in both
passes (``2g_r = −∞``), so the chains reset exactly where the operator does.

Ratio normalisation: the operators are linear in the innermost values, and the denominator is
the same chain with those values replaced by 1, so a ones column is appended to them (hla2's
outer ``v``, ahla's inner ``v``, hla3's inner ``[k | v]``) and the last output column divides the
rest (``clamp_signed``, ``common.ratio_last_column``).

States: the decode state of each family is its chain's two LA states (``H = Σ D k vᵀ``, the
layout of ``linear.init_state``): hla2 ``(S, U)`` (inner over values ``k``, outer), ahla
``(P, E)``, hla3 ``(S, P, F)`` with ``[S | P]`` the inner state over values ``[k | v]``.  A
chain takes the family's state (or ``None``: zeros) and returns ``(o, state)``, so a prompt is
prefilled in one parallel pass and a sequence can be processed in pieces.

A chain takes ``la(q, k, v, g, h0) -> (o, hT)`` (``q, k: [B,T,H,d]``, ``v: [B,T,H,n]``, ``g:
[B,T,H]`` or ``None``, ``h0, hT: [B,H,d,n]``, ``h0 = None`` zeros, ``hT = None`` when the LA does
not return states; ``o: [B,T,H,n]``), so the same three functions run over any LA
implementation: ``over_xla`` (``la_chunked.chunked``, the families' ``chunked`` form,
sequence-parallel through LA's own ``seq_axis``) and ``over_pallas`` (``kernels.la_pallas``).
The intermediate (``K̃``, ``Ṽ``) is cast to the inputs' dtype, so 16-bit inputs give the second
call 16-bit inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.core.documents import gate_or_zeros
from hla_jax.core.state import state_dtype
from hla_jax.kernels import la_kernel
from hla_jax.ops.common import with_ones_column
from hla_jax.ops.xla import la_chunked
from hla_jax.ops.xla.hla_forms import finish


def _twice(g):
    """The log-decay ``2g`` of ``D²`` (``None``: no decay)."""
    return None if g is None else 2 * g


def _fields(state, n):
    """The ``n`` fields of a family state, ``None`` each when the state is (zeros)."""
    return (None,) * n if state is None else tuple(state)


def hla2(la, q, k, v, g=None, *, normalize=False, eps=1e-6, state=None):
    """``LA(q, K̃, v; 2g)`` with ``K̃ = LA(q, k, k; g)``; ``[v | 1]`` when ``normalize``.
    State ``(S, U)``: the inner and the outer LA state."""
    S0, U0 = _fields(state, 2)
    Kt, S = la(q, k, k, g, S0)
    o, U = la(q, Kt.astype(k.dtype), with_ones_column(v) if normalize else v, _twice(g), U0)
    return finish(o, normalize, eps), (S, U)


def ahla(la, q, k, v, g=None, *, normalize=False, eps=1e-6, state=None):
    """``LA(q, k, Ṽ; g)`` with ``Ṽ = LA(q, k, v; g)``; ``[v | 1]`` when ``normalize``.
    State ``(P, E)``: the inner and the outer LA state."""
    P0, E0 = _fields(state, 2)
    Vt, P = la(q, k, with_ones_column(v) if normalize else v, g, P0)
    o, E = la(q, k, Vt.astype(v.dtype), g, E0)
    return finish(o, normalize, eps), (P, E)


def hla3(la, q, k, v, g=None, *, normalize=False, eps=1e-6, state=None):
    """Causal mask: ``LA(q, K̃, Ṽ; 2g)`` with ``[K̃ | Ṽ] = LA(q, k, [k | v]; g)`` (``[k | v | 1]``
    when ``normalize``): one inner pass with ``d + dv (+1)`` value columns.  State
    ``(S, P, F)``: ``[S | P]`` the inner LA state, ``F`` the outer one."""
    d = k.shape[-1]
    S0, P0, F0 = _fields(state, 3)
    h0 = None if state is None else jnp.concatenate([S0, P0], -1)
    KV, h = la(q, k, jnp.concatenate([k, with_ones_column(v) if normalize else v], -1), g, h0)
    KV = KV.astype(jnp.result_type(k, v))
    o, F = la(q, KV[..., :d], KV[..., d:], _twice(g), F0)
    S, P = (None, None) if h is None else (h[..., :d], h[..., d:])
    return finish(o, normalize, eps), (S, P, F)


def over_xla(chain, state_type):
    """``chain`` over XLA's chunked LA (``la_chunked.chunked``): the ``chunked`` form of its family,
    ``f(q, k, v, g=None, *, normalize, eps, chunk_size, seq_axis, initial_state) -> (o, state)``
    (``state`` a ``state_type``), on inputs cast to the state dtype; ``seq_axis`` goes to every
    LA call (``ops.sequence``)."""

    @functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
    def chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None,
                initial_state=None):
        dt = state_dtype(q, k, v, g)

        def la(q, k, v, g, h0):
            return la_chunked.chunked(q, k, v, gate_or_zeros(g, *q.shape[:3], dt), chunk_size,
                                      seq_axis, h0)

        q, k, v = (x.astype(dt) for x in (q, k, v))
        o, state = chain(la, q, k, v, None if g is None else g.astype(dt), normalize=normalize,
                         eps=eps, state=initial_state)
        return o, state_type(*state)

    return chunked


def over_pallas(chain, state_type):
    """``chain`` over the Pallas LA kernel ``hla_jax.kernels.la_pallas`` (float32 outputs and
    states; interpret mode on CPU): ``f(q, k, v, g=None, *, normalize, eps, chunk_size,
    initial_state, return_final_state) -> (o, state)``, ``state`` a ``state_type`` or ``None``
    unless ``return_final_state`` (the kernels then skip the final state); inputs in their own
    dtype (bf16 stays bf16 for both calls)."""

    @functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "return_final_state"))
    def pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, initial_state=None,
               return_final_state=False):
        def la(q, k, v, g, h0):
            out = la_kernel(q, k, v, g, initial_state=h0, return_final_state=return_final_state,
                            chunk_size=chunk_size)
            return out if return_final_state else (out, None)

        o, state = chain(la, q, k, v, g, normalize=normalize, eps=eps, state=initial_state)
        return o, state_type(*state) if return_final_state else None

    return pallas
