"""Causal HLA3 Pallas kernels (interpret mode on CPU) vs the quadratic reference: outputs and
gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax.kernels.hla3 import hla3_pallas
from hla_jax.kernels.hla3_chunk import chunk_backward, chunk_forward
from hla_jax.ops import reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
ref_hla3 = functools.partial(reference.hla3, mask="causal")


def _inputs(rng, B, T, H, d, dv, normalize):
    """``q, k, v``; positive ``q, k`` when normalised (the denominator stays away from 0)."""
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    return (jnp.abs(q), jnp.abs(k), v) if normalize else (q, k, v)


def _check_against_reference(rng, ker, B, T, H, d, dv, gate, normalize):
    q, k, v = _inputs(rng, B, T, H, d, dv, normalize)
    g = make_gate(rng, B, T, H, kind=gate)
    ref = lambda q, k, v, *g: ref_hla3(  # the oracle takes [B,T,H] gates only
        q, k, v, *(jnp.broadcast_to(x, q.shape[:3]) for x in g), normalize=normalize)
    args = (q, k, v) if g is None else (q, k, v, g)
    assert_close(ker(*args), ref(*args), TOL)
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    argnums = tuple(range(len(args)))
    for name, a, b in zip("qkvg", grads_of(ker, args, argnums, w), grads_of(ref, args, argnums, w)):
        assert_close(a, b, TOL, "d" + name)


@pytest.mark.parametrize("B,T,H,d,dv,c,bv,bv_bwd,gate,normalize", [
    (2, 40, 2, 16, 32, 16, 16, None, "token", False),  # T not a multiple of c, two value tiles
    (1, 48, 2, 16, 16, 16, 64, None, None, True),      # ungated, ratio-normalised
    (2, 33, 2, 24, 20, 32, 32, 16, "head", False),     # d, dv padded (24, 20 -> 32); bwd 2 tiles
    (1, 37, 2, 16, 16, 16, 64, None, "token", True),   # gated and normalised
])
def test_hla3_pallas_matches_reference(rng, B, T, H, d, dv, c, bv, bv_bwd, gate, normalize):
    ker = functools.partial(hla3_pallas, normalize=normalize, chunk_size=c, block_v=bv,
                            block_v_bwd=bv_bwd, interpret=True)
    _check_against_reference(rng, ker, B, T, H, d, dv, gate, normalize)


def test_hla3_pallas_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; compared with the float32 reference on
    the same bf16-rounded values, gradients included."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 40, 2, 16, 16))
    g = make_gate(rng, 1, 40, 2)
    ker = lambda q, k, v, g: hla3_pallas(q, k, v, g, chunk_size=16, interpret=True)
    f32 = lambda x: x.astype(jnp.float32)
    out = ker(q, k, v, g)
    assert out.dtype == jnp.float32
    assert_close(out, ref_hla3(f32(q), f32(k), f32(v), g), 3e-2)
    w = jnp.asarray(rng.normal(size=(1, 40, 2, 16)), jnp.float32)
    got = grads_of(ker, (q, k, v, g), (0, 1, 2, 3), w)
    want = grads_of(ref_hla3, (f32(q), f32(k), f32(v), g), (0, 1, 2, 3), w)
    for name, a, b in zip("qkvg", got, want):
        assert a.dtype == (jnp.float32 if name == "g" else jnp.bfloat16)
        assert_close(a, b, 3e-2, "d" + name)


def test_hla3_pallas_reset_gate_stays_finite(rng):
    """A log-decay of -inf (a state reset) keeps the kernel and its gradients finite and forgets
    the past."""
    q, k, v = make_qkv(rng, 1, 32, 1, 16, 16)
    g = make_gate(rng, 1, 32, 1).at[:, 20].set(-jnp.inf)
    ker = lambda q, k, v, g: hla3_pallas(q, k, v, g, chunk_size=16, interpret=True)
    out = ker(q, k, v, g)
    assert np.all(np.isfinite(np.asarray(out)))
    for grad in jax.grad(lambda *a: ker(*a).sum(), argnums=(0, 1, 2, 3))(q, k, v, g):
        assert np.all(np.isfinite(np.asarray(grad)))
    tail = ker(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0))
    assert_close(out[:, 20:], tail, 1e-5)


def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64):
    """The hand-written chunk backward equals ``jax.vjp`` of the chunk forward (float64)."""
    c, d, bv = 16, 8, 4
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V, S0 = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv), f64(d, d)
    S0 = S0 + S0.T
    P0, F0, dO, dS1, dP1, dF1 = f64(d, bv), f64(d, bv), f64(c, bv), f64(d, d), f64(d, bv), f64(d, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    _, vjp = jax.vjp(chunk_forward, Q, K, V, bb, S0, P0, F0)
    dQ, dK, dV, db, dS0, dP0, dF0 = vjp((dO, dS1, dP1, dF1))
    got = chunk_backward(Q, K, V, bb, S0, P0, F0, dO, dS1 + dS1.T, dP1, dF1)
    for name, a, b in zip(["dQ", "dK", "dV", "db", "dS0+dS0ᵀ", "dP0", "dF0"], got,
                          (dQ, dK, dV, db, dS0 + dS0.T, dP0, dF0)):
        assert_close(a, b, 1e-10, name)


def test_hla3_pallas_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        hla3_pallas(q, k, v, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="g"):
        hla3_pallas(q, k, v, jnp.ones((1, 16, 1)), interpret=True)
    with pytest.raises(ValueError, match="k"):
        hla3_pallas(q, k[..., :8], v, interpret=True)


@pytest.mark.parametrize("normalize", [False, True])
def test_hla3_pallas_tpu_path_interpret(rng, normalize):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    ker = functools.partial(hla3_pallas, normalize=normalize, chunk_size=16, interpret=True,
                            platform="tpu")
    _check_against_reference(rng, ker, 1, 40, 2, 16, 16, "token", normalize)


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_hla3_pallas_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 2 * c, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    loss = lambda q, k, v, g: hla3_pallas(q, k, v, g, normalize=True, chunk_size=c, interpret=False,
                                          platform="tpu" if platform == "tpu" else "gpu").sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3)), x(B, T, H, d), x(B, T, H, d),
                     x(B, T, H, dv), jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    assert text.count(KERNEL_CALL[platform]) >= 4  # forward, saved-state forward, backward; ×2 (den)
