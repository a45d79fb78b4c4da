"""The Mosaic GPU first-order kernels (``kernels/la/la_mgpu.py``) on this CPU: run in the GPU
interpreter against a float32 oracle (outputs, final state and every gradient, bf16 inputs,
several chunks and value tiles, a reset gate, an initial state), and lowered for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, state_loss

from hla_jax.kernels import mosaic_gpu
from hla_jax.kernels.la import la_mgpu
from hla_jax.kernels.wrap import chunk_log_decay

TOL = 2e-2  # docs/math.md#tolerances: bf16 inputs (16-bit copies of the state; dg sums the noise of a chunk)


def oracle(q, k, v, g, h0):
    """``O = ((Q Kᵀ) ∘ D) V + (e^{cumsum g} ∘ Q) H0`` and ``H_T``, float32, ``[B,T,H,·]``."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    cs = jnp.cumsum(jnp.maximum(g, -30.0), 1)                      # the kernels' floor
    T = q.shape[1]
    lower = jnp.tril(jnp.ones((T, T), bool))[None, :, :, None]
    D = jnp.exp(jnp.where(lower, cs[:, :, None] - cs[:, None, :], -jnp.inf))
    o = (jnp.einsum("bthd,bshd,btsh,bshv->bthv", q, k, D, v)
         + jnp.einsum("bthd,bhdv->bthv", q * jnp.exp(cs)[..., None], h0))
    end = cs[:, -1:]
    hT = (jnp.exp(end[:, 0])[..., None, None] * h0
          + jnp.einsum("bshd,bshv->bhdv", k * jnp.exp(end - cs)[..., None], v))
    return o, hT


def kernel(q, k, v, g, h0):
    return la_mgpu.core(q, k, v, chunk_log_decay(g, mosaic_gpu.C), h0, True)


@pytest.mark.parametrize("B,T,H,d,dv,reset", [
    (1, 128, 1, 64, 64, False),     # two chunks, one value tile
    (2, 192, 2, 128, 192, True),    # three walk value tiles, three grads tiles, a reset
])
def test_matches_oracle(rng, B, T, H, d, dv, reset):
    q, k = (jnp.asarray(rng.normal(size=(B, T, H, d)) / np.sqrt(d), jnp.bfloat16) for _ in "qk")
    v = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 0.3, (B, T, H)), jnp.float32)
    if reset:
        g = g.at[0, 70, 1].set(-jnp.inf)
    h0 = jnp.asarray(rng.normal(size=(B, H, d, dv)), jnp.float32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    for a, b, what in zip(kernel(q, k, v, g, h0), oracle(*f32, g, h0), ("O", "H_T")):
        assert_close(a, b, TOL, what)
    wo, wh = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, H, dv), (B, H, d, dv)))

    got = jax.grad(state_loss(kernel, wo, wh), argnums=range(5))(q, k, v, g, h0)
    want = jax.grad(state_loss(oracle, wo, wh), argnums=range(5))(*f32, g, h0)
    for a, b, what in zip(got, want, ("dq", "dk", "dv", "dg", "dh0")):
        assert_close(a, b, TOL, what)


def test_lowers_for_cuda():
    """Forward and backward go through the real Mosaic GPU lowering (layout inference, wgmma
    and TMA shapes) for head dims 64 and 128 and value widths of one and two grads tiles."""
    for d, dv in ((64, 64), (128, 256)):
        x = jax.ShapeDtypeStruct((2, 256, 3, d), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, 256, 3, dv), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((2, 3, 256), jnp.float32)
        h0 = jax.ShapeDtypeStruct((2, 3, d, dv), jnp.float32)

        def loss(q, k, v, b, h0):
            o, hT = la_mgpu.core(q, k, v, b, h0)
            return jnp.sum(o) + jnp.sum(hT)

        text = jax.jit(jax.grad(loss, argnums=range(5))).trace(x, x, v, b, h0).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 4, "the walk, reverse walk, states walk and grads"


def test_pieces_equal_one_walk(rng, monkeypatch):
    """A sequence cut into pieces (``mosaic_gpu.pieces``) gives the outputs and gradients of one
    walk: the pieces' initial states (and cotangents) come from the scan over pieces."""
    B, T, H, d, dv = 1, 256, 1, 64, 64
    q, k = (jnp.asarray(rng.normal(size=(B, T, H, d)) / np.sqrt(d), jnp.bfloat16) for _ in "qk")
    v = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 0.3, (B, T, H)), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(B, H, d, dv)), jnp.float32)
    wo = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)

    def run(min_piece):
        monkeypatch.setattr(mosaic_gpu, "MIN_PIECE", min_piece)
        assert mosaic_gpu.pieces(B, H, dv, T // mosaic_gpu.C) == (4 if min_piece == 1 else 1)
        loss = state_loss(kernel, wo, jnp.ones_like(h0))
        return kernel(q, k, v, g, h0), jax.grad(loss, argnums=range(5))(q, k, v, g, h0)

    (o4, h4), g4 = run(1)
    (o1, h1), g1 = run(64)
    for a, b, what in zip((o4, h4, *g4), (o1, h1, *g1), ("O", "H_T", "dq", "dk", "dv", "dg", "dh0")):
        assert_close(a, b, 1e-5, what)


def test_entry_pads_and_refuses(rng):
    """``la_pallas(backend="mosaic_gpu")``: a ragged T, a value width off the tile, a per-head
    gate and an initial state go through the entry's padding (bf16 against the reference);
    inputs the kernels do not take are refused with the reason."""
    from hla_jax.kernels import la_pallas
    from hla_jax.ops import reference

    B, T, H, d, dv = 1, 100, 2, 64, 40
    q, k = (jnp.asarray(rng.normal(size=(B, T, H, d)) / np.sqrt(d), jnp.bfloat16) for _ in "qk")
    v = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0, 0.3, (H,)), jnp.float32)
    o = la_pallas(q, k, v, g, backend="mosaic_gpu", interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(o, reference.linear_attention(*f32, jnp.broadcast_to(g, (B, T, H))), TOL)
    with pytest.raises(ValueError, match="16-bit"):
        la_pallas(q.astype(jnp.float32), k, v, g, backend="mosaic_gpu", interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        la_pallas(q, k, v, g, backend="mosaic_gpu", interpret=True, chunk_size=32)
