"""Packed documents (docs/math.md#packed-documents) and chunked states in and out for the state-space core
(``ops.loglinear``: Mamba-2, Gated DeltaNet and their log-linear versions).

A packed row must equal its documents run alone (outputs and gradients), the chunked form must
continue from a state at any position and return the recurrence's state, and ``step`` must
continue a chunked prefill.  ``python tests/test_segments_loglinear.py`` (8 emulated devices,
run by ``test_sequence_parallel_segments`` in its own process) checks ``seq_axis``.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_env, grads_of, make_gate, make_qkv, rel_err, state_loss

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.core.state import LevelState
from hla_jax.ops.xla import ssm as loglinear

HERE = os.path.dirname(os.path.abspath(__file__))
LL_M2, LL_GDN, GDN, M2 = "loglinear_mamba2", "loglinear_gated_deltanet", "gated_deltanet", "mamba2"
OPS = {  # name -> (entry, uses beta, uses lam)
    LL_M2: (ops.loglinear_mamba2, False, True),
    LL_GDN: (ops.loglinear_gated_deltanet, True, True),
    GDN: (ops.gated_deltanet, True, False),
    M2: (ops.mamba2, False, False),
}
# row 0: documents of 13, 1, 28, 19 tokens (the 28 starts mid-chunk and spans > 2 chunks of 8);
# row 1: one document of 61
DOCS = ((13, 1, 28, 19), (61,))
T = 61


def _segment_ids(docs=DOCS):
    return jnp.asarray([np.repeat(np.arange(len(row)) + 3 * b, row) for b, row in enumerate(docs)],
                       jnp.int32)


def _inputs(rng, B=2, T=T, H=2, d=5, dv=3, dtype=np.float64, levels=None):
    """``q, k, v, g, beta, lam``: L2-normalised keys, β ∈ (0.1, 0.9), λ ∈ (0.2, 1.5)."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), dtype)
    lam = jnp.asarray(rng.uniform(0.2, 1.5, (B, T, H, levels or fenwick.num_levels(T))), dtype)
    return q, k, v, g, beta, lam


def _args(name, xs):
    q, k, v, g, beta, lam = xs
    _, uses_beta, uses_lam = OPS[name]
    return (q, k, v, g) + ((beta,) if uses_beta else ()) + ((lam,) if uses_lam else ())


def _alone_layout(docs=DOCS):
    """Each document in its own row, from position 0: ``src[r, τ] = (b, t)``, the packed token
    that row r holds at τ (the document's last token again past its end: causal, never read),
    ``real[r, τ]``, and ``at[b, t] = (r, τ)``, where packed token (b, t) lies in it."""
    src, real, at = [], [], np.zeros((len(docs), T, 2), int)
    for b, row in enumerate(docs):
        start = 0
        for n in row:
            tau = np.arange(T)
            src.append(np.stack([np.full(T, b), start + np.minimum(tau, n - 1)], -1))
            real.append(tau < n)
            at[b, start:start + n, 0], at[b, start:start + n, 1] = len(src) - 1, tau[:n]
            start += n
    return np.asarray(src), np.asarray(real), at


def _gather(x, idx):
    return x[idx[..., 0], idx[..., 1]]


PACKED_CASES = [(name, impl) for name in (LL_M2, LL_GDN, GDN)
                for impl in ("reference", "recurrent", "scan", "chunked")] + [(M2, "chunked")]


