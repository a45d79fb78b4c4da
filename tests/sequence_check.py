"""Sequence parallelism on 8 emulated CPU devices (run by test_sequence.py in its own process).

``python tests/sequence_check.py``: for every operator, the chunked form with the time axis
sharded over 8 devices inside ``jax.shard_map`` equals the unsharded chunked form in float64 (1e-10)
for outputs and the gradients of ``sum(out * w)`` w.r.t. every input.  T per device (20) is not
a multiple of the chunk (16).  Then ``sequence.over_time`` under ``jit`` on a (data=2,
sequence=4) mesh (the model-level use).  Prints one line per check, exits 1 on a mismatch.

``python tests/sequence_check.py segments``: packed documents (``segment_ids``) under
``seq_axis`` for hla2 (a gate reset) and hla3's paper mask (cut by document), against the
unsharded chunked form (float64, 1e-10, outputs and gradients); run by test_segments_hla.py.

``python tests/sequence_check.py bytes``: per-layer communication (bytes received per device by
the forward's all-gathers) for B=1, H=16, d=dv=128, P=8, from the lowered program, against
``(P − 1)·B·H·|s|·4`` with the summary sizes ``SUMMARY``; exits 1 on a mismatch.
"""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = " ".join(filter(None, (  # the caller's flags kept (the suite's: conftest)
    os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import make_gate, make_qkv, rel_err  # noqa: E402
from jax.sharding import PartitionSpec as Spec  # noqa: E402

from hla_jax import ops  # noqa: E402
from hla_jax.core import fenwick  # noqa: E402

P_DEV, T_LOCAL, CHUNK = 8, 20, 16
CASES = {  # name -> (operator, extra inputs, keyword arguments)
    "hla2": (ops.hla2, ("g",), {"normalize": True}),
    "ahla": (ops.ahla, ("g",), {"normalize": True}),
    "hla3_causal": (ops.hla3, ("g",), {}),
    "hla3_paper": (ops.hla3, (), {"mask": "paper", "normalize": True}),
    "linear_attention": (ops.linear_attention, (), {}),
    "mamba2": (ops.mamba2, ("g",), {}),
    "gated_deltanet": (ops.gated_deltanet, ("g", "beta"), {}),
    "loglinear_mamba2": (ops.loglinear_mamba2, ("g", "lam"), {}),
    "loglinear_gated_deltanet": (ops.loglinear_gated_deltanet, ("g", "beta", "lam"), {}),
    "loglinear_mamba2 (T per device a multiple of the chunk)": (
        ops.loglinear_mamba2, ("g", "lam"), {"chunk_size": 4}),
}


# name -> (|s|: float32 numbers per batch row and head that the forward all-gathers, as text and
# as a function of (d, dv′, L)); dv′ = dv + 1 when normalised, L = ⌈log2 T⌉ + 1 (global T).
# hla2, ahla and causal hla3 are chains (docs/math.md#chains) of two LA passes: one (1 + d·width) each.
SUMMARY = {
    "hla2": ("inner LA (1 + d²) + outer LA (1 + d·dv′)",
             lambda d, dv, L: (1 + d * d) + (1 + d * dv)),
    "ahla": ("inner LA (1 + d·dv′) + outer LA (1 + d·dv′)",
             lambda d, dv, L: 2 * (1 + d * dv)),
    "hla3_causal": ("inner LA (1 + d·(d + dv′)) + outer LA (1 + d·dv′)",
                    lambda d, dv, L: (1 + d * (d + dv)) + (1 + d * dv)),
    "hla3_paper": ("moments (2d² + d·dv′) + H (d·dv′)", lambda d, dv, L: 2 * d * d + 2 * d * dv),
    "linear_attention": ("1 + d·dv", lambda d, dv, L: 1 + d * dv),
    "mamba2": ("1 + d·dv", lambda d, dv, L: 1 + d * dv),
    "gated_deltanet": ("d² + d·dv", lambda d, dv, L: d * d + d * dv),
    "loglinear_mamba2": ("1 + L·d·dv", lambda d, dv, L: 1 + L * d * dv),
    "loglinear_gated_deltanet": ("d² + L·d·dv", lambda d, dv, L: d * d + L * d * dv),
}
SUMMARY["loglinear_mamba2 (T per device a multiple of the chunk)"] = SUMMARY["loglinear_mamba2"]


def inputs(rng, extra, B=2, T=P_DEV * T_LOCAL, H=2, d=4, dv=3, dtype=np.float64):
    """``q, k, v`` (L2-normalised keys) followed by the operator's ``g``, ``beta``, ``lam``."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    more = {"g": make_gate(rng, B=B, T=T, H=H, dtype=dtype),
            "beta": jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), dtype),
            "lam": jnp.asarray(rng.uniform(0.2, 1.5, (B, T, H, fenwick.num_levels(T))), dtype)}
    return (q, k, v) + tuple(more[x] for x in extra)


def sharded(op, kw, n_args, mesh):
    """``op`` on time-sharded inputs: ``shard_map`` with ``seq_axis="seq"``."""
    spec = Spec(None, "seq")
    return jax.shard_map(lambda *a: op(*a, impl="chunked", seq_axis="seq", **kw),
                         mesh=mesh, in_specs=(spec,) * n_args, out_specs=spec)


def out_and_grads(f):
    """``(f(*args), ∇ sum(f(*args) * w))`` in one jitted call."""
    def run(w, *args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(w)
    return jax.jit(run)


def check() -> int:
    jax.config.update("jax_enable_x64", True)
    mesh = jax.make_mesh((P_DEV,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    failed = 0
    for name, (op, extra, kw) in CASES.items():
        kw = {"chunk_size": CHUNK} | kw
        args = inputs(rng, extra)
        w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float64)
        unsharded = functools.partial(op, impl="chunked", **kw)
        ref_out, ref_grads = out_and_grads(unsharded)(w, *args)
        out, grads = out_and_grads(sharded(op, kw, len(args), mesh))(w, *args)
        errs = [rel_err(out, ref_out)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
        ok = out.dtype == jnp.float64 and max(errs) <= 1e-10
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} {name} out {errs[0]:.1e} grads {max(errs[1:]):.1e}")
    return int(failed > 0 or not check_over_time(rng))


def check_over_time(rng) -> bool:
    """``sequence.over_time`` under ``jit`` on a (data=2, sequence=4) mesh, data axis automatic:
    the loss and its gradients equal the unsharded ones (log-linear Gated DeltaNet, T = 4×20)."""
    mesh = jax.make_mesh((2, 4), ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    op, extra, _ = CASES["loglinear_gated_deltanet"]
    args = inputs(rng, extra, T=4 * T_LOCAL)
    sharded_op = ops.sequence.over_time(op, "sequence", chunk_size=CHUNK)

    def loss(f, q, k, v, *gates):  # gates by name: over_time's keyword path
        return jnp.sum(jnp.sin(f(q, k, v, **dict(zip(("g", "beta", "lam"), gates)))))

    grad = jax.jit(jax.value_and_grad(loss, argnums=range(1, len(args) + 1)), static_argnums=0)
    ref = grad(functools.partial(op, chunk_size=CHUNK), *args)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, jax.NamedSharding(mesh, Spec("data", "sequence")))
                  for x in args]
        out = grad(sharded_op, *placed)
    err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
    print(f"{'ok' if err <= 1e-10 else 'FAIL'} over_time data=2 sequence=4 {err:.1e}")
    return err <= 1e-10


SEGMENT_CASES = {  # packed documents under seq_axis: name -> (operator, extra inputs, kwargs)
    "hla2 segments": (ops.hla2, ("g",), {"normalize": True}),
    "hla3_paper segments": (ops.hla3, (), {"mask": "paper", "normalize": True}),
}
# row 0: starts mid-shard (13, 14, 59), at shard starts (40, 120), a document over shards 3-5;
# row 1: one start (5), then one document to the end
SEGMENT_LENGTHS = ((13, 1, 26, 19, 61, 40), (5, 155))


def with_ids(op, kw, ids, *args):
    """``op`` on one shard, ``segment_ids`` first (``shard_map`` shards them with the inputs)."""
    return op(*args, impl="chunked", seq_axis="seq", segment_ids=ids, **kw)


def check_segments() -> int:
    """``segment_ids`` with the time axis sharded over 8 devices: equal to the unsharded chunked
    form with the same ids (float64, 1e-10, outputs and gradients)."""
    jax.config.update("jax_enable_x64", True)
    mesh = jax.make_mesh((P_DEV,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(1)
    ids = jnp.asarray([np.repeat(np.arange(len(r)), r) for r in SEGMENT_LENGTHS], jnp.int32)
    failed = 0
    for name, (op, extra, kw) in SEGMENT_CASES.items():
        kw = {"chunk_size": CHUNK} | kw
        args = inputs(rng, extra)
        w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float64)
        unsharded = functools.partial(op, impl="chunked", segment_ids=ids, **kw)
        ref_out, ref_grads = out_and_grads(unsharded)(w, *args)
        spec = Spec(None, "seq")
        f = jax.shard_map(functools.partial(with_ids, op, kw), mesh=mesh,
                          in_specs=(spec,) * (len(args) + 1), out_specs=spec)
        out, grads = out_and_grads(functools.partial(f, ids))(w, *args)
        errs = [rel_err(out, ref_out)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
        ok = out.dtype == jnp.float64 and max(errs) <= 1e-10
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} {name} out {errs[0]:.1e} grads {max(errs[1:]):.1e}")
    return int(failed > 0)


def bytes_table() -> int:
    """Measured bytes per device against ``(P − 1)·B·H·|s|·4``; returns the number of mismatches."""
    mesh = jax.make_mesh((P_DEV,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    B, H, d, T = 1, 16, 128, P_DEV * 256  # chunk 64
    L = fenwick.num_levels(T)
    rng = np.random.default_rng(0)
    failed = 0
    for name, (op, extra, kw) in CASES.items():
        args = inputs(rng, extra, B=B, T=T, H=H, d=d, dv=d, dtype=np.float32)
        kw = {key: val for key, val in kw.items() if key != "normalize"} | {"chunk_size": 64}
        f = jax.jit(sharded(op, kw, len(args), mesh))
        got = ops.sequence.gathered_bytes(f.lower(*args).as_text(), P_DEV)
        text, size = SUMMARY[name]
        want = (P_DEV - 1) * B * H * size(d, d, L) * 4
        failed += got != want
        print(f"{'ok' if got == want else 'FAIL'} {name} {got:,} |s| = {text} = {want:,}")
    return failed


if __name__ == "__main__":
    if sys.argv[1:] == ["bytes"]:
        sys.exit(int(bytes_table() > 0))
    elif sys.argv[1:] == ["segments"]:
        sys.exit(check_segments())
    else:
        sys.exit(check())
