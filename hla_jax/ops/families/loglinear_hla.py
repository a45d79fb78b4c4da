"""Log-linear HLA (docs/math.md#loglinear-hla): the Fenwick hierarchy of log-linear attention
(docs/math.md#loglinear) on the outer pass of the HLA chains (docs/math.md#chains).  New: in
neither source paper.

    o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s)^m (q_t·K̃_s) Ṽ_s,       ℓ(t,s) = bit_length(t XOR s)

    loglinear_hla2(q,k,v,g,λ) = LLM2(q, K̃, v; 2g, λ)        K̃ = LA(q, k, k; g)
    loglinear_ahla(q,k,v,g,λ) = LLM2(q, k, Ṽ; g, λ)         Ṽ = LA(q, k, v; g)
    loglinear_hla3(q,k,v,g,λ) = LLM2(q, K̃, Ṽ; 2g, λ)        [K̃ | Ṽ] = LA(q, k, [k | v]; g)

``LA`` is first-order gated linear attention (``ops.mamba2``), ``LLM2`` log-linear Mamba-2
(``ops.loglinear_mamba2``).  The family's specs (``SPECS``, one per chain) are read by the
dispatcher and the models like every other family's.  With every λ = 1 each is its HLA operator (``ops.hla2``,
``ops.ahla``, ``ops.hla3`` with the causal mask).  Ratio normalisation appends a ones column to
the innermost values (hla2's outer ``v``, ahla's inner ``v``, hla3's inner ``[k | v]``) and
divides by the last output column (``clamp_signed``).

Every form is ``_compose`` over a pair of forms that exist, an inner LA pass and an outer LLM2
pass: ``reference`` (the quadratic oracles ``reference.linear_attention`` and
``reference.loglinear_mamba2``), ``recurrent`` (``lax.scan`` of ``step``: ``linear.step`` and
the level ``loglinear.step``), ``scan`` (``xla.ssm_forms.scan`` without and with levels),
``chunked`` (``xla.la_chunked.chunked``, then ``xla.loglinear_blocks.blocks`` on whole rows or
the counter form ``xla.loglinear_chunked.chunked``) and ``pallas`` (``kernels.la_kernel``, then
``kernels.loglinear_mamba2_kernel``: packed rows through ``levels.packed``, from a state
through ``levels.from_state``).
Packed documents (``segment_ids``, docs/math.md#packed-documents): both gates reset, ``g = −∞``
at each document's first token, and the outer levels count from it.

State ``State(inner, outer)``: the inner LA state ``Σ D k xᵀ: [B,H,d,n]`` (``x`` the inner
values: hla2 ``n = d``, ahla ``dv``, hla3 ``d + dv``; one more with ``normalize`` for ahla and
hla3) and the outer ``LevelState(H: [L,B,H,d,dv(+1)], t: [B])``, ``L`` the levels of ``lam``.
At step t the outer key or value is the inner pass's output, ``K̃_t = S_t q_t``.

Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` log-decay (``<= 0``) or per-head
``[H]`` or None (no decay), ``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``, ``segment_ids: [B,T]`` int;
outputs ``[B,T,H,dv]`` in the state dtype (float32; float64 for float64 inputs; float32 from
the kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hla_jax.core.documents import doc_starts, gate_or_zeros, reset_gate
from hla_jax.core.state import LevelState, state_dtype
from hla_jax.kernels import la_kernel, loglinear_mamba2_kernel
from hla_jax.ops import dispatch, levels
from hla_jax.ops import reference as oracle
from hla_jax.ops.common import scan_time, with_ones_column
from hla_jax.ops.families import linear, loglinear
from hla_jax.ops.spec import Spec, kernels_preferred
from hla_jax.ops.xla import la_chunked, loglinear_blocks, loglinear_chunked, ssm_forms
from hla_jax.ops.xla.hla_forms import finish
from hla_jax.ops.xla.ssm import cast, cast_state

__all__ = ["AHLA", "HLA2", "HLA3", "SPECS", "Chain", "State", "init_state", "loglinear_ahla",
           "loglinear_hla2", "loglinear_hla3", "step"]


class Chain(NamedTuple):
    """One operator of the family: its ``name``, the outer decay multiple ``m`` (``D^m``, gate
    ``m·g``), the inner pass's values ``inner(k, v) -> x`` and the outer pass's keys and values
    ``outer(k, v, y) -> (K_o, V_o)`` from the inner output ``y = LA(q, k, x; g)`` (``v`` with
    the ones column when normalised)."""
    name: str
    m: int
    inner: Callable
    outer: Callable


def _split_keys(k, v, y):
    """hla3's outer keys and values: ``y = [K̃ | Ṽ]``."""
    return y[..., :k.shape[-1]], y[..., k.shape[-1]:]


