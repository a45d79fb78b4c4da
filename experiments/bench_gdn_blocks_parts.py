"""Where log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``) spends its time:
the per-chunk terms (``chunk_parts``: the UT transform and ``M``, ``Q̂``, ``A_c``, ``Z``), then
with XLA's terms the window inside each chunk (``loglinear_chunked.window``) and the chunk
levels (the up-sweep and the running queries' reads, ``_levels``), with ``terms="kernel"`` the
output (``output``: both on Triton, ``kernels.gdn_blocks.output``), and the whole ``blocks``,
each forward and forward+backward (the gradient of every float input for unit cotangents),
median ms.

    python experiments/bench_gdn_blocks_parts.py [--T 8192] [--tokens 65536] [--shape 16,128,128]
                                                 [--terms kernel,xla] [--name …] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16, ``--shape`` H,d,dv, B·T = ``--tokens``). Writes
``<out>/<name>.json``: one row per ``--terms``, each part's ``(fwd, fwd_bwd)`` and ``rest`` = the
whole minus the parts (the padding, the layout moves and what the parts' boundaries keep XLA
from fusing). ``terms="kernel"`` runs the Mosaic GPU and Triton kernels: compiled on a GPU, in
the interpreters on CPU (slow; a small ``--tokens`` there).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.bench_kernels import inputs, micro_args, micro_size, micro_write, timeit  # noqa: E402
from hla_jax.ops import common, fenwick, loglinear_gdn_blocks  # noqa: E402


def timed(fn, *args, repeats=10):
    """``(fwd, fwd_bwd)`` median ms of ``fn(*args)`` and of the gradient of every argument (all
    are float arrays) for unit cotangents on each output."""
    def grads(*xs):
        out, pull = jax.vjp(fn, *xs)
        return pull(jax.tree.map(jnp.ones_like, out))

    return (timeit(jax.jit(fn), *args, repeats=repeats),
            timeit(jax.jit(grads), *args, repeats=repeats))


def parts(args, terms: str, repeats: int) -> dict:
    """The parts of ``blocks(*args, 64, terms)`` timed on their own inputs."""
    whole = functools.partial(loglinear_gdn_blocks.blocks, chunk_size=64, terms=terms)
    split = functools.partial(loglinear_gdn_blocks.chunk_parts, chunk_size=64, terms=terms)
    M, Qh, A_c, Z, V, Lam = jax.jit(split)(*args)
    B, H, N, c, d = Qh.shape
    lc, Qh = fenwick.chunk_log2(c), Qh.reshape(B, H, N * c, d)
    row = {"terms": terms, "chunk_parts": timed(split, *args, repeats=repeats)}
    if terms == "kernel":
        from hla_jax.kernels import gdn_blocks
        row["output"] = timed(lambda M, V, Qh, A, Z, L: gdn_blocks.output(
            M.reshape(B, H, N * c, c), V, Qh, A, Z, L, lc), M, V, Qh, A_c, Z, Lam, repeats=repeats)
    else:
        row["window"] = timed(loglinear_gdn_blocks.chunk_window, M, V, Lam, repeats=repeats)
        row["levels"] = timed(lambda Qh, A, Z, L: loglinear_gdn_blocks._levels(Qh, A, Z, L, lc, N),
                              Qh, A_c, Z, Lam, repeats=repeats)
    row["whole"] = timed(whole, *args, repeats=repeats)
    named = [p for p in row if p not in ("terms", "whole")]
    row["rest"] = tuple(row["whole"][j] - sum(row[p][j] for p in named) for j in range(2))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    micro_args(p, "bench_gdn_blocks_parts_gpu")
    p.add_argument("--terms", default="kernel,xla")
    a = p.parse_args(argv)
    B, T, shape = micro_size(a)
    q, k, v, g, beta, lam, _ = inputs(B, T, shape)
    res = {"device": jax.devices()[0].device_kind, "B": B, "T": T, "shape": list(shape),
           "dtype": "bfloat16", "rows": []}
    with common.matmul_precision(q, k, v):
        for terms in a.terms.split(","):
            res["rows"].append(parts((q, k, v, g, beta, lam), terms, a.repeats))
            print(json.dumps(res["rows"][-1]), flush=True)
    return micro_write(a, res)


if __name__ == "__main__":
    main()
