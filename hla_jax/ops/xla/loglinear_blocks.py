"""The block form of log-linear Mamba-2 (docs/math.md#loglinear) on the grid of positions: every level at
once,
no scan over chunks.

Chunk ``n' < n`` is at level ``lc + 1 + j`` (``c = 2^lc``), ``j = bit_length(n XOR n') − 1``:
``n'`` lies in the left half and ``n`` in the right half of the aligned block of ``2^(j+1)``
chunks that holds both.  So chunk level ``j`` is "the left half writes, the right half reads".
With ``m`` the left half's last token and its state

    H_j = Σ_{s ∈ left} D(m, s) k_s v_sᵀ                                    [d, dv] per block

a token ``t`` of the right half reads ``λ_t^{lc+1+j} D(t, m) q_tᵀ H_j``.  Each level is two
batched matmuls over half the tokens (one contracts the left half, one broadcasts ``H_j`` over
the right half), the levels are independent, and inside a chunk levels ``0..lc`` are a masked
attention ``(Λ ∘ (QKᵀ) ∘ Γ) V``.  O(T·c·d + T·d·dv·log(T/c)) work, all of it matmuls;
autodiff gives the backward.  The decays ``D(m, s)`` and ``D(t, m)`` are cumulative sums inside
one half (never differences of long sums), so a reset ``g = −∞`` just zeroes what crosses it.
The halves and the per-token weights ``D(m, s)``, ``λ_t^{lc+1+j} D(t, m)`` are
``core.block_levels``' (the kernels use them too).

16-bit inputs run the matmuls on 16-bit operands with float32 accumulation, forward and backward
(``dot16``: the cotangent is rounded to the operands' dtype, as the kernels do); the states,
decays and outputs are float32.  Shapes as in ``ops.families.loglinear``; ``T`` is zero-padded to chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.block_levels import halves, token_weights
from hla_jax.core.layout import heads_first
from hla_jax.core.state import state_dtype
from hla_jax.ops import common
from hla_jax.ops.xla.la_chunked import decays

F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dot16(spec: str, a, b):
    """``einsum(spec, a, b)`` accumulated in float32; the backward's products take the
    cotangent in the operands' dtype (for 16-bit operands: 16-bit matmuls both ways)."""
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def _dot16_fwd(spec, a, b):
    return dot16(spec, a, b), (a, b)


def _dot16_bwd(spec, res, ct):
    """``da = einsum(out,b->a)``, ``db = einsum(a,out->b)``: every index of an operand is in the
    other operand or the output (true of the products here)."""
    a, b = res
    (sa, sb), so = spec.split("->")[0].split(","), spec.split("->")[1]
    ct = ct.astype(a.dtype)
    return (dot16(f"{so},{sb}->{sa}", ct, b).astype(a.dtype),
            dot16(f"{sa},{so}->{sb}", a, ct).astype(b.dtype))


dot16.defvjp(_dot16_fwd, _dot16_bwd)


def _intra(Q, K, V, G, Lam, lc: int, dot):
    """Levels ``0..lc`` inside each chunk: ``(Λ ∘ (QKᵀ) ∘ Γ) V`` with ``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}``
    from the static table (``Q, K: [B,H,N,c,d]``, ``G: [B,H,N,c]``, ``Lam: [B,H,N,c,L]``)."""
    lam = fenwick.at_table(Lam, fenwick.level_table(1 << lc))
    P = dot("...td,...sd->...ts", Q, K) * decays(G)[0] * lam
    return dot("...ts,...sv->...tv", P.astype(V.dtype), V)


def _levels(Q, K, V, LW, N: int, dot):
    """The chunk levels (module docstring): per level the left halves' states
    ``H_j = (LW_j ∘ K)ᵀ V`` and the right halves' reads ``(LW_j ∘ Q) H_j``; ``[B,H,Tp,dv]``."""
    B, H, Tp = Q.shape[:3]
    out = 0.0
    for j in range(LW.shape[2]):
        span = (Tp // N) << j
        Qh, Kh, Vh, Wh = (halves(x, span) for x in (Q, K, V, LW[:, :, j]))
        Hj = dot("bhnsd,bhnse->bhnde", (Wh[:, :, :, 0, :, None] * Kh[:, :, :, 0]).astype(Q.dtype),
                 Vh[:, :, :, 0])
        Oj = dot("bhntd,bhnde->bhnte", (Wh[:, :, :, 1, :, None] * Qh[:, :, :, 1]).astype(Q.dtype),
                 Hj.astype(Q.dtype))
        out = out + jnp.stack([jnp.zeros_like(Oj), Oj], 3).reshape(B, H, -1, Oj.shape[-1])[:, :, :Tp]
    return out


def blocks(q, k, v, g, lam, chunk_size: int = 64):
    """Log-linear Mamba-2 ``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} D(t,s) (q_t·k_s) v_s`` in the block form
    (module docstring): ``q, k [B,T,H,d]``, ``v [B,T,H,dv]``, ``g [B,T,H]`` log-decays,
    ``lam [B,T,H,L ≥ fenwick.num_levels(T)]``, ``chunk_size`` a power of two -> ``[B,T,H,dv]``
    float32 (float64 for float64 inputs)."""
    B, T, H, _ = q.shape
    lc = fenwick.chunk_log2(chunk_size)
    c = chunk_size
    N = -(-T // c)
    low = all(jnp.dtype(x.dtype).itemsize < 4 for x in (q, k, v))
    mdt = q.dtype if low else state_dtype(q, k, v, g, lam)   # matmul operands
    sdt = F32 if low else mdt                                        # states, decays, outputs
    dot = dot16 if low else functools.partial(jnp.einsum, precision=common.HIGHEST)

    Q, K, V = (heads_first(x, N * c, mdt) for x in (q, k, v))
    G, Lam = heads_first(g, N * c, sdt), heads_first(lam, N * c, sdt)
    chunk = lambda x: x.reshape(x.shape[:2] + (N, c) + x.shape[3:])       # noqa: E731
    out = _intra(*(chunk(x) for x in (Q, K, V, G, Lam)), lc, dot).reshape(B, H, N * c, -1)
    out = out + _levels(Q, K, V, token_weights(G, Lam, lc, N), N, dot)
    return jnp.moveaxis(out, 1, 2)[:, :T].astype(sdt)
