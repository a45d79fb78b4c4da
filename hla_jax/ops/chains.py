"""SPEC.md §7: the masked HLA operators are chains of first-order scalar-gated linear attention

    LA(q, k, v; g)_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s          (Mamba-2's SSD core, ``ops.linear``)

    hla2(q,k,v,g) = LA(q, K̃, v; 2g)          K̃ = LA(q, k, k; g)                 (K̃_j = S_j q_j)
    ahla(q,k,v,g) = LA(q, k, Ṽ; g)           Ṽ = LA(q, k, v; g)                 (W_g (W_g V))
    hla3(q,k,v,g) = LA(q, K̃, Ṽ; 2g)          [K̃ | Ṽ] = LA(q, k, [k | v]; g)     (mask="causal")

Exact, not approximate: for ``i ≤ j ≤ t`` the decay factors, ``D(t,i) = D(t,j) D(j,i)``, so a
factor ``D(t,i)`` reaching past the middle index ``j`` splits there.  hla2:
``D(t,j)² D(j,i) = D(t,i) D(t,j)`` (outer gate 2g, ``D(t,j)²`` is the decay of ``2g``); ahla:
``D(t,i) D(i,j) = D(t,j)``; hla3: ``D(t,u)² D(u,i) D(u,j) = D(t,i) D(t,u) D(u,j)``.  With
``g = None`` (no decay) 2g is ``None`` too.

Ratio normalisation: the operators are linear in the innermost values, and the denominator is
the same chain with those values replaced by 1, so a ones column is appended to them (hla2's
outer ``v``, ahla's inner ``v``, hla3's inner ``[k | v]``) and the last output column divides the
rest (``clamp_signed``, ``common.ratio_last_column``).

A chain takes ``la(q, k, v, g) -> o`` (``q, k: [B,T,H,d]``, ``v: [B,T,H,n]``, ``g: [B,T,H]`` or
``None``; ``o: [B,T,H,n]``), so the same three functions run over any LA implementation:
``over_xla`` (``linear.chunked``, the families' ``chunked`` form, sequence-parallel through
LA's own ``seq_axis``) and ``over_pallas`` (``kernels.la.la_pallas``).  The intermediate
(``K̃``, ``Ṽ``) is cast to the inputs' dtype, so 16-bit inputs give the second call 16-bit inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.ops import linear
from hla_jax.ops.common import gate_or_zeros, state_dtype, with_ones_column
from hla_jax.ops.hla_forms import finish


def _twice(g):
    """The log-decay ``2g`` of ``D²`` (``None``: no decay)."""
    return None if g is None else 2 * g


def hla2(la, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """``LA(q, K̃, v; 2g)`` with ``K̃ = LA(q, k, k; g)``; ``[v | 1]`` when ``normalize``."""
    Kt = la(q, k, k, g).astype(k.dtype)
    o = la(q, Kt, with_ones_column(v) if normalize else v, _twice(g))
    return finish(o, normalize, eps)


def ahla(la, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """``LA(q, k, Ṽ; g)`` with ``Ṽ = LA(q, k, v; g)``; ``[v | 1]`` when ``normalize``."""
    Vt = la(q, k, with_ones_column(v) if normalize else v, g).astype(v.dtype)
    return finish(la(q, k, Vt, g), normalize, eps)


def hla3(la, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Causal mask: ``LA(q, K̃, Ṽ; 2g)`` with ``[K̃ | Ṽ] = LA(q, k, [k | v]; g)`` (``[k | v | 1]``
    when ``normalize``): one inner pass with ``d + dv (+1)`` value columns."""
    d = k.shape[-1]
    KV = la(q, k, jnp.concatenate([k, with_ones_column(v) if normalize else v], -1), g)
    KV = KV.astype(jnp.result_type(k, v))
    return finish(la(q, KV[..., :d], KV[..., d:], _twice(g)), normalize, eps)


def over_xla(chain):
    """``chain`` over XLA's chunked LA (``linear.chunked``): the ``chunked`` form of its family,
    ``f(q, k, v, g=None, *, normalize, eps, chunk_size, seq_axis)``, on inputs cast to the state
    dtype; ``seq_axis`` goes to every LA call (``ops.sequence``)."""

    @functools.partial(jax.jit, static_argnames=("normalize", "chunk_size", "seq_axis"))
    def chunked(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64, seq_axis=None):
        dt = state_dtype(q, k, v, g)

        def la(q, k, v, g):
            return linear.chunked(q, k, v, gate_or_zeros(g, *q.shape[:3], dt), chunk_size,
                                  seq_axis)

        q, k, v = (x.astype(dt) for x in (q, k, v))
        return chain(la, q, k, v, None if g is None else g.astype(dt), normalize=normalize,
                     eps=eps)

    return chunked


def over_pallas(chain):
    """``chain`` over the Pallas LA kernel ``hla_jax.kernels.la.la_pallas`` (float32 outputs;
    interpret mode on CPU): ``f(q, k, v, g=None, *, normalize, eps, chunk_size)``, inputs in their
    own dtype (bf16 stays bf16 for both calls)."""

    @functools.partial(jax.jit, static_argnames=("normalize", "chunk_size"))
    def pallas(q, k, v, g=None, *, normalize=False, eps=1e-6, chunk_size=64):
        from hla_jax.kernels.la import la_pallas  # imported at call time: the kernels import ops

        return chain(functools.partial(la_pallas, chunk_size=chunk_size), q, k, v, g,
                     normalize=normalize, eps=eps)

    return pallas
