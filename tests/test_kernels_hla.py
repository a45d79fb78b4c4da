"""HLA2 Pallas kernels (interpret mode on CPU) vs the quadratic reference: outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax.kernels import hla2_pallas
from hla_jax.kernels.hla2_chunk import chunk_backward, chunk_forward
from hla_jax.ops import reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@pytest.mark.parametrize("B,T,H,d,dv,c,gate,normalize", [
    (2, 40, 2, 16, 32, 16, "token", False),   # T not a multiple of the chunk, two value tiles
    (1, 48, 2, 16, 16, 16, None, True),       # ungated, ratio-normalised
    (2, 33, 2, 24, 20, 32, "head", False),    # d and dv padded (24 -> 32, 20 -> 32)
    (1, 37, 2, 16, 16, 16, "token", True),    # gated and normalised
])
def test_hla2_pallas_matches_reference(rng, B, T, H, d, dv, c, gate, normalize):
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H, kind=gate)
    kw = dict(normalize=normalize)
    ker = lambda *a: hla2_pallas(*a, chunk_size=c, block_v=16, interpret=True, **kw)
    ref = lambda q, k, v, *g: reference.hla2(  # the oracle takes [B,T,H] gates only
        q, k, v, *(jnp.broadcast_to(x, q.shape[:3]) for x in g), **kw)
    args = (q, k, v) if g is None else (q, k, v, g)
    assert_close(ker(*args), ref(*args), TOL)
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    argnums = tuple(range(len(args)))
    for name, a, b in zip("qkvg", grads_of(ker, args, argnums, w), grads_of(ref, args, argnums, w)):
        assert_close(a, b, TOL, "d" + name)


def test_hla2_pallas_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; compared with the float32 reference."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 40, 2, 16, 16))
    g = make_gate(rng, 1, 40, 2)
    out = hla2_pallas(q, k, v, g, chunk_size=16, interpret=True)
    assert out.dtype == jnp.float32
    f32 = lambda x: x.astype(jnp.float32)
    assert_close(out, reference.hla2(f32(q), f32(k), f32(v), g), 3e-2)


def test_hla2_pallas_reset_gate_stays_finite(rng):
    """A log-decay of -inf (a state reset) keeps the kernel finite and forgets the past."""
    q, k, v = make_qkv(rng, 1, 32, 1, 16, 16)
    g = make_gate(rng, 1, 32, 1).at[:, 20].set(-jnp.inf)
    out = hla2_pallas(q, k, v, g, chunk_size=16, interpret=True)
    assert np.all(np.isfinite(np.asarray(out)))
    tail = hla2_pallas(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0),
                       chunk_size=16, interpret=True)
    assert_close(out[:, 20:], tail, 1e-5)


def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64):
    """The hand-written chunk backward equals ``jax.vjp`` of the chunk forward (float64)."""
    c, d, bv = 16, 8, 4
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V, S0 = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv), f64(d, d)
    S0 = S0 + S0.T
    U0, dO, dS1, dU1 = f64(d, bv), f64(c, bv), f64(d, d), f64(d, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    _, vjp = jax.vjp(chunk_forward, Q, K, V, bb, S0, U0)
    dQ, dK, dV, db, dS0, dU0 = vjp((dO, dS1, dU1))
    got = chunk_backward(Q, K, V, bb, S0, U0, dO, dS1 + dS1.T, dU1)
    for name, a, b in zip(["dQ", "dK", "dV", "db", "dS0+dS0ᵀ", "dU0"], got,
                          (dQ, dK, dV, db, dS0 + dS0.T, dU0)):
        assert_close(a, b, 1e-10, name)


def test_hla2_pallas_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        hla2_pallas(q, k, v, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="g"):
        hla2_pallas(q, k, v, jnp.ones((1, 16, 1)), interpret=True)
    with pytest.raises(ValueError, match="k"):
        hla2_pallas(q, k[..., :8], v, interpret=True)


@pytest.mark.parametrize("normalize", [False, True])
def test_hla2_pallas_tpu_path_interpret(rng, normalize):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    B, T, H, d, dv = 1, 40, 2, 16, 16
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H)
    ker = lambda *a: hla2_pallas(*a, normalize=normalize, chunk_size=16, interpret=True,
                                 platform="tpu")
    ref = lambda *a: reference.hla2(*a, normalize=normalize)
    assert_close(ker(q, k, v, g), ref(q, k, v, g), TOL)
    w = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    for name, a, b in zip("qkvg", grads_of(ker, (q, k, v, g), (0, 1, 2, 3), w),
                          grads_of(ref, (q, k, v, g), (0, 1, 2, 3), w)):
        assert_close(a, b, TOL, "d" + name)


def test_ops_entry_dispatches_to_the_kernel(rng):
    """``ops.hla2(..., impl="pallas")`` is the kernel; ``seq_axis`` is refused with it."""
    from hla_jax import ops

    q, k, v = make_qkv(rng, B=1, T=40, H=2, d=16, dv=16)
    g = make_gate(rng, B=1, T=40, H=2)
    out = ops.hla2(q, k, v, g, impl="pallas", chunk_size=16)
    assert_close(out, reference.hla2(q, k, v, g), 2e-3)
    with pytest.raises(ValueError, match="seq_axis"):
        ops.hla2(q, k, v, g, impl="pallas", seq_axis="sequence")


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_hla2_pallas_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 2 * c, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    loss = lambda q, k, v, g: hla2_pallas(q, k, v, g, normalize=True, chunk_size=c, interpret=False,
                                          platform="tpu" if platform == "tpu" else "gpu").sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3)), x(B, T, H, d), x(B, T, H, d),
                     x(B, T, H, dv), jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    assert text.count(KERNEL_CALL[platform]) >= 4  # forward, saved-state forward, backward; ×2 (den)


@pytest.mark.parametrize("name,extra", [("ahla", {}), ("hla3", {}), ("loglinear_mamba2", {"lam": 1}),
                                        ("loglinear_gated_deltanet", {"beta": 1, "lam": 1})])
def test_every_kernel_is_an_ops_impl(rng, name, extra):
    """``ops.<name>(..., impl="pallas")`` runs the family's kernel (interpret mode on CPU)."""
    from hla_jax import ops
    from hla_jax.ops import fenwick

    B, T, H, d, dv = 1, 40, 2, 16, 16
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H)
    kw = {}
    if "beta" in extra:
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        kw["beta"] = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    if "lam" in extra:
        kw["lam"] = jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H, fenwick.num_levels(T))), jnp.float32)
    entry = getattr(ops, name)
    assert_close(entry(q, k, v, g, *kw.values(), impl="pallas", chunk_size=16),
                 entry(q, k, v, g, *kw.values(), impl="reference"), TOL)


def test_pallas_impl_is_refused_where_there_is_no_kernel(rng):
    from hla_jax import ops

    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="pallas"):
        ops.hla3(q, k, v, mask="paper", impl="pallas")
    with pytest.raises(ValueError, match="pallas"):
        ops.mamba2(q, k, v, make_gate(rng, 1, 16, 1), impl="pallas")


def test_auto_prefers_the_kernel_only_for_bf16_on_a_gpu(monkeypatch):
    """``impl="auto"``: Pallas on a GPU for all-bf16 inputs without sequence sharding, else XLA."""
    from hla_jax.ops.common import pallas_preferred

    bf16, f32 = jnp.zeros((1, 4, 1, 16), jnp.bfloat16), jnp.zeros((1, 4, 1, 16), jnp.float32)
    assert not pallas_preferred(None, bf16, bf16)  # this machine is a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pallas_preferred(None, bf16, bf16)
    assert not pallas_preferred(None, bf16, f32)
    assert not pallas_preferred("sequence", bf16, bf16)
