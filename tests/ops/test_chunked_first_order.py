"""The chunked first-order forms (hla_jax/ops/xla/la_chunked.py, gdn_chunked.py) against the
quadratic reference and the recurrence, one parametrised set for both: outputs, gradients of
every input, resets, states, pieces, the UT inverse, sharded time.

``python tests/ops/test_chunked_first_order.py FAMILY`` (run by ``test_sharded_equals_unsharded``
with 4 emulated CPU devices) checks FAMILY's ``seq_axis`` form."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    devices_env,
    grads_of,
    keys_around_one_direction,
    make_gate,
    make_qkv,
    rel_err,
)

from hla_jax.ops import reference as ref
from hla_jax.ops.xla import gdn_chunked, la_chunked, ssm_forms

# family -> (chunked module, quadratic reference, names of its inputs)
FAMILIES = {"la": (la_chunked, ref.linear_attention, ("q", "k", "v", "g")),
            "gdn": (gdn_chunked, ref.gated_deltanet, ("q", "k", "v", "g", "beta"))}


def _inputs(rng, family, T, dtype=np.float64, B=2, H=2, d=5, dv=3, resets=(), spread=None):
    """``q, k, v, g`` (and β ∈ (0.1, 0.9) with L2-normalised keys for the delta rule; ``spread``:
    keys around one direction, the hard case of the UT inverse); ``g[:, t] = −∞`` at ``resets``."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    for t in resets:
        g = g.at[:, t].set(-jnp.inf)
    if family == "la":
        return q, k, v, g
    if spread is not None:
        k = jnp.asarray(keys_around_one_direction(rng, k.shape, spread), dtype)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, v, g, jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), dtype)


def _chunked(family, chunk):
    module = FAMILIES[family][0]
    return jax.jit(lambda *a: module.chunked(*a, chunk_size=chunk)[0])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (100, 16), (100, 64), (50, 24)])
def test_float64(x64, rng, family, T, chunk):
    args = _inputs(rng, family, T)
    out = _chunked(family, chunk)(*args)
    assert out.dtype == jnp.float64
    assert_close(out, FAMILIES[family][1](*args), 1e-10)


@pytest.mark.parametrize("family,spread", [("la", None), ("gdn", None), ("gdn", 0.1)])
def test_float32(x64, rng, family, spread):
    args = _inputs(rng, family, 100, np.float32, d=16, spread=spread)
    out = _chunked(family, 64)(*args)
    assert out.dtype == jnp.float32
    assert_close(out, FAMILIES[family][1](*(x.astype(jnp.float64) for x in args)), 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T,resets", [(37, ()), (100, (0, 16, 41, 42, 99))])
def test_gradients(x64, rng, family, T, resets):
    """Every input's gradient; ``g = −∞`` at a row start, a chunk start, mid-chunk twice in a row
    and the last token keeps values and gradients finite and exact."""
    _, reference, names = FAMILIES[family]
    args = _inputs(rng, family, T, resets=resets)
    w = jnp.asarray(rng.normal(size=args[2].shape))
    assert_close(_chunked(family, 16)(*args), reference(*args), 1e-10)
    got = grads_of(_chunked(family, 16), args, range(len(args)), w)
    want = grads_of(jax.jit(reference), args, range(len(args)), w)
    for name, a, b in zip(names, got, want):
        assert_close(a, b, 1e-10, f"d/d{name}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 37])
def test_states_are_the_recurrence(x64, rng, family, T):
    """From an initial state, outputs and the final state equal ``xla.ssm_forms.recurrent``."""
    args = _inputs(rng, family, T, resets=(min(T - 1, 20),))
    h0 = jnp.asarray(rng.normal(size=(2, 2, 5, 3)))
    out, final = FAMILIES[family][0].chunked(*args, 16, initial_state=h0)
    want, want_final = ssm_forms.recurrent(*args, initial_state=h0)
    assert_close(out, want, 1e-10)
    assert_close(final, want_final, 1e-10, "final state")


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_continue_each_other(x64, rng, family):
    chunked = FAMILIES[family][0].chunked
    args = _inputs(rng, family, 60)
    whole, final = chunked(*args, 16)
    first, state = chunked(*(x[:, :23] for x in args), 16)
    second, last = chunked(*(x[:, 23:] for x in args), 16, initial_state=state)
    assert_close(jnp.concatenate([first, second], 1), whole, 1e-10)
    assert_close(last, final, 1e-10, "final state")


@pytest.mark.parametrize("n", [1, 5, 16, 24, 64])
def test_unit_lower_inverse(x64, rng, n):
    """Value and cotangent (on strictly lower ``A``) equal those of ``jnp.linalg.inv``."""
    A = jnp.tril(jnp.asarray(rng.normal(size=(3, n, n))), -1) / np.sqrt(n)
    w = jnp.asarray(rng.normal(size=A.shape))
    assert_close(gdn_chunked.unit_lower_inverse(A), jnp.linalg.inv(jnp.eye(n) + A), 1e-12)
    (got,) = grads_of(lambda A: gdn_chunked.unit_lower_inverse(jnp.tril(A, -1)), (A,), (0,), w)
    (want,) = grads_of(lambda A: jnp.linalg.inv(jnp.eye(n) + jnp.tril(A, -1)), (A,), (0,), w)
    assert_close(got, want, 1e-12, "cotangent")


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_equals_unsharded(family):
    res = subprocess.run([sys.executable, os.path.abspath(__file__), family], env=devices_env(4),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def sharded_check(family, P=4, T_local=20, chunk=16) -> float:
    """Largest relative error of ``FAMILY.chunked`` with time sharded over ``P`` devices
    (``seq_axis``, from an initial state, a reset inside a shard) against the unsharded form:
    outputs, every input's gradient and the last shard's final state (float64)."""
    jax.config.update("jax_enable_x64", True)
    module = FAMILIES[family][0]
    rng = np.random.default_rng(0)
    args = _inputs(rng, family, P * T_local)
    args = (*args[:3], args[3].at[0, 2 * T_local + 5, 1].set(-jnp.inf), *args[4:])
    h0 = jnp.asarray(rng.normal(size=(2, 2, 5, 3)))
    w = jnp.asarray(rng.normal(size=args[2].shape))
    mesh = jax.make_mesh((P,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    time_spec = jax.sharding.PartitionSpec(None, "seq")
    sharded = jax.shard_map(
        lambda *a: module.chunked(*a, chunk_size=chunk, seq_axis="seq", initial_state=h0),
        mesh=mesh, in_specs=(time_spec,) * len(args),
        out_specs=(time_spec, jax.sharding.PartitionSpec("seq")))

    def out_grads_final(f):
        def run(*a):
            (out, final), vjp = jax.vjp(f, *a)
            return out, vjp((w, jnp.zeros_like(final))), final
        return jax.jit(run)(*args)

    got = out_grads_final(sharded)
    want = out_grads_final(functools.partial(module.chunked, chunk_size=chunk, initial_state=h0))
    return max([rel_err(got[0], want[0]), rel_err(got[2][-2:], want[2])]
               + [rel_err(a, b) for a, b in zip(got[1], want[1])])


if __name__ == "__main__":
    err = sharded_check(sys.argv[1])
    print(f"{sys.argv[1]} chunked sharded: {err:.1e}")
    sys.exit(int(not err <= 1e-10))
