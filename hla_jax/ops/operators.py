"""The eight operators' public entries.  Each checks its inputs once and runs the form ``impl``
names through ``dispatch`` ("auto": ``dispatch.auto``'s choice).

Shared arguments: ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g``: log-decay (``<= 0``) ``[B,T,H]``
or per-head ``[H]``; outputs ``[B,T,H,dv]`` in the state dtype (float32, float64 for float64
inputs).  ``impl``: "reference" (the quadratic oracle) | "recurrent" (the serial recurrence, the
decode step) | "scan" (``jax.lax.associative_scan`` over token summaries) | "chunked" (XLA,
matmuls inside chunks of ``chunk_size``) | "pallas" (the kernels; interpret mode on CPU) | "auto".
``segment_ids [B,T]`` int: packed documents, each computed as if alone
(docs/math.md#packed-documents; every impl).  ``initial_state`` / ``return_final_state``
(recurrent, chunked, pallas, auto; not with ``seq_axis``): start from a state in the layout of the
family's ``init_state`` (the row's first token continues it) and return ``(o, final_state)``, so
a prompt is prefilled in one parallel pass and a long sequence can be processed in pieces.
``seq_axis``: the mesh axis the time axis is sharded over, inside ``jax.shard_map`` (chunked and
auto only; ``ops.sequence``).
"""

from __future__ import annotations

from hla_jax.ops.dispatch import run