@pytest.mark.parametrize("name,impl", PACKED_CASES)
def test_packed_rows_equal_documents_alone(x64, rng, name, impl):
    """Outputs and the gradients of ``sum(out · w)`` w.r.t. every input (float64, 1e-10),
    chunk 8.  One call holds both: the two packed rows, then each document alone in a row of
    its own (one segment id per row: a single document)."""
    args = _args(name, _inputs(rng))
    src, real, at = _alone_layout()
    w = jnp.asarray(rng.normal(size=args[2].shape))
    w_all = jnp.concatenate([w, jnp.where(real[..., None, None], _gather(w, src), 0)])
    seg = jnp.concatenate([_segment_ids(), jnp.zeros(real.shape, jnp.int32)])
    fn = functools.partial(OPS[name][0], impl=impl, chunk_size=8, segment_ids=seg)
    argnums = tuple(range(len(args)))
    xs = [jnp.concatenate([x, _gather(x, src)]) for x in args]
    out, grads = jax.jit(lambda *a: (fn(*a), grads_of(fn, a, argnums, w_all)))(*xs)
    B = len(DOCS)
    assert_close(out[:B], _gather(out[B:], at), 1e-10, f"{name} {impl}")
    for what, dx in zip(["q", "k", "v", "g", "beta" if OPS[name][1] else "lam", "lam"], grads):
        assert_close(dx[:B], _gather(dx[B:], at), 1e-10, f"{name} {impl}: d/d{what}")


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_all_ones_lambda_with_segments_is_the_plain_operator(x64, rng, impl):
    q, k, v, g, beta, lam = _inputs(rng)
    kw = {"impl": impl, "chunk_size": 8, "segment_ids": _segment_ids()}
    ones = jnp.ones_like(lam)
    assert_close(ops.loglinear_mamba2(q, k, v, g, ones, **kw),
                 ops.mamba2(q, k, v, g, **kw), 1e-10, "mamba2")
    assert_close(ops.loglinear_gated_deltanet(q, k, v, g, beta, ones, **kw),
                 ops.gated_deltanet(q, k, v, g, beta, **kw), 1e-10, "gated deltanet")


def _assert_states_close(a, b, tol, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jnp.integer):
            np.testing.assert_array_equal(x, y, err_msg=what)
        else:
            assert_close(x, y, tol, what)


@pytest.mark.parametrize("name,segments", [(LL_M2, True), (LL_GDN, True), (GDN, True),
                                           (M2, True), (LL_GDN, False)])
def test_chunked_in_two_pieces_equals_one_pass(x64, rng, name, segments):
    """Split at 37 (not a multiple of the chunk, inside the third document): the second piece
    starts from the first one's final state; outputs and states equal one pass and the
    recurrence (whose final state is the last document's, at its own position)."""
    args = _args(name, _inputs(rng))
    op = functools.partial(OPS[name][0], return_final_state=True)
    seg = _segment_ids() if segments else None
    cut = 37

    def piece(x, part):
        return None if x is None else x[:, :cut] if part == 0 else x[:, cut:]

    o_rec, s_rec = op(*args, impl="recurrent", segment_ids=seg)
    o_one, s_one = op(*args, impl="chunked", chunk_size=8, segment_ids=seg)
    o_1, s_1 = op(*[piece(x, 0) for x in args], impl="chunked", chunk_size=8,
                  segment_ids=piece(seg, 0))
    o_2, s_2 = op(*[piece(x, 1) for x in args], impl="chunked", chunk_size=8,
                  segment_ids=piece(seg, 1), initial_state=s_1)
    assert_close(o_one, o_rec, 1e-10, "one pass")
    assert_close(jnp.concatenate([o_1, o_2], 1), o_rec, 1e-10, "two pieces")
    for what, s in [("one pass", s_one), ("two pieces", s_2)]:
        _assert_states_close(s, s_rec, 1e-10, f"final state, {what}")
    if OPS[name][2]:
        want = [19, 61] if segments else [T, T]
        np.testing.assert_array_equal(s_one.t, want)


