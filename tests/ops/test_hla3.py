"""Third-order HLA (docs/math.md#hla3), masks "causal" and "paper": every form against the quadratic
reference, gradients, the combines' algebra, the decode step."""

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
from hla_jax.ops.families import hla3 as F

B, H, D, DV = 2, 2, 4, 3
_inputs = functools.partial(make_inputs, B=B, H=H, d=D, dv=DV)


def _full(g, T):
    return None if g is None else jnp.broadcast_to(g, (B, T, H))


# (mask, T, chunk_size, gate, normalize): T in {1, 7, 64, 100}, chunks 16 and 64.
CASES = [
    ("causal", 1, 16, None, False),
    ("causal", 7, 16, "head", True),
    ("causal", 64, 64, "token", False),
    ("causal", 100, 16, "reset", True),
    ("paper", 1, 64, None, True),
    ("paper", 7, 16, None, False),
    ("paper", 64, 16, None, True),
    ("paper", 100, 64, None, False),
]


@pytest.mark.parametrize("mask,T,chunk,gate,normalize", CASES)
def test_forms_match_reference_x64(x64, rng, mask, T, chunk, gate, normalize):
    q, k, v, g = _inputs(rng, T, gate, normalize)
    want = reference.hla3(q, k, v, _full(g, T), mask=mask, normalize=normalize)
    assert_forms_match(ops.hla3, (q, k, v, g), want, 1e-10, jnp.float64, mask=mask, normalize=normalize,
                       chunk_size=chunk)


@pytest.mark.parametrize("mask,gate,normalize", [("causal", "token", False),
                                                 ("paper", None, True)])
def test_forms_match_reference_float32(rng, mask, gate, normalize):
    q, k, v, g = _inputs(rng, 100, gate, normalize, np.float32)
    want = ops.hla3(q, k, v, g, mask=mask, normalize=normalize, impl="reference")
    assert_forms_match(ops.hla3, (q, k, v, g), want, 1e-4, jnp.float32, mask=mask, normalize=normalize,
                       chunk_size=16)


@pytest.mark.parametrize("mask,impl,gate,normalize", [
    ("causal", "scan", "token", False),
    ("causal", "chunked", "token", True),
    ("paper", "scan", None, False),
    ("paper", "chunked", None, True),
])
def test_gradients_x64(x64, rng, mask, impl, gate, normalize):
    T = 20
    q, k, v, g = _inputs(rng, T, gate, normalize)
    w = jnp.asarray(rng.normal(size=(B, T, H, DV)))
    args = (q, k, v) if g is None else (q, k, v, g)

    def ref_fn(q, k, v, g=None):
        return reference.hla3(q, k, v, _full(g, T), mask=mask, normalize=normalize)

    def fn(q, k, v, g=None):
        return ops.hla3(q, k, v, g, mask=mask, normalize=normalize, impl=impl, chunk_size=16)

    assert_grads_match(fn, ref_fn, args, w, 1e-10)


@pytest.mark.parametrize("mask", ["causal", "paper"])
def test_causal(rng, mask):
    T, t = 40, 21
    q, k, v, g = _inputs(rng, T, "token" if mask == "causal" else None, False, np.float32)
    assert_causal(rng, lambda q, k, v, g: ops.hla3(q, k, v, g, mask=mask, chunk_size=16),
                  q, k, v, g, t)


@pytest.mark.parametrize("mask,normalize", [("causal", True), ("paper", False)])
def test_step_token_by_token(x64, rng, mask, normalize):
    T = 7
    q, k, v, g = _inputs(rng, T, "token" if mask == "causal" else None, normalize)
    if mask == "causal":
        state = F.init_state(B, H, D, DV, normalize=normalize, dtype=jnp.float64)
        step = jax.jit(lambda s, q, k, v, g: F.step(s, q, k, v, g, normalize=normalize))
    else:
        state = F.paper_init_state(B, H, D, DV, normalize=normalize, dtype=jnp.float64)
        step = jax.jit(lambda s, q, k, v, g: F.paper_step(s, q, k, v, normalize=normalize))
    want = reference.hla3(q, k, v, g, mask=mask, normalize=normalize)
    assert_close(step_outputs(step, state, q, k, v, g)[0], want, 1e-10)


def test_paper_chunk_state_is_recurrent_state(x64, rng):
    """The chunked ``paper`` pass carries exactly the recurrent ``(SK, SQ, P, G1, G2, G3)``."""
    T = 12
    q, k, v, _ = _inputs(rng, T, None, False)
    heads_first = [jnp.moveaxis(x, 1, 2) for x in (q, k, v)]  # [B,H,T,...]: one chunk
    init = F.paper_init_state(B, H, D, DV, dtype=jnp.float64)
    chunk_state, _ = F.paper_chunk(init, *heads_first)
    state, _ = jax.lax.scan(lambda s, x: F.paper_step(s, *x)[::-1], init,
                            tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v)))
    for name, a, b in zip(F.PaperState._fields, chunk_state, state):
        assert_close(a, b, 1e-12, name)


def _random(rng, cls, shapes, gated):
    lead = (2,)
    arrays = [jnp.asarray(rng.normal(size=lead + s)) for s in shapes]
    if cls is F.Summary:
        rho = rng.uniform(0.1, 1.0, size=lead) if gated else np.ones(lead)
        arrays = [jnp.asarray(rho)] + arrays
    return cls(*arrays)


CAUSAL_SHAPES = ((D, D), (D, DV), (D, D), (D, DV), (D, D), (D, DV))
PAPER_SHAPES = ((D, D), (D, D), (D, DV), (D, D), (D, DV), (D, D, D, DV), (D, DV))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["causal", "gated", "paper"]))
def test_combine_associative(seed, kind):
    cls, comb, shapes = ((F.PaperSummary, F.paper_combine, PAPER_SHAPES) if kind == "paper"
                         else (F.Summary, F.combine, CAUSAL_SHAPES))
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        assert_associative(comb, *(_random(rng, cls, shapes, kind == "gated") for _ in range(3)))


def test_auto_is_chunked(rng):
    q, k, v, g = _inputs(rng, 20, "head", False, np.float32)
    np.testing.assert_array_equal(np.asarray(ops.hla3(q, k, v, g)),
                                  np.asarray(ops.hla3(q, k, v, g, impl="chunked")))


def test_bad_input(rng):
    q, k, v, g = _inputs(rng, 8, "token", False, np.float32)
    with pytest.raises(ValueError, match="mask"):
        ops.hla3(q, k, v, mask="full")
    with pytest.raises(ValueError, match="g must be None"):
        ops.hla3(q, k, v, g, mask="paper")
    with pytest.raises(ValueError, match="impl"):
        ops.hla3(q, k, v, impl="triton")
    with pytest.raises(ValueError, match="q"):
        ops.hla3(q[0], k, v)
    with pytest.raises(ValueError, match="k"):
        ops.hla3(q, k[..., :-1], v)
    with pytest.raises(ValueError, match="v"):
        ops.hla3(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="g"):
        ops.hla3(q, k, v, -g)
    with pytest.raises(ValueError, match="g"):
        ops.hla3(q, k, v, g[0])
    with pytest.raises(ValueError, match="chunk_size"):
        ops.hla3(q, k, v, chunk_size=-4)
