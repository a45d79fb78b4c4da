"""The quadratic references against brute-force sums over indices (the definitions in docs/math.md)."""

import itertools

import numpy as np
import pytest

from hla_jax.ops import reference as ref

T, D, DV = 6, 3, 2


@pytest.fixture
def xs(rng):
    q, k = rng.normal(size=(2, 1, T, 1, D))
    v = rng.normal(size=(1, T, 1, DV))
    g = -rng.uniform(0.0, 0.7, size=(1, T, 1))
    beta = rng.uniform(0.1, 1.0, size=(1, T, 1))
    lam = rng.uniform(0.2, 1.5, size=(1, T, 1, 4))
    return q, k, v, g, beta, lam


def _D(g, t, s):
    return np.exp(g[0, s + 1 : t + 1, 0].sum())


def _dot(a, b, x, y):
    return a[0, x, 0] @ b[0, y, 0]


def _brute(fn):
    return np.stack([fn(t) for t in range(T)])[None, :, None, :]


def _check(out, want):
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)


def test_linear(x64, xs):
    q, k, v, g, _, _ = xs
    want = _brute(lambda t: sum(_D(g, t, s) * _dot(q, k, t, s) * v[0, s, 0] for s in range(t + 1)))
    _check(ref.linear_attention(q, k, v, g), want)


def test_hla2(x64, xs):
    q, k, v, g, _, _ = xs
    want = _brute(lambda t: sum(
        _D(g, t, i) * _D(g, t, j) * _dot(q, k, t, i) * _dot(q, k, j, i) * v[0, j, 0]
        for j in range(t + 1) for i in range(j + 1)))
    _check(ref.hla2(q, k, v, g), want)


def test_ahla(x64, xs):
    q, k, v, g, _, _ = xs
    want = _brute(lambda t: sum(
        _D(g, t, j) * _dot(q, k, t, i) * _dot(q, k, i, j) * v[0, j, 0]
        for i in range(t + 1) for j in range(i + 1)))
    _check(ref.ahla(q, k, v, g), want)


def test_hla3_causal(x64, xs):
    q, k, v, g, _, _ = xs
    want = _brute(lambda t: sum(
        _D(g, t, i) * _D(g, t, u) * _D(g, u, j)
        * _dot(q, k, t, i) * _dot(q, k, u, i) * _dot(q, k, u, j) * v[0, j, 0]
        for u in range(t + 1) for i in range(u + 1) for j in range(u + 1)))
    _check(ref.hla3(q, k, v, g), want)


def test_hla3_paper(x64, xs):
    q, k, v, _, _, _ = xs

    def term(t):
        out = 0.0
        for i, u, j in itertools.product(range(t + 1), repeat=3):
            m = max(i, u, j)
            if (i, u, j).count(m) >= 2:
                out = out + _dot(q, k, t, i) * _dot(q, k, u, i) * _dot(q, k, u, j) * v[0, j, 0]
        return out

    _check(ref.hla3(q, k, v, mask="paper"), _brute(term))


def test_hla3_paper_streaming_algebra(x64, xs):
    """The printed streaming algebra of the paper equals the ``paper`` reference."""
    q, k, v, _, _, _ = xs
    SK, SQ = np.zeros((D, D)), np.zeros((D, D))
    P, G1, G2, G3 = np.zeros((D, DV)), np.zeros((D, DV)), np.zeros((D, DV)), np.zeros((D, DV))
    outs = []
    for t in range(T):
        qt, kt, vt = q[0, t, 0], k[0, t, 0], v[0, t, 0]
        G1 += np.outer(kt, kt) @ SQ @ P
        G2 += SK @ np.outer(qt, qt) @ P
        G3 += SK @ SQ @ np.outer(kt, vt)
        SK += np.outer(kt, kt)
        SQ += np.outer(qt, qt)
        P += np.outer(kt, vt)
        outs.append(qt @ (SK @ SQ @ P - G1 - G2 - G3))
    _check(ref.hla3(q, k, v, mask="paper"), np.stack(outs)[None, :, None])


def _level(t, s):
    return 0 if t == s else (t ^ s).bit_length()


def test_loglinear_mamba2(x64, xs):
    q, k, v, g, _, lam = xs
    want = _brute(lambda t: sum(
        lam[0, t, 0, _level(t, s)] * _D(g, t, s) * _dot(q, k, t, s) * v[0, s, 0]
        for s in range(t + 1)))
    _check(ref.loglinear_mamba2(q, k, v, g, lam), want)


@pytest.mark.parametrize("loglinear", [False, True])
def test_gated_deltanet(x64, xs, loglinear):
    q, k, v, g, beta, lam = xs

    def term(t):
        out = 0.0
        for s in range(t + 1):
            x = k[0, s, 0].copy()
            for r in range(s + 1, t + 1):
                kr = k[0, r, 0]
                x = np.exp(g[0, r, 0]) * (x - beta[0, r, 0] * kr * (kr @ x))
            w = lam[0, t, 0, _level(t, s)] if loglinear else 1.0
            out = out + w * (q[0, t, 0] @ x) * beta[0, s, 0] * v[0, s, 0]
        return out

    got = (ref.loglinear_gated_deltanet(q, k, v, g, beta, lam) if loglinear
           else ref.gated_deltanet(q, k, v, g, beta))
    _check(got, _brute(term))


def test_fenwick_levels():
    lev = ref.fenwick_levels(9)
    for t in range(9):
        for s in range(9):
            assert lev[t, s] == (_level(t, s) if s <= t else -1)
