"""Second-order HLA: every form against the quadratic reference, the combine's algebra, the step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_associative,
    assert_close,
    assert_grads_match,
    make_gate,
    make_qkv,
    rel_err,
    step_outputs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.ops import reference
from hla_jax.ops.common import clamp_signed, with_ones_column
from hla_jax.ops.families import hla2 as fam
from hla_jax.ops.families import linear

FORMS = ("recurrent", "scan", "chunked")
D, DV = 5, 3
TOL = {np.float64: 1e-10, np.float32: 1e-4}


def _inputs(rng, T, dtype, gate, positive=False):
    """``q, k, v, g`` with B=H=2, d=5, dv=3; ``positive`` takes |q|, |k| so that den > 0."""
    q, k, v = make_qkv(rng, T=T, d=D, dv=DV, dtype=dtype)
    if positive:
        q, k = jnp.abs(q), jnp.abs(k)
    return q, k, v, make_gate(rng, T=T, kind=gate, dtype=dtype)


def _run(impl, normalize=False, chunk_size=16):
    return functools.partial(ops.hla2, impl=impl, normalize=normalize, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 7, 64, 100])
def test_chunked_float64(x64, rng, T, chunk_size):
    q, k, v, g = _inputs(rng, T, np.float64, "token")
    out = _run("chunked", chunk_size=chunk_size)(q, k, v, g)
    assert out.dtype == jnp.float64 and out.shape == (2, T, 2, DV)
    assert_close(out, _run("reference")(q, k, v, g), 1e-10)


@pytest.mark.parametrize("gate,normalize", [(None, True), ("head", False), ("token", True)])
@pytest.mark.parametrize("impl", FORMS)
def test_forms_float64(x64, rng, impl, gate, normalize):
    q, k, v, g = _inputs(rng, 64, np.float64, gate)
    want = _run("reference", normalize)(q, k, v, g)
    assert_close(_run(impl, normalize)(q, k, v, g), want, 1e-10)


@pytest.mark.parametrize("impl,gate,normalize", [
    ("recurrent", "head", False), ("scan", "token", True), ("chunked", "head", False),
    ("chunked", "token", True)])
def test_forms_float32(rng, impl, gate, normalize):
    q, k, v, g = _inputs(rng, 100, np.float32, gate, positive=normalize)
    out = _run(impl, normalize, chunk_size=64)(q, k, v, g)
    assert out.dtype == jnp.float32
    assert_close(out, _run("reference", normalize)(q, k, v, g), 1e-4)


def test_bfloat16_inputs_give_float32(rng):
    q, k, v, g = (x.astype(jnp.bfloat16) for x in _inputs(rng, 7, np.float32, "token"))
    out = ops.hla2(q, k, v, g)
    assert out.dtype == jnp.float32
    assert_close(out, _run("reference")(q, k, v, g), 1e-4)


@pytest.mark.parametrize("impl,dtype,gate,normalize,T", [
    ("scan", np.float64, "token", False, 7),
    ("scan", np.float32, "head", True, 7),
    ("chunked", np.float64, "head", True, 64),
    ("chunked", np.float32, "token", True, 100),
])
def test_gradients(rng, impl, dtype, gate, normalize, T):
    with jax.enable_x64(dtype == np.float64):
        q, k, v, g = _inputs(rng, T, dtype, gate, positive=normalize)
        w = jnp.asarray(rng.normal(size=(2, T, 2, DV)), dtype)
        assert_grads_match(_run(impl, normalize), _run("reference", normalize), (q, k, v, g), w,
                           TOL[dtype])


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_gradients_without_gate(x64, rng, impl):
    q, k, v, _ = _inputs(rng, 7, np.float64, None)
    w = jnp.asarray(rng.normal(size=(2, 7, 2, DV)))
    assert_grads_match(_run(impl), _run("reference"), (q, k, v), w, 1e-10)


def test_zero_and_negative_denominators(x64, rng):
    """``den`` is a signed sum: a zero ``q_0`` gives ``den_0 = 0`` (clamped to +eps), others go negative."""
    q, k, v, g = _inputs(rng, 64, np.float64, "token")
    q = q.at[:, 0].set(0.0)
    den = _run("reference")(q, k, jnp.ones_like(v[..., :1]), g)[..., 0]
    assert np.all(den[:, 0] == 0) and np.any(den < 0)
    # the family's own denominator: the last column of the readout of a [V | 1] prefix
    prefix = jax.lax.associative_scan(fam.combine, fam.token_summaries(q, k, with_ones_column(v), g),
                                      axis=1)
    assert_close(fam.readout(prefix, q)[..., -1], den, 1e-10)
    want = _run("reference", True)(q, k, v, g)
    assert_close(want, _run("reference")(q, k, v, g) / clamp_signed(den, 1e-6)[..., None], 1e-12)
    for impl in FORMS:
        assert_close(_run(impl, True)(q, k, v, g), want, 1e-10, impl)


@pytest.mark.parametrize("impl", FORMS)
def test_reset_with_infinite_decay(x64, rng, impl):
    """A log-decay of -inf at token r erases the prefix: finite, and outputs from r on ignore tokens < r."""
    q, k, v, g = _inputs(rng, 64, np.float64, "token")
    r = 21
    g = g.at[:, r].set(-jnp.inf)
    fn = _run(impl, True)
    out = fn(q, k, v, g)
    assert np.all(np.isfinite(out))
    assert_close(out, _run("reference", True)(q, k, v, g), 1e-10)
    other = _inputs(rng, 64, np.float64, "token")
    before = lambda x, y: x.at[:, :r].set(y[:, :r])
    out2 = fn(*(before(x, y) for x, y in zip((q, k, v, g), other)))
    assert_close(out2[:, r:], out[:, r:], 1e-12)


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_causality(x64, rng, impl):
    q, k, v, g = _inputs(rng, 64, np.float64, "token")
    t0 = 29  # mid-chunk for chunk_size 16
    later = lambda x, y: x.at[:, t0 + 1:].set(y[:, t0 + 1:])
    q2, k2, v2, g2 = _inputs(rng, 64, np.float64, "token")
    fn = _run(impl, True)
    a = fn(q, k, v, g)
    b = fn(later(q, q2), later(k, k2), later(v, v2), later(g, g2))
    assert_close(b[:, :t0 + 1], a[:, :t0 + 1], 1e-14)
    assert rel_err(b[:, t0 + 1:], a[:, t0 + 1:]) > 1e-3


@pytest.mark.parametrize("normalize", [False, True])
def test_step_by_step_matches_sequence(x64, rng, normalize):
    T = 7
    q, k, v, g = _inputs(rng, T, np.float64, "token")
    step = jax.jit(functools.partial(fam.step, normalize=normalize))
    state = fam.init_state(2, 2, D, DV, normalize=normalize, dtype=jnp.float64)
    outs, state = step_outputs(step, state, q, k, v, g)
    assert_close(outs, _run("reference", normalize)(q, k, v, g), 1e-10)
    # the final state is the two LA states of the chain (docs/math.md#chains): S the inner one (values
    # k), U the
    # outer one (keys K̃ = LA(q, k, k; g), values [V | 1] when normalised, decay 2g)
    def la_state(k, v, g):
        return jax.lax.associative_scan(linear.combine, linear.token_summaries(k, v, g),
                                        axis=1)[1][:, -1]
    Kt = reference.linear_attention(q, k, k, g)
    assert_close(state.S, la_state(k, k, g), 1e-12, "S")
    assert_close(state.U, la_state(Kt, with_ones_column(v) if normalize else v, 2 * g), 1e-12,
                 "U")


def _summary(rng, rho, lead=(2,), d=3, dv=2):
    r = lambda *s: jnp.asarray(rng.normal(size=(*lead, *s)))
    return fam.Summary(jnp.full(lead, rho), r(d, d), r(d, dv), r(d, dv))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       rhos=st.lists(st.floats(0.0, 1.0, exclude_min=True), min_size=3, max_size=3))
def test_combine_is_associative(seed, rhos):
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        assert_associative(fam.combine, *(_summary(rng, r) for r in rhos))


def test_combine_identity(x64, rng):
    """The empty segment (ρ = 1, zeros) is a two-sided identity."""
    a = _summary(rng, 0.7)
    empty = fam.Summary(jnp.ones(2), *(jnp.zeros_like(x) for x in a[1:]))
    for x in (fam.combine(empty, a), fam.combine(a, empty)):
        for name, p, r in zip(fam.Summary._fields, x, a):
            assert_close(p, r, 1e-15, name)


@pytest.mark.parametrize("kwargs,message", [
    ({"k": np.zeros((2, 7, 2, D + 1))}, "hla2: k "),
    ({"v": np.zeros((1, 7, 2, DV))}, "hla2: v "),
    ({"q": np.zeros((2, 7, D))}, "hla2: q "),
    ({"g": np.full((2, 7, 2), 0.1)}, "hla2: g "),
    ({"g": np.zeros((2, 7))}, "hla2: g "),
    ({"impl": "bogus"}, "impl="),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": 2.5}, "chunk_size"),
])
def test_bad_input_raises(kwargs, message):
    args = {"q": np.zeros((2, 7, 2, D)), "k": np.zeros((2, 7, 2, D)), "v": np.zeros((2, 7, 2, DV))}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ops.hla2(**args)