HLA2 = Chain("loglinear_hla2", 2, lambda k, v: k, lambda k, v, y: (y, v))
AHLA = Chain("loglinear_ahla", 1, lambda k, v: v, lambda k, v, y: (k, y))
HLA3 = Chain("loglinear_hla3", 2, lambda k, v: jnp.concatenate([k, v], -1), _split_keys)


class State(NamedTuple):
    """Decode state: ``inner: [B,H,d,n]`` the inner LA state ``Σ D k xᵀ`` (hla2 ``S = Σ D k kᵀ``,
    ahla ``P = Σ D k vᵀ``, hla3 ``[S | P]``), ``outer`` the outer pass's ``LevelState``."""
    inner: jax.Array
    outer: LevelState


def init_state(chain: Chain, B: int, H: int, d: int, dv: int, levels: int, *,
               normalize: bool = False, dtype=jnp.float32) -> State:
    """The empty prefix at position 0 (``dv + 1`` value columns when ``normalize``)."""
    dv = dv + normalize
    x = jax.eval_shape(chain.inner, jax.ShapeDtypeStruct((d,), dtype),
                       jax.ShapeDtypeStruct((dv,), dtype))
    return State(jnp.zeros((B, H, d, x.shape[-1]), dtype),
                 loglinear.init_state(B, H, d, dv, levels=levels, dtype=dtype))


def _compose(chain: Chain, la, llm2, q, k, v, g, lam, normalize, eps, state):
    """The chain over an inner pass ``la(q, k, x, g, h0) -> (y, hT)`` and an outer pass
    ``llm2(q, k, v, g, lam, H0) -> (o, HT)`` (states ``None``: zeros, or not returned);
    returns ``(o, State or None)``.  The intermediate is cast to the inputs' dtype."""
    v = with_ones_column(v) if normalize else v
    h0, H0 = (None, None) if state is None else state
    y, hT = la(q, k, chain.inner(k, v), g, h0)
    Ko, Vo = chain.outer(k, v, y.astype(jnp.result_type(k, v)))
    o, HT = llm2(q, Ko, Vo, chain.m * g, lam, H0)
    return finish(o, normalize, eps), None if hT is None or HT is None else State(hT, HT)


def step(chain: Chain, state: State, q_t, k_t, v_t, g_t, lam_t, *, normalize: bool = False,
         eps=1e-6):
    """One token (the decode step): the inner LA step, then the outer level step on its output.

        h ← a_t h + k_t x_tᵀ,   y_t = hᵀ q_t          (hla2: K̃_t = S_t q_t)
        carry the counter,  H[ℓ] ← a_t^m H[ℓ],  H[0] = K_o,t V_o,tᵀ,   o_t = Σ_ℓ λ_t^ℓ H[ℓ]ᵀ q_t

    ``q_t, k_t: [B,H,d]``, ``v_t: [B,H,dv]``, ``g_t: [B,H]`` (None: no decay), ``lam_t: [B,H,L]``,
    inputs cast to the state dtype.  Returns ``(o_t [B,H,dv], new_state)``.
    """
    dt = state.inner.dtype
    q_t, k_t, v_t, lam_t = cast(dt, q_t, k_t, v_t, lam_t)
    g_t = jnp.zeros(q_t.shape[:-1], dt) if g_t is None else g_t.astype(dt)

    def la(q, k, x, g, h):
        return linear.step(h, q, k, x, g)

    def llm2(q, k, x, g, lam, H):
        return loglinear.step(H, q, k, x, g, None, lam)

    return _compose(chain, la, llm2, q_t, k_t, v_t, g_t, lam_t, normalize, eps, state)


