"""The one dispatcher, generic over the operators: it reads an operator's ``Spec``
(``ops.spec``), checks the call's inputs once against it (``check``), resolves ``impl="auto"``
by the spec's rule and runs the spec's form, jitted under the inputs' matmul precision
(``apply``).  It names no operator: everything that differs between them is in their specs.

Shapes (docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``,
``lam: [B,T,H,L]``, ``segment_ids: [B,T]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.checks import (
    check_chunk_size,
    check_gate,
    check_impl,
    check_lam,
    check_per_token,
    check_qkv,
    check_segment_ids,
)
from hla_jax.ops import common, sequence
from hla_jax.ops.spec import Call, Spec


def _layout(x) -> str:
    """A state's layout in words: ``Name(field=shape dtype, …)`` (nested), or its shape."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return f"{type(x).__name__}(" + ", ".join(
            f"{f}={_layout(y)}" for f, y in zip(x._fields, x)) + ")"
    if isinstance(x, tuple):
        return "(" + ", ".join(_layout(y) for y in x) + ")"
    return f"{tuple(jnp.shape(x))} {jnp.result_type(x)}"


def _fits(state, want) -> bool:
    """``state`` has ``want``'s leaves (shapes, and integers where they are integers), in its
    structure or, for a named tuple, in a plain tuple of its fields."""
    leaves, tree = jax.tree.flatten(state)
    wants, want_tree = jax.tree.flatten(want)
    same = tree == want_tree or (isinstance(want, tuple) and type(state) is tuple
                                 and len(state) == len(want)
                                 and all(_fits(x, w) for x, w in zip(state, want)))
    return same and len(leaves) == len(wants) and all(
        jnp.shape(x) == w.shape and (jnp.issubdtype(jnp.result_type(x), jnp.integer)
                                     or not jnp.issubdtype(w.dtype, jnp.integer))
        for x, w in zip(leaves, wants))


def check_state(spec: Spec, c: Call, impl: str):
    """``initial_state`` / ``return_final_state`` are taken by ``spec.state_impls`` without
    ``seq_axis``; ``initial_state`` has the layout of ``spec.init_state`` (its structure, a
    named tuple's fields also as a plain tuple; shapes; integers where it has integers).
    Returns it in that structure (or None)."""
    state = c.initial_state
    if not c.stateful:
        return None
    if impl not in spec.state_impls or c.seq_axis is not None:
        raise ValueError(f"{spec}: initial_state / return_final_state need impl in "
                         f"{spec.state_impls} and seq_axis=None, got impl={impl!r}, "
                         f"seq_axis={c.seq_axis!r}")
    if state is None:
        return None
    B, _, H, d = c.q.shape
    levels = c.lam.shape[-1] if spec.lam else None
    want = jax.eval_shape(lambda: spec.init_state(B, H, d, c.v.shape[-1], normalize=c.normalize,
                                                  levels=levels))
    if not _fits(state, want):
        if isinstance(want, tuple):
            raise ValueError(f"{spec}: initial_state must be a {_layout(want)} (the layout of "
                             f"init_state), got {_layout(state)}")
        raise ValueError(f"{spec}: initial_state must have shape {want.shape} [B,H,d,dv], got "
                         f"{tuple(jnp.shape(state))}")
    return jax.tree.unflatten(jax.tree.structure(want), jax.tree.leaves(state))


def check(spec: Spec, q, k, v, g=None, beta=None, lam=None, *, impl="auto", chunk_size=64,
          seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False,
          normalize=False, eps=1e-6, **options):
    """Validate a public entry's arguments against ``spec``; returns ``(impl, Call)``.  Each bad
    argument raises a ValueError naming it and what it must be; ``options`` go to
    ``spec.variant``."""
    if spec.variant is not None:
        spec = spec.variant(**options)
    elif options:
        raise TypeError(f"{spec}: unexpected arguments {sorted(options)}")
    impl = check_impl(impl, spec.impls, name=str(spec))
    sequence.check_impl(impl, seq_axis, name=spec.name)
    chunk_size = check_chunk_size(chunk_size, name=spec.name)
    B, T, H, d, dv = check_qkv(q, k, v, name=spec.name)
    if spec.gate == "none" and g is not None:
        raise ValueError(f"{spec}: g must be None: the operator is defined without decay")
    g = check_gate(g, B, T, H, name=spec.name, required=spec.gate == "required")
    segment_ids = check_segment_ids(segment_ids, B, T, name=spec.name)
    if spec.beta:
        beta = check_per_token(beta, B, T, H, "beta", name=spec.name)
    if spec.lam:
        lam = check_lam(lam, B, T, H, name=spec.name, T_all=T * sequence.axis_size(seq_axis))
        fenwick.chunk_log2(chunk_size)
    if spec.normalize and normalize and isinstance(eps, (int, float)) and not eps > 0:
        raise ValueError(f"{spec.name}: eps must be > 0 with normalize=True (the denominator is "
                         f"clamped to |den| >= eps), got {eps!r}")
    c = Call(spec, q, k, v, g, beta, lam, segment_ids, initial_state, bool(return_final_state),
             chunk_size, seq_axis, bool(normalize), eps)
    return impl, dataclasses.replace(c, initial_state=check_state(spec, c, impl))


@functools.partial(jax.jit, static_argnums=0)
def _jitted(form, c: Call):
    return form(c)


def apply(impl: str, c: Call):
    """``c.spec.forms[impl]`` (``impl="auto"``: the spec's choice) on a checked call, jitted
    under the inputs' matmul precision; returns ``(o, final_state or None)``."""
    impl = c.spec.auto(c) if impl == "auto" else impl
    with common.matmul_precision(c.q, c.k, c.v):
        return _jitted(c.spec.forms[impl], c)


def run(spec: Spec, q, k, v, g=None, beta=None, lam=None, *, return_final_state=False, **kw):
    """A public entry: ``check``, then ``apply``.  Returns ``o``, or ``(o, final_state)`` when
    ``return_final_state``."""
    impl, c = check(spec, q, k, v, g, beta, lam, return_final_state=return_final_state, **kw)
    o, state = apply(impl, c)
    return (o, state) if return_final_state else o