def hla2(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Second-order masked HLA (docs/math.md#hla2):
    ``o_t = Σ_{j≤t} Σ_{i≤j} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j``.

    ``g`` optional (None: no decay).  ``normalize`` divides by ``clamp_signed(den, eps)``
    (``eps > 0``), ``den`` the same sum with ``v`` replaced by 1.  "chunked" is the chain
    ``LA(q, K̃, v; 2g)``, ``K̃ = LA(q, k, k; g)`` (docs/math.md#chains) over XLA's chunked LA,
    "pallas" the same chain over ``hla_jax.kernels.la_pallas``.  State: ``hla2.State(S, U)``.
    """
    return run("hla2", q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
               segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state, normalize=normalize, eps=eps)


def ahla(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         seq_axis=None, segment_ids=None, initial_state=None, return_final_state=False):
    """Asymmetric second-order HLA (docs/math.md#ahla):
    ``o_t = Σ_{j≤t} Σ_{i≤j} D(t,j) D(j,i) (q_t·k_j)(q_j·k_i) v_i``.

    ``g``, ``normalize``, ``eps`` as for ``hla2``.  "chunked" is the chain ``LA(q, k, Ṽ; g)``,
    ``Ṽ = LA(q, k, v; g)`` over XLA's chunked LA, "pallas" over ``la_pallas``.  State:
    ``ahla.State(P, E)``.
    """
    return run("ahla", q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
               segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state, normalize=normalize, eps=eps)


def hla3(q, k, v, g=None, *, mask="causal", normalize=False, eps=1e-6, impl="auto",
         chunk_size=64, seq_axis=None, segment_ids=None, initial_state=None,
         return_final_state=False):
    """Third-order HLA (docs/math.md#hla3), ``mask``: "causal" | "paper" (no decay: ``g`` must
    be None).

    ``normalize``, ``eps`` as for ``hla2``.  Causal: "chunked" is the chain ``LA(q, K̃, Ṽ; 2g)``,
    ``[K̃ | Ṽ] = LA(q, k, [k | v]; g)``, "pallas" the same over ``la_pallas``; state
    ``hla3.State(S, P, F)``.  Paper: "chunked" is ``hla3.paper_chunked``, no "pallas"; state
    ``hla3.PaperState``.
    """
    return run("hla3", q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
               segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state, normalize=normalize, eps=eps, mask=mask)


def linear_attention(q, k, v, g=None, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """First-order linear attention ``o = (Γ ∘ QKᵀ) V``, ``Γ[t,s] = D(t,s)``; ``g`` optional.

    "chunked": ``ops.la_chunked``; "pallas": ``hla_jax.kernels.la_pallas``.  State
    ``[B,H,d,dv]``: ``H_t = a_t H_{t−1} + k_t v_tᵀ``.
    """
    return run("linear_attention", q, k, v, g, impl=impl, chunk_size=chunk_size,
               seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state)


def mamba2(q, k, v, g, *, segment_ids=None, initial_state=None, return_final_state=False,
           impl="auto", chunk_size=64, seq_axis=None):
    """Scalar-gated linear attention, Mamba-2's SSD core (q=C, k=B, v=dt·x, g=dt·A); ``g``
    required; otherwise as ``linear_attention``."""
    return run("mamba2", q, k, v, g, impl=impl, chunk_size=chunk_size, seq_axis=seq_axis,
               segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state)


def gated_deltanet(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                   return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """Gated DeltaNet: ``o_t = Σ_{s≤t} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``,
    ``A_r = a_r (I − β_r k_r k_rᵀ)``; ``beta: [B,T,H]``.

    Assumes L2-normalised keys (the calling layer's job) and ``beta`` in (0, 1).  "chunked":
    ``ops.gdn_chunked`` (the UT transform by matmuls); "pallas":
    ``hla_jax.kernels.gated_deltanet_pallas`` (Mosaic GPU: 16-bit inputs, ``d ∈ {64, 128}``,
    chunk 64; Mosaic TPU: bf16 or float32, chunk 64, never run on TPU hardware).  State
    ``[B,H,d,dv]``.
    """
    return run("gated_deltanet", q, k, v, g, beta, impl=impl, chunk_size=chunk_size,
               seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state)


def loglinear_mamba2(q, k, v, g, lam, *, segment_ids=None, initial_state=None,
                     return_final_state=False, impl="auto", chunk_size=64, seq_axis=None):
    """Log-linear Mamba-2 (docs/math.md#loglinear):
    ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s``, ``ℓ(t,s) = bit_length(t XOR s)``;
    ``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]`` (``T`` the global length under ``seq_axis``),
    ``chunk_size`` a power of two.

    With ``segment_ids`` the levels count from each document's first token.  State
    ``LevelState(H: [L,B,H,d,dv], t: [B])`` (with ``segment_ids``: the last document's).
    "chunked": the block form (``ops.loglinear_blocks``) on whole rows; with ``segment_ids``, a
    state or ``seq_axis``, the counter form (``ops.loglinear_chunked``).  "pallas":
    ``hla_jax.kernels.loglinear_mamba2_pallas``, with ``segment_ids`` on an aligned layout of up
    to ``2T`` tokens, or with a state (``loglinear_entry.from_state``: the kernels on the row and
    one ``mamba2`` pass), not both.
    """
    return run("loglinear_mamba2", q, k, v, g, lam=lam, impl=impl, chunk_size=chunk_size,
               seq_axis=seq_axis, segment_ids=segment_ids, initial_state=initial_state,
               return_final_state=return_final_state)


def loglinear_gated_deltanet(q, k, v, g, beta, lam, *, segment_ids=None, initial_state=None,
                             return_final_state=False, impl="auto", chunk_size=64,
                             seq_axis=None):
    """Log-linear Gated DeltaNet: ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_s``;
    ``beta: [B,T,H]``, ``lam`` and the rest as for ``loglinear_mamba2``.

    "chunked": the block form (``ops.loglinear_gdn_blocks``: an up-sweep of chunk transitions
    and a running query per token) on whole rows, else the counter form; "pallas":
    ``hla_jax.kernels.loglinear_gated_deltanet_pallas`` (``segment_ids`` or a state, as for
    ``loglinear_mamba2``, the first-order pass a ``gated_deltanet`` one).
    """
    return run("loglinear_gated_deltanet", q, k, v, g, beta, lam, impl=impl,
               chunk_size=chunk_size, seq_axis=seq_axis, segment_ids=segment_ids,
               initial_state=initial_state, return_final_state=return_final_state)
