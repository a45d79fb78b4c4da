"""First-order Gated DeltaNet on Hopper: the chunk walks of ``la_mgpu`` with a delta-rule value.

Per chunk of ``C = 64`` tokens (``b`` the local cumulative log-decay, ``ρ = exp(b)``,
``ρ_c`` its value at the chunk end, ``γ̄ = ρ_c/ρ``, ``Γ[t,s] = ρ_t/ρ_s`` for ``s ≤ t``), with the
UT transform's ``W = T(ρ∘K)`` and ``U = T V`` computed outside (``kernels/gdn.py``) and the
incoming state ``S: d×dv``:

    V' = U − W S                O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V'          S ← ρ_c S + (γ̄∘K)ᵀ V'

So a chunk is an LA chunk (``la_mgpu``) whose values ``V'`` are read from the state first: one
more matmul.  The backward, with ``V'`` kept from the forward:

    reverse walk (dS: the outgoing state's cotangent)
        dV' = ((K Qᵀ) ∘ Γᵀ) dO + diag(γ̄) K dS
        dK  = ((V' dOᵀ) ∘ Γᵀ) Q + diag(γ̄) V' dSᵀ
        dS ← ρ_c dS + (ρ∘Q)ᵀ dO − Wᵀ dV'
    forward walk (S recomputed as an LA state with values V')
        dQ = diag(ρ) dO Sᵀ + ((dO V'ᵀ) ∘ Γ) K          dW = −dV' Sᵀ

and ``dU = dV'`` (the reverse walk also writes ``−dV'`` in 16 bits: the forward walk's
operand).  Each walk is one CTA per (batch, head, 64 value columns) with the transposed state
``Sᵀ: [64, d]`` float32 in registers and the next chunk's tiles double-buffered by TMA, as in
``la_mgpu``; ``dQ``, ``dK`` and ``dW`` contract over the values, so each value tile writes its
share.  No sequence is cut into pieces (the transition is a matrix: ``la_mgpu.pieces`` needs a
scalar one).

Inputs: ``q, k, w: [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``, ``u, V', dO: [B,Tp,H,dv]`` with
``dv`` a multiple of 64, ``Tp`` a multiple of 64, ``b2 [B,H,Tp]`` the local log2-decay (finite),
states ``[B,H,dv,d]`` float32 (transposed).
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

# per mode: the tiles loaded per chunk ("d": [C,d] key-width, "v": [C,BV] value-width), the
# output tiles and whether the walk runs in reverse
TILES = {"out": "qkwu", "rev": "qkwov", "dq": "kvouq"}
WIDE = set("qkw")


def walk(b2, s0, tiles, *, mode, interpret=None):
    """One walk of ``mode`` (module docstring) over the chunks.

    ``tiles``: the inputs of ``TILES[mode]`` in order (``q, k, w`` key-width; ``u`` = U,
    ``v`` = V', ``o`` = dO value-width); ``s0 [B,H,dv,d]`` the transposed state it starts from
    (``rev``: the final state's cotangent).  Returns, with the state after the walk last:
    ``out``: ``O [B,Tp,H,dv]`` float32, ``V' [B,Tp,H,dv]`` 16-bit;
    ``rev``: ``dU = dV' [B,Tp,H,dv]``, ``dK [nv,B,Tp,H,d]``, ``Σ V'∘(diag(γ̄) K dS) [nv,B,H,Tp]``,
    ``−dV' [B,Tp,H,dv]`` 16-bit;
    ``dq`` (``u`` = ``−dV'``): ``dQ [nv,B,Tp,H,d]``, ``dW [nv,B,Tp,H,d]``, ``Σ_d q∘dQ_inter`` and ``Σ_d q∘dQ``
    ``[nv,B,H,Tp]`` (float32; ``nv`` value tiles; the sums per token are the gate's terms,
    ``kernels/gdn.py``).
    """
    by = dict(zip(TILES[mode], tiles))
    B, Tp, H, d = by["k"].shape
    dv, dt, N = next(by[n] for n in "uvo" if n in by).shape[-1], by["k"].dtype, Tp // C
    nv, reverse = dv // BV, mode == "rev"
    _mm = functools.partial(matmul, interpret=bool(interpret))
    names = TILES[mode]
    outs = {"out": [(C, BV)], "rev": [(C, BV), (C, d), (C,)], "dq": [(C, d), (C, d), (C,), (C,)]}[mode]
    sums = ((nv, B, H, Tp), F32)
    out_type = {"out": [((B, Tp, H, dv), F32), ((B, Tp, H, dv), dt)],
                "rev": [((B, Tp, H, dv), F32), ((nv, B, Tp, H, d), F32), sums, ((B, Tp, H, dv), dt)],
                "dq": [((nv, B, Tp, H, d), F32), ((nv, B, Tp, H, d), F32), sums, sums]}[mode]
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(
        x_s=[smem_tile((2, C, d if n in WIDE else BV), dt) for n in names], b_c=vec, b_r=vec,
        s_pub=smem_tile((BV, d), dt), v16=smem_tile((C, BV), dt),
        io=plgpu.RefUnion([plgpu.SMEM((BV, d), F32)], [plgpu.SMEM(o, F32) for o in outs]),
        in_bar=plgpu.Barrier(num_arrivals=2 + len(names), num_barriers=2), s_bar=plgpu.Barrier())

    def body(b_ref, s0_ref, *refs, x_s, b_c, b_r, s_pub, v16, io, in_bar, s_bar):
        (s_io,), stage = io
        x_refs, (*o_refs, final_ref) = refs[:len(names)], refs[len(names):]
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
            s_pub[...] = s_t.astype(dt)
            plgpu.commit_smem()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's stores
            if mode == "out":
                vn = (plgpu.load(t["u"], layout=WGMMA).astype(F32)
                      - _mm(t["w"], s_pub.T, (C, BV)))                      # V' = U − W S
                v16[...] = vn.astype(dt)
                p = _mm(t["q"], t["k"].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                o = _mm(t["q"], s_pub.T, (C, BV)) * bcast_rows(rho_r, (C, BV))
                plgpu.commit_smem()
                tiles = [_mm(p.astype(dt), v16, (C, BV), init=o)]
                dsts = [o_refs[0].at[bi, rows, hi, cols]]
                new_v = v16
            elif mode == "rev":   # s_t is dSᵀ of the chunk's outgoing state
                pt = _mm(t["k"], t["q"].T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
                kds = _mm(t["k"], s_pub.T, (C, BV)) * bcast_rows(gbar_r, (C, BV))
                dvn = _mm(pt.astype(dt), t["o"], (C, BV), init=kds)         # dV'
                v16[...] = (-dvn).astype(dt)
                vd = _mm(t["v"], t["o"].T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
                dk = _mm(t["v"], s_pub, (C, d)) * bcast_rows(gbar_r, (C, d))
                vkds = (plgpu.load(t["v"], layout=WGMMA).astype(F32) * kds).sum(1)
                tiles = [dvn, _mm(vd.astype(dt), t["q"], (C, d), init=dk), vkds]
                dsts = [o_refs[0].at[bi, rows, hi, cols], o_refs[1].at[iv, bi, rows, hi],
                        o_refs[2].at[iv, bi, hi, rows]]
                plgpu.commit_smem()
            else:                 # dq: s_t is Sᵀ, the values are V'
                ds = _mm(t["o"], t["v"].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                dq = _mm(t["o"], s_pub, (C, d)) * bcast_rows(rho_r, (C, d))
                q_dot = lambda x: (plgpu.load(t["q"], layout=WGMMA).astype(F32) * x).sum(1)  # noqa: E731
                qdq = q_dot(dq)
                dq = _mm(ds.astype(dt), t["k"], (C, d), init=dq)
                tiles = [dq, _mm(t["u"], s_pub, (C, d)), qdq, q_dot(dq)]    # dW = −dV' Sᵀ
                dsts = [o_refs[0].at[iv, bi, rows, hi], o_refs[1].at[iv, bi, rows, hi],
                        o_refs[2].at[iv, bi, hi, rows], o_refs[3].at[iv, bi, hi, rows]]
                new_v = t["v"]
            for buf, val in zip(stage, tiles):
                buf[...] = val
            plgpu.commit_smem()
            for buf, dst in zip(stage, dsts):
                plgpu.copy_smem_to_gmem(buf, dst, commit_group=False)
            if mode != "dq":     # V' (out) or −dV' (rev) in 16 bits
                plgpu.copy_smem_to_gmem(v16, o_refs[-1].at[bi, rows, hi, cols],
                                        commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            decayed = s_t * jnp.exp2(b_last)
            if mode == "rev":     # dSᵀ ← ρ_c dSᵀ + (ρ∘dO)ᵀ Q − dV'ᵀ W
                do_w = plgpu.load(t["o"].T, layout=WGMMA).astype(F32) * bcast_cols(
                    jnp.exp2(b_col), (BV, C))
                s_t = _mm(do_w.astype(dt), t["q"], (BV, d), init=decayed)
                neg = plgpu.load(v16.T, layout=WGMMA)
                return _mm(neg, t["w"], (BV, d), init=s_t)
            # Sᵀ ← ρ_c Sᵀ + (γ̄∘V')ᵀ K
            vw = plgpu.load(new_v.T, layout=WGMMA).astype(F32) * bcast_cols(
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
