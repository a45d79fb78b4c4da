"""Gated DeltaNet's UT transform for NVIDIA GPUs: ``pallas_call`` lowered through Triton, one
program per (batch, head, chunk) over ``kernels/gdn_chunk.py``.

Inputs stay in the caller's layout: ``k [B,Tp,H,d]``, ``v [B,Tp,H,dv]`` (strided tile loads),
``b`` (the chunk-local cumulative log-decay) and ``beta`` as ``[B,H,Tp]`` float32; ``d`` a power
of two >= 16 and ``dv`` a multiple of 64 (the caller pads), taken 128 (or 64) columns at a time.
``forward`` gives ``W [B,Tp,H,d]`` and ``U [B,Tp,H,dv]`` in the input dtype and the inverse
``X = (I + A)⁻¹ [B,H,Tp,c]`` float32 (working on row blocks of ``cb`` tokens), ``backward`` from
that ``X`` the cotangents ``dk, dv, dbeta`` for ``b`` held fixed and its share of the gate's
gradient (the block form of log-linear Gated DeltaNet's, ``kernels/gdn_blocks.py``, which also
hands it ``T``'s own cotangent; the first-order kernel's backward is ``gdn_ut_mgpu.py``'s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hla_jax.kernels import gdn_chunk
from hla_jax.kernels.gpu.walk import compiler_params
from hla_jax.kernels.la_chunk import F32, dot


def _call(kernel, out_shape, c, num_warps, interpret, *args):
    B, Tp, H = args[0].shape[:3]
    return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, Tp // c),
                                compiler_params=compiler_params(num_warps, interpret),
                                interpret=interpret)(*args))


def _rows(c, at=0, n=None):
    """This program's chunk rows ``[at, at + n)`` (all ``c`` by default)."""
    return pl.ds(pl.multiple_of(pl.program_id(2) * c + at, n or c), n or c)


def _value_tiles(dv):
    """``(bu, n)``: value tiles of ``bu`` columns (128, or 64 when ``dv`` is an odd multiple of
    64) and their count."""
    bu = 128 if dv % 128 == 0 else min(dv, 64)
    return bu, dv // bu


def _over_tiles(bu, n, body, init):
    """``body(cols, carry)`` over ``n`` column slices of ``bu``, in a loop (not unrolled: each
    tile's loads and products die with its step)."""
    return lax.fori_loop(0, n, lambda t, carry: body(pl.ds(pl.multiple_of(t * bu, bu), bu), carry),
                         init)


def _over_value_tiles(dv, body, init):
    """``body(cols, carry)`` over the value tiles' column slices (``_value_tiles``)."""
    return _over_tiles(*_value_tiles(dv), body, init)


@functools.partial(jax.jit, static_argnames=("c", "cb", "num_warps", "interpret"))
def forward(k, v, b, beta, *, c=64, cb=32, num_warps=4, interpret=False):
    """``(W, U, X)`` of every chunk (module docstring), ``X [B,H,Tp,c]`` float32; ``U`` a value
    tile at a time."""
    def kernel(k_ref, v_ref, b_ref, beta_ref, w_ref, u_ref, x_ref):
        i, h = pl.program_id(0), pl.program_id(1)
        blocks = [_rows(c, m * cb, cb) for m in range(c // cb)]
        fast = k_ref.dtype == jnp.bfloat16
        bs, betas = [b_ref[i, h, ts] for ts in blocks], [beta_ref[i, h, ts] for ts in blocks]
        Ks = [k_ref[i, ts, h, :] for ts in blocks]
        X = gdn_chunk.ut_inverse(Ks, bs, betas)
        W = gdn_chunk.ut_apply(X, [(bt * jnp.exp(bb))[:, None] * K.astype(F32)
                                   for K, bb, bt in zip(Ks, bs, betas)], fast)
        for m, ts in enumerate(blocks):
            w_ref[i, ts, h, :] = W[m].astype(w_ref.dtype)
            for j, x in enumerate(X[m]):
                x_ref[i, h, ts, pl.ds(j * cb, cb)] = x

        def u_tile(cols, carry):
            U = gdn_chunk.ut_apply(X, [bt[:, None] * v_ref[i, ts, h, cols].astype(F32)
                                       for ts, bt in zip(blocks, betas)], fast)
            for m, ts in enumerate(blocks):
                u_ref[i, ts, h, cols] = U[m].astype(u_ref.dtype)
            return carry

        _over_value_tiles(v.shape[-1], u_tile, 0)

    B, Tp, H = k.shape[:3]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, k.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp, c), F32)]
    return _call(kernel, out_shape, c, num_warps, interpret, k, v, b, beta)


