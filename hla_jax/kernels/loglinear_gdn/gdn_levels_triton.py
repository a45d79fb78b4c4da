"""The output of log-linear Gated DeltaNet's block form (``ops.xla.loglinear_gdn_blocks``) for NVIDIA
GPUs, the window inside each chunk and the reads of the chunk levels, forward, and the reads'
backward: ``pallas_call`` lowered through Triton.

Level ``i``'s nodes ``(Π_i [B,H,n_i,d,d], Z_i [B,H,n_i,d,dv])`` are the up-sweep's
(``gdn_sweep_triton``; level 0 the chunks', ``n_i = ⌈N/2^i⌉``); chunk ``n`` lies in the right half of
pair ``m = n >> (i+1)`` when bit ``i`` of ``n`` is set, and then reads its left node ``2m``.

Forward, one program per (batch, head, chunk) of ``c = 2^lc`` tokens: the window
``o = (Λ ∘ M) V`` over the chunk's own keys (``Λ[τ,σ] = λ_τ^{ℓ(τ,σ)}``, levels ``0..lc``;
``Λ ∘ M`` rounded to ``V``'s dtype, float32 accumulation), then the chunk's tokens carry their
running query ``r`` (first ``Q̂``) up the levels, at each level ``i`` where bit ``i`` is set

    o += λ_{lc+1+i} ∘ (r Z_i),      r ← r Π_i

(products accumulated in float32, ``r`` rounded back to ``Q̂``'s dtype), so ``r`` and ``o`` stay
on chip, and ``o`` is written tokens first.  With ``save`` it also writes the ``r`` each level
read, packed: level ``i``'s right halves hold ``⌊N/2⌋`` chunks, chunk ``n`` at ``n`` without its
bit ``i`` (``_packed``), so a pair's right half is one contiguous run.  (The window's backward is
XLA's: ``gdn_blocks``.)

Backward, one launch per level from the top, one program per (batch, head, pair, run of at most
``RUN`` chunks of its right half): with ``δ`` the cotangent of the query after level ``i``
(carried between launches in ``Q̂``'s dtype, updated in place),

    X = ∂o Z_iᵀ,   ∂λ_{lc+1+i} = rowsum(r ∘ X),   ∂Z_i ⊇ (λ ∘ r)ᵀ ∂o,   ∂Π_i ⊇ rᵀ δ,
    then  δ ← δ Π_iᵀ + λ ∘ X

(``∂o`` in ``Q̂``'s dtype; the node sums over the run on chip).  With one run a pair
(``2^i ≤ RUN``) the program then takes the pair's up-sweep backward too
(``gdn_sweep_triton.pair_backward``), so the node sums never leave the chip; with more, the runs of a
pair are summed by XLA and ``gdn_sweep_triton.backward`` follows.  ``∂Q̂`` is ``δ`` after level 0.
Left-half tokens pass ``δ`` through untouched.

Layouts: ``M [B,H,Tp,c]`` float32, ``V [B,Tp,H,dv]``, ``Q̂ [B,H,Tp,d]``, ``λ [B,H,Tp,L]`` float32
(level ``ℓ``'s weights in column ``ℓ``), ``o [B,Tp,H,dv]`` float32, ``∂o [B,H,Tp,dv]``, the saved
queries ``[B,H,P,⌊N/2⌋c,d]``; ``d``, ``dv`` and ``c`` powers of two ≥ 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hla_jax.kernels.la.la_chunk import F32, dot
from hla_jax.kernels.loglinear.loglinear_chunk import level_table, level_weights
from hla_jax.kernels.loglinear_gdn import gdn_sweep_triton
from hla_jax.kernels.triton import compiler_params

RUN = 16  # the most chunks of a right half one backward program sums over


def _packed(n, i):
    """Chunk ``n``'s index among level ``i``'s right-half chunks: ``n`` with bit ``i`` removed."""
    return ((n >> (i + 1)) << i) | (n & ((1 << i) - 1))


@functools.partial(jax.jit, static_argnames=("lc", "save", "interpret"))
def forward(m, v, qh, pis, zs, lam, *, lc, save=False, interpret=False):
    """``o [B,Tp,H,dv]`` float32, the window and the reads, and with ``save`` the queries each
    level read ``[B,H,P,⌊N/2⌋c,d]`` (module docstring): ``m [B,H,Tp,c]``, ``v [B,Tp,H,dv]``,
    ``lam [B,H,Tp,L]``; ``pis``, ``zs``: level ``i``'s nodes at ``[i]`` (none for one chunk)."""
    B, H, Tp, d = qh.shape
    c, P, dv = 1 << lc, len(pis), v.shape[-1]
    acc = jnp.result_type(F32, qh.dtype)

    def kernel(m_ref, v_ref, qh_ref, *refs):
        pi_refs, z_refs, (lam_ref, o_ref, *r_ref) = refs[:P], refs[P:2 * P], refs[2 * P:]
        b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        lams = [lam_ref[b, h, ts, ell] for ell in range(min(lc + 1, lam.shape[-1]))]
        Lam = level_weights(lams, level_table(c))
        window = dot((Lam * m_ref[b, h, ts, :]).astype(v.dtype), v_ref[b, ts, h, :])

        def level(i, carry):
            r, o = carry
            node = 2 * (n >> (i + 1))
            if save:
                r_ref[0][b, h, i, pl.ds(pl.multiple_of(_packed(n, i) * c, c), c), :] = r
            o = o + lam_ref[b, h, ts, lc + 1 + i][:, None] * dot(r, z_refs[i][b, h, node, :, :])
            return dot(r, pi_refs[i][b, h, node, :, :]).astype(r.dtype), o

        carry = (qh_ref[b, h, ts, :], window)
        for i in range(P):
            carry = lax.cond((n >> i) & 1 == 1, functools.partial(level, i), lambda x: x, carry)
        o_ref[b, ts, h, :] = carry[1]

    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, dv), acc)]
    if save:
        out_shape.append(jax.ShapeDtypeStruct((B, H, P, Tp // c // 2 * c, d), qh.dtype))
    params = compiler_params(4, interpret)
    out = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c), compiler_params=params,
                         interpret=interpret)(m, v, qh, *pis, *zs, lam)
    return tuple(out) if save else out[0]


def backward(r, pi, z, lam, do, delta, dlam, dpi2, dz2, *, i, lc, interpret=False):
    """Level ``i``'s backward (module docstring) and its up-sweep's (``gdn_sweep_triton``): from the
    saved queries ``r [B,H,P,⌊N/2⌋c,d]``, the level's nodes ``pi [B,H,n_i,d,d]``,
    ``z [B,H,n_i,d,dv]``, ``λ [B,H,Tp,L]``, ``do [B,H,Tp,dv]`` in ``r``'s dtype, ``δ [B,H,Tp,d]``
    after level ``i``, ``∂λ [B,H,Tp,L]`` and the combined nodes' cotangents ``dpi2, dz2``
    (``[B,H,⌈n_i/2⌉,…]``) -> ``(δ, ∂λ)`` with level ``i`` done (``∂λ``'s column ``lc + 1 + i``
    written; ``c = 2^lc``) and the level's nodes' ``(∂Π, ∂Z)`` in ``pi``'s dtype.  Runs of
    ``min(2^i, RUN)`` chunks: with one run a pair, its program ends with the pair's up-sweep
    backward (``gdn_sweep_triton.pair_backward``); with more, the runs' sums go through XLA's sum to
    ``gdn_sweep_triton.backward``."""
    run = min(1 << i, RUN)
    out = _backward(r, pi, z, lam, do, delta, dlam, dpi2, dz2, i=i, lc=lc, run=run,
                    interpret=interpret)
    if run == 1 << i:
        return out
    delta, dlam, dpil, dzl = out
    return (delta, dlam) + gdn_sweep_triton.backward(pi, z, dpi2, dz2, dpil, dzl, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("i", "lc", "run", "interpret"))
def _backward(r, pi, z, lam, do, delta, dlam, dpi2, dz2, *, i, lc, run, interpret):
    """``backward``'s kernel: ``(δ, ∂λ, ∂Π, ∂Z)``, the last two the level's nodes' (one run a
    pair) or else the left nodes' own, ``[B,H,⌈n_i/2⌉,…]`` (each run's float32 sums added by
    XLA)."""
    B, H, Tp, d = delta.shape
    c, col = 1 << lc, lc + 1 + i
    N, dv, half, pairs = Tp // c, z.shape[-1], 1 << i, -(-pi.shape[2] // 2)
    runs = half // run
    acc = jnp.result_type(F32, r.dtype)

    def kernel(r_ref, pi_ref, z_ref, lam_ref, do_ref, delta_in, dlam_in, dpi2_ref, dz2_ref,
               delta_ref, dlam_ref, dpi_ref, dz_ref):
        del delta_in, dlam_in                                 # aliased to delta_ref, dlam_ref
        b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        m, first = p // runs, (p % runs) * run
        Pi, Z = pi_ref[b, h, 2 * m, :, :], z_ref[b, h, 2 * m, :, :]

        def chunk(j, sums):
            ts = pl.ds(pl.multiple_of(((2 * m + 1) * half + first + j) * c, c), c)
            # the query saved for chunk (2m+1)·half + first + j at _packed's index for it
            ri = r_ref[b, h, i, pl.ds(pl.multiple_of((m * half + first + j) * c, c), c), :]
            g, dl = do_ref[b, h, ts, :], delta_ref[b, h, ts, :]
            lam_i = lam_ref[b, h, ts, col][:, None]
            X = dot(g, Z, tb=True)
            dlam_ref[b, h, ts, col] = jnp.sum(ri.astype(acc) * X, axis=1)
            delta_ref[b, h, ts, :] = (dot(dl, Pi, tb=True) + lam_i * X).astype(delta_ref.dtype)
            return (sums[0] + dot(ri, dl, ta=True),
                    sums[1] + dot((lam_i * ri).astype(r.dtype), g, ta=True))

        count = jnp.clip(N - (2 * m + 1) * half - first, 0, run)    # the run's chunks before N
        dpi, dz = lax.fori_loop(0, count, chunk, (jnp.zeros((d, d), acc), jnp.zeros((d, dv), acc)))
        if runs == 1:
            gdn_sweep_triton.pair_backward(pi_ref, z_ref, dpi2_ref, dz2_ref, dpi_ref, dz_ref, dpi, dz)
        else:
            dpi_ref[b, h, p, :, :] = dpi
            dz_ref[b, h, p, :, :] = dz

    sums = [(pi.shape[:2] + (pairs * runs,) + pi.shape[3:], acc),
            (z.shape[:2] + (pairs * runs,) + z.shape[3:], acc)]
    nodes = [(pi.shape, pi.dtype), (z.shape, z.dtype)]
    out_shape = [jax.ShapeDtypeStruct(delta.shape, delta.dtype),
                 jax.ShapeDtypeStruct(dlam.shape, dlam.dtype)] + [
        jax.ShapeDtypeStruct(*x) for x in (nodes if runs == 1 else sums)]
    params = None if interpret else plgpu.CompilerParams(num_warps=8, num_stages=2)  # loads ahead
    delta, dlam, dpi, dz = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, H, pairs * runs), compiler_params=params,
        interpret=interpret, input_output_aliases={5: 0, 6: 1})(
            r, pi, z, lam, do, delta, dlam, dpi2, dz2)
    if runs > 1:
        dpi, dz = (x.reshape(B, H, pairs, runs, *x.shape[3:]).sum(3).astype(pi.dtype)
                   for x in (dpi, dz))
    return delta, dlam, dpi, dz
