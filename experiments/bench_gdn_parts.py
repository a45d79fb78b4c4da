"""Where the Gated DeltaNet kernel's time goes, on a Hopper GPU: the UT transform and its
backward (``kernels/gpu/gdn_ut_mgpu.py``), each Mosaic GPU walk (``kernels/gpu/gdn_mgpu.py``:
``out`` forward, ``rev`` backward), the walk's chunk-parallel products
(``kernels/gpu/gdn_grads_mgpu.py``), the whole ``kernels.gdn.core`` forward and backward, and
what is left for XLA's glue (``gates``: its gate and ``β`` preparation alone), median ms.

    python experiments/bench_gdn_parts.py [--T 8192] [--tokens 65536] [--shape 16,128,128]
        [--pieces 1] [--repeats 10] [--name bench_gdn_parts_gpu] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16, ``--shape`` H,d,dv, B·T = ``--tokens``); writes
``<out>/<name>.json``: the parts, ``fwd``/``bwd`` (``core``'s forward and its backward from the
saved residuals) and ``glue_fwd = fwd − ut_fwd − walk_out``, ``glue_bwd = bwd − walk_rev −
grads − ut_bwd``.  ``--pieces P``: each sequence cut into ``P`` pieces (``T`` a multiple of
``64·P``): the steps run on the pieces' rows, with two more, the maps walk (``walk_maps``,
forward) and the reverse walk from zero without residuals (``walk_rev_own``, backward), which the
glue then excludes too.  The Mosaic GPU walks compile for sm_90 only; ``--interpret`` runs every
kernel in Pallas' interpreters (on a CPU: the wiring, not the times).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.bench_kernels import Shape, inputs, micro_args, micro_size, micro_write  # noqa: E402
from experiments.bench_kernels import timeit as _timeit  # noqa: E402
from hla_jax.kernels import gdn, wrap  # noqa: E402
from hla_jax.kernels.gpu import gdn_grads_mgpu, gdn_mgpu, gdn_ut_mgpu, la_mgpu  # noqa: E402


def steps(B: int, T: int, shape: Shape, interpret: bool = False, pieces: int = 1):
    """``({step: (function, args)}, inputs)``: the five steps (``ut_fwd``, ``walk_out``,
    ``walk_rev``, ``grads``, ``ut_bwd``, in the order they run; with ``pieces > 1`` on the pieces'
    rows, and ``walk_maps``, ``walk_rev_own`` too) on ``bench_kernels``' inputs at ``B×T`` and
    ``shape`` (H, d, dv), each fed the outputs of the steps before it, with 16-bit stand-ins for
    the cotangents (``dO``, ``dW``, the walks' ``dK``); ``inputs`` holds what the whole core
    takes."""
    q, k, v, g, beta_t, _, w = inputs(B, T, shape)
    args = (q, k, v, beta_t.astype(jnp.float32), g,
            jnp.zeros((B, q.shape[2], q.shape[-1], v.shape[-1]), jnp.float32))
    do = w
    q, k, v, g, beta_t, w = (la_mgpu.split_pieces(x, pieces) for x in (q, k, v, g, beta_t, w))
    beta = jnp.swapaxes(beta_t, 1, 2).astype(jnp.float32)
    b = wrap.chunk_log_decay(g, gdn_mgpu.C)
    b2 = b * math.log2(math.e)
    h0 = jnp.zeros((B * pieces,) + args[-1].shape[1:], jnp.float32)
    walk = {m: jax.jit(lambda b2, *x, m=m: gdn_mgpu.walk(b2, h0, x, mode=m, interpret=interpret))
            for m in ("out", "rev")}
    ut_fwd, ut_bwd, grads = (jax.jit(functools.partial(f, interpret=interpret))
                             for f in (gdn_ut_mgpu.forward, gdn_ut_mgpu.backward, gdn_grads_mgpu.backward))
    w16, u16, x = ut_fwd(k, v, b2, beta)
    _, vn, s, _ = walk["out"](b2, q, k, w16, u16)
    ndu, ds, _ = walk["rev"](b2, q, k, w16, w)   # w: a bf16 stand-in for dO
    parts = {"ut_fwd": (ut_fwd, (k, v, b2, beta)),
             "walk_out": (walk["out"], (b2, q, k, w16, u16)),
             "walk_rev": (walk["rev"], (b2, q, k, w16, w)),
             "grads": (grads, (q, k, vn, w, ndu, s, ds, b2)),
             "ut_bwd": (ut_bwd, (k, v, b2, beta, x, w16, ndu, w16))}
    if pieces > 1:
        parts["walk_maps"] = (jax.jit(lambda b2, *x: gdn_mgpu.walk(b2, None, x, mode="maps",
                                                                    interpret=interpret)),
                              (b2, k, w16, u16))
        parts["walk_rev_own"] = (jax.jit(lambda b2, *x: gdn_mgpu.walk(b2, h0, x, mode="rev", keep=False,
                                                                       interpret=interpret)),
                                 (b2, q, k, w16, w))
    return parts, dict(args=args, do=do)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    micro_args(p, "bench_gdn_parts_gpu")
    p.add_argument("--interpret", action="store_true",
                   help="Pallas' interpreters (a CPU run: the wiring only, the times mean nothing)")
    p.add_argument("--pieces", type=int, default=1, help="pieces per sequence (T a multiple of 64·P)")
    a = p.parse_args(argv)
    B, T, shape = micro_size(a)
    if a.pieces < 1 or T % (gdn_mgpu.C * a.pieces):
        p.error(f"--pieces must be >= 1 with T a multiple of 64·pieces, got {a.pieces} at T={T}")
    timeit = functools.partial(_timeit, repeats=a.repeats)
    parts, core = steps(B, T, shape, a.interpret, a.pieces)
    args = core["args"]
    fwd = jax.jit(lambda *x: gdn._core_fwd(*x, a.interpret, "gpu", a.pieces))
    (_, hT), res = fwd(*args)
    bwd = jax.jit(lambda res, cts: gdn._core_bwd(a.interpret, "gpu", a.pieces, res, cts))
    row = dict(device=jax.devices()[0].device_kind, B=B, T=T, shape=list(shape), pieces=a.pieces,
               **{name: timeit(f, *x) for name, (f, x) in parts.items()},
               fwd=timeit(fwd, *args), bwd=timeit(bwd, res, (core["do"].astype(jnp.float32), hT)),
               gates=timeit(jax.jit(lambda beta, g: (gdn._local(g), gdn._heads_first(beta))),
                            *args[3:5]))
    row["glue_fwd"] = row["fwd"] - row["ut_fwd"] - row["walk_out"] - row.get("walk_maps", 0.0)
    row["glue_bwd"] = (row["bwd"] - row["walk_rev"] - row["grads"] - row["ut_bwd"]
                       - row.get("walk_rev_own", 0.0))
    print(json.dumps(row))
    return micro_write(a, row)


if __name__ == "__main__":
    main()
