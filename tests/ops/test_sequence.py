"""Sequence parallelism (hla_jax/ops/sequence.py): sharded equals unsharded, argument checks."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import devices_env
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax import ops
from hla_jax.core import fenwick

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_equals_unsharded_on_8_devices():
    """Every operator, float64, outputs and gradients to 1e-10; 8 devices × T=20, chunk 16;
    and ``sequence.over_time`` under ``jit`` on a (data=2, sequence=4) mesh.

    Runs tests/sequence_check.py in its own process: the 8 emulated CPU devices must be set in
    XLA_FLAGS before jax starts.
    """
    env = devices_env(8)
    res = subprocess.run([sys.executable, os.path.join(HERE, "..", "sequence_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    report = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, report
    lines = res.stdout.split()
    assert res.stdout.count("ok ") == 11 and "FAIL" not in lines, report


def _qkv(T=8, B=1, H=1, d=2):
    x = jnp.ones((B, T, H, d))
    return x, x, x, -jnp.ones((B, T, H)) * 0.1, jnp.full((B, T, H), 0.5), jnp.ones((B, T, H, 4))


ENTRIES = {  # name -> call with the inputs of _qkv
    "hla2": lambda q, k, v, g, b, lam, **kw: ops.hla2(q, k, v, g, **kw),
    "ahla": lambda q, k, v, g, b, lam, **kw: ops.ahla(q, k, v, g, **kw),
    "hla3": lambda q, k, v, g, b, lam, **kw: ops.hla3(q, k, v, mask="paper", **kw),
    "linear_attention": lambda q, k, v, g, b, lam, **kw: ops.linear_attention(q, k, v, **kw),
    "mamba2": lambda q, k, v, g, b, lam, **kw: ops.mamba2(q, k, v, g, **kw),
    "gated_deltanet": lambda q, k, v, g, b, lam, **kw: ops.gated_deltanet(q, k, v, g, b, **kw),
    "loglinear_mamba2": lambda q, k, v, g, b, lam, **kw: ops.loglinear_mamba2(q, k, v, g, lam,
                                                                              **kw),
    "loglinear_gated_deltanet": lambda q, k, v, g, b, lam, **kw: ops.loglinear_gated_deltanet(
        q, k, v, g, b, lam, **kw),
}


@pytest.mark.parametrize("name", ENTRIES)
@pytest.mark.parametrize("impl", ["reference", "recurrent", "scan"])
def test_seq_axis_needs_chunked(name, impl):
    with pytest.raises(ValueError, match="seq_axis"):
        ENTRIES[name](*_qkv(), impl=impl, seq_axis="seq")


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**20), st.integers(1, 2**20), st.integers(1, 2**20))
def test_levels_after_a_jump(s, gap, step):
    """A key ``s`` at level ℓ of ``t0 > s`` is at level ``max(ℓ, bit_length(t XOR t0))`` of
    ``t > t0``: the rule ``fenwick.collapse`` applies to the incoming states of a shard."""
    t0 = s + gap
    t = t0 + step
    assert int(fenwick.level(t, s)) == max(int(fenwick.level(t0, s)), int(fenwick.level(t, t0)))


def test_collapse():
    H = jnp.arange(1.0, 6.0)
    np.testing.assert_array_equal(fenwick.collapse(H, 3), [0, 0, 0, 1 + 2 + 3 + 4, 5])
    np.testing.assert_array_equal(fenwick.collapse(H, 0), H)