def _gate(q, g, segment_ids, seq_axis=None):
    """``g: [B,T,H]`` (zeros for None) with ``−∞`` at every document start."""
    B, T, H = q.shape[:3]
    dt = state_dtype(q, g)
    return gate_or_zeros(reset_gate(g, segment_ids, B, T, H, dt, seq_axis), B, T, H, dt)


_STATIC = ("chain", "normalize", "chunk_size", "return_final_state", "seq_axis")


@functools.partial(jax.jit, static_argnames=_STATIC)
def reference(chain: Chain, q, k, v, g, lam, *, normalize=False, eps=1e-6, chunk_size=64,
              segment_ids=None, initial_state=None, return_final_state=False, seq_axis=None):
    """The quadratic oracle: both passes materialise ``T×T`` (``reference.linear_attention``,
    ``reference.loglinear_mamba2``).  Takes no state and no ``seq_axis`` (the entries refuse
    them; ``chunk_size`` is unused); returns ``(o, None)``."""

    def la(q, k, x, g, h0):
        return oracle.linear_attention(q, k, x, g), None

    def llm2(q, k, x, g, lam, H0):
        return oracle.loglinear_mamba2(q, k, x, g, lam, segment_ids=segment_ids), None

    dt = state_dtype(q, k, v, g, lam)
    q, k, v, lam = cast(dt, q, k, v, lam)
    return _compose(chain, la, llm2, q, k, v, _gate(q, g, segment_ids), lam, normalize, eps, None)


@functools.partial(jax.jit, static_argnames=_STATIC)
def recurrent(chain: Chain, q, k, v, g, lam, *, normalize=False, eps=1e-6, chunk_size=64,
              segment_ids=None, initial_state=None, return_final_state=False, seq_axis=None):
    """``lax.scan`` of ``step`` over time from ``initial_state`` (None: ``init_state``); at a
    document start the gate resets both states and the level position restarts at 0.  Returns
    ``(o, final State)`` (``chunk_size`` is unused, no ``seq_axis``)."""
    dt = state_dtype(q, k, v, g, lam)
    q, k, v, lam = cast(dt, q, k, v, lam)
    B, _, H, d = q.shape
    state = (init_state(chain, B, H, d, v.shape[-1], lam.shape[-1], normalize=normalize, dtype=dt)
             if initial_state is None
             else State(initial_state.inner.astype(dt), cast_state(initial_state.outer, dt)))
    starts = None if segment_ids is None else doc_starts(segment_ids)

    def body(state, start, *x):
        if start is not None:
            state = state._replace(outer=state.outer._replace(
                t=jnp.where(start, 0, state.outer.t)))
        return step(chain, state, *x, normalize=normalize, eps=eps)

    return scan_time(body, state, starts, q, k, v, _gate(q, g, segment_ids), lam)


@functools.partial(jax.jit, static_argnames=_STATIC)
def scan(chain: Chain, q, k, v, g, lam, *, normalize=False, eps=1e-6, chunk_size=64,
         segment_ids=None, initial_state=None, return_final_state=False, seq_axis=None):
    """Both passes by ``jax.lax.associative_scan`` (``ssm_forms.scan``: the plain SSM pair, then
    one segmented scan per Fenwick level).  O(T·d·n) memory per level; takes no state and no
    ``seq_axis``; returns ``(o, None)``."""

    def la(q, k, x, g, h0):
        return ssm_forms.scan(q, k, x, g), None

    def llm2(q, k, x, g, lam, H0):
        return ssm_forms.scan(q, k, x, g, None, lam, segment_ids), None

    dt = state_dtype(q, k, v, g, lam)
    q, k, v, lam = cast(dt, q, k, v, lam)
    return _compose(chain, la, llm2, q, k, v, _gate(q, g, segment_ids), lam, normalize, eps, None)


