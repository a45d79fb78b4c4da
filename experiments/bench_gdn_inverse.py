"""What the UT inverse costs the XLA chunked forms of Gated DeltaNet, on one GPU.

Both ``ops.gated_deltanet(impl="chunked")`` and log-linear Gated DeltaNet's block form
(``ops.loglinear_gdn_blocks``, what ``impl="auto"`` takes for whole rows) build each chunk's UT
transform in ``loglinear_chunked.chunk_terms`` with XLA's batched ``solve_triangular``
(``T = (I + A)⁻¹ diag(β)``, one ``64×64`` system per chunk and head).  This times, forward and
forward+backward (median ms, every input's gradient), ``chunk_terms`` alone and the two
operators, first as they are (``solve``) and then with the solve replaced by the doubling
inverse ``(I + A)⁻¹ diag(β)`` of the Gated DeltaNet kernel (``loglinear_gdn_chunk.
unit_lower_inverse``: ``2 log2 c`` batched matmuls, ``doubling``), and the relative difference
``‖o_doubling − o_solve‖ / ‖o_solve‖`` of the operators' outputs (``rel_diff``), so that the
faster one can be chosen on evidence.

    python experiments/bench_gdn_inverse.py [--T 8192] [--tokens 65536] [--shape 16,128,128]
                                            [--name bench_gdn_inverse_gpu] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16; the chunk terms run in float32 at TF32 products).
Writes ``<out>/<name>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
from unittest import mock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.bench_kernels import inputs, measure, methods, micro_args, micro_size, micro_write  # noqa: E402
from hla_jax.kernels.loglinear_gdn_chunk import unit_lower_inverse  # noqa: E402
from hla_jax.ops import common, loglinear_chunked  # noqa: E402
from hla_jax.ops.loglinear_blocks import heads_first  # noqa: E402

OPERATORS = ("gated_deltanet_xla_chunked", "loglinear_gdn_blocks")


def doubling_solve(L, B, *, lower, unit_diagonal):
    """``L⁻¹ B`` for a unit lower-triangular ``L [..., c, c]`` by the doubling inverse of its
    strict part, batched over the leading axes, TF32 products as in the Gated DeltaNet kernel for
    bf16 inputs (the signature of the ``solve_triangular`` call it stands in for)."""
    assert lower and unit_diagonal
    c = L.shape[-1]
    inv = jax.vmap(lambda A: unit_lower_inverse(A, fast=True))(
        jnp.tril(L, -1).reshape(-1, c, c)).reshape(L.shape)
    return common.mm(inv, B)


@contextlib.contextmanager
def inverse(kind: str):
    """A context in which ``chunk_terms`` solves with ``kind`` ("solve" | "doubling"); jit caches
    are cleared on entry and exit so that nothing traced under the other one is reused."""
    jax.clear_caches()
    with (contextlib.nullcontext() if kind == "solve"
          else mock.patch.object(loglinear_chunked, "solve_triangular", doubling_solve)):
        yield
    jax.clear_caches()


def chunk_terms_fn(c: int):
    """``chunk_terms`` on the operators' own layout (heads first, float32, chunks of ``c``) as a
    ``fn(q, k, v, g, beta, lam)`` returning one array, for ``measure``."""
    def fn(q, k, v, g, beta, lam):
        with common.matmul_precision(q, k, v):
            B, T, H = q.shape[:3]
            x = [heads_first(a, T, jnp.float32) for a in (q, k, v, g, beta)]
            x = [a.reshape(B, H, T // c, c, *a.shape[3:]) for a in x]
            return sum(jnp.sum(t) for t in loglinear_chunked.chunk_terms(*x))
    return fn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    micro_args(p, "bench_gdn_inverse_gpu")
    p.add_argument("--chunk", type=int, default=64)
    a = p.parse_args(argv)
    B, T, shape = micro_size(a)
    args = inputs(B, T, shape)
    make = methods()
    fns = {"chunk_terms": chunk_terms_fn(a.chunk), **{m: make[m]() for m in OPERATORS}}
    res, out = dict(device=jax.devices()[0].device_kind, B=B, T=T, shape=a.shape, rows={}), {}
    for kind in ("solve", "doubling"):
        with inverse(kind):
            for name, fn in fns.items():
                row, _ = measure(name, fn, args, B, T, a.repeats)
                res["rows"][f"{name}/{kind}"] = row
                print(json.dumps(row), flush=True)
            out[kind] = {m: jax.jit(fns[m])(*args[:6]) for m in OPERATORS}
    res["rel_diff"] = {m: float(jnp.linalg.norm(out["doubling"][m] - out["solve"][m])
                                / jnp.linalg.norm(out["solve"][m])) for m in OPERATORS}
    print(json.dumps(res["rel_diff"]))
    return micro_write(a, res)


if __name__ == "__main__":
    main()
