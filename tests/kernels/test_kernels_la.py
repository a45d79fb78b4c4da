"""The first-order LA Pallas kernels (``la_pallas`` on the Triton and TPU chunk walks, interpret
mode on CPU) vs the quadratic reference: outputs and gradients, padding, gates and resets,
initial and final states, state passing, bf16, the forward walk and the backward in segments,
the chunk backward, bad input, float32 tiles on a GPU, lowering for real hardware; and the
``impl="pallas"`` / ``"auto"`` dispatch of the ops with kernels (``ops.linear_attention``,
``ops.mamba2``, the log-linear ops), refused where there is none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.kernels import la_pallas, wrap
from hla_jax.kernels.la import la_chunk, la_walks
from hla_jax.kernels.la.la_entry import WALK_TUNING
from hla_jax.ops import reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def la_reference(q, k, v, g=None, h0=None):
    """``(o, H_T)`` of LA from ``h0`` by the quadratic oracle alone: ``d`` tokens before the
    sequence write ``H0`` (keys ``e_i``, values ``H0[i]``, gate 0), ``d`` after it read ``H_T``
    (queries ``e_j``, gate 0), so ``D(t,-1)`` and ``D(T-1,s)`` come from the oracle's ``Γ``."""
    B, T, H, d = q.shape
    dv = v.shape[-1]
    h0 = jnp.zeros((B, H, d, dv)) if h0 is None else h0
    g = jnp.zeros((B, T, H)) if g is None else jnp.broadcast_to(g, (B, T, H))
    eye = jnp.broadcast_to(jnp.eye(d)[None, :, None], (B, d, H, d))
    zeros = jnp.zeros_like(eye)
    o = reference.linear_attention(
        jnp.concatenate([zeros, q, eye], 1), jnp.concatenate([eye, k, zeros], 1),
        jnp.concatenate([jnp.swapaxes(h0, 1, 2), v, jnp.zeros((B, d, H, dv))], 1),
        jnp.concatenate([jnp.zeros((B, d, H)), g, jnp.zeros((B, d, H))], 1))
    return o[:, d:d + T], jnp.swapaxes(o[:, d + T:], 1, 2)


def assert_matches(rng, fn, ref, args, tol=TOL):
    """Outputs (and final states) and the gradients of every argument of a random functional."""
    got, want = fn(*args), ref(*args)
    for name, a, b in zip(("o", "final state"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, tol, name)
    ws = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in jax.tree.leaves(want)]
    loss = lambda f: lambda *a: sum(jnp.sum(x * w) for x, w in zip(jax.tree.leaves(f(*a)), ws))
    argnums = tuple(range(len(args)))
    got, want = (jax.grad(loss(f), argnums)(*args) for f in (fn, ref))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), got, want):
        assert_close(a, b, tol, name)


@pytest.mark.parametrize("B,T,H,d,dv,c,gate", [
    (2, 40, 2, 16, 16, 16, "token"),   # T not a multiple of the chunk
    (1, 37, 2, 24, 80, 16, "head"),    # d padded (24 -> 32), a wide dv padded (80 -> 128)
    (2, 33, 1, 16, 16, 32, None),      # no decay
])
def test_la_matches_reference(rng, B, T, H, d, dv, c, gate):
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H, kind=gate)
    ker = lambda q, k, v, *g: la_pallas(q, k, v, *g, chunk_size=c)
    args = (q, k, v) if g is None else (q, k, v, g)
    assert_matches(rng, ker, lambda *a: la_reference(*a)[0], args)


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_initial_state_in_final_state_out(rng, backend):
    """``o = Σ D (q·k) v + D(t,-1) qᵀ H0`` and ``H_T = D(T-1,-1) H0 + Σ D k vᵀ``; gradients of
    q, k, v, g and the initial state, through the output and the final state."""
    q, k, v = make_qkv(rng, 2, 40, 2, 16, 16)
    g, h0 = make_gate(rng, 2, 40, 2), jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    ker = lambda *a: la_pallas(*a[:4], initial_state=a[4], return_final_state=True, chunk_size=16,
                               backend=backend)
    assert_matches(rng, ker, la_reference, (q, k, v, g, h0))


