"""First-order linear attention and Mamba-2: every form against the quadratic reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, make_gate, make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.ops import reference as ref
from hla_jax.ops.families import linear

FORMS = [("recurrent", 64), ("scan", 64), ("chunked", 16), ("chunked", 32), ("chunked", 64)]


def _inputs(rng, T, gate="token", dtype=np.float64, B=2, H=2, d=5, dv=3):
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    return q, k, v, make_gate(rng, B=B, T=T, H=H, kind=gate, dtype=dtype)


@pytest.mark.parametrize("impl,chunk,T,gate", [
    ("recurrent", 64, 1, "token"), ("recurrent", 64, 100, "head"), ("scan", 64, 5, None),
    ("scan", 64, 257, "token"), ("chunked", 16, 1, "token"), ("chunked", 16, 257, "token"),
    ("chunked", 32, 64, "head"), ("chunked", 32, 100, "token"), ("chunked", 64, 5, None),
    ("chunked", 64, 100, "token"), ("chunked", 64, 257, "head")])
def test_linear_attention_float64(x64, rng, impl, chunk, T, gate):
    q, k, v, g = _inputs(rng, T, gate)
    out = ops.linear_attention(q, k, v, g, impl=impl, chunk_size=chunk)
    assert out.dtype == jnp.float64
    g_full = None if g is None else jnp.broadcast_to(g, q.shape[:3])  # the reference takes [B,T,H]
    assert_close(out, ref.linear_attention(q, k, v, g_full), 1e-10, f"{impl}/{chunk}")


@pytest.mark.parametrize("impl,chunk", FORMS)
def test_mamba2_float32(x64, rng, impl, chunk):
    q, k, v, g = _inputs(rng, 100, dtype=np.float32)
    out = ops.mamba2(q, k, v, g, impl=impl, chunk_size=chunk)
    assert out.dtype == jnp.float32
    want = ref.linear_attention(*(x.astype(jnp.float64) for x in (q, k, v, g)))
    assert_close(out, want, 1e-4, f"{impl}/{chunk}")


def test_chunk_size_need_not_be_a_power_of_two(x64, rng):
    q, k, v, g = _inputs(rng, 50)
    assert_close(ops.mamba2(q, k, v, g, chunk_size=24), ref.linear_attention(q, k, v, g), 1e-10)


@pytest.mark.parametrize("impl,chunk", [("scan", 64), ("chunked", 16)])
def test_gradients(x64, rng, impl, chunk):
    q, k, v, g = _inputs(rng, 45)
    w = jnp.asarray(rng.normal(size=v.shape))
    got = grads_of(lambda *a: ops.mamba2(*a, impl=impl, chunk_size=chunk), (q, k, v, g),
                   (0, 1, 2, 3), w)
    want = grads_of(jax.jit(ref.linear_attention), (q, k, v, g), (0, 1, 2, 3), w)
    for name, a, b in zip("qkvg", got, want):
        assert_close(a, b, 1e-10, f"d/d{name}")


def test_step_token_by_token(x64, rng):
    q, k, v, g = _inputs(rng, 21)
    full = ops.mamba2(q, k, v, g, impl="chunked", chunk_size=16)
    state = linear.init_state(2, 2, 5, 3, dtype=jnp.float64)
    step = jax.jit(linear.step)
    for t in range(q.shape[1]):
        o, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t])
        assert_close(o, full[:, t], 1e-10, f"t={t}")


def test_step_without_gate(x64, rng):
    q, k, v, _ = _inputs(rng, 6)
    state = linear.init_state(2, 2, 5, 3, dtype=jnp.float64)
    outs = []
    for t in range(6):
        o, state = linear.step(state, q[:, t], k[:, t], v[:, t])
        outs.append(o)
    assert_close(jnp.stack(outs, 1), ref.linear_attention(q, k, v), 1e-10)


def test_associative_scan_of_token_summaries(x64, rng):
    """The notebook path: ``associative_scan(combine, token_summaries(...))`` then ``readout``."""
    q, k, v, g = _inputs(rng, 30)
    prefix = jax.jit(lambda s: jax.lax.associative_scan(linear.combine, s, axis=1))
    _, H = prefix(linear.token_summaries(k, v, g))
    assert_close(linear.readout(H, q), ref.linear_attention(q, k, v, g), 1e-10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), gated=st.booleans())
def test_combine_is_associative(seed, gated):
    rng = np.random.default_rng(seed)
    _, k, v, g = _inputs(rng, 3, "token" if gated else None, np.float32, B=1, H=2)
    g = jnp.zeros(k.shape[:3]) if g is None else g
    A, X = linear.token_summaries(k, v, g)
    a, b, c = ((A[:, i], X[:, i]) for i in range(3))
    left = linear.combine(linear.combine(a, b), c)
    right = linear.combine(a, linear.combine(b, c))
    for x, y in zip(left, right):
        assert_close(x, y, 1e-6)


@pytest.mark.parametrize("impl,chunk", [("recurrent", 64), ("scan", 64), ("chunked", 16)])
def test_causal(rng, impl, chunk):
    q, k, v, g = _inputs(rng, 40, dtype=np.float32)
    t0 = 17
    out = ops.mamba2(q, k, v, g, impl=impl, chunk_size=chunk)
    def bump(x):
        return x.at[:, t0 + 1:].add(1.0)

    out2 = ops.mamba2(bump(q), bump(k), bump(v), g.at[:, t0 + 1:].set(-0.1), impl=impl,
                         chunk_size=chunk)
    np.testing.assert_array_equal(np.asarray(out[:, :t0 + 1]), np.asarray(out2[:, :t0 + 1]))


@pytest.mark.parametrize("impl,chunk", [("recurrent", 64), ("scan", 64), ("chunked", 16)])
def test_infinite_log_decay_resets(x64, rng, impl, chunk):
    """A log-decay of −∞ (a document boundary) stays finite and cuts the past off."""
    q, k, v, g = _inputs(rng, 40)
    g = g.at[:, 20].set(-jnp.inf)
    out = ops.mamba2(q, k, v, g, impl=impl, chunk_size=chunk)
    assert_close(out, ref.linear_attention(q, k, v, g), 1e-10)
    after = ref.linear_attention(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0))
    assert_close(out[:, 20:], after, 1e-10, "after the reset")


def test_errors(rng):
    q, k, v, g = _inputs(rng, 8, dtype=np.float32)
    with pytest.raises(ValueError, match="impl"):
        ops.mamba2(q, k, v, g, impl="fast")
    with pytest.raises(ValueError, match="g"):
        ops.mamba2(q, k, v, None)
    with pytest.raises(ValueError, match="log-decay"):
        ops.mamba2(q, k, v, -g)
    with pytest.raises(ValueError, match="k must"):
        ops.linear_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v must"):
        ops.linear_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="rank 4"):
        ops.linear_attention(q[0], k, v)
    with pytest.raises(ValueError, match="g must have shape"):
        ops.mamba2(q, k, v, g[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        ops.mamba2(q, k, v, g, chunk_size=0)


def test_linear_attention_documents_and_state(x64, rng):
    """Without a gate: ``segment_ids`` reset the state at each document start (equal to each
    document alone), and a chunked pass from the state after the first 19 tokens (mid-document,
    off the chunk grid) continues the one-pass outputs and final state."""
    q, k, v, _ = _inputs(rng, 40)
    seg = jnp.asarray([np.repeat([0, 1, 2], [11, 20, 9]), np.repeat([5, 6, 7], [9, 11, 20])])
    out, state = ops.linear_attention(q, k, v, segment_ids=seg, impl="chunked", chunk_size=8,
                                         return_final_state=True)
    oracle = jax.jit(ref.linear_attention)
    for b, cuts in enumerate([(0, 11, 31, 40), (0, 9, 20, 40)]):
        for s, e in zip(cuts[:-1], cuts[1:]):
            alone = oracle(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e])
            assert_close(out[b:b + 1, s:e], alone, 1e-10, f"row {b} [{s}, {e})")
    o1, s1 = ops.linear_attention(q[:, :19], k[:, :19], v[:, :19], segment_ids=seg[:, :19],
                                     impl="chunked", chunk_size=8, return_final_state=True)
    o2, s2 = ops.linear_attention(q[:, 19:], k[:, 19:], v[:, 19:], segment_ids=seg[:, 19:],
                                     impl="chunked", chunk_size=8, initial_state=s1,
                                     return_final_state=True)
    assert_close(jnp.concatenate([o1, o2], 1), out, 1e-10, "two pieces")
    assert_close(s2, state, 1e-10, "final state")
    _, s_rec = ops.linear_attention(q, k, v, segment_ids=seg, impl="recurrent",
                                       return_final_state=True)
    assert_close(state, s_rec, 1e-10, "recurrent final state")
