"""First-order Gated DeltaNet on Hopper: the chunk walks of ``la_mgpu`` with a delta-rule value.

Per chunk of ``C = 64`` tokens (``b`` the local cumulative log-decay, ``ρ = exp(b)``,
``ρ_c`` its value at the chunk end, ``γ̄ = ρ_c/ρ``, ``Γ[t,s] = ρ_t/ρ_s`` for ``s ≤ t``), with the
UT transform's ``W = T(ρ∘K)`` and ``U = T V`` computed outside (``gdn_entry.py``) and the
incoming state ``S: d×dv``:

    V' = U − W S                O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V'          S ← ρ_c S + (γ̄∘K)ᵀ V'

So a chunk is an LA chunk (``la_mgpu``) whose values ``V'`` are read from the state first: one
more matmul.  The walks do only what needs the state in order; each also writes the state it
meets at every chunk in 16 bits (the forward ``Sᵀ`` coming in, the reverse ``dSᵀ``, the
cotangent of the state going out), so the rest of the backward is chunk-parallel
(``gdn_grads_mgpu.py``: ``dQ``, ``dK``'s walk part, ``dW = −dV' Sᵀ``):

    reverse walk    dV' = ((K Qᵀ) ∘ Γᵀ) dO + diag(γ̄) K dS,    dS ← ρ_c dS + (ρ∘Q)ᵀ dO − Wᵀ dV'

and ``−dV'`` in 16 bits (``dU = dV'``: the operand of the products and of the UT backward).
Each walk is one CTA per (batch, head, 64 value columns) with the transposed state
``Sᵀ: [64, d]`` float32 in registers and the next chunks' tiles double-buffered by TMA.  The
forward's CTA is warp-specialized (``_walk_out``: the state's chain, the outputs, the loads in
three warpgroups), the reverse one warpgroup as in ``la_mgpu``.

A sequence cut into pieces (``gdn_entry.py``) needs each piece's map ``S_end = M S_start + E``
(``M: d×d``, the transition is a matrix): the ``maps`` walk is the forward state's chain alone over
the values ``[0 | U]`` from the state ``[I | 0]``, one warpgroup, so its final states are
``[M | E]``; the reverse walk without ``keep`` (from a zero cotangent) gives each piece's own share
of ``dS_start`` and writes nothing else.

Inputs: ``q, k, w: [B,Tp,H,d]`` 16-bit with ``d ∈ {64, 128}``, ``u, dO: [B,Tp,H,dv]`` with
``dv`` a multiple of 64, ``Tp`` a multiple of 64, ``b2 [B,H,Tp]`` the local log2-decay (finite),
states ``[B,H,dv,d]`` float32 (transposed), the per-chunk ones ``[B,H,N,dv,d]`` 16-bit.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from hla_jax.kernels.mosaic_gpu import (
    BV,
    COLS,
    F32,
    ROWS,
    WGMMA,
    C,
    await_tiles,
    bcast_cols,
    bcast_rows,
    build,
    causal_decay,
    products,
    smem_tile,
    store_state,
)

MODES = ("out", "rev", "maps")


def walk(b2, s0, tiles, *, mode, keep=True, interpret=None):
    """One walk of ``mode`` (module docstring) over the chunks.

    ``tiles``: ``q, k, w`` (key-width) and ``u`` = U (``out``) or ``dO`` (``rev``), value-width
    (``maps``: ``k, w, u``); ``s0 [B,H,dv,d]`` the transposed state it starts from (``rev``: the
    final state's cotangent; ``maps``: ``None``, it starts from ``[I | 0]``).
    Returns, with the state after the walk last:
    ``out``: ``O [B,Tp,H,dv]`` float32, ``V' [B,Tp,H,dv]`` 16-bit, ``Sᵀ`` entering each chunk;
    ``rev``: ``−dV' [B,Tp,H,dv]`` 16-bit, ``dSᵀ`` leaving each chunk (the per-chunk states
    ``[B,H,N,dv,d]`` 16-bit); ``maps``: nothing but ``[Mᵀ; Eᵀ] [B,H,d+dv,d]``.  Without ``keep``
    ``V'`` (``dV'``) and the states are ``None``, not written.
    """
    if mode not in MODES:
        raise ValueError(f"gdn_walk_mgpu.walk: mode must be one of {MODES}, got {mode!r}")
    if mode == "maps":
        return _walk_maps(b2, *tiles, interpret=interpret)
    if mode == "rev":
        return _walk_rev(b2, s0, *tiles, keep=keep, interpret=interpret)
    return _walk_out(b2, s0, *tiles, keep=keep, interpret=interpret)


def _publish(s_t, u, w, s_pub, v16, mm, u_scale=None):
    """The forward chain's first half: ``Sᵀ`` (16-bit) and ``V' = U − W S`` published in shared
    memory (``s_pub``, ``v16``) from the chunk's ``U`` and ``W`` tiles (``u_scale``: ``U``'s
    factor)."""
    s_pub[...] = s_t.astype(s_pub.dtype)
    plgpu.commit_smem()
    u = plgpu.load(u, layout=WGMMA).astype(F32)
    vn = (u if u_scale is None else u * u_scale) - mm(w, s_pub.T, (C, BV))   # V' = U − W S
    v16[...] = vn.astype(v16.dtype)
    plgpu.commit_smem()


def _advance(s_t, v16, k, b, slot, mm):
    """The second: ``Sᵀ ← ρ_c Sᵀ + (γ̄∘V')ᵀ K`` from the published ``V'``, the chunk's ``K`` tile
    and its local log2-decays ``b[slot]``."""
    b_last = b[slot, C - 1]
    vw = plgpu.load(v16.T, layout=WGMMA).astype(F32) * bcast_cols(
        jnp.exp2(b_last - plgpu.load(b.at[slot], layout=COLS)), (BV, C))
    return mm(vw.astype(v16.dtype), k, s_t.shape, init=s_t * jnp.exp2(b_last))


def _walk_out(b2, s0, q, k, w, u, *, keep, interpret):
    """The forward walk, warp-specialized: one CTA per (batch, head, 64 value columns) runs three
    warpgroups over the chunks.  The state's (``state``) carries ``Sᵀ`` in registers and per chunk
    publishes its 16-bit copy and ``V' = U − W S`` in shared memory, stores both, and steps
    ``Sᵀ ← ρ_c Sᵀ + (γ̄∘V')ᵀ K``; the output's (``out``) forms ``(Q Kᵀ) ∘ Γ`` before the state
    arrives, then ``O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V'``; the memory's streams the tiles two chunks
    deep.  So the output's products leave the state's chain of dependent steps."""
    B, Tp, H, d = k.shape
    dv, dt, N = u.shape[-1], k.dtype, Tp // C
    _mm, _ = products(interpret)
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(
        q_s=smem_tile((2, C, d), dt), k_s=smem_tile((2, C, d), dt), w_s=smem_tile((2, C, d), dt),
        u_s=smem_tile((2, C, BV), dt), b_s=vec, b_r=vec, b_c=vec,
        s_pub=smem_tile((BV, d), dt), v16=smem_tile((C, BV), dt),
        s_io=plgpu.SMEM((BV, d), F32), o_s=plgpu.SMEM((C, BV), F32),
        in_bar=plgpu.Barrier(num_arrivals=7, num_barriers=2),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        s_ready=plgpu.Barrier(), s_free=plgpu.Barrier(), s_bar=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=3))

    def body(b_ref, s0_ref, q_ref, k_ref, w_ref, u_ref, o_ref, *outs,
             q_s, k_s, w_s, u_s, b_s, b_r, b_c, s_pub, v16, s_io, o_s, in_bar, in_free,
             s_ready, s_free, s_bar, done):
        *kept, final_ref = outs
        bi, hi, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        wg, cols = lax.axis_index("wg"), pl.ds(iv * BV, BV)

        def registers(n, action):
            if not interpret:
                plgpu.set_max_registers(n, action=action)

        @pl.when(wg == 2)
        def _memory():
            registers(40, "decrease")

            def issue(n, slot):
                rows, bar = pl.ds(n * C, C), in_bar.at[slot]
                for ref, buf in ((q_ref, q_s), (k_ref, k_s), (w_ref, w_s)):
                    plgpu.copy_gmem_to_smem(ref.at[bi, rows, hi], buf.at[slot], bar)
                plgpu.copy_gmem_to_smem(u_ref.at[bi, rows, hi, cols], u_s.at[slot], bar)
                for buf in (b_s, b_r, b_c):
                    plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], buf.at[slot], bar)

            for n in range(min(2, N)):
                issue(n, n)

            @pl.loop(2, max(N, 2))
            def _refill(n):
                slot = lax.rem(n, 2)
                plgpu.barrier_wait(in_free.at[slot])
                issue(n, slot)

            for n in range(max(N - 2, 0), N):   # observe the last releases
                plgpu.barrier_wait(in_free.at[n % 2])

        @pl.when(wg == 0)
        def _state():
            registers(232, "increase")
            plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi, cols], s_io, s_bar)
            plgpu.barrier_wait(s_bar)

            def step(n, s_t):
                slot, rows = lax.rem(n, 2), pl.ds(n * C, C)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(n >= 1)
                def _read():   # the output's warpgroup has read the last chunk's S and V'
                    plgpu.barrier_wait(s_free)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # and they were stored
                _publish(s_t, u_s.at[slot], w_s.at[slot], s_pub, v16, _mm)
                plgpu.barrier_arrive(s_ready)
                if keep:
                    vn_ref, s_ref = kept
                    plgpu.copy_smem_to_gmem(v16, vn_ref.at[bi, rows, hi, cols], commit_group=False)
                    plgpu.copy_smem_to_gmem(s_pub, s_ref.at[bi, hi, n, cols], commit_group=False)
                    plgpu.commit_smem_to_gmem_group()
                s_t = _advance(s_t, v16, k_s.at[slot], b_s, slot, _mm)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_t

            s_t = lax.fori_loop(0, N, step, plgpu.load(s_io, layout=WGMMA))
            plgpu.barrier_wait(s_free)
            store_state(s_t, s_io, final_ref.at[bi, hi, cols])

        @pl.when(wg == 1)
        def _out():
            registers(232, "increase")

            def step(n, carry):
                slot = lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                b_row = plgpu.load(b_r.at[slot], layout=ROWS)
                b_col = plgpu.load(b_c.at[slot], layout=COLS)
                p = _mm(q_s.at[slot], k_s.at[slot].T, (C, C)) * causal_decay(b_row, b_col, (C, C))
                plgpu.barrier_wait(s_ready)
                o = _mm(q_s.at[slot], s_pub.T, (C, BV)) * bcast_rows(jnp.exp2(b_row), (C, BV))
                o = _mm(p.astype(dt), v16, (C, BV), init=o)
                plgpu.barrier_arrive(s_free)
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's O was sent
                o_s[...] = o
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s, o_ref.at[bi, pl.ds(n * C, C), hi, cols])
                return carry

            lax.fori_loop(0, N, step, None)
            plgpu.wait_smem_to_gmem(0)

        plgpu.barrier_arrive(done)   # no warpgroup leaves while another still issues wgmma
        plgpu.barrier_wait(done)

    kept = [((B, Tp, H, dv), dt), ((B, H, N, dv, d), dt)] * keep
    out_type = [jax.ShapeDtypeStruct(s, t) for s, t in (
        [((B, Tp, H, dv), F32)] + kept + [((B, H, dv, d), F32)])]
    o, *kept, final = build(body, out_type, scratch, (B, H, dv // BV), ("b", "h", "v"), interpret,
                            "gdn_walk_out", num_threads=3, thread_name="wg")(b2, s0, q, k, w, u)
    vn, s = kept or (None, None)
    return o, vn, s, final


def _walk_maps(b2, k, w, u, *, interpret):
    """The pieces' maps, one warpgroup per (row, head, 64 columns of ``[I | 0]`` then of
    ``[0 | U]``): ``V' = U − W S`` (``U = 0`` on the identity's tiles, whose ``U`` tile is read and
    zeroed) and ``Sᵀ ← ρ_c Sᵀ + (γ̄∘V')ᵀ K``, the forward walk's chain step for step.  The float32
    state is staged before and after the walk in the tiles' memory, so two CTAs fit an SM (about
    105 KiB each): ``(d+dv)/64`` CTAs a row and head, twice the forward walk's."""
    B, Tp, H, d = k.shape
    dv, dt, N, ni = u.shape[-1], k.dtype, Tp // C, d // BV
    _mm, _ = products(interpret)
    s0 = jnp.concatenate([jnp.eye(d, dtype=F32), jnp.zeros((dv, d), F32)])[None, None]
    scratch = dict(
        io=plgpu.RefUnion([smem_tile((2, C, n), dt) for n in (d, d, BV)], plgpu.SMEM((BV, d), F32)),
        b_c=plgpu.SMEM((2, C), F32), s_pub=smem_tile((BV, d), dt), v16=smem_tile((C, BV), dt),
        in_bar=plgpu.Barrier(num_arrivals=4, num_barriers=2), s_bar=plgpu.Barrier())

    def body(b_ref, s0_ref, k_ref, w_ref, u_ref, final_ref, *, io, b_c, s_pub, v16, in_bar, s_bar):
        x_s, s_io = io
        bi, hi, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        u_cols = pl.ds(jnp.maximum(iv - ni, 0) * BV, BV)
        u_on = jnp.where(iv >= ni, 1.0, 0.0).astype(F32)

        def issue(n, slot):
            rows, bar = pl.ds(n * C, C), in_bar.at[slot]
            for src, buf in zip((k_ref.at[bi, rows, hi], w_ref.at[bi, rows, hi],
                                 u_ref.at[bi, rows, hi, u_cols]), x_s):
                plgpu.copy_gmem_to_smem(src, buf.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_c.at[slot], bar)

        plgpu.copy_gmem_to_smem(s0_ref.at[0, 0, pl.ds(iv * BV, BV)], s_io, s_bar)
        plgpu.barrier_wait(s_bar)
        s_init = plgpu.load(s_io, layout=WGMMA)
        plgpu.commit_smem()   # read before the tiles land where it was
        issue(0, 0)

        def step(n, s_t):
            slot = lax.rem(n, 2)
            k, w, u = (buf.at[slot] for buf in x_s)
            await_tiles(in_bar, slot, n, N, issue)
            _publish(s_t, u, w, s_pub, v16, _mm, u_scale=u_on)
            return _advance(s_t, v16, k, b_c, slot, _mm)

        s_t = lax.fori_loop(0, N, step, s_init)
        store_state(s_t, s_io, final_ref.at[bi, hi, pl.ds(iv * BV, BV)])

    out_type = [jax.ShapeDtypeStruct((B, H, d + dv, d), F32)]
    (maps,) = build(body, out_type, scratch, (B, H, ni + dv // BV), ("b", "h", "v"), interpret,
                    "gdn_walk_maps")(b2, s0, k, w, u)
    return maps


def _walk_rev(b2, s0, q, k, w, do, *, keep, interpret):
    """The reverse walk, one warpgroup: per chunk ``dV'`` from the outgoing state's cotangent,
    then ``dSᵀ ← ρ_c dSᵀ + (ρ∘dO)ᵀ Q − dV'ᵀ W``."""
    B, Tp, H, d = k.shape
    dv, dt, N = do.shape[-1], k.dtype, Tp // C
    _mm, _ = products(interpret)
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(
        x_s=[smem_tile((2, C, d if i < 3 else BV), dt) for i in range(4)], b_c=vec, b_r=vec,
        s_pub=smem_tile((BV, d), dt), v16=smem_tile((C, BV), dt), s_io=plgpu.SMEM((BV, d), F32),
        in_bar=plgpu.Barrier(num_arrivals=6, num_barriers=2), s_bar=plgpu.Barrier())

    def body(b_ref, s0_ref, q_ref, k_ref, w_ref, do_ref, *outs,
             x_s, b_c, b_r, s_pub, v16, s_io, in_bar, s_bar):
        *kept, final_ref = outs
        bi, hi, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        cols = pl.ds(iv * BV, BV)

        def issue(i, slot):
            rows, bar = pl.ds((N - 1 - i) * C, C), in_bar.at[slot]
            for ref, buf in zip((q_ref, k_ref, w_ref), x_s):
                plgpu.copy_gmem_to_smem(ref.at[bi, rows, hi], buf.at[slot], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi, cols], x_s[3].at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_c.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[bi, hi, rows], b_r.at[slot], bar)

        issue(0, 0)
        plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi, cols], s_io, s_bar)
        plgpu.barrier_wait(s_bar)

        def step(i, s_t):     # s_t is dSᵀ of the chunk's outgoing state
            slot, n = lax.rem(i, 2), N - 1 - i
            rows = pl.ds(n * C, C)
            q, k, w, o = (buf.at[slot] for buf in x_s)
            await_tiles(in_bar, slot, i, N, issue)
            b_last = b_c[slot, C - 1]
            b_row = plgpu.load(b_r.at[slot], layout=ROWS)
            b_col = plgpu.load(b_c.at[slot], layout=COLS)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last chunk's stores
            s_pub[...] = s_t.astype(dt)
            plgpu.commit_smem()
            pt = _mm(k, q.T, (C, C)) * causal_decay(b_row, b_col, (C, C), True)
            kds = _mm(k, s_pub.T, (C, BV)) * bcast_rows(jnp.exp2(b_last - b_row), (C, BV))
            ndv = -_mm(pt.astype(dt), o, (C, BV), init=kds)                   # −dV'
            v16[...] = ndv.astype(dt)
            plgpu.commit_smem()
            if keep:
                ndv_ref, ds_ref = kept
                plgpu.copy_smem_to_gmem(v16, ndv_ref.at[bi, rows, hi, cols], commit_group=False)
                plgpu.copy_smem_to_gmem(s_pub, ds_ref.at[bi, hi, n, cols], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
            do_w = plgpu.load(o.T, layout=WGMMA).astype(F32) * bcast_cols(
                jnp.exp2(b_col), (BV, C))
            s_t = _mm(do_w.astype(dt), q, (BV, d), init=s_t * jnp.exp2(b_last))
            return _mm(plgpu.load(v16.T, layout=WGMMA), w, (BV, d), init=s_t)

        s_t = lax.fori_loop(0, N, step, plgpu.load(s_io, layout=WGMMA))
        plgpu.wait_smem_to_gmem(0)
        store_state(s_t, s_io, final_ref.at[bi, hi, cols])

    kept = [((B, Tp, H, dv), dt), ((B, H, N, dv, d), dt)] * keep
    out_type = [jax.ShapeDtypeStruct(s, t) for s, t in kept + [((B, H, dv, d), F32)]]
    *kept, final = build(body, out_type, scratch, (B, H, dv // BV), ("b", "h", "v"), interpret,
                         "gdn_walk_rev")(b2, s0, q, k, w, do)
    ndv, ds = kept or (None, None)
    return ndv, ds, final
