"""Packed documents (docs/math.md#packed-documents) and chunked states in and out for hla2, ahla and hla3
(both masks).

Packed rows equal their documents run alone (outputs and gradients of q, k, v, g) in every impl;
a sequence run in two pieces through ``initial_state`` / ``return_final_state`` equals one pass,
and the final state is the recurrence's (``impl="recurrent"`` and a ``step`` loop).
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_env, make_inputs, step_outputs

from hla_jax import ops
from hla_jax.ops.families import ahla as ahla_family
from hla_jax.ops.families import hla2 as hla2_family
from hla_jax.ops.families import hla3 as hla3_family

H, D, DV, CHUNK = 2, 4, 3, 16
LENGTHS = ((13, 1, 28, 19), (61,))  # documents of each row: several chunks, starts mid-chunk
T = 61
DOCS = [(b, sum(row[:i]), n) for b, row in enumerate(LENGTHS) for i, n in enumerate(row)]
SEGMENT_IDS = jnp.asarray([np.repeat(np.arange(len(row)) + 7 * b, row)
                           for b, row in enumerate(LENGTHS)], jnp.int32)
OPS = {  # name -> (entry, keyword arguments)
    "hla2": (ops.hla2, {}),
    "ahla": (ops.ahla, {}),
    "hla3": (ops.hla3, {}),
    "paper": (ops.hla3, {"mask": "paper"}),
}


def _alone(x):
    """``[B,T,...] -> [docs,T,...]``: each document from position 0, zero-padded to T."""
    return jnp.stack([jnp.pad(x[b, s:s + n], [(0, T - n)] + [(0, 0)] * (x.ndim - 2))
                      for b, s, n in DOCS])


def _packed(y):
    """``[docs,T,...] -> [B,T,...]``: each document's outputs back in its row."""
    out = jnp.zeros((len(LENGTHS), T) + y.shape[2:], y.dtype)
    for i, (b, s, n) in enumerate(DOCS):
        out = out.at[b, s:s + n].set(y[i, :n])
    return out


def _args(rng, name, gate, normalize, dtype=np.float64):
    q, k, v, g = make_inputs(rng, T, gate, normalize, dtype, B=len(LENGTHS), H=H, d=D, dv=DV)
    return (q, k, v) if g is None else (q, k, v, g)


