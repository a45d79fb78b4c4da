"""Log-linear HLA (docs/math.md#loglinear-hla, ``hla_jax/ops/families/loglinear_hla.py``): the quadratic
reference against a brute-force sum of the definition, every form against the reference
(float64 1e-10, float32 1e-4, Pallas 2e-3) with the gradients of every input, λ = 1 against the
HLA operators, causality, decode, packed documents, states, normalisation, and (this file run as
a script on 4 emulated devices, by ``test_sequence_parallel``) ``seq_axis``."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_env, make_gate, make_qkv, rel_err

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.core.state import LevelState
from hla_jax.ops import dispatch
from hla_jax.ops.families import loglinear_hla as llh

OPS = {  # name -> (entry, its family, the HLA operator it is at λ = 1)
    "hla2": (llh.loglinear_hla2, llh.HLA2, ops.hla2),
    "ahla": (llh.loglinear_ahla, llh.AHLA, ops.ahla),
    "hla3": (llh.loglinear_hla3, llh.HLA3, ops.hla3),
}
B, H, D, DV = 2, 2, 5, 3


def _inputs(rng, T, dtype=np.float64, normalize=False, levels=None, B=B, d=D, dv=DV):
    """``q, k, v, g, lam``: per-token gates, λ ∈ (0.2, 1.5); ``normalize`` takes |q|, |k| (the
    denominator stays away from 0)."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    if normalize:
        q, k = jnp.abs(q), jnp.abs(k)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    lam = jnp.asarray(rng.uniform(0.2, 1.5, (B, T, H, levels or fenwick.num_levels(T))), dtype)
    return q, k, v, g, lam


def _run(name, impl, **kw):
    return functools.partial(OPS[name][0], impl=impl, **kw)


