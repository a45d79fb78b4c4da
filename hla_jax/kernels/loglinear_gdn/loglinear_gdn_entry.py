"""``loglinear_gated_deltanet_pallas``: log-linear Gated DeltaNet (docs/math.md#loglinear) via Pallas kernels.

Same semantics as ``hla_jax.ops.loglinear_gated_deltanet``:
``o_t = Σ_{s≤t} λ_t^{ℓ(t,s)} q_tᵀ (A_t ⋯ A_{s+1}) k_s β_s v_sᵀ``, ``A_r = a_r (I − β_r k_r k_rᵀ)``;
``q, k: [B,T,H,d]`` (keys L2-normalised by the caller), ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``,
``lam: [B,T,H,L ≥ ⌈log2 T⌉+1]``; returns ``[B,T,H,dv]`` float32.

Design (``loglinear_gdn_chunk.py`` has the per-chunk math):
1. ``ut_forward``, parallel over chunks: the UT transform of each chunk (``(I + A)⁻¹`` by
   block doubling), the state readout ``Q̂``, ``W``, ``U`` and the intra-chunk output.
2. ``walk_forward``, one program per (batch, head, value tile): walks the chunks with the binary
   counter of S = ⌈log2 N⌉ level states (``d×bv`` float32 each, on chip); each chunk propagates the
   non-empty levels through its ``d×d`` transition as 2-D dots, O(T log T · d · dv) in all.
``jax.custom_vjp``: the forward keeps only its inputs.  The backward re-runs 1 and 2 (2 with
``save_states``: each level state at the chunks that read it, about S/2 states per chunk, held
only inside the backward), walks the chunks in reverse with the cotangent level states, writing
each chunk's merged-block and read-level cotangents (``walk_dstates``), computes every chunk's
walk gradients at once with its own value tile (``walk_grads``, ``block_v_bwd``), then runs the
UT backward in parallel over chunks.  ``dg`` follows by autodiff of the per-chunk
cumulative log-decay (``wrap.chunk_gate``, floored at ``LOG_DECAY_FLOOR``: a reset ``g = -inf``
stays finite), ``dlam`` through its padding and transpose.

Backends: ``interpret=None`` runs compiled on GPU/TPU and in interpret mode on CPU.  The NVIDIA
path (``loglinear_gdn_triton.py``, Triton lowering) takes bf16 and float32
(``experiments/kernels/check_kernels_gpu.py`` checks both; float32 at ``d >= 128`` with tiles of
16, ``wrap.F32_GPU_TILE``: Triton's shared memory); the TPU path (``loglinear_gdn_tpu.py``, Mosaic) has
never run on TPU hardware: the tests run it in interpret mode and through the Mosaic
lowering.  Inputs other than all-bf16 run in float32; ``d`` is zero-padded to a power of two
>= 16, ``dv`` to a multiple of the value tile, ``T`` to a multiple of ``chunk_size`` (a power of
two >= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.core import fenwick
from hla_jax.core.checks import check_gate, check_lam, check_per_token, check_qkv
from hla_jax.kernels.loglinear.loglinear_entry import Config, levels_first
from hla_jax.kernels.loglinear_gdn import loglinear_gdn_tpu, loglinear_gdn_triton
from hla_jax.kernels.wrap import backend_choice, chunk_gate, launch, pad, pow2_at_least

BACKENDS = {"triton": loglinear_gdn_triton, "tpu": loglinear_gdn_tpu}

STACK_BYTES = 64 * 1024   # registers the level stack of one Triton program may take


def chunk_levels(T: int, c: int) -> int:
    """``P``: chunk-level states of a sequence of ``T`` tokens in chunks of ``c`` (at least 1)."""
    return max(1, fenwick.num_levels(-(-T // c)) - 1)


def value_tile(block_v: int, d: int, dv: int, P: int) -> int:
    """The value tile: ``block_v``, at most ``dv`` rounded up to a power of two, and small enough
    that ``P`` float32 ``d×bv`` states fit ``STACK_BYTES`` (never below 16)."""
    fit = 1 << max(4, (STACK_BYTES // (4 * P * d)).bit_length() - 1)
    return min(block_v, pow2_at_least(max(dv, 16)), fit)


def value_tiles(block_v: int, block_v_bwd: int, d: int, dv: int, P: int):
    """``(bv, bv_bwd, dvp)``: the walks' value tile (``value_tile``), the chunk-parallel
    gradients' (``block_v_bwd``, at most ``dv`` rounded up to a power of two) and ``dv`` padded
    to a multiple of both."""
    bv = value_tile(block_v, d, dv, P)
    bvb = min(block_v_bwd, pow2_at_least(max(dv, 16)))
    return bv, bvb, -(-dv // max(bv, bvb)) * max(bv, bvb)


def _ut(cfg, q, k, v, b, beta, lam):
    return BACKENDS[cfg.backend].ut_forward(q, k, v, b, beta, lam, c=cfg.c,
                                             num_warps=cfg.num_warps, interpret=cfg.interpret)


def _walk(cfg, q, k, v, b, beta, lam, save_states=False):
    qh, w, u, o_intra = _ut(cfg, q, k, v, b, beta, lam)
    return BACKENDS[cfg.backend].walk_forward(
        qh, w, k, u, o_intra, b, lam, c=cfg.c, bv=cfg.bv, save_states=save_states,
        num_warps=cfg.num_warps, interpret=cfg.interpret), (qh, w, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def loglinear_gdn_core(q, k, v, b, beta, lam, cfg: Config):
    """The operator on padded inputs: ``q, k [B,Tp,H,d]``, ``v [B,Tp,H,dv]``, ``b, beta
    [B,H,Tp]`` (``b`` the per-chunk cumulative log-decay), ``lam [B,H,log2 c + 1 + S,Tp]``
    float32 -> ``[B,Tp,H,dv]`` float32."""
    return _walk(cfg, q, k, v, b, beta, lam)[0]


def _core_fwd(q, k, v, b, beta, lam, cfg):
    return loglinear_gdn_core(q, k, v, b, beta, lam, cfg), (q, k, v, b, beta, lam)


def _core_bwd(cfg, res, do):
    q, k, v, b, beta, lam = res
    mod, dt = BACKENDS[cfg.backend], q.dtype
    kw = dict(c=cfg.c, num_warps=cfg.num_warps, interpret=cfg.interpret)
    (_, states), (qh, w, u) = _walk(cfg, q, k, v, b, beta, lam, save_states=True)
    do = do.astype(dt)
    dOwn, dlev = mod.walk_dstates(qh, w, k, u, b, lam, states, do, bv=cfg.bv, **kw)
    dqh, dw, dk1, du, db1, dlam1 = mod.walk_grads(qh, w, k, u, b, lam, states, dOwn, dlev, do,
                                                  bv=cfg.bv_bwd, **kw)
    dq, dk2, dv, db2, dbeta, dlam2 = mod.ut_backward(
        q, k, v, b, beta, lam, do, dqh.sum(0).astype(dt), dw.sum(0).astype(dt), du.astype(dt),
        **kw)
    return (dq.astype(dt), (dk1.sum(0) + dk2).astype(dt), dv.astype(dt), db1.sum(0) + db2,
            dbeta, jnp.concatenate([dlam2, dlam1.sum(0)], axis=2))


loglinear_gdn_core.defvjp(_core_fwd, _core_bwd)


def loglinear_gated_deltanet_pallas(q, k, v, g, beta, lam, *, chunk_size=64, interpret=None,
                                    block_v=64, block_v_bwd=64, num_warps=8, backend=None):
    """Log-linear Gated DeltaNet via Pallas (see the module docstring) on whole rows, positions
    from 0: packed documents and continued states are compositions in ``ops.levels``
    (``ops.loglinear_gated_deltanet(impl="pallas", segment_ids=…)``).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``, unit norm.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        beta: write strengths ``[B,T,H]``.
        lam: level weights ``[B,T,H,L]``, ``L ≥ ⌈log2 T⌉+1``.
        chunk_size: a power of two >= 16.
        interpret: None runs compiled on GPU/TPU and in interpret mode on CPU.
        block_v: caps the walks' value tile (a power of two >= 16; ``value_tile`` shrinks it so
            the level states of one program fit ``STACK_BYTES``).
        block_v_bwd: the value tile of the chunk-parallel walk gradients.
        num_warps: Triton's warps per program.
        backend: "triton" | "tpu" | None (the default device's: "tpu" on a TPU, else "triton").

    Returns:
        ``o [B,T,H,dv]`` float32.

    Raises:
        ValueError: naming the argument (shapes, dtypes, ``g``, ``beta``, too few levels,
            tiles).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax.kernels import loglinear_gated_deltanet_pallas
        >>> q = k = v = jnp.full((1, 32, 1, 16), 0.25)
        >>> g, beta = -0.1 * jnp.ones((1, 32, 1)), 0.5 * jnp.ones((1, 32, 1))
        >>> lam = jnp.ones((1, 32, 1, 6))
        >>> loglinear_gated_deltanet_pallas(q, k, v, g, beta, lam, chunk_size=16).shape
        (1, 32, 1, 16)
    """
    name = "loglinear_gated_deltanet_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=True)
    beta = check_per_token(beta, B, T, H, "beta", name=name)
    lam = check_lam(lam, B, T, H, name=name)
    return loglinear_gated_deltanet_kernel(q, k, v, g, beta, lam, chunk_size=chunk_size,
                                           interpret=interpret,
                                           block_v=block_v, block_v_bwd=block_v_bwd,
                                           num_warps=num_warps, backend=backend)


def loglinear_gated_deltanet_kernel(q, k, v, g, beta, lam, *, chunk_size=64, interpret=None,
                                    block_v=64, block_v_bwd=64, num_warps=8, backend=None):
    """``loglinear_gated_deltanet_pallas`` on inputs it has checked (``g`` and per-token inputs
    ``[B,T,H]``): the ops' entry, which checks them itself."""
    name = "loglinear_gated_deltanet_pallas"
    B, T, H, d = q.shape
    dv = v.shape[-1]
    backend = backend_choice(name, backend, tuple(BACKENDS), "triton")
    c, Tp, dp, dt, interpret, backend, block_v, block_v_bwd = launch(
        name, q, k, v, chunk_size=chunk_size, block_v=block_v, interpret=interpret,
        backend=backend, block_v_bwd=block_v_bwd)
    S = chunk_levels(T, c)  # chunk levels log2 c + 1 .. log2 c + S
    bv, bvb, dvp = value_tiles(block_v, block_v_bwd, dp, dv, S)
    per_token = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0)))
    cfg = Config(c, bv, bvb, num_warps, interpret, backend)
    o = loglinear_gdn_core(pad(q.astype(dt), Tp, dp), pad(k.astype(dt), Tp, dp),
                           pad(v.astype(dt), Tp, dvp), chunk_gate(g, B, H, Tp, c),
                           jnp.swapaxes(per_token(beta), 1, 2),
                           levels_first(lam, Tp, c.bit_length() + S), cfg)
    return o[:, :T, :, :dv]
