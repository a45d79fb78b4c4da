"""The chunked Gated DeltaNet (hla_jax/ops/gdn_chunked.py) against the quadratic reference and
the recurrence: outputs, gradients of every input, resets, states, the UT inverse, sharded time.

``python tests/test_gdn_chunked.py`` (run by ``test_sharded_equals_unsharded`` with 4 emulated
CPU devices) checks the ``seq_axis`` form."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_env, grads_of, keys_around_one_direction, make_gate, make_qkv
from test_la_chunked import sharded_check

from hla_jax.ops import reference as ref
from hla_jax.ops.xla import gdn_chunked, ssm_forms


def _inputs(rng, T, dtype=np.float64, B=2, H=2, d=5, dv=3, resets=(), spread=None):
    """``q, k, v, g, beta`` with L2-normalised keys (``spread``: around one direction, the hard
    case of the UT inverse) and β ∈ (0.1, 0.9); ``g[:, t] = −∞`` at the ``resets``."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    if spread is not None:
        k = jnp.asarray(keys_around_one_direction(rng, k.shape, spread), dtype)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    for t in resets:
        g = g.at[:, t].set(-jnp.inf)
    return q, k, v, g, jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), dtype)


def _chunked(chunk):
    return jax.jit(lambda *a: gdn_chunked.chunked(*a, chunk_size=chunk)[0])


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (100, 16), (100, 64), (50, 24)])
def test_float64(x64, rng, T, chunk):
    args = _inputs(rng, T)
    out = _chunked(chunk)(*args)
    assert out.dtype == jnp.float64
    assert_close(out, ref.gated_deltanet(*args), 1e-10)


@pytest.mark.parametrize("spread", [None, 0.1])
def test_float32(x64, rng, spread):
    args = _inputs(rng, 100, np.float32, d=16, spread=spread)
    out = _chunked(64)(*args)
    assert out.dtype == jnp.float32
    assert_close(out, ref.gated_deltanet(*(x.astype(jnp.float64) for x in args)), 1e-4)


@pytest.mark.parametrize("T,resets", [(37, ()), (100, (0, 16, 41, 42, 99))])
def test_gradients(x64, rng, T, resets):
    """Every input's gradient; ``g = −∞`` at a row start, a chunk start, mid-chunk twice in a row
    and the last token keeps values and gradients finite and exact."""
    args = _inputs(rng, T, resets=resets)
    w = jnp.asarray(rng.normal(size=args[2].shape))
    assert_close(_chunked(16)(*args), ref.gated_deltanet(*args), 1e-10)
    got = grads_of(_chunked(16), args, range(5), w)
    want = grads_of(jax.jit(ref.gated_deltanet), args, range(5), w)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert_close(a, b, 1e-10, f"d/d{name}")


@pytest.mark.parametrize("T", [1, 37])
def test_states_are_the_recurrence(x64, rng, T):
    """From an initial state, outputs and the final state equal ``xla.ssm_forms.recurrent``."""
    args = _inputs(rng, T, resets=(min(T - 1, 20),))
    h0 = jnp.asarray(rng.normal(size=(2, 2, 5, 3)))
    out, final = gdn_chunked.chunked(*args, 16, initial_state=h0)
    want, want_final = ssm_forms.recurrent(*args, initial_state=h0)
    assert_close(out, want, 1e-10)
    assert_close(final, want_final, 1e-10, "final state")


@pytest.mark.parametrize("n", [1, 5, 16, 24, 64])
def test_unit_lower_inverse(x64, rng, n):
    """Value and cotangent (on strictly lower ``A``) equal those of ``jnp.linalg.inv``."""
    A = jnp.tril(jnp.asarray(rng.normal(size=(3, n, n))), -1) / np.sqrt(n)
    w = jnp.asarray(rng.normal(size=A.shape))
    assert_close(gdn_chunked.unit_lower_inverse(A), jnp.linalg.inv(jnp.eye(n) + A), 1e-12)
    (got,) = grads_of(lambda A: gdn_chunked.unit_lower_inverse(jnp.tril(A, -1)), (A,), (0,), w)
    (want,) = grads_of(lambda A: jnp.linalg.inv(jnp.eye(n) + jnp.tril(A, -1)), (A,), (0,), w)
    assert_close(got, want, 1e-12, "cotangent")


def test_sharded_equals_unsharded():
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=devices_env(4),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


if __name__ == "__main__":
    err = sharded_check(gdn_chunked, 1)
    print(f"gdn_chunked sharded: {err:.1e}")
    sys.exit(int(not err <= 1e-10))
