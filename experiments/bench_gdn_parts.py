"""Where the Gated DeltaNet kernel's time goes, on a Hopper GPU: the UT transform
(``kernels/gpu/gdn_ut.py``, forward and backward) and each Mosaic GPU walk
(``kernels/gpu/gdn_mgpu.py``: ``out`` forward, ``rev`` and ``dq`` backward), median ms.

    python experiments/bench_gdn_parts.py [--T 8192] [--tokens 65536] [--out DIR]

Same inputs as ``bench_kernels.py`` (bf16, H=16, d=dv=128, B·T = ``--tokens``); writes
``<out>/bench_gdn_parts_gpu.json``.  The Mosaic GPU walks run compiled only (sm_90).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax
import jax.numpy as jnp
from bench_kernels import Shape, inputs, timeit

from hla_jax.kernels import wrap
from hla_jax.kernels.gpu import gdn_mgpu, gdn_ut


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    B, T = max(a.tokens // a.T, 1), a.T
    q, k, v, g, beta, _, w = inputs(B, T, Shape())
    beta = jnp.swapaxes(beta, 1, 2).astype(jnp.float32)
    b = wrap.chunk_log_decay(g, gdn_mgpu.C)
    b2 = b * math.log2(math.e)
    h0 = jnp.zeros((B, q.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
    ut, ut_bwd = gdn_ut.forward, gdn_ut.backward
    walk = {m: jax.jit(lambda b2, *x, m=m: gdn_mgpu.walk(b2, h0, x, mode=m))
            for m in gdn_mgpu.TILES}
    w16, u16 = ut(k, v, b, beta)
    _, vn, _ = walk["out"](b2, q, k, w16, u16)
    du = walk["rev"](b2, q, k, w16, w, vn)[0].astype(q.dtype)   # w: a bf16 stand-in for dO
    row = dict(device=jax.devices()[0].device_kind, B=B, T=T, ut_fwd=timeit(ut, k, v, b, beta),
               ut_bwd=timeit(ut_bwd, k, v, b, beta, w16.astype(jnp.float32), du),
               walk_out=timeit(walk["out"], b2, q, k, w16, u16),
               walk_rev=timeit(walk["rev"], b2, q, k, w16, w, vn),
               walk_dq=timeit(walk["dq"], b2, k, vn, w, du, q))
    print(json.dumps(row))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_gdn_parts_gpu.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
