"""The block form of log-linear Gated DeltaNet (docs/math.md#loglinear) on the grid of positions:
every level at once, no scan over chunks.

As in log-linear Mamba-2's (``ops.xla.loglinear_blocks``), chunk ``n' < n`` is at level ``lc + 1 + j``
(``c = 2^lc``), ``j = bit_length(n XOR n') − 1``: the left half of the aligned block of
``2^(j+1)`` chunks writes, the right half reads.  Here the transitions between them are matrices:
chunk ``n`` maps an entering state ``S`` to ``A_n S + Z_n`` and its tokens read ``S`` as ``Q̂_n S``
(``loglinear_chunked.chunk_terms``: ``A_n = γ_c I − K̃ᵀ W``, ``Z_n = K_wᵀ V``, ``Q̂ = γ∘Q − P W``).
An up-sweep combines aligned blocks, left ``L`` before right ``R``,

    (Π, Z) = (Π_R Π_L,  Π_R Z_L + Z_R),

so at level ``j`` a left half's ``Z`` is its state ``H_j`` and ``Π`` its transition.  A token of
chunk ``n`` reads ``H_j`` through the chunks between that left half and ``n``: the left halves
``L_i``, ``i < j``, of the smaller blocks whose right half holds ``n``, in order.  So each token
carries a running query ``r`` (first ``Q̂``) up the levels: at level ``i``, where ``n`` lies in a
right half,

    o ⊇ λ^{lc+1+i} ∘ (r Z_{L_i}),      then  r ← r Π_{L_i}.

Each level is four batched matmuls, two combining adjacent blocks and two over the right
halves' tokens: O(T·c·d + T·d·(d+dv)·log(T/c) + (T/c)·d²·(d+dv)) work, depth O(log T), no
scan; autodiff gives the backward.  Inside a chunk levels ``0..lc`` are ``(Λ ∘ M) V``
(``core.block_levels.chunk_window``).  With ``terms="kernel"`` the window and the levels are
Triton kernels (``kernels.loglinear_gdn.gdn_blocks.output``, its backward the window's by XLA
and the levels' by Triton).
Shapes as in ``ops.families.loglinear``; ``T`` is zero-padded to chunks (zero tokens are identity
transitions). The chunk terms are formed in the state dtype at the caller's matmul precision
(``common.matmul_precision``; ``terms="kernel"``'s kernels: float32 factors as two 16-bit halves in
the UT transform, TF32 in the Triton chunk terms but for ``Z``'s 16-bit product). With 16-bit
inputs ``Q̂``, ``A_c``, ``Z``, ``V`` are kept in 16 bits, and so are the up-sweep's ``(Π, Z)`` and
the running query ``r``: the sweeps and reads take 16-bit operands with float32 accumulation,
forward and backward (``loglinear_blocks.dot16``), as the kernels do, their results rounded back
to 16 bits; ``M``, the window and the output are float32 (the kernels' window rounds ``Λ ∘ M`` to
16 bits for its product, as the first-order kernels' chunk products do).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.block_levels import chunk_window, halves
from hla_jax.core.layout import heads_first
from hla_jax.core.state import state_dtype
from hla_jax.kernels.loglinear_gdn import gdn_blocks
from hla_jax.ops import common
from hla_jax.ops.xla.loglinear_blocks import dot16
from hla_jax.ops.xla.loglinear_chunked import chunk_terms
from hla_jax.ops.xla.ssm import combine


def _pairs(Pi, Z, dot):
    """Adjacent nodes ``(2m, 2m+1)`` of ``Pi [B,H,n,d,d]``, ``Z [B,H,n,d,dv]`` (an odd ``n`` gets an
    identity node at the end): the left ones ``(Π_L, Z_L)`` and the combined ``(Π, Z)``
    (``ssm.combine``) in their dtype."""
    if Pi.shape[2] % 2:
        eye = jnp.broadcast_to(jnp.eye(Pi.shape[-1], dtype=Pi.dtype), Pi.shape[:2] + (1,) + Pi.shape[3:])
        Pi = jnp.concatenate([Pi, eye], 2)
        Z = jnp.concatenate([Z, jnp.zeros_like(Z[:, :, :1])], 2)
    PiL, PiR, ZL, ZR = Pi[:, :, 0::2], Pi[:, :, 1::2], Z[:, :, 0::2], Z[:, :, 1::2]
    Pi2, Z2 = combine((PiL, ZL), (PiR, ZR), functools.partial(dot, "...ij,...jk->...ik"))
    return (PiL, ZL), (Pi2.astype(Pi.dtype), Z2.astype(Z.dtype))


def _sweep(Pi, Z, P: int, dot):
    """The up-sweep: per level ``i < P`` the left halves' ``(Π_L, Z_L)`` (``_pairs``), each
    ``[B,H,⌈N/2^(i+1)⌉,·,·]``, from the chunks' ``Pi [B,H,N,d,d]``, ``Z [B,H,N,d,dv]``."""
    out = []
    for _ in range(P):
        left, (Pi, Z) = _pairs(Pi, Z, dot)
        out.append(left)
    return out


