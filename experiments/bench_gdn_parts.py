"""Where the Gated DeltaNet kernel's time goes, on a Hopper GPU: the UT transform
(``kernels/gpu/gdn_ut.py``, forward and backward), each Mosaic GPU walk
(``kernels/gpu/gdn_mgpu.py``: ``out`` forward, ``rev`` backward), the walk's chunk-parallel
products (``kernels/gpu/gdn_grads.py``), the whole ``kernels.gdn.core`` forward and backward, and
what is left for XLA's glue, median ms; with ``--sweep ut`` also the UT settings that were chosen
this way: ``ut_fwd_cb16`` (row blocks of 16 tokens instead of 32) and ``ut_{fwd,bwd}_w{2,8}`` (2
and 8 Triton warps instead of 4); with ``--sweep grads`` the products' ``grads_w{4,8}_kb{d,64}``
(Triton warps, block of keys per program).

    python experiments/bench_gdn_parts.py [--T 8192] [--tokens 65536] [--name bench_gdn_parts_gpu]
                                          [--sweep ut|grads ...] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16, H=16, d=dv=128, B·T = ``--tokens``); writes
``<out>/<name>.json``: the parts, ``fwd``/``bwd`` (``core``'s forward and its backward from the
saved residuals) and ``glue_fwd = fwd − ut_fwd − walk_out``, ``glue_bwd = bwd − walk_rev −
grads − ut_bwd``.  The Mosaic GPU walks run compiled only (sm_90).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from bench_kernels import Shape, inputs, timeit

from hla_jax.kernels import gdn, wrap
from hla_jax.kernels.gpu import gdn_grads, gdn_mgpu, gdn_ut


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--name", default="bench_gdn_parts_gpu")
    p.add_argument("--sweep", action="append", default=[], choices=("ut", "grads"),
                   help="also time the UT or products kernels' other settings")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    B, T = max(a.tokens // a.T, 1), a.T
    q, k, v, g, beta_t, _, w = inputs(B, T, Shape())
    beta = jnp.swapaxes(beta_t, 1, 2).astype(jnp.float32)
    b = wrap.chunk_log_decay(g, gdn_mgpu.C)
    b2 = b * math.log2(math.e)
    h0 = jnp.zeros((B, q.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
    walk = {m: jax.jit(lambda b2, *x, m=m: gdn_mgpu.walk(b2, h0, x, mode=m))
            for m in gdn_mgpu.TILES}
    w16, u16, x = gdn_ut.forward(k, v, b, beta)
    _, vn, s, _ = walk["out"](b2, q, k, w16, u16)
    du, ndu, ds, _ = walk["rev"](b2, q, k, w16, w)   # w: a bf16 stand-in for dO
    grads_args = (q, k, vn, w, ndu, s, ds, b)
    args = (q, k, v, beta_t.astype(jnp.float32), g, h0)
    fwd = jax.jit(lambda *x: gdn._core_fwd(*x, False, "gpu"))
    (o, hT), res = fwd(*args)
    bwd = jax.jit(lambda res, cts: gdn._core_bwd(False, "gpu", res, cts))
    share = w16[None].astype(jnp.float32)   # one share of dW and of the walks' dK
    ut_bwd_args = (k, v, w16, b, beta, x, share, du, share)
    row = dict(device=jax.devices()[0].device_kind, B=B, T=T,
               ut_fwd=timeit(gdn_ut.forward, k, v, b, beta),
               ut_bwd=timeit(gdn_ut.backward, *ut_bwd_args),
               walk_out=timeit(walk["out"], b2, q, k, w16, u16),
               walk_rev=timeit(walk["rev"], b2, q, k, w16, w),
               grads=timeit(gdn_grads.backward, *grads_args),
               fwd=timeit(fwd, *args), bwd=timeit(bwd, res, (w.astype(jnp.float32), hT)))
    if "ut" in a.sweep:
        row["ut_fwd_cb16"] = timeit(functools.partial(gdn_ut.forward, cb=16), k, v, b, beta)
        for nw in (2, 8):   # the UT kernels' Triton warps (4 by default)
            row[f"ut_fwd_w{nw}"] = timeit(functools.partial(gdn_ut.forward, num_warps=nw), k, v, b, beta)
            row[f"ut_bwd_w{nw}"] = timeit(functools.partial(gdn_ut.backward, num_warps=nw), *ut_bwd_args)
    if "grads" in a.sweep:
        for nw in (4, 8):
            for kb in (None, 64):
                row[f"grads_w{nw}_kb{kb or 'd'}"] = timeit(
                    functools.partial(gdn_grads.backward, num_warps=nw, kb=kb), *grads_args)
    row["glue_fwd"] = row["fwd"] - row["ut_fwd"] - row["walk_out"]
    row["glue_bwd"] = row["bwd"] - row["walk_rev"] - row["grads"] - row["ut_bwd"]
    print(json.dumps(row))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
