"""Log-linear Mamba-2 and (log-linear) Gated DeltaNet: every form against the quadratic oracle."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, make_gate, make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.ops import reference as ref
from hla_jax.ops.xla import ssm as loglinear

OPS = {  # name -> (operator, reference, uses beta, uses lam)
    "loglinear_mamba2": (ops.loglinear_mamba2, ref.loglinear_mamba2, False, True),
    "gated_deltanet": (ops.gated_deltanet, ref.gated_deltanet, True, False),
    "loglinear_gated_deltanet": (ops.loglinear_gated_deltanet, ref.loglinear_gated_deltanet,
                                 True, True),
}


def _inputs(rng, T, dtype=np.float64, B=2, H=2, d=5, dv=3, levels=None):
    """``q, k, v, g, beta, lam`` with L2-normalised keys, β ∈ (0.1, 0.9), λ ∈ (0.2, 1.5)."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), dtype)
    lam = jnp.asarray(rng.uniform(0.2, 1.5, size=(B, T, H, levels or fenwick.num_levels(T))), dtype)
    return q, k, v, g, beta, lam


def _args(name, xs):
    q, k, v, g, beta, lam = xs
    _, _, uses_beta, uses_lam = OPS[name]
    return (q, k, v, g) + ((beta,) if uses_beta else ()) + ((lam,) if uses_lam else ())


def _reference(name, *args):
    return jax.jit(OPS[name][1])(*(a.astype(jnp.float64) for a in args))


LL_M2, LL_GDN, GDN = "loglinear_mamba2", "loglinear_gated_deltanet", "gated_deltanet"
CASES = [  # (operator, impl, chunk, T): every T and chunk size per form, not the full product
    (LL_M2, "recurrent", 64, 100), (LL_GDN, "recurrent", 64, 1), (GDN, "recurrent", 64, 64),
    (LL_M2, "scan", 64, 257), (LL_GDN, "scan", 64, 5), (LL_GDN, "scan", 64, 64),
    (GDN, "scan", 64, 100),
    (LL_M2, "chunked", 16, 1), (LL_M2, "chunked", 32, 257), (LL_M2, "chunked", 64, 64),
    (LL_GDN, "chunked", 16, 257), (LL_GDN, "chunked", 32, 100), (LL_GDN, "chunked", 64, 5),
    (GDN, "chunked", 16, 100), (GDN, "chunked", 64, 257),
]


@pytest.mark.parametrize("name,impl,chunk,T", CASES)
def test_forms_float64(x64, rng, name, impl, chunk, T):
    args = _args(name, _inputs(rng, T))
    out = OPS[name][0](*args, impl=impl, chunk_size=chunk)
    assert out.dtype == jnp.float64
    assert_close(out, _reference(name, *args), 1e-10, f"{name} {impl}/{chunk}")


@pytest.mark.parametrize("name,impl,chunk", [
    (LL_GDN, "recurrent", 64), (LL_M2, "scan", 64), (LL_GDN, "scan", 64), (LL_M2, "chunked", 32),
    (LL_GDN, "chunked", 64), (GDN, "chunked", 16)])
def test_forms_float32(x64, rng, name, impl, chunk):
    args = _args(name, _inputs(rng, 100, dtype=np.float32))
    out = OPS[name][0](*args, impl=impl, chunk_size=chunk)
    assert out.dtype == jnp.float32
    assert_close(out, _reference(name, *args), 1e-4, f"{name} {impl}/{chunk}")


@pytest.mark.parametrize("impl,chunk", [("scan", 64), ("chunked", 16)])
@pytest.mark.parametrize("name", list(OPS))
def test_gradients(x64, rng, name, impl, chunk):
    args = _args(name, _inputs(rng, 12 if impl == "scan" else 37))
    w = jnp.asarray(rng.normal(size=args[2].shape))
    argnums = tuple(range(len(args)))
    fn = functools.partial(OPS[name][0], impl=impl, chunk_size=chunk)
    got = grads_of(fn, args, argnums, w)
    want = grads_of(jax.jit(OPS[name][1]), args, argnums, w)
    names = ["q", "k", "v", "g", "beta" if OPS[name][2] else "lam", "lam"]
    for what, a, b in zip(names, got, want):
        assert_close(a, b, 1e-10, f"{name} {impl}: d/d{what}")


@pytest.mark.parametrize("impl,chunk", [("recurrent", 64), ("scan", 64), ("chunked", 16)])
def test_all_ones_lambda_is_the_plain_operator(x64, rng, impl, chunk):
    q, k, v, g, beta, lam = _inputs(rng, 64)
    ones = jnp.ones_like(lam)
    kw = {"impl": impl, "chunk_size": chunk}
    assert_close(ops.loglinear_mamba2(q, k, v, g, ones, **kw),
                 ops.mamba2(q, k, v, g, **kw), 1e-10, "mamba2")
    assert_close(ops.loglinear_gated_deltanet(q, k, v, g, beta, ones, **kw),
                 ops.gated_deltanet(q, k, v, g, beta, **kw), 1e-10, "gated deltanet")


