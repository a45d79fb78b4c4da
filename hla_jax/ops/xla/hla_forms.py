"""The forms shared by the HLA families: the recurrent and scan drivers, and ``spec``, which makes
a family's ``ops.spec.Spec`` (its forms, its ``auto`` rule, its state) from its ``Family``.

A family (``hla2``, ``ahla``, ``hla3`` causal and paper) supplies its mathematics as a ``Family``:
``init_state``, ``step``, ``token_summaries``, ``combine``, ``readout``, the quadratic
``reference``, and its ``chunked`` form (for hla2, ahla and causal hla3 the chain (docs/math.md#chains) of
first-order LA passes, ``chains.over_xla``) and ``pallas`` form (``chains.over_pallas``, or
``None``).  The drivers are jitted once with the family static.

Packed documents (docs/math.md#packed-documents, ``segment_ids: [B,T]`` int): a decayed family
(``decayed=True``:
hla2, ahla, causal hla3) resets its state through its gate, ``g = −∞`` at every document start
(``core.documents.reset_gate``), which every form of it takes exactly; the ``paper`` mask has no decay, so
its forms take the starts themselves (``starts: [B,T]`` bool, ``core.documents.doc_starts``): the
recurrence restarts from the empty state, the scan uses a segmented combine, and the reference
and chunked forms mask by document.  States (``initial_state`` / ``return_final_state``): the
recurrent, chunked and Pallas forms start from a state in the family's ``init_state`` layout and
return the final one; the row's first token continues the initial state.
Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay or ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.core.checks import check_qkv
from hla_jax.core.documents import doc_starts
from hla_jax.core.state import state_dtype
from hla_jax.ops.common import cast_inputs, ratio_last_column, scan_time
from hla_jax.ops.spec import Spec, kernels_preferred, reset


class Family(NamedTuple):
    """One HLA family's mathematics, as the drivers use it (hashable: a static jit argument).

    ``step(state, q_t, k_t, v_t[, g_t], *, normalize, eps) -> (o_t, state)``;
    ``token_summaries(q, k, v[, g])``; ``combine(a, b)``; ``readout(prefix, q, *, normalize, eps)``;
    ``reference(q, k, v, g, *, normalize, eps)`` the quadratic oracle;
    ``chunked(q, k, v, g, *, normalize, eps, chunk_size, seq_axis, initial_state) -> (o, state)``
    and ``pallas(q, k, v, g, *, normalize, eps, chunk_size, initial_state, return_final_state)
    -> (o, state or None)`` (or ``None``: no kernel) the fast forms.  The gate ``g`` is passed
    to ``step`` and ``token_summaries`` only when it is not ``None``.  ``decayed``: packed
    documents reset through ``g``; otherwise ``reference`` and ``chunked`` also take the
    document starts ``starts: [B,T]`` bool.
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
    decayed: bool = True


def finish(o, normalize: bool, eps):
    """``o`` divided by its denominator column when ``normalize`` (``[V | 1]`` inputs)."""
    return ratio_last_column(o, eps) if normalize else o


def _qkvg(q, k, v, g):
    return (q, k, v) if g is None else (q, k, v, g)


def _restarting(step):
    """``step`` from the empty (zero) state at a document's first token ``start_t: [B]``."""

    def restarted(state, start_t, *x, **kw):
        state = jax.tree.map(lambda s: jnp.where(start_t[:, None, None, None], 0, s), state)
        return step(state, *x, **kw)

    return restarted


def _segmented(combine):
    """``combine`` over ``(f, summary)`` pairs, ``f = 1`` for a segment holding a document start
    (``f`` has the summaries' leading axes): ``(f_A, A) ⊕ (f_B, B) = (max(f_A, f_B),
    (1 − f_B) A ⊕ B)`` drops what precedes B's starts.  Associative for a family without decay,
    whose zero summary is a left identity of ``combine`` (hla3's ``paper`` mask)."""

    def seg(a, b):
        (fa, sa), (fb, sb) = a, b
        cut = lambda x: (1 - fb).reshape(fb.shape + (1,) * (x.ndim - fb.ndim)) * x
        return jnp.maximum(fa, fb), combine(jax.tree.map(cut, sa), sb)

    return seg


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def recurrent(family: Family, q, k, v, g=None, starts=None, initial_state=None, *,
              normalize=False, eps=1e-6):
    """Serial recurrence: ``lax.scan`` of ``family.step`` over time from ``initial_state`` (None:
    ``family.init_state``), restarted at ``starts [B,T]``; returns ``(o, final_state)``."""
    B, _, H, d, dv = check_qkv(q, k, v, name=family.name)
    dt = state_dtype(q, k, v, g)
    state = (family.init_state(B, H, d, dv, normalize=normalize, dtype=dt) if initial_state is None
             else jax.tree.map(lambda x: x.astype(dt), initial_state))
    if starts is None:
        return scan_time(family.step, state, *_qkvg(q, k, v, g), normalize=normalize, eps=eps)
    return scan_time(_restarting(family.step), state, starts, *_qkvg(q, k, v, g),
                     normalize=normalize, eps=eps)