@functools.partial(jax.jit, static_argnames=("c", "kt", "num_warps", "interpret"))
def backward(k, v, b, beta, x, dw, du, *, dt=None, c=64, kt=64, num_warps=4, interpret=False):
    """``(dk, dv, dbeta, db)`` from the forward's ``x``, the cotangents ``du [B,Tp,H,dv]`` and
    ``dw [B,Tp,H,d]`` and the cotangent ``dt [B,H,Tp,c]`` float32 of ``T = X diag(β)`` itself
    (``None``: none; it adds to ``dT``): ``dk`` in ``k``'s dtype, ``dv`` in ``v``'s, the rest float32
    ``[B,H,Tp]`` (``db`` the UT transform's share of ``∂L/∂b``, ``gdn_chunk``).  Three loops
    over tiles of ``kt`` columns keep the registers to ``[c,kt]`` tiles: values (``dV``,
    ``dU Vᵀ``), keys (``dT``, ``K Kᵀ``), keys again (``dK``)."""
    d, dv = k.shape[-1], v.shape[-1]
    kt = min(kt, d)
    if d % kt or dv % kt:
        raise ValueError(f"gdn_ut.backward: kt={kt} must divide d={d} of k [B,T,H,d] and dv={dv} "
                         f"of v [B,T,H,dv]")
    extra = [dt] if dt is not None else []

    def kernel(k_ref, v_ref, b_ref, beta_ref, x_ref, dw_ref, du_ref, *refs):
        *dt_ref, dk_ref, dv_ref, dbeta_ref, db_ref = refs
        i, h, ts = pl.program_id(0), pl.program_id(1), _rows(c)
        bb, beta, X = b_ref[i, h, ts], beta_ref[i, h, ts], x_ref[i, h, ts, :]
        kdt, r = k_ref.dtype, jnp.exp(bb)
        fast = kdt == jnp.bfloat16

        def value_tile(cols, duv):
            dU, V = du_ref[i, ts, h, cols], v_ref[i, ts, h, cols]
            dv_ref[i, ts, h, cols] = gdn_chunk.ut_backward_values(X, beta, dU, fast).astype(dv_ref.dtype)
            return duv + dot(dU.astype(kdt), V, tb=True)

        def key_tile(cols, carry):
            return gdn_chunk.ut_backward_key_terms(k_ref[i, ts, h, cols], r, dw_ref[i, ts, h, cols],
                                                   *carry)

        def key_grad(cols, db):
            K = k_ref[i, ts, h, cols]
            dK, kdw = gdn_chunk.ut_backward_keys(X, r, beta, bE, K,
                                                 dw_ref[i, ts, h, cols].astype(F32))
            dk_ref[i, ts, h, cols] = dK.astype(dk_ref.dtype)
            return db + kdw

        cc = jnp.zeros((c, c), F32)
        duv = _over_tiles(kt, dv // kt, value_tile, dt_ref[0][i, h, ts, :] if dt_ref else cc)
        dTm, KK = _over_tiles(kt, d // kt, key_tile, (duv, cc))
        bE, dbeta_ref[i, h, ts], db = gdn_chunk.ut_backward_gram(X, bb, beta, KK, dTm, fast)
        db_ref[i, h, ts] = _over_tiles(kt, d // kt, key_grad, db)

    B, Tp, H = k.shape[:3]
    per_token = jax.ShapeDtypeStruct((B, H, Tp), F32)
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                 per_token, per_token]
    return _call(kernel, out_shape, c, num_warps, interpret, k, v, b, beta, x, dw, du, *extra)
