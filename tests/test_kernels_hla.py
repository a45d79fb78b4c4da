"""The HLA Pallas kernels (hla2, ahla, hla3 causal; interpret mode on CPU) vs the quadratic
references: outputs and gradients, bf16, resets, bad input, the TPU path, the chunk backward,
lowering for real hardware, and the ``impl="pallas"`` / ``"auto"`` dispatch of every kernel."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax import kernels
from hla_jax.kernels.gpu.walk import DD
from hla_jax.kernels.wrap import LAYOUTS
from hla_jax.ops import reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
FAMILIES = ("hla2", "ahla", "hla3")


def kernel(family, **kw):
    return lambda *a: getattr(kernels, f"{family}_pallas")(*a, interpret=True, **kw)


def oracle(family, normalize):
    """The quadratic reference (it takes ``[B,T,H]`` gates only)."""
    return lambda q, k, v, *g: getattr(reference, family)(
        q, k, v, *(jnp.broadcast_to(x, q.shape[:3]) for x in g), normalize=normalize)


def inputs(rng, B, T, H, d, dv, gate, normalize):
    """``(q, k, v[, g])``; positive q, k when normalised keep the signed denominators away from 0."""
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    if normalize:
        q, k = jnp.abs(q), jnp.abs(k)
    g = make_gate(rng, B, T, H, kind=gate)
    return (q, k, v) if g is None else (q, k, v, g)


def assert_matches(rng, ker, ref, args, tol=TOL):
    """Outputs and the gradients of every argument (a random linear functional)."""
    assert_close(ker(*args), ref(*args), tol)
    w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
    argnums = tuple(range(len(args)))
    for name, a, b in zip("qkvg", grads_of(ker, args, argnums, w), grads_of(ref, args, argnums, w)):
        assert_close(a, b, tol, "d" + name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("B,T,H,d,dv,c,gate,normalize", [
    (2, 40, 2, 16, 32, 16, "token", False),   # T not a multiple of the chunk, two value tiles
    (1, 48, 2, 16, 16, 16, None, True),       # ungated, ratio-normalised
    (2, 33, 2, 24, 20, 32, "head", False),    # d and dv padded (24 -> 32, 20 -> 32)
    (1, 37, 2, 16, 16, 16, "token", True),    # gated and normalised
])
def test_kernel_matches_reference(rng, family, B, T, H, d, dv, c, gate, normalize):
    args = inputs(rng, B, T, H, d, dv, gate, normalize)
    assert_matches(rng, kernel(family, normalize=normalize, chunk_size=c, block_v=16),
                   oracle(family, normalize), args)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_bf16(rng, family):
    """bf16 inputs: bf16 matmul operands, float32 state; vs the float32 reference on the same
    bf16-rounded values, gradients included."""
    args = [x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 40, 2, 16, 16)] + [make_gate(rng, 1, 40, 2)]
    ker = kernel(family, chunk_size=16)
    assert ker(*args).dtype == jnp.float32
    ref = lambda *a: oracle(family, False)(*(x.astype(jnp.float32) for x in a))
    assert_matches(rng, ker, ref, args, 3e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_reset_gate_stays_finite(rng, family):
    """A log-decay of -inf (a state reset) keeps the kernel finite and forgets the past."""
    q, k, v = make_qkv(rng, 1, 32, 1, 16, 16)
    g = make_gate(rng, 1, 32, 1).at[:, 20].set(-jnp.inf)
    ker = kernel(family, chunk_size=16)
    out = ker(q, k, v, g)
    assert np.all(np.isfinite(np.asarray(out)))
    tail = ker(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0))
    assert_close(out[:, 20:], tail, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64, family):
    """The hand-written chunk backward equals ``jax.vjp`` of the chunk forward (float64).  A
    ``d×d`` state is symmetric and carries the symmetrised cotangent ``dS + dSᵀ``."""
    chunk = importlib.import_module(f"hla_jax.kernels.{family}_chunk")
    c, d, bv = 16, 8, 4
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V, dO = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv), f64(c, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    layout = LAYOUTS[family]
    sym = lambda x, kind: x + x.T if kind == DD else x
    states = [sym(f64(d, d if kind == DD else bv), kind) for kind in layout]
    dstates = [f64(d, d if kind == DD else bv) for kind in layout]
    _, vjp = jax.vjp(chunk.chunk_forward, Q, K, V, bb, *states)
    want = vjp((dO, *dstates))
    got = chunk.chunk_backward(Q, K, V, bb, *states, dO, *(sym(x, kind) for x, kind in zip(dstates, layout)))
    want = list(want[:4]) + [sym(x, kind) for x, kind in zip(want[4:], layout)]
    for name, a, b in zip(["dQ", "dK", "dV", "db"] + [f"d{kind}{i}" for i, kind in enumerate(layout)],
                          got, want):
        assert_close(a, b, 1e-10, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_rejects_bad_input(rng, family):
    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    fn = getattr(kernels, f"{family}_pallas")
    for kw, match in [(dict(chunk_size=24), "chunk_size"), (dict(block_v=24), "block_v")]:
        with pytest.raises(ValueError, match=f"{family}_pallas: {match}"):
            fn(q, k, v, interpret=True, **kw)
    with pytest.raises(ValueError, match=f"{family}_pallas: g"):
        fn(q, k, v, jnp.ones((1, 16, 1)), interpret=True)
    with pytest.raises(ValueError, match=f"{family}_pallas: k"):
        fn(q, k[..., :8], v, interpret=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_parallel_forward_and_own_backward_tile(rng, family, platform):
    """The forward as ``states`` walk + chunk-parallel ``outputs``, and a backward value tile
    wider than the forward's, match the reference too."""
    args = inputs(rng, 2, 40, 2, 16, 32, "token", False)
    assert_matches(rng, kernel(family, chunk_size=16, block_v=16, block_v_bwd=32,
                               parallel_forward=True, platform=platform),
                   oracle(family, False), args)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_backward_in_segments_from_checkpoints(rng, family, platform):
    """``checkpoint_every``: the backward recomputes the states segment by segment from float32
    checkpoints and carries the state cotangent between segments: the gradients of the
    reference, and those of the one-segment backward (T=90 in 6 chunks: 3 segments of 2, and 2
    of 3 after padding 5 -> 6 chunks at T=70)."""
    for T, every in ((90, 2), (70, 4)):
        args = inputs(rng, 1, T, 2, 16, 32, "token", False)
        kw = dict(chunk_size=16, block_v=16, block_v_bwd=32, platform=platform)
        w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
        whole = grads_of(kernel(family, checkpoint_every=None, **kw), args, (0, 1, 2, 3), w)
        assert_matches(rng, kernel(family, checkpoint_every=every, **kw), oracle(family, False), args)
        for name, a, b in zip("qkvg", grads_of(kernel(family, checkpoint_every=every, **kw), args,
                                               (0, 1, 2, 3), w), whole):
            assert_close(a, b, 1e-5, "d" + name)


