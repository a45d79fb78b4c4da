"""The NVIDIA backend of ``kernels/gdn.py``: its five steps on the Hopper kernels (the UT transform
and its backward in Triton, ``gdn_ut.py``; the two walks in Mosaic GPU, ``gdn_mgpu.py``, which
run in log2 units on transposed states; the walk's products in Triton, ``gdn_grads.py``).

The interface, shared with ``kernels/tpu/gdn.py`` (``b``, ``beta`` ``[B,H,Tp]`` float32; ``q, k,
v, dO`` and the returned ``O, dQ, dK, dV`` in the caller's ``[B,Tp,H,·]``; states ``[B,H,d,dv]``
float32; the rest backend-owned, passed between the steps):

    ut_forward(k, v, b, beta)                       -> W, U, X
    walk_out(q, k, w, u, b, h0)                     -> O, H_T, V', S per chunk
    walk_rev(q, k, w, dO, b, dH_T)                  -> dU, −dV', dS per chunk, dH0
    grads(q, k, V', dO, −dV', S, dS, b)             -> dQ, dK_walk, dW, ∂L/∂b (the walk's share)
    ut_backward(k, v, b, beta, X, dW, dU, dK_walk)  -> dK, dV, dβ, ∂L/∂b (the UT's share)
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.gpu import gdn_grads, gdn_mgpu, gdn_ut
from hla_jax.kernels.gpu.la_mgpu import LOG2E


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def ut_forward(k, v, b, beta, *, interpret):
    return gdn_ut.forward(k, v, b, beta, interpret=interpret)


def walk_out(q, k, w, u, b, h0, *, interpret):
    o, vn, s, sT = gdn_mgpu.walk(b * LOG2E, _t(h0), (q, k, w, u), mode="out", interpret=interpret)
    return o, _t(sT), vn, s


def walk_rev(q, k, w, do, b, dhT, *, interpret):
    du, ndu, ds, dh0 = gdn_mgpu.walk(b * LOG2E, _t(dhT), (q, k, w, do), mode="rev",
                                     interpret=interpret)
    return du, ndu, ds, _t(dh0)


def grads(q, k, vn, do, ndu, s, ds, b, *, interpret):
    dq, dk, dw, db = gdn_grads.backward(q, k, vn, do, ndu, s, ds, b, interpret=interpret)
    return dq, dk, dw, db.sum(0)   # the key blocks' shares


def ut_backward(k, v, b, beta, x, dw, du, dk, *, interpret):
    return gdn_ut.backward(k, v, b, beta, x, dw, du, dk_walk=dk, interpret=interpret)