@pytest.mark.parametrize("name", [LL_M2, LL_GDN])
def test_decode_step_equals_chunked(x64, rng, name):
    """``step`` (its position carried in the state; fixed maximum of 15 levels) reproduces the
    chunked output."""
    T, levels = 70, 15
    q, k, v, g, beta, lam = _inputs(rng, T, levels=levels)
    beta = beta if OPS[name][2] else None
    full = OPS[name][0](*_args(name, (q, k, v, g, beta, lam)), impl="chunked", chunk_size=16)
    state = loglinear.init_state(2, 2, 5, 3, levels, jnp.float64)
    step = jax.jit(loglinear.step)
    for t in range(T):
        o, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t],
                        None if beta is None else beta[:, t], lam[:, t])
        assert_close(o, full[:, t], 1e-10, f"t={t}")


def test_spare_levels_change_nothing(x64, rng):
    """A fixed maximum of 15 levels (more than T=100 needs) gives the same outputs."""
    args = _args("loglinear_mamba2", _inputs(rng, 100, levels=15))
    want = _reference("loglinear_mamba2", *args)
    for impl, chunk in [("recurrent", 64), ("scan", 64), ("chunked", 32)]:
        out = ops.loglinear_mamba2(*args, impl=impl, chunk_size=chunk)
        assert_close(out, want, 1e-10, impl)


def _summaries(rng, n, matrix):
    _, k, v, g, beta, _ = _inputs(rng, n, dtype=np.float32, B=1, H=2)
    A, X = loglinear.token_summaries(k, v, g, beta if matrix else None)
    return [(A[:, i], X[:, i]) for i in range(n)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), matrix=st.booleans())
def test_combine_is_associative(seed, matrix):
    """The Fenwick-level SSM pair combine, scalar (Mamba-2) and matrix (Gated DeltaNet) A."""
    a, b, c = _summaries(np.random.default_rng(seed), 3, matrix)
    left = loglinear.combine(loglinear.combine(a, b), c)
    right = loglinear.combine(a, loglinear.combine(b, c))
    for x, y in zip(left, right):
        assert_close(x, y, 1e-5)


@pytest.mark.parametrize("impl,chunk", [("scan", 64), ("chunked", 16)])
@pytest.mark.parametrize("name", [LL_M2, LL_GDN])
def test_causal(rng, name, impl, chunk):
    q, k, v, g, beta, lam = _inputs(rng, 40, dtype=np.float32)
    t0 = 22
    out = OPS[name][0](*_args(name, (q, k, v, g, beta, lam)), impl=impl, chunk_size=chunk)
    changed = tuple(x.at[:, t0 + 1:].set(val)
                    for x, val in zip((q, k, v, g, beta, lam), (1.0, 0.5, 2.0, -0.3, 0.5, 3.0)))
    out2 = OPS[name][0](*_args(name, changed), impl=impl, chunk_size=chunk)
    np.testing.assert_array_equal(np.asarray(out[:, :t0 + 1]), np.asarray(out2[:, :t0 + 1]))


@pytest.mark.parametrize("name,impl,chunk", [
    (LL_GDN, "recurrent", 64), (LL_M2, "scan", 64), (LL_GDN, "scan", 64), (LL_M2, "chunked", 16),
    (LL_GDN, "chunked", 16), (GDN, "chunked", 16)])
def test_infinite_log_decay_stays_finite(x64, rng, name, impl, chunk):
    """A log-decay of −∞ (a document boundary) keeps every form finite and exact."""
    q, k, v, g, beta, lam = _inputs(rng, 40)
    args = _args(name, (q, k, v, g.at[:, 19].set(-jnp.inf), beta, lam))
    assert_close(OPS[name][0](*args, impl=impl, chunk_size=chunk), _reference(name, *args), 1e-10)


def test_errors(rng):
    q, k, v, g, beta, lam = _inputs(rng, 40, dtype=np.float32)
    with pytest.raises(ValueError, match="T=40 needs at least 7"):
        ops.loglinear_mamba2(q, k, v, g, lam[..., :6])
    with pytest.raises(ValueError, match="T=40 needs at least 7"):
        ops.loglinear_gated_deltanet(q, k, v, g, beta, lam[..., :3])
    with pytest.raises(ValueError, match="lam must have shape"):
        ops.loglinear_mamba2(q, k, v, g, lam[:, :39])
    with pytest.raises(ValueError, match="lam must have shape"):
        ops.loglinear_mamba2(q, k, v, g, lam[..., 0])
    with pytest.raises(ValueError, match="beta must have shape"):
        ops.gated_deltanet(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="log-decay"):
        ops.loglinear_mamba2(q, k, v, -g, lam)
    with pytest.raises(ValueError, match="log-decay"):
        ops.gated_deltanet(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="g .*required"):
        ops.gated_deltanet(q, k, v, None, beta)
    for c in (24, 48, 0):
        with pytest.raises(ValueError, match="chunk_size"):
            ops.loglinear_mamba2(q, k, v, g, lam, chunk_size=c)
    with pytest.raises(ValueError, match="power of two"):
        ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl="scan", chunk_size=24)
    for fn, args in [(ops.loglinear_mamba2, (q, k, v, g, lam)),
                     (ops.gated_deltanet, (q, k, v, g, beta))]:
        with pytest.raises(ValueError, match="impl"):
            fn(*args, impl="fast")
    with pytest.raises(ValueError, match="k must"):
        ops.gated_deltanet(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="rank 4"):
        ops.loglinear_mamba2(q, k, v[0], g, lam)


