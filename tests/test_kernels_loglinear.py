"""Log-linear Mamba-2 Pallas kernels (interpret mode on CPU) vs the quadratic reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax.kernels.loglinear import level_scales, loglinear_mamba2_pallas
from hla_jax.kernels.loglinear_chunk import (
    block_end,
    chunk_backward,
    chunk_forward,
    counter_flags,
    place,
    take,
)
from hla_jax.ops import fenwick, reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _lam(rng, B, T, H, extra=0, dtype=jnp.float32):
    return jnp.asarray(rng.uniform(0.2, 1.5, size=(B, T, H, fenwick.num_levels(T) + extra)), dtype)


def _check(rng, ker, q, k, v, g, lam, tol=TOL):
    """Output and the gradients of every input (q, k, v, g, lam) against the reference."""
    args = (q, k, v, g, lam)
    assert_close(ker(*args), reference.loglinear_mamba2(*args), tol)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    argnums = tuple(range(len(args)))
    got = grads_of(ker, args, argnums, w)
    want = grads_of(reference.loglinear_mamba2, args, argnums, w)
    for name, a, b in zip(["q", "k", "v", "g", "lam"], got, want):
        assert_close(a, b, tol, "d" + name)


@pytest.mark.parametrize("B,T,H,d,dv,c,gate,extra", [
    (2, 64, 2, 16, 32, 16, "token", 0),   # B, H > 1, d != dv, two walk value tiles, 4 chunks
    (1, 100, 2, 24, 20, 32, "head", 2),   # T, d, dv padded; per-head gate; spare λ levels
    (1, 1000, 1, 16, 16, 32, "token", 0),  # 32 chunks: five counter slots
])
def test_loglinear_mamba2_pallas_matches_reference(rng, B, T, H, d, dv, c, gate, extra):
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H, kind=gate)
    g = g if gate == "token" else jnp.broadcast_to(g, (B, T, H))  # the oracle takes [B,T,H]
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=c, block_v=16, interpret=True)
    _check(rng, ker, q, k, v, g, _lam(rng, B, T, H, extra))


def test_loglinear_mamba2_pallas_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; compared with the float32 reference."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 100, 2, 16, 16))
    g = make_gate(rng, 1, 100, 2)
    lam = _lam(rng, 1, 100, 2)
    out = loglinear_mamba2_pallas(q, k, v, g, lam, chunk_size=16, interpret=True)
    assert out.dtype == jnp.float32
    f32 = lambda x: x.astype(jnp.float32)
    assert_close(out, reference.loglinear_mamba2(f32(q), f32(k), f32(v), g, lam), 3e-2)


def test_loglinear_mamba2_pallas_reset_gate(rng):
    """A log-decay of -inf (a state reset) keeps outputs and gradients finite and exact."""
    q, k, v = make_qkv(rng, 1, 80, 2, 16, 16)
    g = make_gate(rng, 1, 80, 2).at[:, 37].set(-jnp.inf).at[:, 48].set(-jnp.inf)
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=16, interpret=True)
    _check(rng, ker, q, k, v, g, _lam(rng, 1, 80, 2))


def test_loglinear_mamba2_pallas_tpu_path_interpret(rng):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    B, T, H, d, dv = 2, 100, 1, 16, 32
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=16, interpret=True, platform="tpu")
    _check(rng, ker, q, k, v, make_gate(rng, B, T, H), _lam(rng, B, T, H))


def test_all_ones_lambda_is_mamba2(rng):
    q, k, v = make_qkv(rng, 1, 70, 2, 16, 16)
    g = make_gate(rng, 1, 70, 2)
    out = loglinear_mamba2_pallas(q, k, v, g, jnp.ones((1, 70, 2, 8)), chunk_size=16,
                                  interpret=True)
    assert_close(out, reference.linear_attention(q, k, v, g), TOL)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 6, 7])
def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64, n):
    """The hand-written chunk backward equals ``jax.vjp`` of the chunk forward (float64), at
    chunks whose counter reads and merges different slots."""
    c, d, bv, P = 16, 8, 4, 3
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V, dO, d_merged = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv), f64(c, bv), f64(d, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    lams = list(jnp.asarray(rng.uniform(0.2, 1.5, (5 + P, c))))
    Ws, s = [f64(d, bv) for _ in range(P)], jnp.asarray(rng.uniform(0.3, 1.0, P))
    lives, merges, _ = counter_flags(jnp.int32(n), P)

    def fwd(Q, K, V, bb, lams, Ws, s):
        return chunk_forward(Q, K, V, bb, lams, lambda j: Ws[j], list(s), lives, merges)

    _, vjp = jax.vjp(fwd, Q, K, V, bb, lams, Ws, s)
    dQ, dK, dV, db, dlams, dWs, ds = vjp((dO, d_merged))
    got = chunk_backward(Q, K, V, bb, lams, lambda j: Ws[j], list(s), lives, merges, dO,
                         d_merged, [jnp.zeros((d, bv))] * P, 0.0)
    want = (dQ, dK, dV, db, jnp.stack(dlams), jnp.stack(dWs), s * ds)
    for name, a, b in zip(["dQ", "dK", "dV", "db", "dlams", "dWs", "s·ds"], got, want):
        assert_close(jnp.stack(a) if isinstance(a, list) else a, b, 1e-10, name)


def test_counter_take_is_the_transpose_of_place(rng, x64):
    P, shape = 3, (8, 4)
    f64 = lambda: jnp.asarray(rng.normal(size=shape), jnp.float64)
    for n in range(8):                  # n = 7: the merged state leaves the stack
        ats = counter_flags(jnp.int32(n), P)[2]
        Ws, merged, dWs = [f64() for _ in range(P)], f64(), [f64() for _ in range(P)]
        _, vjp = jax.vjp(lambda Ws, m, ats=ats: place(Ws, m, ats), Ws, merged)
        want_dWs, want_dm = vjp(dWs)
        d_merged, got_dWs, _ = take(dWs, [0.0] * P, ats)
        assert_close(d_merged, want_dm, 1e-15, f"d_merged at {n}")
        for a, b in zip(got_dWs, want_dWs):
            assert_close(a, b, 1e-15, f"dWs at {n}")


def test_level_scales_are_the_decay_between_block_end_and_chunk(rng, x64):
    """``s[n, j] = exp(Σ_{m<k<n} b_k^end)``, ``m = block_end(n, j)``, when bit j of n is 1."""
    c, N, P = 4, 13, 4
    b = jnp.asarray(-rng.uniform(0, 1, (1, 1, N * c)))
    s = np.asarray(level_scales(b, c, P))[0, 0]
    tot = np.asarray(b)[0, 0, c - 1::c]
    for n in range(N):
        for j in range(P):
            m = int(block_end(n, j))
            want = np.exp(tot[m + 1:n].sum()) if (n >> j) & 1 else 0.0
            np.testing.assert_allclose(s[n, j], want, rtol=1e-13)


def test_loglinear_mamba2_pallas_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 40, 1, 16, 16)
    g, lam = make_gate(rng, 1, 40, 1), _lam(rng, 1, 40, 1)
    with pytest.raises(ValueError, match="chunk_size"):
        loglinear_mamba2_pallas(q, k, v, g, lam, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        loglinear_mamba2_pallas(q, k, v, g, lam, block_v=24, interpret=True)
    with pytest.raises(ValueError, match="block_v_bwd"):
        loglinear_mamba2_pallas(q, k, v, g, lam, block_v_bwd=8, interpret=True)
    with pytest.raises(ValueError, match="T=40 needs at least 7"):
        loglinear_mamba2_pallas(q, k, v, g, lam[..., :6], interpret=True)
    with pytest.raises(ValueError, match="lam must have shape"):
        loglinear_mamba2_pallas(q, k, v, g, lam[:, :39], interpret=True)
    with pytest.raises(ValueError, match="log-decay"):
        loglinear_mamba2_pallas(q, k, v, -g, lam, interpret=True)
    with pytest.raises(ValueError, match="g .*required"):
        loglinear_mamba2_pallas(q, k, v, None, lam, interpret=True)
    with pytest.raises(ValueError, match="k must"):
        loglinear_mamba2_pallas(q, k[..., :8], v, g, lam, interpret=True)


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_loglinear_mamba2_pallas_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 1024, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    loss = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=c, interpret=False,
                                              platform="tpu" if platform == "tpu" else "gpu").sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), x(B, T, H, d),
                     x(B, T, H, d), x(B, T, H, dv), f32(B, T, H), f32(B, T, H, 11))
    assert text.count(KERNEL_CALL[platform]) >= 3  # states, dstates, grads (grad drops the forward)


def test_float32_at_head_dim_128_gets_smaller_tiles_on_gpu():
    """As for ``la_pallas``: float32 at d=128, compiled for a GPU, caps every tile at
    ``wrap.F32_GPU_TILE`` (Triton's shared memory); bf16 keeps the requested tiles."""
    from hla_jax.kernels import wrap

    for name in ("loglinear_mamba2_pallas", "loglinear_gated_deltanet_pallas"):
        for dtype, want in ((jnp.float32, wrap.F32_GPU_TILE[name]), (jnp.bfloat16, 64)):
            q = jnp.zeros((1, 100, 1, 128), dtype)
            got = wrap.launch(name, q, q, q, chunk_size=64, block_v=64, block_v_bwd=64,
                              interpret=False, platform="gpu")
            assert (got.c, got.bv, got.bv_bwd, got.Tp) == (want, want, want, -(-100 // want) * want)
