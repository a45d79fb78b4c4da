"""First-order gated linear attention on Hopper: Pallas Mosaic GPU kernels (wgmma, TMA), on the
shared helpers of ``kernels/mosaic_gpu.py``.

``LA(q, k, v; g)_t = Σ_{s≤t} D(t,s) (q_t·k_s) v_s + D(t,−1) q_tᵀ H0``, per chunk of ``C = 64``
tokens with the local cumulative log-decay ``b`` (``ρ = exp(b)``, ``ρ_c = ρ`` at the chunk end,
``γ = ρ_c / ρ``, ``Γ[t,s] = ρ_t / ρ_s`` for ``s ≤ t``) and the incoming state ``S``:

    O  = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V                 S ← ρ_c S + (γ∘K)ᵀ V
    dQ = diag(ρ) dO Sᵀ + ((dO Vᵀ) ∘ Γ) K               (the same forward walk)
    dS ← ρ_c dS + (ρ∘Q)ᵀ dO                            (in reverse; dS: the outgoing S's cotangent)
    dK = diag(γ) V dSᵀ + ((V dOᵀ) ∘ Γᵀ) Q             dV = diag(γ) K dS + ((K Qᵀ) ∘ Γᵀ) dO

Every kernel is one ``walk``: one CTA per (batch, head, 64 value columns) over the chunks in
order (or in reverse), the transposed state ``Sᵀ: [64, d]`` float32 in registers as a wgmma
accumulator, the next chunk's tiles double-buffered by TMA, and per chunk a readout of a 16-bit
copy of the state (``mode``): the outputs ``O``, the query gradient ``dQ``, or, walking the state
cotangent back with ``q, dO`` in the roles of ``k, v``, the key and value gradients.  So no
per-chunk state ever goes to memory.  The state update takes its left operand from registers
(``(γ∘V)ᵀ``), so only the readout reads the state from shared memory.

The gate's gradient needs no state product: with ``G`` the global cumulative log-decay,
``o`` depends on ``G`` only through ``e^{G_t} q_t`` and ``e^{−G_s} k_s`` (and ``H_T`` through
``e^{G_{T−1}}``), so ``∂L/∂G_t = q_t·dq_t − k_t·dk_t (+ ⟨H_T, dH_T⟩ at the last token)``.

A few long sequences leave most of the GPU idle (``mosaic_gpu.pieces``): each is cut into ``P`` pieces that
walk in parallel from their own initial states, found by a state-only walk per piece and the
scan ``S_{p+1} = ρ_p S_p + E_p`` over pieces (``ρ_p`` the piece's total decay), and the same
for the cotangent in reverse.

Inputs are 16-bit (``wgmma`` takes float32 only as TF32 from shared memory and without
transposes, which this dataflow needs): ``q, k: [B,Tp,H,d]`` with ``d ∈ {64, 128}``,
``v: [B,Tp,H,dv]`` with ``dv`` a multiple of 64, ``Tp`` a multiple of 64; ``b: [B,H,Tp]`` float32
(finite: the caller floors the log-decays).  Decays run in log2 units (``exp2``).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.mosaic_gpu import (
    BV,
    COLS,
    F32,
    LOG2E,
    ROWS,
    WGMMA,
    C,
    await_tiles,
    bcast_cols,
    bcast_rows,
    build,
    causal_decay,
    piece_starts,
    pieces,
    products,
    smem_tile,
    split_pieces,
    store_state,
)


def walk(key, val, b2, s0, extra=(), *, mode, reverse=False, interpret=None):
    """One walk ``Sᵀ ← ρ_c Sᵀ + (w∘V)ᵀ K`` per (batch, head, 64-column value tile) with a
    per-chunk readout (module docstring); ``w = γ`` forward, ``w = ρ`` in reverse.

    ``key [B,Tp,H,d]`` and ``val [B,Tp,H,dv]`` drive the update (``k, v``; in reverse ``q, dO``),
    ``b2 [B,H,Tp]`` is the local cumulative log2-decay, ``s0 [B,H,dv,d]`` float32 the transposed
    state the walk starts from.  ``mode``: "state" (no readout), "out" (``extra = (q,)``:
    ``O [B,Tp,H,dv]``), "dq" (``extra = (dO, q)``: ``dQ [nv,B,Tp,H,d]``, one share per value
    tile, and ``Σ_d q∘dQ_inter [nv,B,H,Tp]``), "dkv" (reverse, ``extra = (k, v)``:
    ``dK [nv,B,Tp,H,d]``, ``dV [B,Tp,H,dv]`` and ``Σ_d k∘dK_inter [nv,B,H,Tp]``), all float32;
    ``_inter``: the part read from the state (``_core_bwd`` needs it for the gate).
    Returns ``(*readouts, final [B,H,dv,d])``, ``final`` the state after the walk.
    """
    B, Tp, H, d = key.shape
    dv, dt, N, nv = val.shape[-1], key.dtype, Tp // C, val.shape[-1] // BV
    _mm, _ = products(interpret)
    vec = plgpu.SMEM((2, C), F32)
    tile = {"k": (2, C, d), "v": (2, C, BV)}
    extras = {"state": "", "out": "k", "dq": "vk", "dkv": "kv"}[mode]  # extra tiles' widths
    outs = {"state": [], "out": [(C, BV)], "dq": [(C, d), (C,)],
            "dkv": [(C, d), (C, BV), (C,)]}[mode]
    out_type = {"state": [], "out": [(B, Tp, H, dv)], "dq": [(nv, B, Tp, H, d), (nv, B, H, Tp)],
                "dkv": [(nv, B, Tp, H, d), (B, Tp, H, dv), (nv, B, H, Tp)]}[mode]
    scratch = dict(
        key_s=smem_tile(tile["k"], dt), val_s=smem_tile(tile["v"], dt), b_c=vec, b_r=vec,
        x_s=[smem_tile(tile[w], dt) for w in extras], s_pub=smem_tile((BV, d), dt),
        # the state is loaded and stored only before and after the walk: it shares the staging
        io=plgpu.RefUnion([plgpu.SMEM((BV, d), F32)], [plgpu.SMEM(o, F32) for o in outs]),
        in_bar=plgpu.Barrier(num_arrivals=4 + len(extras), num_barriers=2), s_bar=plgpu.Barrier())

    def body(*refs, key_s, val_s, b_c, b_r, x_s, s_pub, io, in_bar, s_bar):
        (s_io,), stage = io
        key_ref, val_ref, b_ref, s0_ref, *refs = refs
        x_refs, (*o_refs, final_ref) = refs[:len(extras)], refs[len(extras):]
        bi, hi, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(iv * BV, BV)

        def chunk(i):
            return N - 1 - i if reverse else i

        def issue(i, slot):
            rows, bar = pl.ds(chunk(i) * C, C), in_bar.at[slot]
            plgpu.copy_gmem_to_smem(key_ref.at[bi, rows, hi], key_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(val_ref.at[bi, rows, hi, cols], val_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_c.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_r.at[slot], bar)
            for w, ref, buf in zip(extras, x_refs, x_s):
                src = ref.at[bi, rows, hi] if w == "k" else ref.at[bi, rows, hi, cols]
                plgpu.copy_gmem_to_smem(src, buf.at[slot], bar)

        issue(0, 0)
        plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi, cols], s_io, s_bar)
        plgpu.barrier_wait(s_bar)
        s_init = plgpu.load(s_io, layout=WGMMA)

        def readout(slot, b_row, b_col):
            """This chunk's readout tiles from ``s_pub`` (the 16-bit state) and the slot."""
            x = [buf.at[slot] for buf in x_s]
            rho = bcast_rows(jnp.exp2(b_row), (C, d if mode != "out" else BV))
            if mode == "out":    # diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V
                (q,) = x
                p = _mm(q, key_s.at[slot].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                o = _mm(q, s_pub.T, (C, BV)) * rho
                return [_mm(p.astype(dt), val_s.at[slot], (C, BV), init=o)]
            if mode == "dq":     # diag(ρ) dO Sᵀ + ((dO Vᵀ) ∘ Γ) K
                do, q = x
                ds = _mm(do, val_s.at[slot].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                dq = _mm(do, s_pub, (C, d)) * rho
                inter = (dq * plgpu.load(q, layout=WGMMA).astype(F32)).sum(1)
                return [_mm(ds.astype(dt), key_s.at[slot], (C, d), init=dq), inter]
            k, v = x             # dK, dV from the cotangent dS (key_s = Q, val_s = dO)
            gam = jnp.exp2(b_r[slot, C - 1] - b_row)
            dst = _mm(v, val_s.at[slot].T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
            dk = _mm(v, s_pub, (C, d)) * bcast_rows(gam, (C, d))
            inter = (dk * plgpu.load(k, layout=WGMMA).astype(F32)).sum(1)
            dk = _mm(dst.astype(dt), key_s.at[slot], (C, d), init=dk)
            pt = _mm(k, key_s.at[slot].T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
            dv_ = _mm(k, s_pub.T, (C, BV)) * bcast_rows(gam, (C, BV))
            return [dk, _mm(pt.astype(dt), val_s.at[slot], (C, BV), init=dv_), inter]

        def step(i, s_t):
            slot, n = lax.rem(i, 2), chunk(i)
            rows = pl.ds(n * C, C)
            await_tiles(in_bar, slot, i, N, issue)
            b_last = b_c[slot, C - 1]
            b_col = plgpu.load(b_c.at[slot], layout=COLS)
            if outs:
                s_pub[...] = s_t.astype(dt)
                plgpu.commit_smem()
                tiles = readout(slot, plgpu.load(b_r.at[slot], layout=ROWS), b_col)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's stores
                for buf, x in zip(stage, tiles):
                    buf[...] = x
                plgpu.commit_smem()
                dsts = {"out": lambda: [o_refs[0].at[bi, rows, hi, cols]],
                        "dq": lambda: [o_refs[0].at[iv, bi, rows, hi],
                                       o_refs[1].at[iv, bi, hi, rows]],
                        "dkv": lambda: [o_refs[0].at[iv, bi, rows, hi],
                                        o_refs[1].at[bi, rows, hi, cols],
                                        o_refs[2].at[iv, bi, hi, rows]]}[mode]()
                for buf, dst in zip(stage, dsts):
                    plgpu.copy_smem_to_gmem(buf, dst, commit_group=False)
                plgpu.commit_smem_to_gmem_group()
            w = jnp.exp2(b_col) if reverse else jnp.exp2(b_last - b_col)  # ρ or γ, per token
            vw = plgpu.load(val_s.at[slot].T, layout=WGMMA).astype(F32)
            vw = (vw * bcast_cols(w, (BV, C))).astype(dt)
            return _mm(vw, key_s.at[slot], (BV, d), init=s_t * jnp.exp2(b_last))

        s_t = lax.fori_loop(0, N, step, s_init)
        plgpu.wait_smem_to_gmem(0)
        store_state(s_t, s_io, final_ref.at[bi, hi, cols])

    out_type = [jax.ShapeDtypeStruct(s, F32) for s in out_type + [(B, H, dv, d)]]
    name = f"la_walk_{mode}" + "_rev" * reverse
    return build(body, out_type, scratch, (B, H, nv), ("b", "h", "v"), interpret, name)(
        key, val, b2, s0, *extra)


def _split_gates(b2, P):
    """``b2 [B,H,Tp]`` -> ``[B·P,H,Tp/P]`` (``split_pieces``' rows, heads first)."""
    B, H, Tp = b2.shape
    return jnp.transpose(b2.reshape(B, H, P, Tp // P), (0, 2, 1, 3)).reshape(B * P, H, Tp // P)


def _walk_pieces(key, val, b2, s0, extra, *, mode, reverse, interpret):
    """``walk`` on sequences cut into ``pieces``: a state-only walk per piece from zero, the
    scan of ``piece_starts``, then the real walk per piece from its start; returns ``walk``'s
    readouts and the state after the whole sequence (in reverse: before it)."""
    B, Tp, H, d = key.shape
    P = pieces(B, H, val.shape[-1], Tp // C)
    run = functools.partial(walk, mode=mode, reverse=reverse, interpret=interpret)
    if P == 1:
        return run(key, val, b2, s0, extra)
    tok = [split_pieces(x, P) for x in (key, val, *extra)]
    b2p = _split_gates(b2, P)
    (local,) = walk(tok[0], tok[1], b2p, jnp.zeros((B * P,) + s0.shape[1:], F32), mode="state",
                    reverse=reverse, interpret=interpret)
    decay = jnp.exp2(b2p[..., C - 1::C].sum(-1)).reshape(B, P, H)
    starts = piece_starts(local.reshape((B, P) + s0.shape[1:]), s0,
                          lambda p, s: decay[:, p, :, None, None] * s, reverse)
    *res, finals = run(tok[0], tok[1], b2p, starts.reshape((B * P,) + s0.shape[1:]), tok[2:])
    finals = finals.reshape((B, P) + s0.shape[1:])[:, 0 if reverse else P - 1]
    def merge(x, per_token_sums):  # [nv, B·P, H, Tp/P], else tiles [(nv,) B·P, Tp/P, H, ·]
        if not per_token_sums:
            return x.reshape(x.shape[:-4] + (B, Tp) + x.shape[-2:])
        x = x.reshape(x.shape[:-3] + (B, P, H, Tp // P))
        return jnp.swapaxes(x, -3, -2).reshape(x.shape[:-4] + (B, H, Tp))

    return [merge(x, mode in ("dq", "dkv") and i == len(res) - 1)   # their sums come last
            for i, x in enumerate(res)] + [finals]


def _t(x):
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def core(q, k, v, b, h0, interpret=None):
    """``(O [B,Tp,H,dv], H_T [B,H,d,dv])`` float32 of LA on padded inputs (module docstring):
    ``b [B,H,Tp]`` the chunk-local cumulative natural-log decay, ``h0 [B,H,d,dv]`` float32."""
    o, final = _walk_pieces(k, v, b * LOG2E, _t(h0), (q,), mode="out", reverse=False,
                            interpret=interpret)
    return o, _t(final)


def _core_fwd(q, k, v, b, h0, interpret):
    o, hT = core(q, k, v, b, h0, interpret)
    return (o, hT), (q, k, v, b, h0, hT)


def _core_bwd(interpret, res, cts):
    """``dq`` from a forward walk, ``dk, dv, dh0`` from the reverse one, and ``db``: with
    ``X_n = ⟨S_{n+1}, dS_{n+1}⟩`` at the end of chunk ``n`` (``X_{N−1} = ⟨H_T, dH_T⟩``,
    ``X_{n−1} = X_n + Σ_{t∈n} (q·dq_inter − k·dk_inter)_t``, the inter-chunk parts the walks sum),
    ``db_t = q_t·dq_t − k_t·dk_t``, plus ``X_n`` at each chunk's last token."""
    q, k, v, b, h0, hT = res
    do, dhT = cts
    do, b2 = do.astype(q.dtype), b * LOG2E
    dq, qdq, _ = _walk_pieces(k, v, b2, _t(h0), (do, q), mode="dq", reverse=False,
                              interpret=interpret)
    dk, dv, kdk, dh0 = _walk_pieces(q, do, b2, _t(dhT), (k, v), mode="dkv", reverse=True,
                                    interpret=interpret)
    dq, dk = dq.sum(0), dk.sum(0)
    B, H, Tp = b.shape
    inter = (qdq.sum(0) - kdk.sum(0)).reshape(B, H, Tp // C, C).sum(-1)      # [B,H,N]
    X = jnp.sum(hT * dhT, (-2, -1))[..., None] + jnp.cumsum(inter[..., ::-1], -1)[..., ::-1] - inter
    db = jnp.transpose(jnp.sum(dq * q.astype(F32) - dk * k.astype(F32), -1), (0, 2, 1))
    db = db.reshape(B, H, Tp // C, C).at[..., -1].add(X).reshape(B, H, Tp)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db, _t(dh0))


core.defvjp(_core_fwd, _core_bwd)