def test_plain_gated_deltanet_accepts_any_chunk_size(x64, rng):
    args = _args("gated_deltanet", _inputs(rng, 50))
    out = ops.gated_deltanet(*args, chunk_size=24)
    assert_close(out, _reference("gated_deltanet", *args), 1e-10)


def test_block_form_bf16_runs_16_bit_products_both_ways(rng):
    """``impl="chunked"`` (the block form, ``ops.loglinear_blocks``) on bf16 inputs: outputs and
    every gradient within the bf16 tolerance of the float32 oracle, every product of the inputs on
    16-bit operands (forward and backward; the decays' chunk sums, ``la_chunked.decays``, are
    float32), and no loop over chunks at all."""
    q, k, v, g, _, lam = _inputs(rng, 300, np.float32, d=16, dv=16)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    fn = functools.partial(ops.loglinear_mamba2, impl="chunked", chunk_size=16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(fn(q, k, v, g, lam), ref.loglinear_mamba2(*f32, g, lam), 2e-2)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    got = grads_of(fn, (q, k, v, g, lam), range(5), w)
    want = grads_of(ref.loglinear_mamba2, (*f32, g, lam), range(5), w)
    for name, a, b in zip(["q", "k", "v", "g", "lam"], got, want):
        assert_close(a.astype(jnp.float32), b, 2e-2, "d" + name)
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=range(5))).lower(
        q, k, v, g, lam).as_text()
    operands = re.findall(r"stablehlo.dot_general.*: \(tensor<([^>]*)>, tensor<([^>]*)>\)", hlo)
    decays = [x for x in operands if "16x16xf32" in x]  # the decays' chunk sums, float32
    assert operands and {(a[-4:], b[-4:]) for a, b in operands if (a, b) not in decays} == {
        ("bf16", "bf16")}
    assert "stablehlo.while" not in hlo


def test_gated_deltanet_block_form_bf16_has_no_loop(rng):
    """``impl="chunked"`` of log-linear Gated DeltaNet (the block form,
    ``ops.loglinear_gdn_blocks``) on bf16 inputs: outputs and every gradient within the bf16
    tolerance of the float32 oracle, the sweeps and reads on 16-bit operands (the chunk terms
    in float32), and no loop over chunks or levels in the program."""
    q, k, v, g, beta, lam = _inputs(rng, 300, np.float32, d=16, dv=16)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    fn = functools.partial(ops.loglinear_gated_deltanet, impl="chunked", chunk_size=16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(fn(q, k, v, g, beta, lam), ref.loglinear_gated_deltanet(*f32, g, beta, lam), 2e-2)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    got = grads_of(fn, (q, k, v, g, beta, lam), range(6), w)
    want = grads_of(ref.loglinear_gated_deltanet, (*f32, g, beta, lam), range(6), w)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "lam"], got, want):
        assert_close(a.astype(jnp.float32), b, 2e-2, "d" + name)
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=range(6))).lower(
        q, k, v, g, beta, lam).as_text()
    assert "stablehlo.while" not in hlo
    operands = re.findall(r"stablehlo.dot_general.*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", hlo)
    assert ("bf16", "bf16") in operands and ("f32", "f32") in operands


@pytest.mark.parametrize("name", [LL_M2, LL_GDN])
def test_block_form_is_taken_only_on_the_grid(x64, rng, name):
    """Packed documents and states keep the counter form (levels off the grid); both equal the
    oracle, and the block form is the grid case."""
    from hla_jax.ops.xla import loglinear_blocks, loglinear_gdn_blocks

    xs = _inputs(rng, 70)
    args = _args(name, xs)
    out = OPS[name][0](*args, impl="chunked", chunk_size=16)
    blocks = (loglinear_blocks.blocks(*args, 16) if name == LL_M2
              else loglinear_gdn_blocks.blocks(*args, 16))
    assert_close(out, blocks, 1e-13, "the block form")  # the same program up to jit's fusion
    seg = jnp.asarray(np.repeat([[0, 1, 2]], [20, 31, 19], axis=1).repeat(2, 0))
    packed = OPS[name][0](*args, impl="chunked", chunk_size=16, segment_ids=seg)
    assert_close(packed, OPS[name][1](*args, segment_ids=seg), 1e-10)
    state = loglinear.init_state(2, 2, 5, 3, fenwick.num_levels(70), jnp.float64)
    resumed = OPS[name][0](*args, impl="chunked", chunk_size=16, initial_state=state)
    assert_close(resumed, OPS[name][1](*args), 1e-10, "from an empty state: the counter form")
