"""First-order Gated DeltaNet on Hopper: the chunk walks of ``la_mgpu`` with a delta-rule value.

Per chunk of ``C = 64`` tokens (``b`` the local cumulative log-decay, ``ρ = exp(b)``,
``ρ_c`` its value at the chunk end, ``γ̄ = ρ_c/ρ``, ``Γ[t,s] = ρ_t/ρ_s`` for ``s ≤ t``), with the
UT transform's ``W = T(ρ∘K)`` and ``U = T V`` computed outside (``kernels/gdn.py``) and the
incoming state ``S: d×dv``:

    V' = U − W S                O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V'          S ← ρ_c S + (γ̄∘K)ᵀ V'

So a chunk is an LA chunk (``la_mgpu``) whose values ``V'`` are read from the state first: one
more matmul.  The walks do only what needs the state in order; each also writes the state it
meets at every chunk in 16 bits (the forward ``Sᵀ`` coming in, the reverse ``dSᵀ``, the
cotangent of the state going out), so the rest of the backward is chunk-parallel
(``gdn_grads_mgpu.py``: ``dQ``, ``dK``'s walk part, ``dW = −dV' Sᵀ``):

    reverse walk    dV' = ((K Qᵀ) ∘ Γᵀ) dO + diag(γ̄) K dS,    dS ← ρ_c dS + (ρ∘Q)ᵀ dO − Wᵀ dV'

and ``−dV'`` in 16 bits (``dU = dV'``: the operand of the products and of the UT backward).  Each walk is one
CTA per (batch, head, 64 value columns) with the transposed state ``Sᵀ: [64, d]`` float32 in
registers and the next chunk's tiles double-buffered by TMA, as in ``la_mgpu``.  No sequence is
cut into pieces (the transition is a matrix: ``la_mgpu.pieces`` needs a scalar one).

Inputs: ``q, k, w: [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``, ``u, dO: [B,Tp,H,dv]`` with
``dv`` a multiple of 64, ``Tp`` a multiple of 64, ``b2 [B,H,Tp]`` the local log2-decay (finite),
states ``[B,H,dv,d]`` float32 (transposed), the per-chunk ones ``[B,H,N,dv,d]`` 16-bit.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.gpu.la_mgpu import (
    BV,
    COLS,
    F32,
    ROWS,
    WGMMA,
    C,
    bcast_cols,
    bcast_rows,
    build,
    causal_decay,
    matmul,
    smem_tile,
)

# per mode: the tiles loaded per chunk (q, k, w [C,d] key-width, the rest [C,BV] value-width)
TILES = {"out": "qkwu", "rev": "qkwo"}
WIDE = set("qkw")


def walk(b2, s0, tiles, *, mode, interpret=None):
    """One walk of ``mode`` (module docstring) over the chunks.

    ``tiles``: the inputs of ``TILES[mode]`` in order (``q, k, w`` key-width; ``u`` = U,
    ``o`` = dO value-width); ``s0 [B,H,dv,d]`` the transposed state it starts from (``rev``: the
    final state's cotangent).  Returns, with the state after the walk last:
    ``out``: ``O [B,Tp,H,dv]`` float32, ``V' [B,Tp,H,dv]`` 16-bit, ``Sᵀ`` entering each chunk;
    ``rev``: ``−dV' [B,Tp,H,dv]`` 16-bit, ``dSᵀ`` leaving each chunk (the per-chunk states
    ``[B,H,N,dv,d]`` 16-bit).
    """
    by = dict(zip(TILES[mode], tiles))
    B, Tp, H, d = by["k"].shape
    dv, dt, N = next(by[n] for n in "uo" if n in by).shape[-1], by["k"].dtype, Tp // C
    nv, reverse = dv // BV, mode == "rev"
    _mm = functools.partial(matmul, interpret=bool(interpret))
    names = TILES[mode]
    out_type = [((B, Tp, H, dv), F32)] * (not reverse) + [((B, Tp, H, dv), dt),
                                                          ((B, H, N, dv, d), dt)]
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(
        x_s=[smem_tile((2, C, d if n in WIDE else BV), dt) for n in names], b_c=vec, b_r=vec,
        s_pub=smem_tile((BV, d), dt), v16=smem_tile((C, BV), dt),
        io=plgpu.RefUnion([plgpu.SMEM((BV, d), F32)], [plgpu.SMEM((C, BV), F32)]),
        in_bar=plgpu.Barrier(num_arrivals=2 + len(names), num_barriers=2), s_bar=plgpu.Barrier())

    def body(b_ref, s0_ref, *refs, x_s, b_c, b_r, s_pub, v16, io, in_bar, s_bar):
        (s_io,), (stage,) = io
        x_refs, (*o_ref, v16_ref, s_ref, final_ref) = refs[:len(names)], refs[len(names):]
        bi, hi, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(iv * BV, BV)
        x = dict(zip(names, x_s))

        def chunk(i):
            return N - 1 - i if reverse else i

        def issue(i, slot):
            rows, bar = pl.ds(chunk(i) * C, C), in_bar.at[slot]
            for n, ref, buf in zip(names, x_refs, x_s):
                src = ref.at[bi, rows, hi] if n in WIDE else ref.at[bi, rows, hi, cols]
                plgpu.copy_gmem_to_smem(src, buf.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_c.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_r.at[slot], bar)

        issue(0, 0)
        plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi, cols], s_io, s_bar)
        plgpu.barrier_wait(s_bar)
        s_init = plgpu.load(s_io, layout=WGMMA)

        def step(i, s_t):
            slot, n = lax.rem(i, 2), chunk(i)
            rows = pl.ds(n * C, C)
            t = {k: buf.at[slot] for k, buf in x.items()}
            plgpu.barrier_wait(in_bar.at[slot])

            @pl.when(i + 1 < N)
            def _prefetch():
                plgpu.commit_smem()
                issue(i + 1, 1 - slot)

            b_last = b_c[slot, C - 1]
            b_row = plgpu.load(b_r.at[slot], layout=ROWS)
            b_col = plgpu.load(b_c.at[slot], layout=COLS)
            rho_r, gbar_r = jnp.exp2(b_row), jnp.exp2(b_last - b_row)   # ρ, γ̄ per row
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's stores
            s_pub[...] = s_t.astype(dt)
            plgpu.commit_smem()
            if mode == "out":
                vn = (plgpu.load(t["u"], layout=WGMMA).astype(F32)
                      - _mm(t["w"], s_pub.T, (C, BV)))                      # V' = U − W S
                v16[...] = vn.astype(dt)
                p = _mm(t["q"], t["k"].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                o = _mm(t["q"], s_pub.T, (C, BV)) * bcast_rows(rho_r, (C, BV))
                plgpu.commit_smem()
                out = _mm(p.astype(dt), v16, (C, BV), init=o)
            else:                 # s_t is dSᵀ of the chunk's outgoing state
                pt = _mm(t["k"], t["q"].T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
                kds = _mm(t["k"], s_pub.T, (C, BV)) * bcast_rows(gbar_r, (C, BV))
                out = _mm(pt.astype(dt), t["o"], (C, BV), init=kds)         # dV'
                v16[...] = (-out).astype(dt)
            stores = [(v16, v16_ref.at[bi, rows, hi, cols]),             # V' or −dV', 16 bits
                      (s_pub, s_ref.at[bi, hi, n, cols])]                # Sᵀ or dSᵀ, 16 bits
            if mode == "out":
                stage[...] = out
                stores.append((stage, o_ref[0].at[bi, rows, hi, cols]))  # O
            plgpu.commit_smem()
            for buf, dst in stores:
                plgpu.copy_smem_to_gmem(buf, dst, commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            decayed = s_t * jnp.exp2(b_last)
            if mode == "rev":     # dSᵀ ← ρ_c dSᵀ + (ρ∘dO)ᵀ Q − dV'ᵀ W
                do_w = plgpu.load(t["o"].T, layout=WGMMA).astype(F32) * bcast_cols(
                    jnp.exp2(b_col), (BV, C))
                s_t = _mm(do_w.astype(dt), t["q"], (BV, d), init=decayed)
                neg = plgpu.load(v16.T, layout=WGMMA)
                return _mm(neg, t["w"], (BV, d), init=s_t)
            # Sᵀ ← ρ_c Sᵀ + (γ̄∘V')ᵀ K
            vw = plgpu.load(v16.T, layout=WGMMA).astype(F32) * bcast_cols(
                jnp.exp2(b_last - b_col), (BV, C))
            return _mm(vw.astype(dt), t["k"], (BV, d), init=decayed)

        s_t = lax.fori_loop(0, N, step, s_init)
        plgpu.wait_smem_to_gmem(0)
        s_io[...] = s_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_io, final_ref.at[bi, hi, cols])
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(s, t) for s, t in out_type + [((B, H, dv, d), F32)]]
    return build(body, out_type, scratch, (B, H, nv), ("b", "h", "v"), interpret,
                 f"gdn_walk_{mode}")(b2, s0, *tiles)