def test_final_state_without_initial_and_initial_without_final(rng):
    q, k, v = make_qkv(rng, 2, 40, 2, 16, 16)
    g, h0 = make_gate(rng, 2, 40, 2), jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    o, hT = la_pallas(q, k, v, g, return_final_state=True, chunk_size=16)
    for a, b in zip((o, hT), la_reference(q, k, v, g)):
        assert_close(a, b, TOL)
    assert_close(la_pallas(q, k, v, g, initial_state=h0, chunk_size=16),
                 la_reference(q, k, v, g, h0)[0], TOL)


def test_two_halves_with_state_passing_equal_one_pass(rng):
    """Chunked prefill: the second half started from the first half's final state gives the
    outputs, final state and gradients of one pass over the whole (the halves split a chunk)."""
    q, k, v = make_qkv(rng, 2, 40, 2, 16, 16)
    g = make_gate(rng, 2, 40, 2)
    run = lambda *a, h0=None: la_pallas(*a, initial_state=h0, return_final_state=True,
                                        chunk_size=16)

    def halves(q, k, v, g):
        o1, h1 = run(*(x[:, :23] for x in (q, k, v, g)))
        o2, h2 = run(*(x[:, 23:] for x in (q, k, v, g)), h0=h1)
        return jnp.concatenate([o1, o2], 1), h2

    assert_matches(rng, halves, run, (q, k, v, g), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_reset_gate_stays_finite_and_forgets(rng, backend):
    """Log-decays of -inf (state resets, packed documents) keep outputs and gradients finite;
    the outputs are the reference's with the reset, and those after it ignore the past."""
    q, k, v = make_qkv(rng, 2, 40, 2, 16, 16)
    g = make_gate(rng, 2, 40, 2).at[0, 5, 1].set(-jnp.inf).at[1, 16:18, 0].set(-jnp.inf)
    g = g.at[:, 20].set(-jnp.inf)
    h0 = jnp.asarray(rng.normal(size=(2, 2, 16, 16)), jnp.float32)
    ker = lambda q, k, v, h0: la_pallas(q, k, v, g, initial_state=h0, return_final_state=True,
                                        chunk_size=16, backend=backend)
    o, hT = ker(q, k, v, h0)
    for a, b in zip((o, hT), la_reference(q, k, v, g, h0)):
        assert_close(a, b, TOL)
    tail = la_pallas(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0), chunk_size=16,
                     backend=backend)
    assert_close(o[:, 20:], tail, 1e-5, "after the reset")
    w = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
    for x in grads_of(lambda *a: ker(*a)[0], (q, k, v, h0), (0, 1, 2, 3), w):
        assert np.all(np.isfinite(np.asarray(x)))


