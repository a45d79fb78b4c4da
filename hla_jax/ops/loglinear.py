"""Log-linear Mamba-2 and (log-linear) Gated DeltaNet: the first-order state-space core
(docs/math.md#loglinear).

One core covers four operators.  A token's transition is ``A_t = a_t`` (Mamba-2, stored as
``[..., 1, 1]``) or ``A_t = a_t (I − β_t k_t k_tᵀ)`` (Gated DeltaNet, ``[..., d, d]``), and it
writes ``X_t = k_t β_t v_tᵀ`` (β = 1 for Mamba-2).  Then

    plain:      o_t = q_tᵀ Σ_{s≤t} (A_t ⋯ A_{s+1}) X_s
    log-linear: o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) X_s,  ℓ(t,s) = bit_length(t XOR s)

With every λ = 1 the log-linear operator is the plain one; the plain forms here are the same
code with the level split switched off (``lam=None``: one state, plain cost).

Packed documents (docs/math.md#packed-documents, ``segment_ids: [B,T]`` int): every form equals the
operator run on
each document alone.  The transition of a document's first token is zero (``g = -inf``, so no
state crosses a start) and the log-linear levels count from it,
``ℓ(t,s) = bit_length((t−t0) XOR (s−t0))``.  States (``init_state``/``step``, and the recurrent,
chunked and Pallas forms' ``initial_state`` / final state): plain ``[B,H,d,dv]``; log-linear
``LevelState(H: [L,B,H,d,dv], t: [B])``, the level states and each row's position.

Shapes: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``, ``lam: [B,T,H,L]`` with
``L ≥ fenwick.num_levels(T)``; outputs ``[B,T,H,dv]`` in the state dtype.  The algebra (token
summaries, ``combine``, ``readout``, ``init_state``/``step``) is in ``ops.ssm``, the chunked form
in ``ops.loglinear_chunked``; this module holds the recurrent and scan forms and the entries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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
from hla_jax.core.documents import doc_positions, doc_starts, gate_or_zeros, reset_gate
from hla_jax.core.state import LevelState, state_dtype
from hla_jax.kernels import (
    gated_deltanet_pallas,
    la_pallas,
    loglinear_gated_deltanet_pallas,
    loglinear_mamba2_pallas,
)
from hla_jax.kernels.gdn import gdn_entry
from hla_jax.kernels.loglinear.loglinear_entry import from_state
from hla_jax.ops import common, loglinear_gdn_blocks, reference, sequence
from hla_jax.ops.loglinear_blocks import blocks
from hla_jax.ops.loglinear_chunked import chunked
from hla_jax.ops.ssm import (
    cast,
    cast_state,
    combine,
    init_state,
    readout,
    reset,
    step,
    token_summaries,
)

__all__ = ["chunked", "combine", "gated_deltanet", "init_state", "loglinear_gated_deltanet",
           "loglinear_mamba2", "readout", "recurrent", "run", "scan", "step", "token_summaries"]

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas", "auto")
# the kernel of each entry with impl="pallas"
KERNELS = {"linear_attention": la_pallas, "mamba2": la_pallas, "gated_deltanet": gated_deltanet_pallas,
           "loglinear_mamba2": loglinear_mamba2_pallas,
           "loglinear_gated_deltanet": loglinear_gated_deltanet_pallas}


# --------------------------------------------------------------------------- forms


def recurrent(q, k, v, g, beta=None, lam=None, initial_state=None, segment_ids=None):
    """Serial recurrence: ``lax.scan`` of ``step`` over time (the decode path), from
    ``initial_state`` (``init_state``'s layout; None: zeros).  ``segment_ids [B,T]``: the state
    is reset at each document start (``g = -inf``, and the level position restarts at 0).
    Returns ``(outputs, final state)``."""
    dt = state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = cast(dt, q, k, v, g, beta, lam)
    B, _, H, d = q.shape
    g = reset(g, segment_ids)
    levels = None if lam is None else lam.shape[-1]
    starts = None if lam is None or segment_ids is None else doc_starts(segment_ids)

    def body(state, start, *x):
        if start is not None:
            state = state._replace(t=jnp.where(start, 0, state.t))
        return step(state, *x)

    state0 = (init_state(B, H, d, v.shape[-1], levels, dt) if initial_state is None
              else cast_state(initial_state, dt))
    return common.scan_time(body, state0, starts, q, k, v, g, beta, lam)


def _segmented_states(A, X, reset, axis=1):
    """Inclusive prefix states ``H_t = A_t H_{t−1} + X_t`` along the time ``axis``, restarted
    where ``reset`` (shaped like the axes up to time, broadcasting) is True."""
    reset = jnp.asarray(reset)
    A = jnp.where(reset.reshape(reset.shape + (1,) * (A.ndim - axis - 1)), 0, A)
    return jax.lax.associative_scan(combine, (A, X), axis=axis)[1]


def scan(q, k, v, g, beta=None, lam=None, segment_ids=None):
    """Token-level associative scan with ``combine`` (docs/math.md#loglinear-scan).

    Plain: one scan, ``o_t = q_tᵀ H_t``.  Log-linear: level 0 is the token itself; for level
    ℓ ≥ 1 the bucket of query t (present when bit ℓ−1 of its position p is 1) is the aligned
    block ``[b, b + 2^{ℓ−1})``, ``b = (p >> ℓ) << ℓ``: a segmented scan per level, restarted
    at positions that are multiples of ``2^ℓ`` and fed only by the left half of each ``2^ℓ``
    block, carries the block's state through ``A_{e+1} … A_t`` to its readers in the right half
    (the levels stacked on a leading axis: one scan for all of them).  Positions count from the
    row's start, or with ``segment_ids [B,T]`` from each document's (a start restarts every
    level; ``g = -inf`` there cuts the earlier documents off).
    Memory O(T·d·dv) per level, plus O(T·d²) per level for Gated DeltaNet's transitions: use
    the chunked form for long sequences.
    """
    dt = state_dtype(q, k, v, g, beta, lam)
    q, k, v, g, beta, lam = cast(dt, q, k, v, g, beta, lam)
    T = q.shape[1]
    A, X = token_summaries(k, v, reset(g, segment_ids), beta)
    if lam is None:
        return readout(_segmented_states(A, X, np.zeros(T, bool)), q)
    pos = (jnp.broadcast_to(jnp.arange(T), q.shape[:2]) if segment_ids is None
           else doc_positions(segment_ids))
    levels = fenwick.num_levels(T)
    lev = jnp.arange(1, levels)[:, None, None]
    left = (((pos >> (lev - 1)) & 1) == 0)[..., None, None]     # [ℓ, B, T, 1, 1]
    blocks = _segmented_states(A[None], jnp.where(left[..., None], X[None], 0),
                               (pos & ((1 << lev) - 1)) == 0, axis=2)
    lam_l = jnp.moveaxis(lam[..., 1:levels], -1, 0)[..., None]    # [ℓ, B, T, H, 1]
    return lam[..., 0:1] * readout(X, q) + jnp.sum(
        jnp.where(left, 0, lam_l) * readout(blocks, q[None]), axis=0)


# --------------------------------------------------------------------------- public entries

_JITTED = {"recurrent": jax.jit(recurrent), "scan": jax.jit(scan),
           "chunked": jax.jit(chunked, static_argnames=("chunk_size", "seq_axis")),
           "blocks": jax.jit(blocks, static_argnames="chunk_size"),
           "gdn_blocks": jax.jit(loglinear_gdn_blocks.blocks, static_argnames=("chunk_size", "terms"))}


def _reference(q, k, v, g, beta, lam, segment_ids):
    if beta is None and lam is None:  # the first-order oracle: documents by the reset gate
        return reference.linear_attention(q, k, v, reset(g, segment_ids))
    if beta is None:
        return reference.loglinear_mamba2(q, k, v, g, lam, segment_ids=segment_ids)
    if lam is None:
        return reference.gated_deltanet(q, k, v, g, beta, segment_ids=segment_ids)
    return reference.loglinear_gated_deltanet(q, k, v, g, beta, lam, segment_ids=segment_ids)


def check_state(initial_state, return_final_state, impl, seq_axis, B, H, d, dv, levels=None, *,
                name):
    """``initial_state`` / ``return_final_state`` are taken by the recurrent, chunked and Pallas
    forms (not under ``seq_axis``; the log-linear kernels not with ``segment_ids`` too);
    ``initial_state`` must be ``init_state(B, H, d, dv, levels)``'s layout: ``[B,H,d,dv]``, or
    ``LevelState`` with ``H: [levels,B,H,d,dv]``, ``t: [B]`` int."""
    if not common.wants_state(initial_state, return_final_state, impl, seq_axis, name=name):
        return
    if initial_state is None:
        return
    if levels is None:
        if jnp.shape(initial_state) != (B, H, d, dv):
            raise ValueError(f"{name}: initial_state must have shape {(B, H, d, dv)}, got "
                             f"{jnp.shape(initial_state)}")
        return
    want = f"LevelState(H=[levels,B,H,d,dv]={(levels, B, H, d, dv)}, t=[B]={(B,)} int)"
    if not isinstance(initial_state, LevelState):
        raise ValueError(f"{name}: initial_state must be a {want}, got {type(initial_state)}")
    Hs, t = initial_state
    if (jnp.shape(Hs) != (levels, B, H, d, dv) or jnp.shape(t) != (B,)
            or not jnp.issubdtype(jnp.result_type(t), jnp.integer)):
        raise ValueError(f"{name}: initial_state must be a {want}, got H {jnp.shape(Hs)}, "
                         f"t {jnp.result_type(t)}{list(jnp.shape(t))}")


def _kernel_takes(name, q, k, v, chunk_size) -> bool:
    """Whether ``name``'s kernel runs these inputs here: the Gated DeltaNet kernel is Hopper's
    (Mosaic GPU: 16-bit, ``d ∈ {64, 128}``, chunk 64); the others take any GPU input."""
    return name != "gated_deltanet" or gdn_entry.supports(q, k, v, chunk_size)


def run(name, q, k, v, g, beta=None, lam=None, *, impl="auto", chunk_size=64, log_levels=False,
        gate_required=True, seq_axis=None, segment_ids=None, initial_state=None,
        return_final_state=False):
    """Validate, then dispatch ``impl`` to the reference or one of the (jitted) forms above.

    ``log_levels``: ``lam`` is required and ``chunk_size`` must be a power of two;
    ``gate_required=False``: ``g=None`` means no decay; ``seq_axis``: the mesh axis the time
    axis is sharded over, inside ``jax.shard_map`` (chunked only; ``ops.sequence``);
    ``segment_ids [B,T]``: packed documents (docs/math.md#packed-documents: the state is reset with ``g =
    -inf`` at
    each document start, and the log-linear levels count from it); ``initial_state`` /
    ``return_final_state``: the recurrent, chunked and Pallas forms start from a state in
    ``init_state``'s layout and return ``(o, final_state)`` (the log-linear kernels through
    ``kernels.loglinear.loglinear_entry.from_state``: the kernels on the row, one first-order
    pass for the state).
    """
    impl = check_impl(impl, IMPLS, name=name)
    if impl == "pallas" and name not in KERNELS:
        raise ValueError(f"{name}: impl='pallas' has kernels for {tuple(KERNELS)} only")
    sequence.check_impl(impl, seq_axis, name=name)
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=gate_required)
    segment_ids = check_segment_ids(segment_ids, B, T, name=name)
    if beta is not None:
        beta = check_per_token(beta, B, T, H, "beta", name=name)
    levels = None
    if log_levels:
        lam = check_lam(lam, B, T, H, name=name, T_all=T * sequence.axis_size(seq_axis))
        fenwick.chunk_log2(chunk_size)
        levels = lam.shape[-1]
    check_state(initial_state, return_final_state, impl, seq_axis, B, H, d, dv, levels, name=name)
    given = [arg for arg, x in (("segment_ids", segment_ids), ("initial_state", initial_state),
                                ("return_final_state", return_final_state or None))
             if x is not None]
    state_args = [a for a in given if a != "segment_ids"]
    if lam is not None and impl == "pallas" and state_args and segment_ids is not None:
        raise ValueError(f"{name}: impl='pallas' takes segment_ids or {state_args[0]}, not both; "
                         f"impl='chunked' takes both")
    # log-linear GDN on whole rows: the block form, faster than its kernels forward+backward
    # (its backward does not carry the counter's level states back through every chunk)
    blocks_first = name == "loglinear_gated_deltanet" and segment_ids is None
    # a state: the kernels on the row and one first-order pass, faster than the counter form;
    # a state with packed documents: the counter form
    both = lam is not None and state_args and segment_ids is not None
    preferred = (impl == "auto" and common.pallas_preferred(seq_axis, chunk_size, q, k, v)
                 and _kernel_takes("gated_deltanet" if blocks_first else name, q, k, v, chunk_size))
    if preferred and name in KERNELS and not both and not blocks_first:
        impl = "pallas"
    # the block form's chunk terms from the first-order kernel's UT transform where that kernel
    # runs (faster than XLA's batched triangular solve and einsums)
    terms = "kernel" if preferred and blocks_first else "xla"
    impl = "chunked" if impl == "auto" else impl
    if impl == "pallas":  # the kernels take g=None as no decay
        extra = [x for x in (beta, lam) if x is not None]
        g = reset_gate(g, segment_ids, B, T, H, q.dtype, seq_axis)
        entry = KERNELS[name]
        if lam is None:
            return entry(q, k, v, g, *extra, chunk_size=chunk_size, initial_state=initial_state,
                         return_final_state=return_final_state)
        if state_args:  # a state: the kernels on the row, composed with one first-order pass
            plain = functools.partial(run, "mamba2" if beta is None else "gated_deltanet",
                                      chunk_size=chunk_size)
            out = from_state(functools.partial(entry, chunk_size=chunk_size), plain,
                             q, k, v, g, extra[:-1], lam,
                             None if initial_state is None else cast_state(initial_state, jnp.float32))
            return out if return_final_state else out[0]
        return entry(q, k, v, g, *extra, chunk_size=chunk_size, segment_ids=segment_ids)
    g = gate_or_zeros(g, B, T, H, q.dtype if g is None else g.dtype)
    if impl == "reference":
        return _reference(q, k, v, g, beta, lam, segment_ids)
    blocked = impl == "chunked" and lam is not None and not given and seq_axis is None
    if blocked and name == "loglinear_mamba2":
        return _JITTED["blocks"](q, k, v, g, lam, chunk_size=chunk_size)
    with common.matmul_precision(q, k, v):
        if blocked:
            return _JITTED["gdn_blocks"](q, k, v, g, beta, lam, chunk_size=chunk_size, terms=terms)
        if impl == "scan":
            return _JITTED["scan"](q, k, v, g, beta, lam, segment_ids)
        if impl == "recurrent":
            out = _JITTED["recurrent"](q, k, v, g, beta, lam, initial_state, segment_ids)
        else:
            out = _JITTED["chunked"](q, k, v, g, beta, lam, chunk_size=chunk_size,
                                     seq_axis=seq_axis, initial_state=initial_state,
                                     segment_ids=segment_ids)
    return out if return_final_state else out[0]


def loglinear_mamba2(q, k, v, g, lam, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s``; ``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``
    (``T`` the global length under ``seq_axis``).

    ``segment_ids [B,T]`` int: packed documents (docs/math.md#packed-documents), each computed as if
    alone: the
    levels count from its first token, ``ℓ(t,s) = bit_length((t−t0) XOR (s−t0))``.
    ``initial_state`` / ``return_final_state`` (recurrent, chunked, pallas): start from a
    ``LevelState(H: [L,B,H,d,dv], t: [B])`` (``init_state``/``step``'s layout; the row's first
    tokens continue its document at position ``t``) and return ``(o, final_state)`` (with
    ``segment_ids``: the last document's), so a prompt is prefilled in one parallel pass and
    decoding continues with ``step``.  ``impl="chunked"`` without those three (and without
    ``seq_axis``): the block form (``ops.loglinear_blocks``, no scan); with them: the counter
    form (``ops.loglinear_chunked``).  ``impl="pallas"``:
    ``hla_jax.kernels.loglinear_mamba2_pallas`` (the block form's kernels), with
    ``segment_ids`` on an aligned layout of up to ``2T`` tokens, or with a state
    (``kernels.loglinear.loglinear_entry.from_state``: the kernels on the row at its offset
    below ``2^K ≥ T``, up to ``3T`` tokens, and one ``mamba2`` pass with ``2L·dv`` value columns
    for the state's reads and the final state), not both; "auto"
    takes it on a GPU for bf16 inputs (``common.pallas_preferred``), else "chunked"."""
    return run("loglinear_mamba2", q, k, v, g, None, lam, impl=impl, chunk_size=chunk_size,
               log_levels=True, seq_axis=seq_axis, segment_ids=segment_ids,
               initial_state=initial_state, return_final_state=return_final_state)


def gated_deltanet(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                   return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``, ``A_r = a_r (I − β_r k_r k_rᵀ)``.

    Assumes L2-normalised keys (the calling layer's job) and ``beta`` in (0, 1).
    ``segment_ids [B,T]``: packed documents, the state reset (``g = -inf``) at each start.
    ``initial_state [B,H,d,dv]`` / ``return_final_state`` (recurrent, chunked, pallas): as for
    ``loglinear_mamba2``.  ``impl="pallas"``: ``hla_jax.kernels.gated_deltanet_pallas`` (Mosaic
    GPU: 16-bit inputs, ``d ∈ {64, 128}``, chunk 64; on a TPU its Mosaic TPU backend: bf16 or
    float32, chunk 64, never run on TPU hardware); "auto" takes it on a Hopper GPU for bf16
    inputs it takes, else "chunked".
    """
    return run("gated_deltanet", q, k, v, g, beta, impl=impl, chunk_size=chunk_size,
               seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state)


def loglinear_gated_deltanet(q, k, v, g, beta, lam, *, segment_ids=None, initial_state=None,
                             return_final_state=False, impl="auto", chunk_size=64,
                             seq_axis=None):
    """``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``; ``lam: [B,T,H,L]``.
    ``segment_ids``, ``initial_state`` (``LevelState``), ``return_final_state`` as for
    ``loglinear_mamba2``; ``impl="pallas"``:
    ``hla_jax.kernels.loglinear_gated_deltanet_pallas`` (``segment_ids`` on the same aligned
    layout, or a state as for ``loglinear_mamba2``, the first-order pass a ``gated_deltanet``
    one); "auto" takes it on a GPU for bf16 inputs with ``segment_ids`` and no state, else
    "chunked" (whole rows: the block form, faster forward+backward than the
    kernels; its chunk terms from the ``gated_deltanet`` kernel's UT transform where
    "auto" would take that kernel).  ``impl="chunked"``
    without those three (and without ``seq_axis``): the block form
    (``ops.loglinear_gdn_blocks``: an up-sweep of chunk transitions and a running query per
    token, no scan); with them: the counter form (``ops.loglinear_chunked``)."""
    return run("loglinear_gated_deltanet", q, k, v, g, beta, lam, impl=impl,
               chunk_size=chunk_size, log_levels=True, seq_axis=seq_axis, segment_ids=segment_ids,
               initial_state=initial_state, return_final_state=return_final_state)