@pytest.mark.parametrize("family", ["hla2", "ahla"])
def test_state_cotangents_do_not_depend_on_the_states(rng, family):
    """HLA2 and AHLA are linear in their states, so ``dstates`` may run without them; HLA3's
    are bilinear (``wrap.BILINEAR``) and need them."""
    from hla_jax.kernels import wrap

    assert family not in wrap.BILINEAR and "hla3" in wrap.BILINEAR
    q, k, v = make_qkv(rng, 1, 48, 2, 16, 32)
    b = wrap.chunk_log_decay(make_gate(rng, 1, 48, 2), 16)
    do = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    mod = wrap.kernels(wrap.Config(family, 16, 16, 16, interpret=True))
    kw = dict(c=16, bv=16, interpret=True)
    saved = mod.states(q, k, v, b, **kw)
    for a, b_ in zip(mod.dstates(q, k, v, b, *saved, do, **kw)[0], mod.dstates(q, k, v, b, do, **kw)[0]):
        assert_close(a, b_, 1e-6, "dstates")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_tpu_path_interpret(rng, family, normalize):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    args = inputs(rng, 1, 40, 2, 16, 16, "token", normalize)
    assert_matches(rng, kernel(family, normalize=normalize, chunk_size=16, platform="tpu"),
                   oracle(family, normalize), args)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("platform,c,parallel", [("cuda", 64, False), ("cuda", 64, True), ("tpu", 128, True)])