def _out_and_grads(fn, args, w):
    """``fn(*args)`` and the gradients of ``sum(fn(*args) * w)``, in one jitted vjp."""
    def run(w, *args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(w.astype(out.dtype))
    return jax.jit(run)(w, *args)


def _assert_match(out_grads, want_grads, tol, what):
    """Outputs (finite) and gradients ``(out, (dq, dk, dv[, dg]))`` equal the wanted ones."""
    (out, grads), (want, want_grads) = out_grads, want_grads
    assert np.all(np.isfinite(out)), what
    assert_close(out, want, tol, what)
    for x, a, b in zip("qkvg", grads, want_grads):
        assert_close(a, b, tol, f"{what} d/d{x}")


def _check_packed(rng, name, gate, normalize, impls, dtype, tol, outputs_only=()):
    """Packed rows against their documents alone (the reference on each document's own tokens,
    causal: the zero padding after them is inert), outputs and gradients (outputs only for the
    impls in ``outputs_only``)."""
    entry, kw = OPS[name]
    kw = kw | {"normalize": normalize}
    args = _args(rng, name, gate, normalize, dtype)
    w = jnp.asarray(rng.normal(size=(len(LENGTHS), T, H, DV)))
    want = _out_and_grads(lambda *a: _packed(entry(*map(_alone, a), impl="reference", **kw)),
                          args, w)
    for impl in impls:
        packed = functools.partial(entry, impl=impl, chunk_size=CHUNK, segment_ids=SEGMENT_IDS,
                                   **kw)
        if impl in outputs_only:
            assert_close(jax.jit(packed)(*args), want[0], tol, impl)
        else:
            _assert_match(_out_and_grads(packed, args, w), want, tol, impl)


IMPLS = ("reference", "recurrent", "scan", "chunked")
# operator -> (gate, normalize) for every impl; the decayed operators' other settings (gate None
# <-> per-token, normalize flipped) run chunked
SETTINGS = {"hla2": ("token", False), "ahla": (None, True), "hla3": ("token", True),
            "paper": (None, False)}


@pytest.mark.parametrize("name", OPS)
def test_packed_rows_equal_documents_alone_x64(x64, rng, name):
    """Documents of 13, 1, 28, 19 tokens in one row, 61 in the other, chunk 16: float64, 1e-10.
    The decayed operators' scan is their scan under a −∞ gate: outputs here for ahla and hla3,
    gradients for hla2; the ``paper`` scan's segmented combine with gradients."""
    gate, normalize = SETTINGS[name]
    _check_packed(rng, name, gate, normalize, IMPLS, np.float64, 1e-10,
                  outputs_only=("scan",) if name in ("ahla", "hla3") else ())


@pytest.mark.parametrize("name", ["hla2", "ahla", "hla3"])
def test_packed_rows_equal_documents_alone_other_settings_x64(x64, rng, name):
    """The settings the test above leaves out, chunked (``paper`` normalised: the two-piece and
    sharded tests)."""
    gate, normalize = SETTINGS[name]
    _check_packed(rng, name, "token" if gate is None else None, not normalize, ("chunked",),
                  np.float64, 1e-10)


@pytest.mark.parametrize("name,gate,normalize", [("hla2", "token", True), ("hla3", None, False)])
def test_packed_rows_equal_documents_alone_pallas(rng, name, gate, normalize):
    """The Pallas chains (interpret mode; ahla's is the same reset through ``la_pallas``),
    float32: 2e-3."""
    _check_packed(rng, name, gate, normalize, ("pallas",), np.float32, 2e-3)


FAMILIES = {"hla2": (hla2_family.init_state, hla2_family.step),
            "ahla": (ahla_family.init_state, ahla_family.step),
            "hla3": (hla3_family.init_state, hla3_family.step),
            "paper": (hla3_family.paper_init_state,
                      lambda s, q, k, v, g, **kw: hla3_family.paper_step(s, q, k, v, **kw))}


def _last_document_state(name, args, normalize):
    """Each row's final state by the family's ``step`` over its last document from empty."""
    init, step = FAMILIES[name]
    step = jax.jit(functools.partial(step, normalize=normalize))
    states = []
    for b, row in enumerate(LENGTHS):
        x = [a[b:b + 1, T - row[-1]:] for a in args] + [None] * (4 - len(args))
        states.append(step_outputs(step, init(1, H, D, DV, normalize=normalize,
                                              dtype=args[0].dtype), *x)[1])
    return jax.tree.map(lambda *s: jnp.concatenate(s), *states)


@pytest.mark.parametrize("name,gate,normalize,impl,grads", [
    ("hla2", "token", True, "chunked", True), ("ahla", None, False, "chunked", False),
    ("hla3", "token", False, "chunked", False), ("paper", None, True, "chunked", False),
    ("hla3", None, True, "recurrent", False)])
def test_two_pieces_equal_one_pass_x64(x64, rng, name, gate, normalize, impl, grads):
    """Packed rows cut at t = 30 (inside a document): the first piece's final state starts the
    second; outputs (and gradients, through the state) equal one pass, and the final state is
    the recurrence's and that of a ``step`` loop over each row's last document."""
    entry, kw = OPS[name]
    kw = kw | {"normalize": normalize, "chunk_size": CHUNK}
    args = _args(rng, name, gate, normalize)
    cut = 30

    def pieces(*a):
        first = [x[:, :cut] for x in a] + [SEGMENT_IDS[:, :cut]]
        rest = [x[:, cut:] for x in a] + [SEGMENT_IDS[:, cut:]]
        o1, s1 = entry(*first[:-1], segment_ids=first[-1], impl=impl, return_final_state=True,
                       **kw)
        o2, s2 = entry(*rest[:-1], segment_ids=rest[-1], impl=impl, initial_state=s1,
                       return_final_state=True, **kw)
        return jnp.concatenate([o1, o2], 1), s2

    def one_pass(*a, impl="chunked", **more):
        return entry(*a, segment_ids=SEGMENT_IDS, impl=impl, **kw, **more)

    (out, state), (want, recurrent) = (
        jax.jit(f)(*args) for f in (pieces, functools.partial(one_pass, impl="recurrent",
                                                              return_final_state=True)))
    assert_close(out, want, 1e-10)
    stepped = _last_document_state(name, args, normalize)
    assert type(state) is type(recurrent) is type(stepped)
    for field, x, y, z in zip(state._fields, state, recurrent, stepped):
        assert_close(x, y, 1e-10, f"{field} (recurrent)")
        assert_close(x, z, 1e-10, f"{field} (step)")
    if grads:
        w = jnp.asarray(rng.normal(size=out.shape))
        _assert_match(*(_out_and_grads(f, args, w) for f in (lambda *a: pieces(*a)[0], one_pass)),
                      1e-10, "two pieces")


def test_two_pieces_equal_one_pass_pallas(rng):
    """The Pallas chain hands its two LA passes' final states on (hla3: the inner state is
    ``[S | P]``), float32, 2e-3."""
    entry, _ = OPS["hla3"]
    q, k, v, g = _args(rng, "hla3", "token", False, np.float32)
    run = functools.partial(entry, chunk_size=CHUNK, impl="pallas")
    o1, s1 = run(q[:, :30], k[:, :30], v[:, :30], g[:, :30], return_final_state=True)
    o2, s2 = run(q[:, 30:], k[:, 30:], v[:, 30:], g[:, 30:], initial_state=s1,
                 return_final_state=True)
    assert_close(jnp.concatenate([o1, o2], 1), entry(q, k, v, g, impl="reference"), 2e-3)
    want = entry(q, k, v, g, impl="recurrent", return_final_state=True)[1]
    for field, x, y in zip(want._fields, s2, want):
        assert_close(x, y, 2e-3, field)


def test_bad_segment_ids_and_states(rng):
    q, k, v, g = _args(rng, "hla2", "token", False, np.float32)
    with pytest.raises(ValueError, match="segment_ids"):
        ops.hla2(q, k, v, g, segment_ids=SEGMENT_IDS[:, :-1])
    with pytest.raises(ValueError, match="segment_ids"):
        ops.ahla(q, k, v, g, segment_ids=SEGMENT_IDS.astype(jnp.float32))
    for impl in ("reference", "scan"):
        with pytest.raises(ValueError, match="return_final_state"):
            ops.hla2(q, k, v, g, impl=impl, return_final_state=True)
    with pytest.raises(ValueError, match="seq_axis"):
        ops.hla3(q, k, v, g, initial_state=hla3_family.init_state(2, H, D, DV), seq_axis="seq")
    with pytest.raises(ValueError, match="initial_state must be a State"):
        ops.hla2(q, k, v, g, normalize=True, initial_state=hla2_family.init_state(2, H, D, DV))
    with pytest.raises(ValueError, match="initial_state must be a PaperState"):
        ops.hla3(q, k, v, mask="paper", initial_state=hla3_family.init_state(2, H, D, DV))
    _, state = ops.ahla(q, k, v, g, initial_state=tuple(ahla_family.init_state(2, H, D, DV)),
                        return_final_state=True)
    assert isinstance(state, ahla_family.State)


def test_sharded_segments_on_8_devices():
    """``seq_axis`` with ``segment_ids`` (hla2, hla3 paper): documents that start inside
    shards, at shard boundaries and span whole shards; tests/sequence_check.py ``segments``."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = devices_env(8)
    res = subprocess.run([sys.executable, os.path.join(here, "..", "sequence_check.py"), "segments"],
                         env=env, capture_output=True, text=True, timeout=600)
    report = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, report
    assert res.stdout.count("ok ") == 2 and "FAIL" not in res.stdout.split(), report
