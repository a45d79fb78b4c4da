"""One dispatcher for the eight operators: the inputs are checked once (``check``), ``impl="auto"``
is decided in one place (``auto``), and ``FORMS`` maps (operator, impl) to the function that runs.

Every form takes a checked ``Call`` and returns ``(o, final_state or None)``; ``run`` jits it (the
call is a pytree whose flags are static), under the matmul precision of its inputs
(``common.matmul_precision``).  Packed documents (docs/math.md#packed-documents): a decayed
operator resets its state through its gate, ``g = −∞`` at each document start (``reset``); hla3's
``paper`` mask has no decay and takes the starts themselves.

Shapes (docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``,
``lam: [B,T,H,L]``, ``segment_ids: [B,T]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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
from hla_jax.core.documents import doc_starts, gate_or_zeros, reset_gate
from hla_jax.core.state import LevelState
from hla_jax.kernels import (
    gated_deltanet_kernel,
    la_kernel,
    loglinear_gated_deltanet_kernel,
    loglinear_mamba2_kernel,
)
from hla_jax.kernels.gdn import gdn_entry
from hla_jax.kernels.loglinear.loglinear_entry import from_state
from hla_jax.ops import (
    ahla,
    common,
    gdn_chunked,
    hla2,
    hla3,
    hla_forms,
    la_chunked,
    loglinear,
    loglinear_blocks,
    loglinear_chunked,
    loglinear_gdn_blocks,
    reference,
    sequence,
)
from hla_jax.ops.ssm import cast_state

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas", "auto")
STATE_IMPLS = ("recurrent", "chunked", "pallas", "auto")
HLA = {"hla2": hla2.FAMILY, "ahla": ahla.FAMILY, "hla3": hla3.CAUSAL, "hla3_paper": hla3.PAPER}
LOGLINEAR = ("loglinear_mamba2", "loglinear_gated_deltanet")
GATE_OPTIONAL = ("linear_attention", *HLA)
MASKS = ("causal", "paper")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q", "k", "v", "g", "beta", "lam", "segment_ids", "initial_state",
                                "eps"],
                   meta_fields=["op", "name", "return_final_state", "chunk_size", "seq_axis",
                                "normalize"])
@dataclasses.dataclass(frozen=True)
class Call:
    """An operator call with checked inputs: ``g`` ``[B,T,H]`` or None (no decay), ``beta`` /
    ``lam`` where the operator has them, the state in the operator's layout.  ``op`` is the
    table's key (``"hla3_paper"`` for hla3's paper mask), ``name`` the public entry's."""
    op: str
    name: str
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: Any = None
    beta: Any = None
    lam: Any = None
    segment_ids: Any = None
    initial_state: Any = None
    return_final_state: bool = False
    chunk_size: int = 64
    seq_axis: Any = None
    normalize: bool = False
    eps: Any = 1e-6

    @property
    def stateful(self) -> bool:
        return self.initial_state is not None or self.return_final_state


# --------------------------------------------------------------------------- checks


def _check_state(c: Call, impl: str):
    """``initial_state`` / ``return_final_state`` are taken by the ``STATE_IMPLS`` without
    ``seq_axis``; ``initial_state`` has the layout of the operator's ``init_state``: an HLA
    family's state tuple, ``LevelState(H: [L,B,H,d,dv], t: [B] int)`` for the log-linear
    operators, ``[B,H,d,dv]`` otherwise.  Returns it in that type (or None)."""
    state, name = c.initial_state, c.name
    if not c.stateful:
        return None
    if impl not in STATE_IMPLS or c.seq_axis is not None:
        raise ValueError(f"{name}: initial_state / return_final_state need impl in {STATE_IMPLS} "
                         f"and seq_axis=None, got impl={impl!r}, seq_axis={c.seq_axis!r}")
    if state is None:
        return None
    B, _, H, d = c.q.shape
    dv = c.v.shape[-1]
    if c.op in HLA:
        want = jax.eval_shape(lambda: HLA[c.op].init_state(B, H, d, dv, normalize=c.normalize))
        got = (tuple(jnp.shape(x) for x in state) if isinstance(state, tuple)
               else jnp.shape(state))
        if got != tuple(w.shape for w in want):
            raise ValueError(f"{name}: initial_state must be a {type(want).__name__} (the layout "
                             f"of init_state) with shapes "
                             f"{dict(zip(want._fields, (w.shape for w in want)))}, got {got}")
        return type(want)(*state)
    if c.lam is None:
        if jnp.shape(state) != (B, H, d, dv):
            raise ValueError(f"{name}: initial_state must have shape {(B, H, d, dv)} [B,H,d,dv], "
                             f"got {jnp.shape(state)}")
        return state
    L = c.lam.shape[-1]
    want = f"LevelState(H=[levels,B,H,d,dv]={(L, B, H, d, dv)}, t=[B]={(B,)} int)"
    if not isinstance(state, LevelState):
        raise ValueError(f"{name}: initial_state must be a {want}, got {type(state)}")
    Hs, t = state
    if (jnp.shape(Hs) != (L, B, H, d, dv) or jnp.shape(t) != (B,)
            or not jnp.issubdtype(jnp.result_type(t), jnp.integer)):
        raise ValueError(f"{name}: initial_state must be a {want}, got H {jnp.shape(Hs)}, "
                         f"t {jnp.result_type(t)}{list(jnp.shape(t))}")
    return state


