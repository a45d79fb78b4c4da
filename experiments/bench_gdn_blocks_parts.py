"""Where log-linear Gated DeltaNet's block form (``ops.loglinear_gdn_blocks``) spends its time:
the per-chunk terms (``chunk_parts``: the UT transform and ``M``, ``Q̂``, ``A_c``, ``Z``), the
window inside each chunk (``loglinear_chunked.window``), the chunk levels (the up-sweep and the
running queries, ``_levels``) and the whole ``blocks``, each forward and forward+backward (the
gradient of every float input for unit cotangents), median ms.

    python experiments/bench_gdn_blocks_parts.py [--T 8192] [--tokens 65536] [--shape 16,128,128]
                                                 [--terms kernel,xla] [--warps 4,8]
                                                 [--name …] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16, ``--shape`` H,d,dv, B·T = ``--tokens``). Writes
``<out>/<name>.json``: one row per ``--terms``, each part's ``(fwd, fwd_bwd)`` and ``rest`` = the
whole minus the three parts (the padding, the layout moves and what the parts' boundaries keep
XLA from fusing); with ``--warps``, under ``warps`` the Triton kernels of ``terms="kernel"``
(chunk terms and level reads, forward and backward) at each warp count. ``terms="kernel"`` runs
Triton kernels (the UT transform, the chunk terms, the level reads): compiled on a GPU, in the
interpreter on CPU (slow; a small ``--tokens`` there).
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
from hla_jax.kernels import gdn_blocks, wrap  # noqa: E402
from hla_jax.kernels.gpu import gdn_levels, gdn_terms  # noqa: E402
from hla_jax.ops import common, fenwick, loglinear_chunked, loglinear_gdn_blocks  # noqa: E402
from hla_jax.ops.loglinear_blocks import dot16, heads_first  # noqa: E402


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
    lev = fenwick.level_table(c)
    row = {"terms": terms,
           "chunk_parts": timed(split, *args, repeats=repeats),
           "window": timed(lambda L, M, V: loglinear_chunked.window(L.reshape(B, H, N, c, -1),
                                                                    M, V, lev), Lam, M, V,
                           repeats=repeats),
           "levels": timed(lambda Qh, A, Z, L: loglinear_gdn_blocks._levels(
               Qh.reshape(B, H, N * c, d), A, Z, L, fenwick.chunk_log2(c), N,
               terms == "kernel"),
               Qh, A_c, Z, Lam, repeats=repeats),
           "whole": timed(whole, *args, repeats=repeats)}
    row["rest"] = tuple(row["whole"][j] - sum(row[p][j] for p in ("chunk_parts", "window", "levels"))
                        for j in range(2))
    return row


def kernel_warps(q, k, v, g, beta, lam, warps, repeats: int) -> dict:
    """Median ms of the Triton kernels of ``terms="kernel"`` on their own inputs at each count
    of Triton ``warps``: the chunk terms' forward and backward (``kernels/gpu/gdn_terms.py``)
    and the level reads' (``kernels/gpu/gdn_levels.py``); compiled on a GPU, interpreted on CPU."""
    B, T, H, d = q.shape
    N, interpret = T // gdn_blocks.C, jax.default_backend() == "cpu"
    heads = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)              # noqa: E731
    b = jnp.cumsum(jnp.maximum(heads(g), wrap.LOG_DECAY_FLOOR).reshape(B, H, N, -1), -1)
    b = b.reshape(B, H, T)
    w, u, t = gdn_blocks.ut(k, v, b, heads(beta), interpret)
    terms = (q, k, w, u, t, b)
    M, Qh, A_c, Z = gdn_blocks.delta(*terms, interpret)
    cts = tuple(jnp.ones_like(x) for x in (M, Qh, A_c, Z))
    nodes = loglinear_gdn_blocks._upsweep(A_c.astype(q.dtype), Z.astype(q.dtype), N, dot16)
    pi, offsets = gdn_blocks._stacked([p for p, _ in nodes])
    lc = fenwick.chunk_log2(gdn_blocks.C)
    lv = jnp.moveaxis(heads_first(lam, T, jnp.float32), -1, 2)[:, :, lc + 1:lc + 1 + len(nodes)]
    reads = (Qh.astype(q.dtype), lv, pi, gdn_blocks._stacked([z for _, z in nodes])[0])
    do = jnp.ones(Qh.shape[:3] + Z.shape[-1:], jnp.float32)
    row = {}
    for nw in warps:
        at = dict(num_warps=nw, interpret=interpret)
        row[f"terms_fwd_w{nw}"] = timeit(functools.partial(gdn_terms.forward, **at), *terms,
                                         repeats=repeats)
        row[f"terms_bwd_w{nw}"] = timeit(functools.partial(gdn_terms.backward, **at), *terms, *cts,
                                         repeats=repeats)
        at["offsets"] = offsets
        row[f"levels_fwd_w{nw}"] = timeit(functools.partial(gdn_levels.forward, **at), *reads,
                                          repeats=repeats)
        row[f"levels_bwd_w{nw}"] = timeit(functools.partial(gdn_levels.backward, **at), *reads, do,
                                          repeats=repeats)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    micro_args(p, "bench_gdn_blocks_parts_gpu")
    p.add_argument("--terms", default="kernel,xla")
    p.add_argument("--warps", default="", help="Triton warp counts to time the kernels at, e.g. 4,8")
    a = p.parse_args(argv)
    B, T, shape = micro_size(a)
    q, k, v, g, beta, lam, _ = inputs(B, T, shape)
    res = {"device": jax.devices()[0].device_kind, "B": B, "T": T, "shape": list(shape),
           "dtype": "bfloat16", "rows": []}
    with common.matmul_precision(q, k, v):
        for terms in a.terms.split(","):
            res["rows"].append(parts((q, k, v, g, beta, lam), terms, a.repeats))
            print(json.dumps(res["rows"][-1]), flush=True)
        if a.warps:
            res["warps"] = kernel_warps(q, k, v, g, beta, lam, [int(x) for x in a.warps.split(",")],
                                        a.repeats)
            print(json.dumps(res["warps"]), flush=True)
    return micro_write(a, res)


if __name__ == "__main__":
    main()
