"""The kernel parts of log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``):
its per-chunk terms (``chunk_terms``) from the first-order kernel's UT transform and its backward
(``kernels/gpu/gdn_ut_mgpu.py``, Mosaic GPU) and one Triton program per chunk for the rest
(``kernels/gpu/gdn_terms.py``) instead of XLA's batched triangular solve and einsums
(``loglinear_chunked.chunk_terms``); and the chunk levels (``levels``: the
up-sweep a Triton program per pair of nodes, ``kernels/gpu/gdn_sweep.py``, and the reads' forward
one program per chunk carrying its running query up the levels, ``kernels/gpu/gdn_levels.py``)
instead of XLA's batched products and pass per level over every token.

Per chunk of ``C = 64`` tokens, with ``ρ = exp(b)`` (``b`` the chunk-local cumulative log-decay,
floored at ``wrap.LOG_DECAY_FLOOR``), ``Γ[τ,σ] = ρ_τ/ρ_σ`` (``τ ≥ σ``), ``K̃ = (ρ_c/ρ)∘K``::

    T = (I + strict_tril(diag(β)(K Kᵀ) ∘ Γ))⁻¹ diag(β),   W = T(ρ∘K),   U = T V    (gdn_ut_mgpu)
    P = (Q Kᵀ) ∘ Γ,   M = P T,   Q̂ = ρ∘Q − P W,   A_c = ρ_c I − K̃ᵀ W,   Z = K̃ᵀ U   (gdn_terms)

(as ``loglinear_chunked.delta_terms`` in XLA, whose autodiff is ``gdn_terms``' backward: a
Triton backward of its own, one program per chunk, was slower on the H200).  The UT
transform's backward is the first-order kernel's, handed ``T``'s own cotangent (from ``M``) to
add to the ``dT = dW (ρ∘K)ᵀ + dU Vᵀ`` it forms; it gives the UT transform's whole share of
``∂L/∂b``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.kernels import wrap
from hla_jax.kernels.gpu import gdn_levels, gdn_sweep, gdn_terms, gdn_ut_mgpu
from hla_jax.kernels.gpu.la_mgpu import F32, LOG2E, C
from hla_jax.kernels.la_chunk import decays
from hla_jax.ops import common
from hla_jax.ops.loglinear_blocks import dot16
from hla_jax.ops.loglinear_chunked import delta_terms


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def ut(k, v, b, beta, interpret):
    """``(W [B,Tp,H,d], U [B,Tp,H,dv]`` in ``k``'s dtype, ``T [B,H,Tp,C]`` float32: row ``τ``,
    its chunk's column ``σ``) from ``k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (``dv`` a multiple of 64),
    ``b, beta [B,H,Tp]`` float32."""
    return _ut_fwd(k, v, b, beta, interpret)[0]


def _ut_fwd(k, v, b, beta, interpret):
    b2 = b * LOG2E
    w, u, x = gdn_ut_mgpu.forward(k, v, b2, beta, interpret=interpret)
    B, H, Tp = b.shape
    t = (x.reshape(B, H, Tp // C, C, C) * beta.reshape(B, H, Tp // C, 1, C)).reshape(B, H, Tp, C)
    return (w, u, t), (k, v, b2, beta, x)


def _ut_bwd(interpret, res, cts):
    k, v, b2, beta, x = res
    dw, du, dt = cts
    dk, dv, dbeta, db = gdn_ut_mgpu.backward(k, v, b2, beta, x, dw, -du, dt_own=dt,
                                             interpret=interpret)
    return dk, dv, db, dbeta


ut.defvjp(_ut_fwd, _ut_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def delta(q, k, w, u, t, b, interpret):
    """``(M, Q̂, A_c, Z)`` from the UT transform's ``w, u, t`` (``kernels/gpu/gdn_terms.py``)."""
    return gdn_terms.forward(q, k, w, u, t, b, interpret=interpret)


def _delta_fwd(q, k, w, u, t, b, interpret):
    return delta(q, k, w, u, t, b, interpret), (q, k, w, u, t, b)


def _dot(spec, a, b):
    """``einsum(spec, a, b)``: ``dot16`` for two 16-bit operands (16-bit products both ways),
    else in float32 at the enclosing matmul precision."""
    if all(jnp.dtype(x.dtype).itemsize < 4 for x in (a, b)):
        return dot16(spec, a, b)
    return common.ein(spec, a.astype(F32), b.astype(F32))


def _delta_xla(q, k, w, u, t, b):
    """``gdn_terms.forward`` by XLA (``loglinear_chunked.delta_terms``), in its layouts; the
    products of two 16-bit operands (``QKᵀ``, ``K̃ᵀW``, ``K̃ᵀU``, ``K̃`` rounded to 16 bits)
    take 16-bit operands both ways, so the backward reads and writes 16-bit per-chunk terms."""
    B, Tp, H, d = q.shape
    N = Tp // C
    chunked = lambda x: jnp.moveaxis(x, 2, 1).reshape(B, H, N, C, -1)         # noqa: E731
    bb = b.reshape(B, H, N, C)
    Gam = jnp.vectorize(lambda x: decays(x)[3], signature="(c)->(c,c)")(bb)  # the kernel's Γ
    M, Qh, A_c, Kt = delta_terms(chunked(q), chunked(k), Gam, jnp.exp(bb),
                                 t.reshape(B, H, N, C, C), chunked(w), dot=_dot)
    Z = _dot("...cd,...cv->...dv", Kt, chunked(u))
    return (M.reshape(B, H, Tp, C), Qh.reshape(B, H, Tp, d).astype(q.dtype), A_c.astype(q.dtype),
            Z.astype(q.dtype))


def _delta_bwd(interpret, res, cts):
    """XLA's autodiff of ``_delta_xla`` (its unused forward products are dead code there)."""
    return jax.vjp(_delta_xla, *res)[1](cts)


delta.defvjp(_delta_fwd, _delta_bwd)


def chunk_terms(q, k, v, g, beta, Tp: int, interpret=None):
    """``(M [B,H,N,C,C]`` float32, ``Q̂ [B,H,N,C,d]``, ``A_c [B,H,N,d,d]``, ``Z [B,H,N,d,dv]`` in
    ``q``'s dtype) per chunk, heads first, for ``q, k [B,T,H,d]``, ``v [B,T,H,dv]``,
    ``g, beta [B,T,H]`` zero-padded to ``Tp`` tokens (a multiple of ``C``): the UT transform,
    then ``P``, ``M``, ``Q̂``, ``A_c``, ``Z`` (``kernels/gpu/gdn_terms.py``; their backward by
    XLA's autodiff of the same terms).  ``interpret=None``: the GPU and Triton interpreters on CPU
    (which also take float32 inputs)."""
    B, T, H, d = k.shape
    dv, N = v.shape[-1], Tp // C
    interpret = bool(jax.default_backend() == "cpu" if interpret is None else interpret)
    if not interpret and jnp.dtype(k.dtype).itemsize != 2:
        raise ValueError(f"gdn_blocks.chunk_terms: compiled, the kernels take 16-bit q, k, v "
                         f"(as kernels.gated_deltanet_pallas), got {k.dtype}")
    per_token = lambda x: jnp.swapaxes(jnp.pad(x.astype(F32), ((0, 0), (0, Tp - T), (0, 0))), 1, 2)
    G = jnp.maximum(per_token(g), wrap.LOG_DECAY_FLOOR).reshape(B, H, N, C)
    b = jnp.cumsum(G, -1).reshape(B, H, Tp)
    q, k, v = wrap.pad(q, Tp, d), wrap.pad(k, Tp, d), wrap.pad(v, Tp, -(-dv // 64) * 64)
    w, u, t = ut(k, v, b, per_token(beta), interpret)
    M, Qh, A_c, Z = delta(q, k, w, u, t, b, interpret)
    chunk = lambda x: x.reshape(B, H, N, C, -1)                                 # noqa: E731
    return chunk(M), chunk(Qh), A_c, Z[..., :dv]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sweep(pi, z, P, interpret):
    """The up-sweep's left nodes per level, ``[(Π_L, Z_L)]`` (``kernels/gpu/gdn_sweep.py``)."""
    return _sweep_fwd(pi, z, P, interpret)[0]


def _sweep_fwd(pi, z, P, interpret):
    nodes, left = [], []
    for i in range(P):
        nodes.append((pi, z))
        left.append((pi[:, :, 0::2], z[:, :, 0::2]))
        if i + 1 < P:
            pi, z = gdn_sweep.forward(pi, z, interpret=interpret)
    return left, nodes


def _sweep_bwd(P, interpret, nodes, dleft):
    """Down the levels: each level's nodes' cotangents from its combined nodes' (zero above the
    top) and its left nodes' own."""
    pi, z = nodes[-1]
    dpi = jnp.zeros(pi.shape[:2] + (-(-pi.shape[2] // 2),) + pi.shape[3:], pi.dtype)
    dz = jnp.zeros(z.shape[:2] + dpi.shape[2:3] + z.shape[3:], z.dtype)
    for (pi, z), (dpil, dzl) in zip(reversed(nodes), reversed(dleft)):
        dpi, dz = gdn_sweep.backward(pi, z, dpi, dz, dpil, dzl, interpret=interpret)
    return dpi, dz


_sweep.defvjp(_sweep_fwd, _sweep_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _read(qh, sweep, lam, c, xla, interpret):
    """The reads by the kernel (``kernels/gpu/gdn_levels.py``); differentiated, by ``xla``."""
    pis = jnp.concatenate([p for p, _ in sweep], 2)
    zs = jnp.concatenate([z for _, z in sweep], 2)
    offsets = tuple(int(o) for o in np.cumsum([0] + [p.shape[2] for p, _ in sweep[:-1]]))
    return gdn_levels.forward(qh, pis, zs, jnp.moveaxis(lam, -1, 2), offsets=offsets, c=c,
                              interpret=interpret)


def _read_fwd(qh, sweep, lam, c, xla, interpret):
    return jax.vjp(lambda *a: xla(*a, c), qh, sweep, lam)


def _read_bwd(c, xla, interpret, pull, do):
    return pull(do)


_read.defvjp(_read_fwd, _read_bwd)


def _widen(x, *widths):
    """``x`` zero-padded on its last ``len(widths)`` axes to ``widths``."""
    lead = [(0, 0)] * (x.ndim - len(widths))
    return jnp.pad(x, lead + [(0, w - n) for w, n in zip(widths, x.shape[x.ndim - len(widths):])])


def levels(qh, pi, z, lam, c: int, xla, interpret=None):
    """The chunk levels of ``ops.loglinear_gdn_blocks``: the up-sweep of the chunks' ``(Π, Z)``
    (one Triton program per pair and level, forward and backward), then the reads
    ``Σ_i λ_i ∘ (r_i Z_i)``, ``r_{i+1} = r_i Π_i`` over the levels ``i`` at which a token's chunk
    lies in a right half (one Triton program per chunk): ``qh [B,H,Tp,d]`` (``Tp = N c``),
    ``pi [B,H,N,d,d]``, ``z [B,H,N,d,dv]`` in ``qh``'s dtype, ``lam [B,H,Tp,P]`` float32 (level
    ``i``'s weight in column ``i``, ``P ≥ 1``) -> ``[B,H,Tp,dv]`` float32; ``d``, ``dv``
    zero-padded to powers of two ≥ 16.  The reads' gradient is ``xla(qh, sweep, lam, c)``'s,
    the same reads by XLA's pass per level, whose autodiff beat a backward kernel walking down
    the levels with the sums over right halves as batched matmuls (the levels' forward+backward
    11.58 against 12.98 ms at T=8192 on the H200, ``bench_gdn_blocks_parts_gpu_levels_bwd.json``).
    ``interpret=None``: the Triton interpreter on CPU."""
    interpret = bool(jax.default_backend() == "cpu" if interpret is None else interpret)
    d, dv = qh.shape[-1], z.shape[-1]
    dp, dvp = wrap.pow2_at_least(max(d, 16)), wrap.pow2_at_least(max(dv, 16))
    sweep = _sweep(_widen(pi, dp, dp), _widen(z, dp, dvp), lam.shape[-1], interpret)
    return _read(_widen(qh, dp), sweep, lam, c, xla, interpret)[..., :dv]
