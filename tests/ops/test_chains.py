"""docs/math.md#chains: hla2, ahla and causal hla3 as chains of first-order LA passes (hla_jax/ops/chains.py),
over XLA's chunked LA (impl="chunked") and the Pallas LA kernel (impl="pallas", interpret mode),
against the quadratic references: outputs and gradients of q, k, v, g."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_grads_match, make_inputs

from hla_jax import ops
from hla_jax.ops import chains, reference
from hla_jax.ops.xla import hla_forms

B, H, D, DV = 2, 2, 5, 3
OPS = ("hla2", "ahla", "hla3")


def _oracle(name, normalize, T):
    """The quadratic reference (``[B,T,H]`` gates only: a per-head gate is broadcast)."""
    def ref(q, k, v, g=None):
        g = None if g is None else jnp.broadcast_to(g, (q.shape[0], T, q.shape[2]))
        return getattr(reference, name)(q, k, v, g, normalize=normalize)
    return ref


def _entry(name, impl, normalize, chunk_size):
    def run(q, k, v, g=None):
        return getattr(ops, name)(q, k, v, g, normalize=normalize, impl=impl,
                                  chunk_size=chunk_size)
    return run


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("gate,normalize", [
    (None, True), ("head", False), ("token", False), ("token", True), ("reset", True)])
def test_xla_chain_matches_reference_x64(x64, rng, name, gate, normalize):
    """T = 37 with chunk 16 (ragged), float64, 1e-10; ``reset``: −∞ log-decays stay finite."""
    T = 37
    q, k, v, g = make_inputs(rng, T, gate, normalize, B=B, H=H, d=D, dv=DV)
    args = (q, k, v) if g is None else (q, k, v, g)
    fn, ref = _entry(name, "chunked", normalize, 16), _oracle(name, normalize, T)
    out = fn(*args)
    assert out.dtype == jnp.float64 and np.all(np.isfinite(out))
    assert_close(out, ref(*args), 1e-10)
    w = jnp.asarray(rng.normal(size=(B, T, H, DV)))
    assert_grads_match(fn, ref, args, w, 1e-10)


@pytest.mark.parametrize("name", OPS)
def test_chain_is_generic_and_keeps_the_input_dtype(rng, name):
    """A chain over any ``la(q, k, v, g, h0) -> (o, hT)``: over the quadratic LA reference (no
    states) it is the operator; with bf16
    inputs every LA call gets bf16 ``q, k, v`` (the intermediate is cast back)."""
    T = 12
    q, k, v, g = (x.astype(jnp.bfloat16) for x in make_inputs(rng, T, "token", True,
                                                             np.float32, B=B, H=H, d=D, dv=DV))
    seen = []

    def la(q, k, v, g, h0):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference.linear_attention(q, k, v, g), None

    out, _ = getattr(chains, name)(la, q, k, v, g, normalize=True)
    assert seen == [(jnp.bfloat16,) * 3] * 2
    assert_close(out, _oracle(name, True, T)(q, k, v, g), 2e-2)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("normalize", [False, True])
def test_pallas_chain_matches_reference(rng, name, normalize):
    """impl="pallas": the chain over ``kernels.la_pallas`` (interpret mode on CPU), float32,
    per-token gates, T = 20 with chunk 16; outputs and gradients to 2e-3."""
    T = 20
    q, k, v, g = make_inputs(rng, T, "token", normalize, np.float32, B=1, H=H, d=8, dv=4)
    w = jnp.asarray(rng.normal(size=(1, T, H, 4)), jnp.float32)
    fn, ref = _entry(name, "pallas", normalize, 16), _oracle(name, normalize, T)
    out = fn(q, k, v, g)
    assert out.dtype == jnp.float32
    assert_close(out, ref(q, k, v, g), 2e-3)
    assert_grads_match(fn, ref, (q, k, v, g), w, 2e-3)


def test_auto_takes_the_pallas_chain_where_preferred(rng, monkeypatch):
    """``impl="auto"`` runs the family's Pallas chain when ``spec.kernels_preferred`` says so
    (a GPU with bf16 inputs; faked here), hla3's paper mask the chunked form."""
    T = 20
    q, k, v, g = make_inputs(rng, T, "token", False, np.float32, B=1, H=H, d=8, dv=4)
    monkeypatch.setattr(hla_forms, "kernels_preferred", lambda c: True)
    run = functools.partial(ops.hla2, q, k, v, g, chunk_size=16)
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(run(impl="pallas")))
    paper = functools.partial(ops.hla3, q, k, v, mask="paper", chunk_size=16)
    np.testing.assert_array_equal(np.asarray(paper()), np.asarray(paper(impl="chunked")))


@pytest.mark.parametrize("name", OPS)
def test_pallas_chain_refuses_seq_axis(rng, name):
    """The Pallas chain does not shard time: ``seq_axis`` is for impl="chunked" (or "auto")."""
    q, k, v, g = make_inputs(rng, 16, "token", False, np.float32, B=1, H=H, d=8, dv=4)
    with pytest.raises(ValueError, match="seq_axis"):
        getattr(ops, name)(q, k, v, g, impl="pallas", seq_axis="sequence")
