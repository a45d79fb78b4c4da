"""AHLA Pallas kernels (interpret mode on CPU) vs the quadratic reference: outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax.kernels.ahla import ahla_pallas
from hla_jax.kernels.ahla_chunk import chunk_backward, chunk_forward
from hla_jax.ops import reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _ref(normalize):
    """The oracle, which takes ``[B,T,H]`` gates only."""
    return lambda q, k, v, *g: reference.ahla(
        q, k, v, *(jnp.broadcast_to(x, q.shape[:3]) for x in g), normalize=normalize)


def _check_against_reference(rng, ker, ref, args, dv):
    assert_close(ker(*args), ref(*args), TOL)
    B, T, H = args[0].shape[:3]
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    argnums = tuple(range(len(args)))
    for name, a, b in zip("qkvg", grads_of(ker, args, argnums, w), grads_of(ref, args, argnums, w)):
        assert_close(a, b, TOL, "d" + name)


@pytest.mark.parametrize("B,T,H,d,dv,c,gate,normalize", [
    (2, 40, 2, 16, 32, 16, "token", False),   # T not a multiple of the chunk, two value tiles
    (1, 48, 2, 16, 16, 16, None, True),       # ungated, ratio-normalised
    (2, 33, 2, 24, 20, 32, "head", False),    # d and dv padded (24 -> 32, 20 -> 32)
    (1, 37, 2, 16, 16, 16, "token", True),    # gated and normalised
])
def test_ahla_pallas_matches_reference(rng, B, T, H, d, dv, c, gate, normalize):
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H, kind=gate)
    ker = lambda *a: ahla_pallas(*a, normalize=normalize, chunk_size=c, block_v=16, interpret=True)
    _check_against_reference(rng, ker, _ref(normalize), (q, k, v) if g is None else (q, k, v, g), dv)


def test_ahla_pallas_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; compared with the float32 reference."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 40, 2, 16, 16))
    g = make_gate(rng, 1, 40, 2)
    out = ahla_pallas(q, k, v, g, chunk_size=16, interpret=True)
    assert out.dtype == jnp.float32
    f32 = lambda x: x.astype(jnp.float32)
    assert_close(out, reference.ahla(f32(q), f32(k), f32(v), g), 3e-2)


def test_ahla_pallas_reset_gate_stays_finite(rng):
    """A log-decay of -inf (a state reset) keeps the kernel finite and forgets the past."""
    q, k, v = make_qkv(rng, 1, 32, 1, 16, 16)
    g = make_gate(rng, 1, 32, 1).at[:, 20].set(-jnp.inf)
    out = ahla_pallas(q, k, v, g, chunk_size=16, interpret=True)
    assert np.all(np.isfinite(np.asarray(out)))
    tail = ahla_pallas(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0),
                       chunk_size=16, interpret=True)
    assert_close(out[:, 20:], tail, 1e-5)


def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64):
    """The hand-written chunk backward equals ``jax.vjp`` of the chunk forward (float64)."""
    c, d, bv = 16, 8, 4
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv)
    P0, E0, dO, dP1, dE1 = f64(d, bv), f64(d, bv), f64(c, bv), f64(d, bv), f64(d, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    _, vjp = jax.vjp(chunk_forward, Q, K, V, bb, P0, E0)
    got = chunk_backward(Q, K, V, bb, P0, E0, dO, dP1, dE1)
    for name, a, b in zip(["dQ", "dK", "dV", "db", "dP0", "dE0"], got, vjp((dO, dP1, dE1))):
        assert_close(a, b, 1e-10, name)


def test_ahla_pallas_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="ahla_pallas: chunk_size"):
        ahla_pallas(q, k, v, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="ahla_pallas: g"):
        ahla_pallas(q, k, v, jnp.ones((1, 16, 1)), interpret=True)
    with pytest.raises(ValueError, match="ahla_pallas: k"):
        ahla_pallas(q, k[..., :8], v, interpret=True)


@pytest.mark.parametrize("normalize", [False, True])
def test_ahla_pallas_tpu_path_interpret(rng, normalize):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    B, T, H, d, dv = 1, 40, 2, 16, 16
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H)
    ker = lambda *a: ahla_pallas(*a, normalize=normalize, chunk_size=16, interpret=True,
                                 platform="tpu")
    _check_against_reference(rng, ker, _ref(normalize), (q, k, v, g), dv)


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_ahla_pallas_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 2 * c, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    loss = lambda q, k, v, g: ahla_pallas(q, k, v, g, normalize=True, chunk_size=c, interpret=False,
                                          platform="tpu" if platform == "tpu" else "gpu").sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3)), x(B, T, H, d), x(B, T, H, d),
                     x(B, T, H, dv), jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    assert text.count(KERNEL_CALL[platform]) >= 4  # forward, saved-state forward, backward; ×2 (den)