@functools.partial(jax.jit, static_argnames=_STATIC)
def chunked(chain: Chain, q, k, v, g, lam, *, normalize=False, eps=1e-6, chunk_size=64,
            segment_ids=None, initial_state=None, return_final_state=False, seq_axis=None):
    """XLA's chunked forms: the inner pass ``la_chunked.chunked``, the outer the block form
    (``loglinear_blocks.blocks``) on whole rows, else (``segment_ids``, a state or
    ``seq_axis``) the counter form ``loglinear_chunked.chunked``.  ``chunk_size`` a power of
    two, any ``T``; ``seq_axis``: both passes sequence-parallel (``ops.sequence``).  Returns
    ``(o, State)``, the state None on whole rows without ``return_final_state`` or under
    ``seq_axis``."""
    whole_rows = (segment_ids is None and initial_state is None and not return_final_state
                  and seq_axis is None)

    def la(q, k, x, g, h0):
        return la_chunked.chunked(q, k, x, g, chunk_size, seq_axis, h0)

    def llm2(q, k, x, g, lam, H0):
        if whole_rows:
            return loglinear_blocks.blocks(q, k, x, g, lam, chunk_size), None
        return loglinear_chunked.chunked(q, k, x, g, None, lam, chunk_size, seq_axis, H0,
                                         segment_ids)

    return _compose(chain, la, llm2, q, k, v, _gate(q, g, segment_ids, seq_axis), lam, normalize,
                    eps, initial_state)


@functools.partial(jax.jit, static_argnames=_STATIC)
def pallas(chain: Chain, q, k, v, g, lam, *, normalize=False, eps=1e-6, chunk_size=64,
           segment_ids=None, initial_state=None, return_final_state=False, seq_axis=None):
    """The kernels (interpret mode on CPU): the inner pass ``la_kernel``, the outer
    ``loglinear_mamba2_kernel`` (``segment_ids`` on its aligned layout, ``levels.packed``), or
    with a state ``levels.from_state`` (the kernel on the row and one ``la_kernel`` pass for the
    state's reads and the final state).  A state or ``segment_ids``, not both; no ``seq_axis``.
    Inputs in their own dtype (bf16 stays bf16 for both passes), float32 outputs.  Returns
    ``(o, State or None)``."""
    stateful = initial_state is not None or return_final_state
    if stateful and segment_ids is not None:
        given = "initial_state" if initial_state is not None else "return_final_state"
        raise ValueError(f"{chain.name}: impl='pallas' takes segment_ids or {given}, not both; "
                         f"impl='chunked' takes both")

    def first_order(q, k, x, g, *, initial_state, return_final_state):
        out = la_kernel(q, k, x, g, initial_state=initial_state,
                        return_final_state=return_final_state, chunk_size=chunk_size)
        return out if return_final_state else (out, None)

    def la(q, k, x, g, h0):
        return first_order(q, k, x, g, initial_state=h0, return_final_state=stateful)

    def llm2(q, k, x, g, lam, H0):
        entry = functools.partial(loglinear_mamba2_kernel, chunk_size=chunk_size)
        if stateful:
            H0 = None if H0 is None else cast_state(H0, jnp.float32)
            return levels.from_state(entry, first_order, q, k, x, g, (), lam, H0)
        if segment_ids is not None:
            return levels.packed(entry, q, k, x, g, (), lam, segment_ids), None
        return entry(q, k, x, g, lam), None

    state = (None if initial_state is None
             else State(initial_state.inner.astype(jnp.float32), initial_state.outer))
    return _compose(chain, la, llm2, q, k, v, _gate(q, g, segment_ids), lam, normalize, eps,
                    state)