def test_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state and outputs; vs the float32 reference
    on the same bf16-rounded values (docs/math.md#tolerances: 2e-2), gradients included."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 2, 40, 2, 16, 16))
    g = make_gate(rng, 2, 40, 2)
    assert la_pallas(q, k, v, g, chunk_size=16).dtype == jnp.float32
    ref = lambda *a: la_reference(*(x.astype(jnp.float32) for x in a))[0]
    assert_matches(rng, lambda *a: la_pallas(*a, chunk_size=16), ref, (q, k, v, g), 2e-2)


def core(T, every, **kw):
    """``(o, hT)`` of ``la_walks.core`` from ``h0`` (chunk 16, value tiles 16 / 32)."""
    def fn(q, k, v, g, h0):
        p = la_walks.prepare(q, k, v, g, **{"backend": "triton", **kw}, chunk_size=16,
                             interpret=True, block_v=16, block_v_bwd=32, checkpoint_every=every)
        o, hT = la_walks.core(p.q, p.k, p.v, p.b, h0, p.cfg)
        return o[:, :T], hT
    return fn


@pytest.mark.parametrize("backend", ["triton", "tpu"])
@pytest.mark.parametrize("parallel_forward", [False, True])
@pytest.mark.parametrize("T,every", [(90, 2), (70, 4)])
def test_backward_in_segments_carries_the_initial_state(rng, backend, parallel_forward, T, every):
    """The forward as one walk or as ``states`` + chunk-parallel ``outputs``; a backward value
    tile wider than the forward's; ``checkpoint_every``: the backward recomputes the states
    segment by segment from float32 checkpoints (the first from the initial state) and carries
    the state cotangent back, from the final state's: the reference, and the one-segment
    gradients, ``dh0`` included (T=90 in 6 chunks: 3 segments of 2; T=70: 5 chunks padded to 6,
    2 segments of 3)."""
    q, k, v = make_qkv(rng, 1, T, 2, 16, 32)
    g, h0 = make_gate(rng, 1, T, 2), jnp.asarray(rng.normal(size=(1, 2, 16, 32)), jnp.float32)
    kw = dict(backend=backend, parallel_forward=parallel_forward)
    assert_matches(rng, core(T, every, **kw), core(T, None, **kw), (q, k, v, g, h0), 1e-5)
    assert_matches(rng, core(T, every, **kw), la_reference, (q, k, v, g, h0))


def test_chunk_backward_is_the_vjp_of_chunk_forward(rng, x64):
    """The hand-written chunk backward (``db`` from ``Σ q∘dq − Σ k∘dk`` plus the chunk-end
    terms) equals ``jax.vjp`` of the chunk forward, in float64."""
    c, d, bv = 16, 8, 4
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K = f64(c, d) / 2, f64(c, d) / 2
    V, dO, S, dS1 = f64(c, bv), f64(c, bv), f64(d, bv), f64(d, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    _, vjp = jax.vjp(la_chunk.chunk_forward, Q, K, V, bb, S)
    got = la_chunk.chunk_backward(Q, K, V, bb, S, dO, dS1)
    for name, a, b in zip(("dQ", "dK", "dV", "db", "dS0"), got, vjp((dO, dS1))):
        assert_close(a, b, 1e-10, name)


def test_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 16, 2, 16, 8)
    for kw, match in [(dict(initial_state=jnp.zeros((1, 2, 8, 16))), "initial_state"),
                      (dict(backend="cuda"), "backend"), (dict(chunk_size=24), "chunk_size"),
                      (dict(backend="mosaic_gpu", chunk_size=32), "backend='mosaic_gpu' takes")]:
        with pytest.raises(ValueError, match=f"la_pallas: {match}"):
            la_pallas(q, k, v, **kw)
    with pytest.raises(ValueError, match="la_pallas: g"):
        la_pallas(q, k, v, jnp.ones((1, 16, 2)))
    with pytest.raises(ValueError, match="la_pallas: k"):
        la_pallas(q, k[..., :8], v)
    for kw, match in [(dict(block_v=24), "block_v"), (dict(checkpoint_every=0), "checkpoint_every")]:
        with pytest.raises(ValueError, match=f"la_pallas: {match}"):
            la_walks.prepare(q, k, v, None, backend="triton", **kw)


def test_float32_at_head_dim_128_gets_smaller_tiles_on_gpu(rng, monkeypatch):
    """float32 at d=128 does not fit Triton's shared memory at the bf16 tiles: chunk and value
    tiles are capped at ``wrap.F32_GPU_TILE`` (bf16 and d=64 keep theirs); with no cap, a clear
    error up front, not a failed compile minutes later."""
    seen = []
    monkeypatch.setattr(la_walks, "core", lambda q, k, v, b, h0, cfg: seen.append(cfg) or (v, h0))
    for d, dtype in ((128, jnp.float32), (128, jnp.bfloat16), (64, jnp.float32)):
        q, k, v = (x.astype(dtype) for x in make_qkv(rng, 1, 100, 1, d, 128))
        la_pallas(q, k, v, backend="triton", interpret=False)
    tiles = (64, WALK_TUNING["block_v"], WALK_TUNING["block_v_bwd"])
    cap = wrap.F32_GPU_TILE["la_pallas"]
    assert [(x.c, x.bv_fwd, x.bv_bwd) for x in seen] == [tuple(min(t, cap) for t in tiles)] + [tiles] * 2
    monkeypatch.setattr(wrap, "F32_GPU_TILE", {})
    with pytest.raises(ValueError, match="bf16"):
        la_pallas(*make_qkv(rng, 1, 16, 1, 128, 16), backend="triton", interpret=False)


@pytest.mark.parametrize("platform,c,parallel_forward", [
    ("cuda", 64, False), ("cuda", 64, True), ("tpu", 128, False), ("tpu", 128, True)])
def test_lowers_for_hardware(platform, c, parallel_forward):
    """Forward and backward, with initial and final states and backward segments, pass the real
    Triton (H200) / Mosaic TPU lowering at la_pallas's tiles: no device needed."""
    B, T, H, d, dv = 1, 4 * c, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

    def loss(q, k, v, g, h0):
        p = la_walks.prepare(q, k, v, g, chunk_size=c, interpret=False, checkpoint_every=2,
                             backend="tpu" if platform == "tpu" else "triton",
                             **dict(WALK_TUNING, parallel_forward=parallel_forward))
        o, hT = la_walks.core(p.q, p.k, p.v, p.b, h0, p.cfg)
        return o.sum() + hT.sum()

    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), x(B, T, H, d),
                     x(B, T, H, d), x(B, T, H, dv), jax.ShapeDtypeStruct((B, T, H), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, d, dv), jnp.float32))
    assert text.count(KERNEL_CALL[platform]) >= 4  # checkpoints, states, dstates, grads