def _read(Qh, sweep, Lam, c: int, dot):
    """The running queries' reads (module docstring) by XLA, a pass per level: ``Qh [B,H,Tp,d]``
    in chunks of ``c``, ``sweep`` as ``_sweep``'s, ``Lam [B,H,Tp,P]`` -> ``[B,H,Tp,dv]``."""
    B, H, Tp, d = Qh.shape
    r, out = Qh, 0.0
    for i, (PiL, ZL) in enumerate(sweep):
        span = c << i
        rh = halves(r, span)                                       # [B,H,nb,2,span,d]
        lam = halves(Lam[..., i], span)[:, :, :, 1, :, None]
        o = lam * dot("bhntd,bhnde->bhnte", rh[:, :, :, 1], ZL)
        rPi = dot("bhntd,bhnde->bhnte", rh[:, :, :, 1], PiL).astype(r.dtype)
        r = jnp.stack([rh[:, :, :, 0], rPi], 3).reshape(B, H, -1, d)[:, :, :Tp]
        out = out + jnp.stack([jnp.zeros_like(o), o], 3).reshape(B, H, -1, o.shape[-1])[:, :, :Tp]
    return out


def _levels(Qh, Pi, Z, Lam, lc: int, N: int):
    """The chunk levels (module docstring): ``Qh [B,H,Tp,d]`` per token, ``Pi [B,H,N,d,d]`` and
    ``Z [B,H,N,d,dv]`` per chunk, all in one dtype, ``Lam [B,H,Tp,L]`` -> ``[B,H,Tp,dv]``; 16-bit
    terms: ``dot16`` products, ``r``, ``Π``, ``Z`` rounded back to 16 bits, the output float32."""
    dot = dot16 if jnp.dtype(Qh.dtype).itemsize < 4 else common.ein
    P = fenwick.num_levels(N) - 1
    if P == 0:
        return 0.0
    return _read(Qh, _sweep(Pi, Z, P, dot), Lam[..., lc + 1:lc + 1 + P], Qh.shape[2] // N, dot)


def blocks(q, k, v, g, beta, lam, chunk_size: int = 64, terms: str = "xla"):
    """Log-linear Gated DeltaNet ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ``
    in the block form (module docstring): ``q, k [B,T,H,d]`` (keys L2-normalised by the caller),
    ``v [B,T,H,dv]``, ``g, beta [B,T,H]``, ``lam [B,T,H,L ≥ fenwick.num_levels(T)]``,
    ``chunk_size`` a power of two -> ``[B,T,H,dv]`` in the state dtype (float32; float64 for
    float64 inputs).  ``terms="kernel"``: the per-chunk terms from the first-order kernel's UT
    transform, the window and the chunk levels' up-sweep and reads on Triton
    (``kernels.loglinear_gdn.gdn_blocks``; chunk 64, ``d`` a power of two ≥ 16; the GPU and
    Triton interpreters on CPU; log-decays floored at ``kernels.wrap.LOG_DECAY_FLOOR``), else
    XLA's."""
    M, Qh, A_c, Z, V, Lam = chunk_parts(q, k, v, g, beta, lam, chunk_size, terms)
    B, H, N, c, d = Qh.shape
    lc, Qh = fenwick.chunk_log2(c), Qh.reshape(B, H, N * c, d)
    if terms == "kernel":
        return gdn_blocks.output(M.reshape(B, H, N * c, c), V, Qh, A_c, Z, Lam, lc)[:, :q.shape[1]]
    out = chunk_window(M, V, Lam) + _levels(Qh, A_c, Z, Lam, lc, N)
    return jnp.moveaxis(out, 1, 2)[:, :q.shape[1]]


def chunk_parts(q, k, v, g, beta, lam, chunk_size: int = 64, terms: str = "xla"):
    """``blocks``' per-chunk terms ``(M [B,H,N,c,c], Q̂ [B,H,N,c,d], A_c [B,H,N,d,d],
    Z [B,H,N,d,dv], V [B,N·c,H,dv], Λ [B,H,N·c,L])``, heads first but ``V`` (tokens first, as
    given), the inputs zero-padded to ``N = ⌈T/c⌉`` chunks; ``terms`` as for ``blocks``.  All are
    formed in the state dtype; with 16-bit ``q, k, v``, ``Q̂``, ``A_c``, ``Z`` and ``V`` are kept
    in ``q``'s dtype."""
    if terms not in ("xla", "kernel"):
        raise ValueError(f"loglinear_gdn_blocks: terms must be 'xla' or 'kernel', got {terms!r}")
    c = chunk_size
    fenwick.chunk_log2(c)                       # ValueError unless a power of two
    N = -(-q.shape[1] // c)
    dt = state_dtype(q, k, v, g, beta, lam)
    mdt = q.dtype if all(jnp.dtype(x.dtype).itemsize < 4 for x in (q, k, v)) else dt
    chunk = lambda x: x.reshape(x.shape[:2] + (N, c) + x.shape[3:])      # noqa: E731
    V = jnp.pad(v.astype(mdt), ((0, 0), (0, N * c - v.shape[1]), (0, 0), (0, 0)))
    Lam = heads_first(lam, N * c, dt)
    if terms == "kernel":
        if c != gdn_blocks.C or dt != jnp.float32:
            raise ValueError(f"loglinear_gdn_blocks: terms='kernel' takes chunk_size={gdn_blocks.C} "
                             f"and float32 or 16-bit inputs, got {chunk_size} and {dt}")
        M, Qh, A_c, Z = gdn_blocks.chunk_terms(q, k, v, g, beta, N * c)
    else:
        Q, K, G, Beta = (chunk(heads_first(x, N * c, dt)) for x in (q, k, g, beta))
        Vh = chunk(jnp.moveaxis(V, 1, 2))
        M, Qh, A_c, Kw = chunk_terms(Q, K, Vh, G, Beta)
        Z = common.ein("...cd,...cv->...dv", Kw, Vh)
    return M, Qh.astype(mdt), A_c.astype(mdt), Z.astype(mdt), V, Lam
