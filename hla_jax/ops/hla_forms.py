"""The recurrent / scan drivers and the public-entry dispatch shared by the HLA families.

A family (``hla2``, ``ahla``, ``hla3`` causal and paper) supplies its mathematics as a ``Family``:
``init_state``, ``step``, ``token_summaries``, ``combine``, ``readout``, the quadratic
``reference``, and its ``chunked`` form (for hla2, ahla and causal hla3 the SPEC §7 chain of
first-order LA passes, ``chains.over_xla``) and ``pallas`` form (``chains.over_pallas``, or
``None``).  The drivers are jitted once with the family static.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay or ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from hla_jax.ops import sequence
from hla_jax.ops.common import (
    cast_inputs,
    check_chunk_size,
    check_gate,
    check_impl,
    check_qkv,
    pallas_preferred,
    ratio_last_column,
    scan_time,
    state_dtype,
)


class Family(NamedTuple):
    """One HLA family's mathematics, as the drivers use it (hashable: a static jit argument).

    ``step(state, q_t, k_t, v_t[, g_t], *, normalize, eps) -> (o_t, state)``;
    ``token_summaries(q, k, v[, g])``; ``combine(a, b)``; ``readout(prefix, q, *, normalize, eps)``;
    ``reference(q, k, v, g, *, normalize, eps)`` the quadratic oracle;
    ``chunked(q, k, v, g, *, normalize, eps, chunk_size, seq_axis)`` and
    ``pallas(q, k, v, g, *, normalize, eps, chunk_size)`` (or ``None``: no kernel) the fast forms.
    The gate ``g`` is passed to ``step`` and ``token_summaries`` only when it is not ``None``.
    """
    name: str
    init_state: Callable
    step: Callable
    token_summaries: Callable
    combine: Callable
    readout: Callable
    reference: Callable
    chunked: Callable
    pallas: Callable | None = None


def finish(o, normalize: bool, eps):
    """``o`` divided by its denominator column when ``normalize`` (``[V | 1]`` inputs)."""
    return ratio_last_column(o, eps) if normalize else o


def _qkvg(q, k, v, g):
    return (q, k, v) if g is None else (q, k, v, g)


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def recurrent(family: Family, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Serial recurrence: ``lax.scan`` of ``family.step`` over time from ``family.init_state``."""
    B, _, H, d, dv = check_qkv(q, k, v, name=family.name)
    state = family.init_state(B, H, d, dv, normalize=normalize, dtype=state_dtype(q, k, v, g))
    out, _ = scan_time(family.step, state, *_qkvg(q, k, v, g), normalize=normalize, eps=eps)
    return out


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def scan(family: Family, q, k, v, g=None, *, normalize=False, eps=1e-6):
    """Token-level ``jax.lax.associative_scan(combine, token_summaries)``, then ``readout``.

    Materialises one summary per token: O(T·d²) memory by nature (O(T·d³·dv) for hla3's paper
    summary); the chunked form is the one that scales.
    """
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    summaries = family.token_summaries(*_qkvg(q, k, v, g))
    prefix = jax.lax.associative_scan(family.combine, summaries, axis=1)
    return family.readout(prefix, q, normalize=normalize, eps=eps)


def dispatch(family: Family, impl, impls, q, k, v, g=None, *, normalize=False, eps=1e-6,
             chunk_size=64, seq_axis=None):
    """A public entry's checks, then ``impl``: "reference" | "recurrent" | "scan" | "chunked" |
    "pallas" | "auto" ("pallas" when the family has it and ``common.pallas_preferred``, else
    "chunked").  Bad ``impl``, ``seq_axis`` use, ``chunk_size``, ``q, k, v`` or ``g`` raise
    ``ValueError`` naming the argument."""
    name = family.name
    check_impl(impl, impls, name=name)
    sequence.check_impl(impl, seq_axis, name=name)
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, _, _ = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name)
    if impl == "auto":
        fast = family.pallas is not None and pallas_preferred(seq_axis, chunk_size, q, k, v)
        impl = "pallas" if fast else "chunked"
    if impl == "reference":
        return family.reference(q, k, v, g, normalize=normalize, eps=eps)
    if impl == "recurrent":
        return recurrent(family, q, k, v, g, normalize=normalize, eps=eps)
    if impl == "scan":
        return scan(family, q, k, v, g, normalize=normalize, eps=eps)
    if impl == "pallas":
        return family.pallas(q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size)
    return family.chunked(q, k, v, g, normalize=normalize, eps=eps, chunk_size=chunk_size,
                          seq_axis=seq_axis)