def check(name, q, k, v, g=None, beta=None, lam=None, *, impl, chunk_size, seq_axis, segment_ids,
          initial_state, return_final_state, normalize=False, eps=1e-6, mask="causal"):
    """Validate a public entry's arguments; returns ``(impl, Call)``.  Each bad argument raises a
    ValueError naming it and what it must be."""
    op = name
    if name == "hla3":
        if mask not in MASKS:
            raise ValueError(f"hla3: mask={mask!r} is not one of {MASKS}")
        if mask == "paper" and g is not None:
            raise ValueError("hla3: mask='paper' is defined without decay: g must be None")
        op = "hla3_paper" if mask == "paper" else "hla3"
    impl = check_impl(impl, IMPLS, name=name)
    if impl != "auto" and impl not in FORMS[op]:
        raise ValueError(f"{name}: impl={impl!r} is for mask='causal' only; mask={mask!r} takes "
                         f"{tuple(FORMS[op]) + ('auto',)}")
    sequence.check_impl(impl, seq_axis, name=name)
    chunk_size = check_chunk_size(chunk_size, name=name)
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=name not in GATE_OPTIONAL)
    segment_ids = check_segment_ids(segment_ids, B, T, name=name)
    if "gated_deltanet" in name:
        beta = check_per_token(beta, B, T, H, "beta", name=name)
    if name in LOGLINEAR:
        lam = check_lam(lam, B, T, H, name=name, T_all=T * sequence.axis_size(seq_axis))
        fenwick.chunk_log2(chunk_size)
    if normalize and isinstance(eps, (int, float)) and not eps > 0:
        raise ValueError(f"{name}: eps must be > 0 with normalize=True (the denominator is "
                         f"clamped to |den| >= eps), got {eps!r}")
    c = Call(op, name, q, k, v, g, beta, lam, segment_ids, initial_state,
             bool(return_final_state), chunk_size, seq_axis, bool(normalize), eps)
    c = dataclasses.replace(c, initial_state=_check_state(c, impl))
    if impl == "pallas" and name in LOGLINEAR and c.stateful and segment_ids is not None:
        given = "initial_state" if initial_state is not None else "return_final_state"
        raise ValueError(f"{name}: impl='pallas' takes segment_ids or {given}, not both; "
                         f"impl='chunked' takes both")
    return impl, c


# --------------------------------------------------------------------------- auto


def pallas_preferred(c: Call) -> bool:
    """The configuration in which the kernels beat the XLA chunked forms (the kernel benchmarks
    on the results page) and which the GPU check covers: on a GPU, ``q, k, v`` all bf16, time
    not sharded, a chunk the kernels take (a power of two >= 16).  Float32 at d=128 needs
    smaller Triton tiles (``kernels.wrap.F32_GPU_TILE``), and the TPU kernels have never run on
    a TPU: the XLA chunked forms there."""
    return (c.seq_axis is None and jax.default_backend() == "gpu" and c.chunk_size >= 16
            and c.chunk_size & (c.chunk_size - 1) == 0
            and all(x.dtype == jnp.bfloat16 for x in (c.q, c.k, c.v)))