def _out_and_grads(fn, args, w):
    """``fn(*args)`` and the gradients of ``sum(fn(*args) · w)`` w.r.t. every argument, in one
    program."""
    def both(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(w.astype(out.dtype))

    return jax.jit(both)(*args)


def _assert_out_and_grads_close(fn, ref, args, w, tol, what):
    """``fn`` and ``ref`` agree on ``args``: outputs and the gradients of q, k, v, g, lam."""
    (out, grads), (want, want_grads) = _out_and_grads(fn, args, w), _out_and_grads(ref, args, w)
    assert out.dtype == args[0].dtype
    assert_close(out, want, tol, what)
    for name, a, b in zip("q k v g lam".split(), grads, want_grads):
        assert_close(a, b, tol, f"{what}: d/d{name}")


def _brute(name, q, k, v, g, lam):
    """The definition summed index by index (NumPy, float64), one row and head:
    hla2 ``Σ_{i≤j≤t} λ_t^{ℓ(t,j)} D(t,i) D(t,j) (q_t·k_i)(q_j·k_i) v_j``, ahla
    ``Σ_{j≤i≤t} λ_t^{ℓ(t,i)} D(t,j) (q_t·k_i)(q_i·k_j) v_j``, hla3
    ``Σ_{u≤t} Σ_{i,j≤u} λ_t^{ℓ(t,u)} D(t,i) D(t,u) D(u,j) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j``."""
    q, k, v, g, lam = (np.asarray(x, np.float64) for x in (q, k, v, g, lam))
    T = q.shape[0]
    c = np.concatenate([[0.0], np.cumsum(g)])

    def D(t, s):
        return np.exp(c[t + 1] - c[s + 1])

    o = np.zeros((T, v.shape[-1]))
    for t in range(T):
        for u in range(t + 1):  # the outer index
            w = lam[t, fenwick.level(t, u)]
            for i in range(u + 1):
                if name == "hla2":
                    o[t] += w * D(t, i) * D(t, u) * (q[t] @ k[i]) * (q[u] @ k[i]) * v[u]
                elif name == "ahla":
                    o[t] += w * D(t, i) * (q[t] @ k[u]) * (q[u] @ k[i]) * v[i]
                else:
                    for j in range(u + 1):
                        o[t] += (w * D(t, i) * D(t, u) * D(u, j) * (q[t] @ k[i]) * (q[u] @ k[i])
                                 * (q[u] @ k[j]) * v[j])
    return o


@pytest.mark.parametrize("name", OPS)
def test_reference_is_the_definition(x64, rng, name):
    """The reference (a chain of two quadratic oracles) equals the brute-force sum, T = 11."""
    q, k, v, g, lam = (x[0, :, 0] for x in _inputs(rng, 11))
    out = _run(name, "reference")(*(x[None, :, None] for x in (q, k, v, g, lam)))
    assert_close(out[0, :, 0], _brute(name, q, k, v, g, lam), 1e-12)


FORMS_X64 = [  # (operator, impl, normalize): each operator and each form, normalised and not
    ("hla2", "recurrent", False), ("hla2", "scan", True), ("hla2", "chunked", True),
    ("ahla", "recurrent", True), ("ahla", "scan", False), ("ahla", "chunked", False),
    ("hla3", "recurrent", False), ("hla3", "scan", True), ("hla3", "chunked", True),
]


@pytest.mark.parametrize("name,impl,normalize", FORMS_X64)
def test_forms_float64(x64, rng, name, impl, normalize):
    """T = 37, chunk 16: outputs and the gradients of q, k, v, g, lam to 1e-10."""
    args = _inputs(rng, 37, normalize=normalize)
    w = jnp.asarray(rng.normal(size=args[2].shape))
    _assert_out_and_grads_close(_run(name, impl, chunk_size=16, normalize=normalize),
                                _run(name, "reference", normalize=normalize), args, w, 1e-10, impl)


@pytest.mark.parametrize("name,impl", [("hla2", "chunked"), ("ahla", "scan"), ("hla3", "chunked"),
                                       ("hla3", "recurrent")])
def test_forms_float32(x64, rng, name, impl):
    """float32 inputs: float32 outputs within 1e-4 of the float64 reference, T = 70, chunk 16."""
    args = _inputs(rng, 70, np.float32)
    out = _run(name, impl, chunk_size=16)(*args)
    assert out.dtype == jnp.float32
    assert_close(out, _run(name, "reference")(*(x.astype(jnp.float64) for x in args)), 1e-4)


def test_bf16_inputs(rng):
    """bf16 ``q, k, v`` (the intermediate cast back to bf16, the outer block form on 16-bit
    products): float32 outputs within 2e-2 of the float32 reference."""
    q, k, v, g, lam = _inputs(rng, 70, np.float32, d=8, dv=8)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = llh.loglinear_hla3(q, k, v, g, lam, impl="chunked", chunk_size=16)
    assert out.dtype == jnp.float32
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(out, llh.loglinear_hla3(*f32, g, lam, impl="reference"), 2e-2)


@pytest.mark.parametrize("name", OPS)
def test_all_ones_lambda_is_the_hla_operator(x64, rng, name):
    """λ = 1: the HLA operator (causal mask), with no decay, a per-head gate and a −∞ reset."""
    q, k, v, g, lam = _inputs(rng, 37)
    ones = jnp.ones_like(lam)
    hla = functools.partial(OPS[name][2], impl="reference")
    for gate in (None, g[0, 0], g.at[1, 20].set(-jnp.inf)):
        for impl in ("reference", "chunked"):
            out = _run(name, impl, chunk_size=16)(q, k, v, gate, ones)
            want = hla(q, k, v, None if gate is None else jnp.broadcast_to(gate, g.shape))
            assert_close(out, want, 1e-10, f"{impl}, gate {None if gate is None else gate.shape}")


@pytest.mark.parametrize("name", OPS)
def test_causal(rng, name):
    """Changing the tokens after t leaves the outputs up to t bit-identical."""
    q, k, v, g, lam = _inputs(rng, 40, np.float32)
    t = 22
    fn = _run(name, "chunked", chunk_size=16)
    out = fn(q, k, v, g, lam)
    changed = [x.at[:, t + 1:].set(val) for x, val in zip((q, k, v, g, lam), (1.0, 0.5, 2.0, -0.3, 3.0))]
    out2 = fn(*changed)
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(out2[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


@pytest.mark.parametrize("name", OPS)
def test_decode_step_equals_chunked(x64, rng, name):
    """``step`` token by token (a fixed maximum of 15 levels, normalised), from ``init_state``
    and from a chunked prefill of 13 tokens, reproduces the chunked output and the chunked
    form's final state."""
    T, levels, cut = 40, 15, 13
    q, k, v, g, lam = xs = _inputs(rng, T, normalize=True, levels=levels)
    family = OPS[name][1]
    run = _run(name, "chunked", chunk_size=16, normalize=True, return_final_state=True)
    full, final = run(*xs)
    _, prefilled = run(*(x[:, :cut] for x in xs))
    step = jax.jit(functools.partial(llh.step, family, normalize=True))
    for t0, state in [(0, llh.init_state(family, B, H, D, DV, levels, normalize=True,
                                         dtype=jnp.float64)), (cut, prefilled)]:
        for t in range(t0, T):
            o, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t], lam[:, t])
            assert_close(o, full[:, t], 1e-10, f"from {t0}: t={t}")
        _assert_states_close(state, final, 1e-10, f"from {t0}: final state")


DOCS = (9, 1, 20, 11)  # one packed row of 41 tokens: documents mid-chunk, of one token, > 1 chunk


def _packed_and_alone(x):
    """Row 0: the packed row ``x[0]``; row 1 + i: document i alone from position 0 (its last
    token repeated past its end: causal, never compared)."""
    starts = np.cumsum((0,) + DOCS[:-1])
    T = sum(DOCS)
    rows = [x[0]] + [x[0, np.minimum(s + np.arange(T), s + n - 1)] for s, n in zip(starts, DOCS)]
    return jnp.stack(rows)


def _packed_part(x):
    """The alone rows' documents, laid out as the packed row."""
    return jnp.concatenate([x[1 + i, :n] for i, n in enumerate(DOCS)])


@pytest.mark.parametrize("name,impl", [("hla2", "recurrent"), ("ahla", "scan"), ("hla3", "chunked")])
def test_packed_row_equals_documents_alone(x64, rng, name, impl):
    """``segment_ids``: outputs and the gradients of every input equal each document run alone
    (levels counted from its first token, gates reset), float64, chunk 8, one call for both."""
    T = sum(DOCS)
    args = [_packed_and_alone(x) for x in _inputs(rng, T, B=1)]
    seg = jnp.zeros((1 + len(DOCS), T), jnp.int32).at[0].set(
        np.repeat(np.arange(len(DOCS), dtype=np.int32), DOCS))
    w = _packed_and_alone(jnp.asarray(rng.normal(size=(1, T, H, DV))))
    alone = np.zeros(w.shape[:2], bool)
    for i, n in enumerate(DOCS):
        alone[1 + i, :n] = True
    w = jnp.where(jnp.asarray(alone)[..., None, None] | (jnp.arange(len(w)) == 0)[:, None, None, None],
                  w, 0)
    out, grads = _out_and_grads(_run(name, impl, chunk_size=8, segment_ids=seg), args, w)
    assert_close(out[0], _packed_part(out), 1e-10, "outputs")
    for what, dx in zip("q k v g lam".split(), grads):
        assert_close(dx[0], _packed_part(dx), 1e-10, f"d/d{what}")


def _assert_states_close(a, b, tol, what):
    np.testing.assert_array_equal(a.outer.t, b.outer.t, err_msg=what)
    assert_close(a.inner, b.inner, tol, f"{what}: inner")
    assert_close(a.outer.H, b.outer.H, tol, f"{what}: outer levels")


@pytest.mark.parametrize("name,normalize", [("hla2", True), ("hla3", False)])
def test_two_pieces_equal_one_pass(x64, rng, name, normalize):
    """Packed rows split at 29 (off the chunk grid, inside a document): the chunked second piece
    from the first's final state equals one recurrent pass, outputs and final states."""
    T, cut = sum(DOCS), 29
    args = _inputs(rng, T)
    seg = jnp.asarray(np.repeat(np.arange(len(DOCS)), DOCS)[None].repeat(B, 0))
    run = functools.partial(OPS[name][0], return_final_state=True, normalize=normalize)
    o_rec, s_rec = run(*args, impl="recurrent", segment_ids=seg)
    o_1, s_1 = run(*(x[:, :cut] for x in args), impl="chunked", chunk_size=8,
                   segment_ids=seg[:, :cut])
    o_2, s_2 = run(*(x[:, cut:] for x in args), impl="chunked", chunk_size=8,
                   segment_ids=seg[:, cut:], initial_state=s_1)
    assert_close(jnp.concatenate([o_1, o_2], 1), o_rec, 1e-10, "outputs")
    _assert_states_close(s_2, s_rec, 1e-10, "final state")
    np.testing.assert_array_equal(s_2.outer.t, [DOCS[-1]] * B)


def test_normalisation_divides_by_the_operator_on_ones(x64, rng):
    """``normalize``: the operator over ``v`` divided by the operator with ``v`` replaced by 1
    (the ones column goes to the innermost values: hla2's outer, ahla's and hla3's inner)."""
    q, k, v, g, lam = _inputs(rng, 37, normalize=True)
    for name in OPS:
        fn = _run(name, "reference")
        den = fn(q, k, jnp.ones_like(v[..., :1]), g, lam)
        assert_close(fn(q, k, v, g, lam, normalize=True), fn(q, k, v, g, lam) / den, 1e-12, name)


def test_pallas(rng):
    """The LA kernel, then the log-linear kernel (interpret mode), float32, T = 20 with chunk
    16, normalised hla3 (whose outer keys and values both come from the inner pass): outputs
    and the gradients of every input within 2e-3 of the reference."""
    name, normalize = "hla3", True
    args = _inputs(rng, 20, np.float32, normalize, B=1, d=8, dv=4)
    w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
    _assert_out_and_grads_close(_run(name, "pallas", chunk_size=16, normalize=normalize),
                                _run(name, "reference", normalize=normalize), args, w, 2e-3,
                                "pallas")


def test_pallas_with_documents_and_states(rng):
    """The kernels with ``segment_ids`` equal the reference; from a state (position 9 of the
    row, continued by the kernels) they equal the recurrence, outputs and final state (ahla)."""
    q, k, v, g, lam = _inputs(rng, 20, np.float32, B=1, d=8, dv=4, levels=6)
    seg = jnp.asarray([[0] * 7 + [1] * 13])
    fn = functools.partial(llh.loglinear_ahla, chunk_size=16)
    assert_close(fn(q, k, v, g, lam, impl="pallas", segment_ids=seg),
                 fn(q, k, v, g, lam, impl="reference", segment_ids=seg), 2e-3, "segment_ids")
    o_rec, s_rec = fn(q, k, v, g, lam, impl="recurrent", return_final_state=True)
    _, s_1 = fn(*(x[:, :9] for x in (q, k, v, g, lam)), impl="recurrent", return_final_state=True)
    o_2, s_2 = fn(*(x[:, 9:] for x in (q, k, v, g, lam)), impl="pallas", initial_state=s_1,
                  return_final_state=True)
    assert_close(o_2, o_rec[:, 9:], 2e-3, "outputs from a state")
    _assert_states_close(s_2, s_rec, 2e-3, "final state")


def test_auto(rng, monkeypatch):
    """``impl="auto"``: the kernels where ``spec.kernels_preferred`` (faked here), except a
    state with ``segment_ids``; the chunked form otherwise."""
    q, k, v, g, lam = _inputs(rng, 20, np.float32)
    seg = jnp.zeros((B, 20), jnp.int32)

    def choose(segment_ids, stateful):
        _, c = dispatch.check(llh.HLA2_SPEC, q, k, v, g, lam=lam, chunk_size=16,
                              segment_ids=segment_ids, return_final_state=stateful)
        return c.spec.auto(c)

    assert choose(segment_ids=None, stateful=False) == "chunked"
    monkeypatch.setattr(llh, "kernels_preferred", lambda c: True)
    assert choose(segment_ids=seg, stateful=False) == "pallas"
    assert choose(segment_ids=None, stateful=True) == "pallas"
    assert choose(segment_ids=seg, stateful=True) == "chunked"


def test_errors(rng):
    q, k, v, g, lam = _inputs(rng, 40, np.float32)
    f = llh.loglinear_hla2
    with pytest.raises(ValueError, match="loglinear_hla2: lam has 6 levels but T=40 needs at least 7"):
        f(q, k, v, g, lam[..., :6])
    with pytest.raises(ValueError, match="loglinear_ahla: g is a log-decay"):
        llh.loglinear_ahla(q, k, v, -g, lam)
    with pytest.raises(ValueError, match="power of two"):
        f(q, k, v, g, lam, chunk_size=24)
    with pytest.raises(ValueError, match="loglinear_hla3: impl='fast'"):
        llh.loglinear_hla3(q, k, v, g, lam, impl="fast")
    with pytest.raises(ValueError, match="initial_state / return_final_state need impl"):
        f(q, k, v, g, lam, impl="scan", return_final_state=True)
    with pytest.raises(ValueError, match="seq_axis"):
        f(q, k, v, g, lam, impl="recurrent", seq_axis="seq")
    with pytest.raises(ValueError, match="eps must be > 0"):
        f(q, k, v, g, lam, normalize=True, eps=0.0)
    seg = jnp.zeros((B, 40), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids or return_final_state, not both"):
        f(q, k, v, g, lam, impl="pallas", segment_ids=seg, return_final_state=True)
    good = llh.init_state(llh.HLA3, B, H, D, DV, 7)
    for bad in (good.outer, good._replace(inner=good.inner[..., :D]),
                good._replace(outer=LevelState(good.outer.H[1:], good.outer.t))):
        with pytest.raises(ValueError, match=r"loglinear_hla3: initial_state must be a State\(inner"):
            llh.loglinear_hla3(q, k, v, g, lam, initial_state=bad)
    with pytest.raises(ValueError, match="initial_state must be a State"):  # normalised: dv + 1
        llh.loglinear_hla3(q, k, v, g, lam, normalize=True, initial_state=good)


def test_sequence_parallel():
    """``seq_axis`` on 4 emulated devices (this file run as a script)."""
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=devices_env(4),
                         cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                         text=True, timeout=600)
    report = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0 and res.stdout.startswith("ok "), report


def sharded_check() -> int:
    """Normalised hla3 (both of its outer inputs from the inner pass), chunked over 4 devices ×
    11 tokens (chunk 8, packed documents crossing shard boundaries), equals the unsharded
    chunked form: outputs and the gradients of every input, float64, 1e-10."""
    jax.config.update("jax_enable_x64", True)
    devices, local = 4, 11
    mesh = jax.make_mesh((devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(None, "seq")
    rng = np.random.default_rng(0)
    args = _inputs(rng, devices * local, normalize=True)
    seg = jnp.asarray([np.repeat(np.arange(4), (9, 14, 1, 20)), np.zeros(devices * local, int)])
    w = jnp.asarray(rng.normal(size=args[2].shape))

    def op(seg, *a, **kw):
        return llh.loglinear_hla3(*a, impl="chunked", chunk_size=8, normalize=True,
                                  segment_ids=seg, **kw)

    def out_and_grads(f, *a):
        out, vjp = jax.vjp(f, *a)
        return out, vjp(w)[1:]

    sharded = jax.shard_map(functools.partial(op, seq_axis="seq"), mesh=mesh,
                            in_specs=(spec,) * 6, out_specs=spec)
    got = jax.jit(functools.partial(out_and_grads, sharded))(seg, *args)
    want = jax.jit(functools.partial(out_and_grads, op))(seg, *args)
    err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print(f"{'ok' if err <= 1e-10 else 'FAIL'} hla3 {err:.1e}")
    return int(not err <= 1e-10)


if __name__ == "__main__":
    sys.exit(sharded_check())