def test_kernel_lowers_for_hardware(family, platform, c, parallel):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 4 * c, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    fn = getattr(kernels, f"{family}_pallas")
    loss = lambda q, k, v, g: fn(q, k, v, g, normalize=True, chunk_size=c, interpret=False,
                                 platform="tpu" if platform == "tpu" else "gpu",
                                 parallel_forward=parallel, checkpoint_every=2).sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3)), x(B, T, H, d), x(B, T, H, d),
                     x(B, T, H, dv), jax.ShapeDtypeStruct((B, T, H), jnp.float32))
    # forward (or states + outputs), checkpoints, states, dstates, grads; ×2 (the denominator)
    assert text.count(KERNEL_CALL[platform]) >= 10


@pytest.mark.parametrize("name,extra", [("hla2", ()), ("ahla", ()), ("hla3", ()),
                                        ("loglinear_mamba2", ("lam",)),
                                        ("loglinear_gated_deltanet", ("beta", "lam"))])
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
    if name == "hla2":
        with pytest.raises(ValueError, match="seq_axis"):
            entry(q, k, v, g, impl="pallas", seq_axis="sequence")


def test_pallas_impl_is_refused_where_there_is_no_kernel(rng):
    from hla_jax import ops

    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="pallas"):
        ops.hla3(q, k, v, mask="paper", impl="pallas")
    with pytest.raises(ValueError, match="pallas"):
        ops.gated_deltanet(q, k, v, make_gate(rng, 1, 16, 1), jnp.full((1, 16, 1), 0.5),
                           impl="pallas")


def test_auto_prefers_the_kernel_only_for_bf16_on_a_gpu(monkeypatch):
    """``impl="auto"``: Pallas on a GPU for all-bf16 inputs without sequence sharding, else XLA."""
    from hla_jax.ops.common import pallas_preferred

    bf16, f32 = jnp.zeros((1, 4, 1, 16), jnp.bfloat16), jnp.zeros((1, 4, 1, 16), jnp.float32)
    assert not pallas_preferred(None, 64, bf16, bf16)  # this machine is a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pallas_preferred(None, 64, bf16, bf16)
    assert not pallas_preferred(None, 64, bf16, f32)
    assert not pallas_preferred("sequence", 64, bf16, bf16)
    assert not pallas_preferred(None, 8, bf16, bf16)  # the kernels' chunks are >= 16


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_at_head_dim_128_gets_smaller_tiles_on_gpu(rng, family, monkeypatch):
    """float32 at d=128 does not fit Triton's shared memory at the bf16 tiles: chunk and value
    tiles are capped at ``wrap.F32_GPU_TILE`` (bf16 and d=64 keep theirs); with no cap, a clear
    error up front, not a failed compile minutes later."""
    from hla_jax.kernels import wrap

    seen = []
    monkeypatch.setattr(wrap, "chunked_core", lambda q, k, v, b, cfg: seen.append(cfg) or v)
    fn = getattr(kernels, f"{family}_pallas")
    for d, dtype in ((128, jnp.float32), (128, jnp.bfloat16), (64, jnp.float32)):
        q, k, v = (x.astype(dtype) for x in make_qkv(rng, 1, 100, 1, d, 128))
        fn(q, k, v, interpret=False, platform="gpu", block_v=64, block_v_bwd=128)
    capped = wrap.F32_GPU_TILE[f"{family}_pallas"]
    assert (seen[0].c, seen[0].bv_fwd, seen[0].bv_bwd) == (min(64, capped),) * 2 + (min(128, capped),)
    assert [(x.c, x.bv_fwd, x.bv_bwd) for x in seen[1:]] == [(64, 64, 128)] * 2
    monkeypatch.setattr(wrap, "F32_GPU_TILE", {})
    with pytest.raises(ValueError, match="bf16"):
        fn(*make_qkv(rng, 1, 16, 1, 128, 16), interpret=False, platform="gpu")