@pytest.mark.parametrize("name", [LL_M2, LL_GDN])
def test_chunked_from_a_state_at_any_position(x64, rng, name):
    """A chunked pass from ``LevelState`` at positions 45 and 3 (rows differ, off the chunk
    grid), with documents, equals the recurrence from that state."""
    args = _args(name, _inputs(rng, T=40, levels=8))
    L, B, H, d, dv = 8, 2, 2, 5, 3
    state = LevelState(jnp.asarray(rng.normal(size=(L, B, H, d, dv))),
                                 jnp.asarray([45, 3], jnp.int32))
    seg = _segment_ids(((9, 20, 11), (40,)))[:, :40]
    kw = {"initial_state": state, "return_final_state": True, "segment_ids": seg}
    o, s = OPS[name][0](*args, impl="chunked", chunk_size=8, **kw)
    o_rec, s_rec = OPS[name][0](*args, impl="recurrent", **kw)
    assert_close(o, o_rec, 1e-10, "outputs")
    _assert_states_close(s, s_rec, 1e-10, "final state")
    np.testing.assert_array_equal(s.t, [11, 43])


@pytest.mark.parametrize("name", [LL_M2, LL_GDN, GDN])
def test_step_continues_a_chunked_prefill(x64, rng, name):
    """Prefill the first 50 tokens of packed rows in one chunked pass (the rows end at
    different positions of their last documents: 8 and 50), then ``step`` the rest: equals
    the recurrence over the whole rows."""
    q, k, v, g, beta, lam = xs = _inputs(rng)
    seg = _segment_ids()
    cut = 50
    prompt = [x[:, :cut] for x in _args(name, xs)]
    _, state = OPS[name][0](*prompt, impl="chunked", chunk_size=16, segment_ids=seg[:, :cut],
                            return_final_state=True)
    want = OPS[name][0](*_args(name, xs), impl="recurrent", segment_ids=seg)
    if OPS[name][2]:
        np.testing.assert_array_equal(state.t, [8, 50])
    step = jax.jit(loglinear.step)
    for t in range(cut, T):
        o, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t],
                        beta[:, t] if OPS[name][1] else None, lam[:, t] if OPS[name][2] else None)
        assert_close(o, want[:, t], 1e-10, f"t={t}")


@pytest.mark.parametrize("name,t0,T", [
    (LL_M2, (232, 0), 40),  # row 0 crosses 2^K = 64 with A = t0 >> K = 3 odd (true level 9,
    (LL_GDN, (232, 0), 40),  # not 7); row 1 starts at position 0
    (LL_M2, (250, 128), 1),  # one token; row 1 at an aligned position
])
def test_pallas_continues_a_state(rng, name, t0, T):
    """``impl="pallas"`` with ``initial_state`` and ``return_final_state`` (the log-linear
    kernels on the row, composed with one first-order pass for the state's reads and the final
    state: ``ops.levels.from_state``) equals the recurrence from the same
    state, rows at different positions, a −∞ reset in the row: outputs, final state, and the
    gradients of every input and the initial state (float32, the kernels in interpret mode)."""
    L = fenwick.num_levels(300)
    xs = list(_inputs(rng, T=T, H=1, d=16, dv=8, dtype=np.float32, levels=L))
    xs[3] = xs[3].at[1, T // 2].set(-jnp.inf)
    H0 = jnp.asarray(rng.normal(size=(L, 2, 1, 16, 8)), jnp.float32)
    t = jnp.asarray(t0, jnp.int32)

    def run(impl):
        def f(*a):
            o, st = OPS[name][0](*a[:-1], impl=impl, chunk_size=16,
                                 initial_state=LevelState(a[-1], t),
                                 return_final_state=True)
            assert np.array_equal(np.asarray(st.t), np.asarray(t) + T)
            return o, st.H
        return f

    args = _args(name, xs) + (H0,)
    got, want = run("pallas")(*args), run("recurrent")(*args)
    for a, b, what in zip(got, want, ("o", "final H")):
        assert_close(a, b, 2e-3, what)
    wo, wh = (jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in want)
    names = [n for n in ("q", "k", "v", "g", "beta", "lam") if n != "beta" or OPS[name][1]] + ["H0"]
    for n, a, b in zip(names, jax.grad(state_loss(run("pallas"), wo, wh), range(len(args)))(*args),
                       jax.grad(state_loss(run("recurrent"), wo, wh), range(len(args)))(*args)):
        assert_close(a, b, 2e-3, "d" + n)


def test_errors(rng):
    q, k, v, g, beta, lam = _inputs(rng, T=16, dtype=np.float32)
    seg = _segment_ids(((5, 11), (16,)))
    for arg, kw in [("return_final_state", {"return_final_state": True}),
                    ("initial_state", {"initial_state": loglinear.init_state(2, 2, 5, 3, 5)})]:
        with pytest.raises(ValueError, match=f"segment_ids or {arg}, not both.*chunked"):
            ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl="pallas",
                                         segment_ids=seg, **kw)
        with pytest.raises(ValueError, match=f"segment_ids or {arg}, not both.*chunked"):
            ops.loglinear_mamba2(q, k, v, g, lam, impl="pallas", segment_ids=seg, **kw)
    with pytest.raises(ValueError, match="segment_ids must be an integer array"):
        ops.gated_deltanet(q, k, v, g, beta, segment_ids=seg[:, :8])
    with pytest.raises(ValueError, match="LevelState"):
        ops.loglinear_mamba2(q, k, v, g, lam, initial_state=jnp.zeros((2, 2, 5, 3)))
    with pytest.raises(ValueError, match="LevelState"):  # 5 levels, lam has 5: H of 4 is wrong
        ops.loglinear_gated_deltanet(
            q, k, v, g, beta, lam, initial_state=loglinear.init_state(2, 2, 5, 3, 4))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 2, 5, 3\)"):
        ops.gated_deltanet(q, k, v, g, beta, initial_state=jnp.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match="initial_state / return_final_state need impl"):
        ops.loglinear_mamba2(q, k, v, g, lam, impl="scan", return_final_state=True)


