"""Bad input is refused at every operator entry with a ValueError naming the argument, before
anything is traced; legal edge cases (T = 1, d = 1, −∞ gates, documents of one token) give
finite values equal to the quadratic oracle.  Property-based: hypothesis draws the operator,
the shapes, the dtype and the corruption."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.ops import registry

OPS = tuple(registry.OPERATORS)  # every operator of the registry


def _inputs(name, B, T, H, d, dv, seed=0, dtype=np.float32):
    """``(args, kwargs)`` of a valid call of ``ops.<name>``."""
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(B, T, H, d)) / max(d, 1) ** 0.5, dtype) for _ in range(2))
    if "deltanet" in name:
        k = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = jnp.asarray(r.normal(size=(B, T, H, dv)), dtype)
    g = jnp.asarray(-r.uniform(0.05, 1.0, (B, T, H)), dtype)
    args = [q, k, v, g]
    if "deltanet" in name:
        args.append(jnp.asarray(r.uniform(0.1, 0.9, (B, T, H)), dtype))
    if name.startswith("loglinear"):
        args.append(jnp.asarray(r.uniform(0.5, 1.5, (B, T, H, fenwick.num_levels(T))), dtype))
    return args


# corruption -> (how it changes (args, kwargs), the words the error must contain)
def _corrupt(name, kind, args):
    q, k, v, g = args[:4]
    kw = {}
    if kind == "rank":
        args[0] = q[0]
        want = "q must have rank 4"
    elif kind == "k_shape":
        args[1] = k[..., :-1] if k.shape[-1] > 1 else jnp.concatenate([k, k], -1)
        want = "k must have the shape of q"
    elif kind == "v_shape":
        args[2] = jnp.concatenate([v, v], 0)
        want = "v must have shape"
    elif kind == "empty":
        args = [x[:, :0] for x in args]
        want = "at least one"
    elif kind == "int_q":
        args[0] = q.astype(jnp.int32)
        want = "q must be a floating-point"
    elif kind == "gate_sign":
        args[3] = -g
        want = "g is a log-decay and must be <= 0"
    elif kind == "gate_shape":
        args[3] = g[:, :, :1] if g.shape[2] > 1 else jnp.concatenate([g, g], 2)
        want = "g must have shape"
    elif kind == "segment_dtype":
        kw["segment_ids"] = jnp.zeros(q.shape[:2], jnp.float32)
        want = "segment_ids must be an integer array"
    elif kind == "segment_shape":
        kw["segment_ids"] = jnp.zeros((q.shape[0], q.shape[1] + 1), jnp.int32)
        want = "segment_ids must be an integer array"
    elif kind == "chunk":
        kw["chunk_size"] = 0
        want = "chunk_size must be a positive int"
    elif kind == "impl":
        kw["impl"] = "fast"
        want = "impl='fast' is not one of"
    elif kind == "state":
        kw["initial_state"] = jnp.zeros((q.shape[0] + 1, 1, 1, 1))  # never [B,H,d,dv]
        want = "initial_state must"
    return args, kw, want


KINDS = ("rank", "k_shape", "v_shape", "empty", "int_q", "gate_sign", "gate_shape",
         "segment_dtype", "segment_shape", "chunk", "impl", "state")


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(OPS), kind=st.sampled_from(KINDS), B=st.integers(1, 2),
       T=st.integers(2, 9), H=st.integers(1, 2), d=st.integers(1, 4), dv=st.integers(1, 4))
def test_bad_input_is_refused_naming_the_argument(name, kind, B, T, H, d, dv):
    args, kw, want = _corrupt(name, kind, _inputs(name, B, T, H, d, dv))
    with pytest.raises(ValueError, match=name) as e:
        getattr(ops, name)(*args, **kw)
    assert want in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["loglinear_mamba2", "loglinear_gated_deltanet"])
def test_log_levels_need_enough_levels_and_a_power_of_two_chunk(name):
    args = _inputs(name, 1, 20, 1, 4, 4)
    with pytest.raises(ValueError, match="needs at least"):
        getattr(ops, name)(*args[:-1], args[-1][..., :2])
    with pytest.raises(ValueError, match="power of two"):
        getattr(ops, name)(*args, chunk_size=24)
    with pytest.raises(ValueError, match="lam must be a floating-point"):
        getattr(ops, name)(*args[:-1], args[-1].astype(jnp.int32))


@pytest.mark.parametrize("name", ["gated_deltanet", "loglinear_gated_deltanet"])
def test_beta_is_a_float_per_token(name):
    args = _inputs(name, 1, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="beta must have shape"):
        getattr(ops, name)(*args[:4], args[4][:, :, :1], *args[5:])
    with pytest.raises(ValueError, match="beta must be a floating-point"):
        getattr(ops, name)(*args[:4], args[4].astype(jnp.int32), *args[5:])


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(OPS), T=st.sampled_from([1, 2, 5]), d=st.sampled_from([1, 3]),
       resets=st.booleans(), one_token_docs=st.booleans(), seed=st.integers(0, 2**16))
def test_edge_cases_are_finite_and_exact(name, T, d, resets, one_token_docs, seed):
    """T = 1, d = 1, −∞ gates and documents of one token: the chunked form (and the recurrence)
    equal the oracle, finite everywhere."""
    kw = {"segment_ids": jnp.arange(T, dtype=jnp.int32)[None]} if one_token_docs else {}
    f = getattr(ops, name)
    with jax.enable_x64(True):
        args = _inputs(name, 1, T, 2, d, d, seed, np.float64)
        if resets:
            args[3] = args[3].at[:, ::2].set(-jnp.inf)
        want = f(*args, impl="reference", **kw)
        for impl in ("chunked", "recurrent"):
            got = f(*args, impl=impl, chunk_size=16, **kw)
            assert bool(jnp.all(jnp.isfinite(got))), impl
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-10, err_msg=impl)