@functools.partial(jax.jit, static_argnames=("family", "normalize"))
def scan(family: Family, q, k, v, g=None, starts=None, *, normalize=False, eps=1e-6):
    """Token-level ``jax.lax.associative_scan(combine, token_summaries)``, then ``readout``;
    segmented at ``starts [B,T]`` (``_segmented``).

    Materialises one summary per token: O(T·d²) memory by nature (O(T·d³·dv) for hla3's paper
    summary); the chunked form is the one that scales.
    """
    q, k, v, g = cast_inputs(q, k, v, g, normalize)
    summaries = family.token_summaries(*_qkvg(q, k, v, g))
    if starts is None:
        prefix = jax.lax.associative_scan(family.combine, summaries, axis=1)
    else:
        flags = jnp.broadcast_to(starts[..., None], q.shape[:3]).astype(q.dtype)
        prefix = jax.lax.associative_scan(_segmented(family.combine), (flags, summaries), axis=1)[1]
    return family.readout(prefix, q, normalize=normalize, eps=eps)


def forms(family: Family) -> dict:
    """A family's forms (``ops.spec``: ``form(c) -> (o, state or None)``); the paper mask
    (``decayed=False``) takes the document starts."""

    def docs(c):
        if family.decayed:
            return reset(c), None
        return c.g, None if c.segment_ids is None else doc_starts(c.segment_ids, c.seq_axis)

    def by_doc(starts):
        return {} if family.decayed else {"starts": starts}

    kw = lambda c: dict(normalize=c.normalize, eps=c.eps)  # noqa: E731

    def reference_form(c):
        g, starts = docs(c)
        return family.reference(c.q, c.k, c.v, g, **kw(c), **by_doc(starts)), None

    def recurrent_form(c):
        g, starts = docs(c)
        return recurrent(family, c.q, c.k, c.v, g, starts, c.initial_state, **kw(c))

    def scan_form(c):
        g, starts = docs(c)
        return scan(family, c.q, c.k, c.v, g, starts, **kw(c)), None

    def chunked_form(c):
        g, starts = docs(c)
        return family.chunked(c.q, c.k, c.v, g, **kw(c), chunk_size=c.chunk_size,
                              seq_axis=c.seq_axis, initial_state=c.initial_state,
                              **by_doc(starts))

    def pallas_form(c):
        return family.pallas(c.q, c.k, c.v, reset(c), **kw(c), chunk_size=c.chunk_size,
                             initial_state=c.initial_state,
                             return_final_state=c.return_final_state)

    out = {"reference": reference_form, "recurrent": recurrent_form, "scan": scan_form,
           "chunked": chunked_form}
    return out if family.pallas is None else {**out, "pallas": pallas_form}


def auto(c) -> str:
    """An HLA operator's ``impl="auto"``: its Pallas chain where the kernels are preferred
    (``spec.kernels_preferred``) and it has one, else the chunked chain."""
    return "pallas" if kernels_preferred(c) and "pallas" in c.spec.forms else "chunked"


def spec(family: Family, **kw) -> Spec:
    """The ``Spec`` of an HLA family: ``g`` optional (``gate="none"`` for an undecayed one),
    ``normalize``, the forms of ``forms``, the rule of ``auto``, the family's state and step
    under the spec's signatures, and the "qk" mixer named after it; ``kw`` override."""

    def init_state(B, H, d, dv, *, normalize=False, dtype=jnp.float32, **_):
        return family.init_state(B, H, d, dv, normalize=normalize, dtype=dtype)

    def step(state, q, k, v, g=None, *_, normalize=False, eps=1e-6, **__):
        return family.step(state, *_qkvg(q, k, v, g), normalize=normalize, eps=eps)

    return Spec(**{"name": family.name, "forms": forms(family), "auto": auto,
                   "init_state": init_state, "step": step,
                   "gate": "optional" if family.decayed else "none", "normalize": True,
                   "mixer": family.name, "features": "qk", **kw})
