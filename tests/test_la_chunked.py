"""The chunked first-order linear attention (hla_jax/ops/la_chunked.py) against the quadratic
reference and the recurrence: outputs, gradients of every input, resets, states, sharded time.

``python tests/test_la_chunked.py`` (run by ``test_sharded_equals_unsharded`` with 4 emulated
CPU devices) checks the ``seq_axis`` form."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, devices_env, grads_of, make_gate, make_qkv, rel_err

from hla_jax.ops import reference as ref
from hla_jax.ops.xla import la_chunked, ssm_forms


def _inputs(rng, T, dtype=np.float64, B=2, H=2, d=5, dv=3, resets=()):
    """``q, k, v, g``; ``resets``: positions t where ``g[:, t] = −∞`` (a document start)."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    g = make_gate(rng, B=B, T=T, H=H, dtype=dtype)
    for t in resets:
        g = g.at[:, t].set(-jnp.inf)
    return q, k, v, g


def _chunked(chunk):
    return jax.jit(lambda *a: la_chunked.chunked(*a, chunk_size=chunk)[0])


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (100, 16), (100, 64), (50, 24)])
def test_float64(x64, rng, T, chunk):
    q, k, v, g = _inputs(rng, T)
    out = _chunked(chunk)(q, k, v, g)
    assert out.dtype == jnp.float64
    assert_close(out, ref.linear_attention(q, k, v, g), 1e-10)


def test_float32(x64, rng):
    q, k, v, g = _inputs(rng, 100, np.float32)
    out = _chunked(16)(q, k, v, g)
    assert out.dtype == jnp.float32
    assert_close(out, ref.linear_attention(*(x.astype(jnp.float64) for x in (q, k, v, g))), 1e-4)


@pytest.mark.parametrize("T,resets", [(37, ()), (100, (0, 16, 41, 42, 99))])
def test_gradients(x64, rng, T, resets):
    """Every input's gradient; ``g = −∞`` at a row start, a chunk start, mid-chunk twice in a row
    and the last token keeps values and gradients finite and exact."""
    args = _inputs(rng, T, resets=resets)
    w = jnp.asarray(rng.normal(size=args[2].shape))
    assert_close(_chunked(16)(*args), ref.linear_attention(*args), 1e-10)
    got = grads_of(_chunked(16), args, (0, 1, 2, 3), w)
    want = grads_of(jax.jit(ref.linear_attention), args, (0, 1, 2, 3), w)
    for name, a, b in zip("qkvg", got, want):
        assert_close(a, b, 1e-10, f"d/d{name}")


@pytest.mark.parametrize("T", [1, 37])
def test_states_are_the_recurrence(x64, rng, T):
    """From an initial state, outputs and the final state equal ``xla.ssm_forms.recurrent``."""
    q, k, v, g = _inputs(rng, T, resets=(min(T - 1, 20),))
    h0 = jnp.asarray(rng.normal(size=(2, 2, 5, 3)))
    out, final = la_chunked.chunked(q, k, v, g, 16, initial_state=h0)
    want, want_final = ssm_forms.recurrent(q, k, v, g, initial_state=h0)
    assert_close(out, want, 1e-10)
    assert_close(final, want_final, 1e-10, "final state")


def test_pieces_continue_each_other(x64, rng):
    q, k, v, g = _inputs(rng, 60)
    whole, final = la_chunked.chunked(q, k, v, g, 16)
    first, state = la_chunked.chunked(*(x[:, :23] for x in (q, k, v, g)), 16)
    second, last = la_chunked.chunked(*(x[:, 23:] for x in (q, k, v, g)), 16, initial_state=state)
    assert_close(jnp.concatenate([first, second], 1), whole, 1e-10)
    assert_close(last, final, 1e-10, "final state")


def test_sharded_equals_unsharded():
    res = subprocess.run([sys.executable, os.path.abspath(__file__)], env=devices_env(4),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def sharded_check(module, extra, P=4, T_local=20, chunk=16) -> float:
    """Largest relative error of ``module.chunked`` with time sharded over ``P`` devices
    (``seq_axis``, from an initial state, a reset inside a shard) against the unsharded form:
    outputs, every input's gradient and the last shard's final state (float64)."""
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, T=P * T_local, dtype=np.float64)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = make_gate(rng, T=P * T_local, dtype=np.float64).at[0, 2 * T_local + 5, 1].set(-jnp.inf)
    args = (q, k, v, g) + tuple(jnp.asarray(rng.uniform(0.1, 0.9, g.shape)) for _ in range(extra))
    h0 = jnp.asarray(rng.normal(size=(2, 2, 5, 3)))
    w = jnp.asarray(rng.normal(size=v.shape))
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
    err = sharded_check(la_chunked, 0)
    print(f"la_chunked sharded: {err:.1e}")
    sys.exit(int(not err <= 1e-10))