def test_sequence_parallel_segments():
    """``seq_axis`` with ``segment_ids`` on 8 emulated devices (this file run as a script)."""
    env = devices_env(8)
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=HERE,
                         capture_output=True, text=True, timeout=600)
    report = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, report
    assert res.stdout.count("ok ") == len(SHARDED) and "FAIL" not in res.stdout.split(), report


SHARDED = (M2, LL_M2, LL_GDN)


def _chunked(entry, segment_ids, *args, **kw):
    return entry(*args, impl="chunked", chunk_size=8, segment_ids=segment_ids, **kw)


def _out_and_grads(f, w, *args):
    """``f(*args)`` and the gradients of ``sum(f(*args) · w)`` (the segment ids' left out)."""
    out, vjp = jax.vjp(f, *args)
    return out, vjp(w)[1:]


def sharded_check() -> int:
    """``SHARDED`` (a plain and both log-linear operators), chunked over 8 devices × 20 tokens
    (chunk 8, documents crossing
    shard boundaries and starting on one), equals the unsharded chunked form with the same
    ``segment_ids``: outputs and gradients, float64, 1e-10."""
    jax.config.update("jax_enable_x64", True)
    devices, local = 8, 20
    mesh = jax.make_mesh((devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(None, "seq")
    rng = np.random.default_rng(0)
    xs = _inputs(rng, T=devices * local, d=4)
    seg = _segment_ids(((13, 1, 28, 18, 40, 3, 20, 37), (160,)))
    failed = 0
    for name in SHARDED:
        entry = OPS[name][0]
        args = (seg,) + _args(name, xs)
        w = jnp.asarray(rng.normal(size=args[3].shape))
        op = functools.partial(_chunked, entry)
        sharded = jax.shard_map(functools.partial(op, seq_axis="seq"), mesh=mesh,
                                in_specs=(spec,) * len(args), out_specs=spec)
        out, grads = jax.jit(functools.partial(_out_and_grads, sharded))(w, *args)
        ref, ref_grads = jax.jit(functools.partial(_out_and_grads, op))(w, *args)
        err = max([rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)])
        failed += not err <= 1e-10
        print(f"{'ok' if err <= 1e-10 else 'FAIL'} {name} {err:.1e}")
    return failed


if __name__ == "__main__":
    sys.exit(int(sharded_check() > 0))
