"""AHLA (docs/math.md#ahla): every form against the quadratic reference, gradients, the combine's algebra."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_associative,
    assert_causal,
    assert_close,
    assert_forms_match,
    assert_grads_match,
    make_inputs,
    step_outputs,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.ops import reference
from hla_jax.ops.families import ahla as F

B, H, D, DV = 2, 2, 5, 3
_inputs = functools.partial(make_inputs, B=B, H=H, d=D, dv=DV)


# (T, chunk_size, gate, normalize): T in {1, 7, 64, 100}, chunks 16 and 64, every gate kind.
CASES = [
    (1, 16, None, False),
    (7, 16, "head", True),
    (64, 64, "token", False),
    (64, 16, None, True),
    (100, 16, "reset", True),
    (100, 64, "head", False),
]


@pytest.mark.parametrize("T,chunk,gate,normalize", CASES)
def test_forms_match_reference_x64(x64, rng, T, chunk, gate, normalize):
    q, k, v, g = _inputs(rng, T, gate, normalize)
    want = reference.ahla(q, k, v, None if g is None else jnp.broadcast_to(g, (B, T, H)),
                          normalize=normalize)
    assert_forms_match(ops.ahla, (q, k, v, g), want, 1e-10, jnp.float64, normalize=normalize,
                       chunk_size=chunk)


@pytest.mark.parametrize("normalize", [False, True])
def test_forms_match_reference_float32(rng, normalize):
    q, k, v, g = _inputs(rng, 100, "token", normalize, np.float32)
    want = ops.ahla(q, k, v, g, normalize=normalize, impl="reference")
    assert_forms_match(ops.ahla, (q, k, v, g), want, 1e-4, jnp.float32, normalize=normalize,
                       chunk_size=16)


@pytest.mark.parametrize("impl,gate,normalize", [
    ("scan", "token", False), ("chunked", "token", True), ("chunked", "head", False)])
def test_gradients_x64(x64, rng, impl, gate, normalize):
    T = 20
    q, k, v, g = _inputs(rng, T, gate, normalize)
    w = jnp.asarray(rng.normal(size=(B, T, H, DV)))

    def ref_fn(q, k, v, g):
        return reference.ahla(q, k, v, jnp.broadcast_to(g, (B, T, H)), normalize=normalize)

    def fn(q, k, v, g):
        return ops.ahla(q, k, v, g, normalize=normalize, impl=impl, chunk_size=16)

    assert_grads_match(fn, ref_fn, (q, k, v, g), w, 1e-10)


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_causal(rng, impl):
    T, t = 40, 21
    q, k, v, g = _inputs(rng, T, "token", False, np.float32)
    assert_causal(rng, lambda q, k, v, g: ops.ahla(q, k, v, g, impl=impl, chunk_size=16),
                  q, k, v, g, t)


@pytest.mark.parametrize("normalize", [False, True])
def test_step_token_by_token(x64, rng, normalize):
    T = 7
    q, k, v, g = _inputs(rng, T, "token", normalize)
    state = F.init_state(B, H, D, DV, normalize=normalize, dtype=jnp.float64)
    step = jax.jit(lambda s, *x: F.step(s, *x, normalize=normalize))
    assert_close(step_outputs(step, state, q, k, v, g)[0],
                 reference.ahla(q, k, v, g, normalize=normalize), 1e-10)


def _random_summary(rng, gated):
    lead = (2,)
    rho = rng.uniform(0.1, 1.0, size=lead) if gated else np.ones(lead)
    return F.Summary(jnp.asarray(rho), *(jnp.asarray(rng.normal(size=lead + s))
                                         for s in ((D, DV), (D, D), (D, DV))))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gated=st.booleans())
def test_combine_associative(seed, gated):
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        assert_associative(F.combine, *(_random_summary(rng, gated) for _ in range(3)))


def test_token_summaries_scan_gives_state(x64, rng):
    """The inclusive prefix of token summaries carries the recurrent state (P, E)."""
    q, k, v, g = _inputs(rng, 9, "token", False)

    @jax.jit
    def both(q, k, v, g):
        prefix = jax.lax.associative_scan(F.combine, F.token_summaries(q, k, v, g), axis=1)
        state, _ = jax.lax.scan(lambda s, x: F.step(s, *x)[::-1],
                                F.init_state(B, H, D, DV, dtype=jnp.float64),
                                tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g)))
        return prefix, state

    prefix, state = both(q, k, v, g)
    assert_close(prefix.P[:, -1], state.P, 1e-12, "P")
    assert_close(prefix.E[:, -1], state.E, 1e-12, "E")


def test_auto_is_chunked(rng):
    q, k, v, g = _inputs(rng, 20, "head", False, np.float32)
    np.testing.assert_array_equal(np.asarray(ops.ahla(q, k, v, g)),
                                  np.asarray(ops.ahla(q, k, v, g, impl="chunked")))


def test_bad_input(rng):
    q, k, v, g = _inputs(rng, 8, "token", False, np.float32)
    with pytest.raises(ValueError, match="impl"):
        ops.ahla(q, k, v, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        ops.ahla(q, k, v, impl="fast")
    with pytest.raises(ValueError, match="q"):
        ops.ahla(q[0], k, v)
    with pytest.raises(ValueError, match="k"):
        ops.ahla(q, k[..., :-1], v)
    with pytest.raises(ValueError, match="v"):
        ops.ahla(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="g"):
        ops.ahla(q, k, v, -g)
    with pytest.raises(ValueError, match="g"):
        ops.ahla(q, k, v, g[:, :, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        ops.ahla(q, k, v, chunk_size=0)