def auto(c: Call) -> str:
    """``impl="auto"``'s choice: the Pallas form where ``pallas_preferred``, else "chunked", with
    these exceptions.

    - hla3's paper mask has no kernel;
    - Gated DeltaNet's kernel is Hopper's (``gdn_entry.supports``: Mosaic GPU, 16-bit, ``d`` 64
      or 128, chunk 64);
    - log-linear Gated DeltaNet on whole rows (no ``segment_ids``) takes the block form, faster
      forward+backward than its kernels, with its chunk terms from the Gated DeltaNet kernel's
      UT transform where that kernel runs ("chunked_ut_kernel"); with a state it takes the
      counter form;
    - a log-linear operator with both a state and ``segment_ids`` takes the counter form (its
      kernels take one or the other).
    """
    if not pallas_preferred(c) or c.op == "hla3_paper":
        return "chunked"
    if c.op == "gated_deltanet":
        return "pallas" if gdn_entry.supports(c.q, c.k, c.v, c.chunk_size) else "chunked"
    if c.op == "loglinear_gated_deltanet" and c.segment_ids is None:
        ut = not c.stateful and gdn_entry.supports(c.q, c.k, c.v, c.chunk_size)
        return "chunked_ut_kernel" if ut else "chunked"
    if c.op in LOGLINEAR and c.stateful and c.segment_ids is not None:
        return "chunked"
    return "pallas"


# --------------------------------------------------------------------------- forms


def reset(c: Call):
    """The log-decay ``[B,T,H]`` with ``−∞`` at every document start (None: no decay and no
    documents)."""
    B, T, H = c.q.shape[:3]
    return reset_gate(c.g, c.segment_ids, B, T, H, c.q.dtype if c.g is None else c.g.dtype,
                      c.seq_axis)


def _gate(c: Call, documents: bool = True):
    """The log-decay ``[B,T,H]``, zeros where there is no decay; reset at the document starts
    unless ``documents=False`` (for forms that take ``segment_ids`` themselves)."""
    B, T, H = c.q.shape[:3]
    g = reset(c) if documents else c.g
    return gate_or_zeros(g, B, T, H, c.q.dtype if g is None else g.dtype)


def _hla_forms(family: hla_forms.Family) -> dict:
    """An HLA family's forms; the paper mask (``decayed=False``) takes the document starts."""

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
        return hla_forms.recurrent(family, c.q, c.k, c.v, g, starts, c.initial_state, **kw(c))

    def scan_form(c):
        g, starts = docs(c)
        return hla_forms.scan(family, c.q, c.k, c.v, g, starts, **kw(c)), None

    def chunked_form(c):
        g, starts = docs(c)
        return family.chunked(c.q, c.k, c.v, g, **kw(c), chunk_size=c.chunk_size,
                              seq_axis=c.seq_axis, initial_state=c.initial_state,
                              **by_doc(starts))

    def pallas_form(c):
        return family.pallas(c.q, c.k, c.v, reset(c), **kw(c), chunk_size=c.chunk_size,
                             initial_state=c.initial_state,
                             return_final_state=c.return_final_state)

    forms = {"reference": reference_form, "recurrent": recurrent_form, "scan": scan_form,
             "chunked": chunked_form}
    return forms if family.pallas is None else {**forms, "pallas": pallas_form}


def _recurrent(c):
    return loglinear.recurrent(c.q, c.k, c.v, _gate(c, False), c.beta, c.lam, c.initial_state,
                               c.segment_ids)


def _scan(c):
    return loglinear.scan(c.q, c.k, c.v, _gate(c, False), c.beta, c.lam, c.segment_ids), None


def _la_reference(c):
    return reference.linear_attention(c.q, c.k, c.v, _gate(c)), None


def _gdn_reference(c):
    return reference.gated_deltanet(c.q, c.k, c.v, c.g, c.beta, segment_ids=c.segment_ids), None


def _loglinear_reference(c):
    if c.beta is None:
        return reference.loglinear_mamba2(c.q, c.k, c.v, c.g, c.lam,
                                          segment_ids=c.segment_ids), None
    return reference.loglinear_gated_deltanet(c.q, c.k, c.v, c.g, c.beta, c.lam,
                                              segment_ids=c.segment_ids), None


def _la_chunked(c):
    return la_chunked.chunked(c.q, c.k, c.v, _gate(c), c.chunk_size, c.seq_axis, c.initial_state)


def _gdn_chunked(c):
    return gdn_chunked.chunked(c.q, c.k, c.v, _gate(c), c.beta, c.chunk_size, c.seq_axis,
                               c.initial_state)


