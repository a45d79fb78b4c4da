"""Fenwick levels, the static intra-chunk table and the binary-counter carry (docs/math.md#loglinear)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hla_jax.core import fenwick
from hla_jax.ops import reference as ref


@pytest.mark.parametrize("T", [1, 2, 5, 64, 100, 257])
def test_level_matches_reference(T):
    want = ref.fenwick_levels(T)
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    lower = s <= t
    np.testing.assert_array_equal(fenwick.level(t, s)[lower], want[lower])  # numpy path
    traced = jax.jit(fenwick.level)(jnp.asarray(t, jnp.int32), jnp.asarray(s, jnp.int32))
    np.testing.assert_array_equal(np.asarray(traced)[lower], want[lower])  # jax (clz) path


@pytest.mark.parametrize("c", [1, 2, 16, 64])
def test_level_table_is_reference_table(c):
    np.testing.assert_array_equal(fenwick.level_table(c), ref.fenwick_levels(c))


def test_num_levels():
    for T in range(1, 1100):
        assert fenwick.num_levels(T) == max(1, math.ceil(math.log2(T)) + 1)
        assert fenwick.num_levels(T) == (T - 1).bit_length() + 1
    for T in (1, 5, 64, 100, 257):
        assert fenwick.num_levels(T) == ref.fenwick_levels(T).max() + 1


def test_trailing_zeros_and_bit_length():
    t = np.arange(1, 5000)
    tz = np.asarray(jax.jit(fenwick.trailing_zeros)(jnp.asarray(t, jnp.int32)))
    np.testing.assert_array_equal(tz, [(x & -x).bit_length() - 1 for x in t.tolist()])
    want = [x.bit_length() for x in t.tolist()]
    np.testing.assert_array_equal(fenwick.bit_length(t), want)  # numpy path
    np.testing.assert_array_equal(np.asarray(fenwick.bit_length(jnp.asarray(t))), want)  # clz path


@pytest.mark.parametrize("c", [1, 2, 16, 64])
def test_chunk_log2(c):
    assert fenwick.chunk_log2(c) == int(np.log2(c))


@pytest.mark.parametrize("c", [0, 3, 24, 48, -4])
def test_chunk_log2_rejects_non_powers_of_two(c):
    with pytest.raises(ValueError, match="power of two"):
        fenwick.chunk_log2(c)


@settings(max_examples=30, deadline=None)
@given(lc=st.integers(0, 6), n=st.integers(1, 200), data=st.data())
def test_chunk_level_formula(lc, n, data):
    """Between chunks: ``ℓ(n c + τ, n' c + σ) = log2 c + 1 + ⌊log2(n XOR n')⌋`` for every τ, σ."""
    c = 1 << lc
    n_prev = data.draw(st.integers(0, n - 1))
    tau, sigma = data.draw(st.integers(0, c - 1)), data.draw(st.integers(0, c - 1))
    want = lc + 1 + int(np.floor(np.log2(n ^ n_prev)))
    assert int(fenwick.level(n * c + tau, n_prev * c + sigma)) == want


def _counter_levels(T, L):
    """Run the counter with one-hot keys: ``out[t, ℓ, s] = 1`` iff key s is in H[ℓ] at step t."""

    def body(H, t):
        H = fenwick.carry(H, t).at[0].set(jax.nn.one_hot(t, T))
        return H, H

    _, out = jax.lax.scan(body, jnp.zeros((L, T)), jnp.arange(T))
    return np.asarray(out)


@pytest.mark.parametrize("T", [1, 5, 64, 100])
def test_carry_sorts_keys_into_fenwick_levels(T):
    """After carry(H, t) and H[0] = {t}, H[ℓ] holds exactly the keys s with ℓ(t, s) = ℓ."""
    L = fenwick.num_levels(T)
    out = _counter_levels(T, L)
    want = ref.fenwick_levels(T)
    for lev in range(L):
        np.testing.assert_array_equal(out[:, lev, :], (want == lev).astype(np.float64))


def test_carry_with_spare_levels():
    """A fixed maximum number of levels (more than needed) changes nothing."""
    out = _counter_levels(37, 15)
    assert not out[:, fenwick.num_levels(37):].any()


@settings(max_examples=20, deadline=None)
@given(t=st.integers(0, 2**10 - 1), seed=st.integers(0, 2**31 - 1))
def test_carry_properties(t, seed):
    """Mass is conserved, levels 0..z are emptied, only level z+1 gains, t = 0 is the identity."""
    L = 11
    H = np.random.default_rng(seed).normal(size=(L, 3, 2)).astype(np.float32)
    out = np.asarray(jax.jit(fenwick.carry)(jnp.asarray(H), jnp.int32(t)))
    np.testing.assert_allclose(out.sum(0), H.sum(0), atol=1e-5)
    if t == 0:
        np.testing.assert_array_equal(out, H)
        return
    z = (t & -t).bit_length() - 1
    assert not out[: z + 1].any()
    np.testing.assert_allclose(out[z + 1], H[: z + 2].sum(0), atol=1e-5)
    np.testing.assert_array_equal(out[z + 2:], H[z + 2:])


def test_carry_per_row():
    """``carry(H, t)`` with one position per batch row equals each row carried alone."""
    H = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4, 3)))
    t = jnp.asarray([0, 1, 12, 7], jnp.int32)
    out = jax.jit(fenwick.carry)(H, t)
    for b in range(4):
        np.testing.assert_array_equal(out[:, b], fenwick.carry(H[:, b], t[b]))


@settings(max_examples=30, deadline=None)
@given(s=st.integers(0, 2**12), gap=st.integers(1, 2**12), step=st.integers(0, 2**12))
def test_levels_at(s, gap, step):
    """A key ``s`` at level ℓ of ``t0 > s`` is at level ``levels_at(L, t, t0)[ℓ]`` of ``t ≥ t0``."""
    t0, t = s + gap, s + gap + step
    lev = np.asarray(fenwick.levels_at(15, jnp.int32(t), jnp.int32(t0)))
    assert lev[int(fenwick.level(t0, s))] == int(fenwick.level(t, s))