def _form(fn):
    """``fn`` (one of the forms above) as a form of the dispatcher (``ops.spec``), for the chain
    its spec names."""

    def form(c):
        return fn(_CHAINS[c.spec.name], c.q, c.k, c.v, c.g, c.lam, normalize=c.normalize,
                  eps=c.eps, chunk_size=c.chunk_size, segment_ids=c.segment_ids,
                  initial_state=c.initial_state, return_final_state=c.return_final_state,
                  seq_axis=c.seq_axis)

    return form


FORMS = {f.__name__: _form(f) for f in (reference, recurrent, scan, chunked, pallas)}


def _auto(c) -> str:
    """"pallas" where the kernels are preferred (``spec.kernels_preferred``: a GPU, bf16 inputs)
    unless a state comes with ``segment_ids`` (the log-linear kernel takes one or the other),
    else "chunked"."""
    both = c.stateful and c.segment_ids is not None
    return "pallas" if kernels_preferred(c) and not both else "chunked"


def _spec(chain: Chain, n) -> Spec:
    """The spec of ``chain``; ``n(d, dv)``: the width of its inner values."""

    def init(B, H, d, dv, *, normalize=False, levels=None, dtype=jnp.float32, **_):
        return init_state(chain, B, H, d, dv, levels, normalize=normalize, dtype=dtype)

    def decode(state, q, k, v, g=None, beta=None, lam=None, *, normalize=False, eps=1e-6):
        return step(chain, state, q, k, v, g, lam, normalize=normalize, eps=eps)

    def flops(T, d, c):
        """The inner LA pass over ``n`` value columns (``QKᵀ`` ``2cd``, ``(·)X`` ``2cn``,
        ``Q h₀``, ``Kᵀ X`` ``4dn``), then log-linear Mamba-2's outer pass."""
        return 2 * c * d + 2 * c * n(d, d) + 4 * d * n(d, d) + loglinear.LOGLINEAR_MAMBA2.flops(T, d, c)

    return Spec(chain.name, FORMS, _auto, init, decode, gate="optional", lam=True,
                normalize=True, flops=flops, mixer=chain.name, features="qk")


_CHAINS = {chain.name: chain for chain in (HLA2, AHLA, HLA3)}
HLA2_SPEC = _spec(HLA2, lambda d, dv: d)
AHLA_SPEC = _spec(AHLA, lambda d, dv: dv)
HLA3_SPEC = _spec(HLA3, lambda d, dv: d + dv)
SPECS = (HLA2_SPEC, AHLA_SPEC, HLA3_SPEC)