@pytest.mark.parametrize("entry", ["linear_attention", "mamba2"])
def test_ops_dispatch(rng, entry):
    """``ops.linear_attention`` / ``ops.mamba2`` with ``impl="pallas"`` run ``la_pallas``
    (g=None: no decay)."""
    q, k, v = make_qkv(rng, 2, 40, 2, 16, 16)
    g = make_gate(rng, 2, 40, 2) if entry == "mamba2" else None
    fn = getattr(ops, entry)
    assert_close(fn(q, k, v, g, impl="pallas", chunk_size=16), fn(q, k, v, g, impl="reference"),
                 TOL)


@pytest.mark.parametrize("name,extra", [("loglinear_mamba2", ("lam",)),
                                        ("loglinear_gated_deltanet", ("beta", "lam"))])
def test_loglinear_ops_dispatch(rng, name, extra):
    """``ops.<name>(..., impl="pallas")`` runs the log-linear kernel (interpret mode on CPU)."""
    B, T, H, d, dv = 1, 40, 2, 16, 16
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H)
    kw = {}
    if "beta" in extra:
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        kw["beta"] = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    kw["lam"] = jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H, fenwick.num_levels(T))), jnp.float32)
    entry = getattr(ops, name)
    assert_close(entry(q, k, v, g, *kw.values(), impl="pallas", chunk_size=16),
                 entry(q, k, v, g, *kw.values(), impl="reference"), TOL)


def test_pallas_impl_is_refused_where_there_is_no_kernel(rng):
    q, k, v = make_qkv(rng, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="pallas"):
        ops.hla3(q, k, v, mask="paper", impl="pallas")
    with pytest.raises(ValueError, match="pallas"):
        ops.gated_deltanet(q, k, v, make_gate(rng, 1, 16, 1), jnp.full((1, 16, 1), 0.5),
                           impl="pallas")