def _loglinear_chunked(c, terms="xla"):
    """Whole rows: the block forms (no scan); with ``segment_ids``, a state or ``seq_axis``: the
    counter form (``loglinear_chunked``)."""
    if c.segment_ids is None and not c.stateful and c.seq_axis is None:
        if c.beta is None:
            return loglinear_blocks.blocks(c.q, c.k, c.v, c.g, c.lam, chunk_size=c.chunk_size), None
        return loglinear_gdn_blocks.blocks(c.q, c.k, c.v, c.g, c.beta, c.lam,
                                           chunk_size=c.chunk_size, terms=terms), None
    return loglinear_chunked.chunked(c.q, c.k, c.v, c.g, c.beta, c.lam, c.chunk_size, c.seq_axis,
                                     c.initial_state, c.segment_ids)


def _with_state(c: Call, out):
    """A kernel's output as ``(o, final_state or None)``: the kernels compute the final state
    only when asked (``return_final_state``)."""
    return out if c.return_final_state else (out, None)


def _la_pallas(c):
    return _with_state(c, la_kernel(c.q, c.k, c.v, reset(c), chunk_size=c.chunk_size,
                                    initial_state=c.initial_state,
                                    return_final_state=c.return_final_state))


def _gdn_pallas(c):
    return _with_state(c, gated_deltanet_kernel(c.q, c.k, c.v, reset(c), c.beta,
                                                chunk_size=c.chunk_size,
                                                initial_state=c.initial_state,
                                                return_final_state=c.return_final_state))


def _first_order(op: str, chunk_size: int):
    """``f(q, k, v, g, *beta, initial_state, return_final_state)``: the operator ``op`` without
    levels, on inputs derived from checked ones, by ``auto``'s choice."""

    def f(q, k, v, g, *beta, initial_state, return_final_state):
        c = Call(op, op, q, k, v, g, *beta, initial_state=initial_state,
                 return_final_state=return_final_state, chunk_size=chunk_size)
        return FORMS[op][auto(c)](c)

    return f


def _loglinear_pallas(c):
    """The log-linear kernels on whole rows or packed documents; from a state, the kernels on the
    row composed with one first-order pass (``loglinear_entry.from_state``)."""
    kernel = loglinear_mamba2_kernel if c.beta is None else loglinear_gated_deltanet_kernel
    extras = () if c.beta is None else (c.beta,)
    if c.stateful:
        first = _first_order("mamba2" if c.beta is None else "gated_deltanet", c.chunk_size)
        state = None if c.initial_state is None else cast_state(c.initial_state, jnp.float32)
        return from_state(functools.partial(kernel, chunk_size=c.chunk_size), first,
                          c.q, c.k, c.v, c.g, extras, c.lam, state)
    return kernel(c.q, c.k, c.v, reset(c), *extras, c.lam, chunk_size=c.chunk_size,
                  segment_ids=c.segment_ids), None


_SSM = {"recurrent": _recurrent, "scan": _scan}
_LA = {"reference": _la_reference, **_SSM, "chunked": _la_chunked, "pallas": _la_pallas}
_LOGLINEAR = {"reference": _loglinear_reference, **_SSM, "chunked": _loglinear_chunked,
              "pallas": _loglinear_pallas}
FORMS = {
    "linear_attention": _LA,
    "mamba2": _LA,
    "gated_deltanet": {"reference": _gdn_reference, **_SSM, "chunked": _gdn_chunked,
                       "pallas": _gdn_pallas},
    "loglinear_mamba2": _LOGLINEAR,
    "loglinear_gated_deltanet": {
        **_LOGLINEAR,
        "chunked_ut_kernel": functools.partial(_loglinear_chunked, terms="kernel")},
    **{op: _hla_forms(family) for op, family in HLA.items()},
}


@functools.partial(jax.jit, static_argnums=0)
def _jitted(form, c: Call):
    return form(c)


def run(name, q, k, v, g=None, beta=None, lam=None, *, impl="auto", chunk_size=64, seq_axis=None,
        segment_ids=None, initial_state=None, return_final_state=False, normalize=False,
        eps=1e-6, mask="causal"):
    """A public entry: ``check``, ``auto`` when ``impl="auto"``, then ``FORMS[op][impl]``, jitted
    under the inputs' matmul precision.  Returns ``o``, or ``(o, final_state)`` when
    ``return_final_state``."""
    impl, c = check(name, q, k, v, g, beta, lam, impl=impl, chunk_size=chunk_size,
                    seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
                    return_final_state=return_final_state, normalize=normalize, eps=eps,
                    mask=mask)
    impl = auto(c) if impl == "auto" else impl
    with common.matmul_precision(c.q, c.k, c.v):
        o, state = _jitted(FORMS[c.op][impl], c)
    return (o, state) if return_final_state else o