def loglinear_hla2(q, k, v, g, lam, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
                   seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Log-linear second-order HLA: ``LLM2(q, K̃, v; 2g, λ)`` with ``K̃ = LA(q, k, k; g)``,

        o_t = Σ_{j≤t} λ_t^{ℓ(t,j)} Σ_{i≤j} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j

    (docs/math.md#loglinear-hla); every λ = 1 gives ``ops.hla2``.

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``), or None (no decay).
        lam: level weights ``[B,T,H,L]``, ``L ≥ ⌈log2 T⌉+1`` (``T`` the global length under
            ``seq_axis``).
        normalize: divide by ``clamp_signed(den, eps)``, ``den`` the same sum with ``v``
            replaced by 1.
        eps: the denominator's floor, ``> 0``.
        impl: "reference" | "recurrent" | "scan" | "chunked" | "pallas" | "auto" (``auto``).
        chunk_size: a power of two (chunked, pallas; the kernels take 16 or more).
        seq_axis: the mesh axis time is sharded over, inside ``jax.shard_map`` (chunked, auto).
        segment_ids: ``[B,T]`` int, packed documents, each computed as if alone.
        initial_state: a ``State`` (``init_state``'s layout) the row continues (recurrent,
            chunked, pallas, auto; pallas: not with ``segment_ids``).
        return_final_state: also return the ``State`` after the last token.

    Returns:
        ``o [B,T,H,dv]`` in the state dtype, or ``(o, State)`` when ``return_final_state``.

    Raises:
        ValueError: an argument of the wrong shape, dtype or value, naming it.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = jnp.ones((1, 8, 1, 4)) / 2
        >>> o = ops.loglinear_hla2(q, k, jnp.ones((1, 8, 1, 2)), None, jnp.ones((1, 8, 1, 4)))
        >>> o.shape
        (1, 8, 1, 2)
    """
    return dispatch.run(HLA2_SPEC, q, k, v, g, lam=lam, normalize=normalize, eps=eps, impl=impl,
                        chunk_size=chunk_size, seq_axis=seq_axis, segment_ids=segment_ids,
                        initial_state=initial_state, return_final_state=return_final_state)


def loglinear_ahla(q, k, v, g, lam, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
                   seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Log-linear asymmetric HLA: ``LLM2(q, k, Ṽ; g, λ)`` with ``Ṽ = LA(q, k, v; g)``,

        o_t = Σ_{i≤t} λ_t^{ℓ(t,i)} Σ_{j≤i} D(t,j) (q_t·k_i)(q_i·k_j) v_j

    (docs/math.md#loglinear-hla); every λ = 1 gives ``ops.ahla``.

    Args:
        q, k, v, g, lam, normalize, eps, impl, chunk_size, seq_axis, segment_ids,
        initial_state, return_final_state: as for ``loglinear_hla2``.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, State)`` when ``return_final_state``.

    Raises:
        ValueError: an argument of the wrong shape, dtype or value, naming it.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 1, 4)) / 2
        >>> ops.loglinear_ahla(q, k, v, None, jnp.ones((1, 8, 1, 4)), impl="recurrent").shape
        (1, 8, 1, 4)
    """
    return dispatch.run(AHLA_SPEC, q, k, v, g, lam=lam, normalize=normalize, eps=eps, impl=impl,
                        chunk_size=chunk_size, seq_axis=seq_axis, segment_ids=segment_ids,
                        initial_state=initial_state, return_final_state=return_final_state)


def loglinear_hla3(q, k, v, g, lam, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
                   seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Log-linear third-order HLA (causal mask): ``LLM2(q, K̃, Ṽ; 2g, λ)`` with
    ``[K̃ | Ṽ] = LA(q, k, [k | v]; g)``,

        o_t = Σ_{u≤t} λ_t^{ℓ(t,u)} Σ_{i≤u} Σ_{j≤u} D(t,i) D(t,u) D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j

    (docs/math.md#loglinear-hla); every λ = 1 gives ``ops.hla3`` (``mask="causal"``).

    Args:
        q, k, v, g, lam, normalize, eps, impl, chunk_size, seq_axis, segment_ids,
        initial_state, return_final_state: as for ``loglinear_hla2``.

    Returns:
        ``o [B,T,H,dv]``, or ``(o, State)`` when ``return_final_state``.

    Raises:
        ValueError: an argument of the wrong shape, dtype or value, naming it.

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax import ops
        >>> q = k = v = jnp.ones((1, 8, 1, 4)) / 2
        >>> lam, g = jnp.ones((1, 8, 1, 4)), -0.1 * jnp.ones((1, 8, 1))
        >>> ops.loglinear_hla3(q, k, v, g, lam, impl="chunked", chunk_size=4).shape
        (1, 8, 1, 4)
    """
    return dispatch.run(HLA3_SPEC, q, k, v, g, lam=lam, normalize=normalize, eps=eps, impl=impl,
                        chunk_size=chunk_size, seq_axis=seq_axis, segment_ids=segment_ids,
                        initial_state=initial_state, return_final_state=return_final_state)
