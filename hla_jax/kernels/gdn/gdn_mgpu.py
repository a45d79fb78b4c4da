"""The Mosaic GPU backend of ``gdn_entry.py``: its five steps on the Hopper kernels, in log2
units: the UT transform and its backward, ``gdn_ut_mgpu.py``, the two walks on transposed
states, ``gdn_walk_mgpu.py``, and the walk's products, ``gdn_grads_mgpu.py``.

The interface, shared with ``gdn_tpu.py`` (``b``, ``beta`` ``[B,H,Tp]`` float32; ``q, k,
v, dO`` and the returned ``O, dQ, dK, dV`` in the caller's ``[B,Tp,H,·]``; states ``[B,H,d,dv]``
float32; the rest backend-owned, passed between the steps):

    ut_forward(k, v, b, beta, keep)                 -> W, U, X
    walk_out(q, k, w, u, b, h0, keep)               -> O, H_T, V', S per chunk
    walk_rev(q, k, w, dO, b, dH_T, keep)            -> −dV', dS per chunk, dH0
    grads(q, k, V', dO, −dV', S, dS, b)             -> dQ, dK_walk, dW, ∂L/∂b (the walk's share)
    ut_backward(k, v, b, beta, X, dW, −dV', dK_walk) -> dK, dV, dβ, ∂L/∂b (the UT's share)

(``dU = dV'``: the UT backward takes it negated and in 16 bits, as the products do.)  Without
``keep`` (a forward no backward follows; a piece's own cotangent) ``X``, ``V'`` and ``S`` (``dV'``
and ``dS``) are ``None``: this backend does not write them.  Only this backend cuts sequences into
pieces (``gdn_entry.py``), with one more step:

    walk_maps(k, w, u, b)                           -> M [B,H,d,d], E [B,H,d,dv]: S_T = M H0 + E
"""

from __future__ import annotations

import jax.numpy as jnp

from hla_jax.kernels.gdn import gdn_grads_mgpu, gdn_ut_mgpu, gdn_walk_mgpu
from hla_jax.kernels.mosaic_gpu import LOG2E


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def ut_forward(k, v, b, beta, *, keep, interpret):
    return gdn_ut_mgpu.forward(k, v, b * LOG2E, beta, keep=keep, interpret=interpret)


def walk_out(q, k, w, u, b, h0, *, keep, interpret):
    o, vn, s, sT = gdn_walk_mgpu.walk(b * LOG2E, _t(h0), (q, k, w, u), mode="out", keep=keep,
                                 interpret=interpret)
    return o, _t(sT), vn, s


def walk_rev(q, k, w, do, b, dhT, *, keep=True, interpret):
    ndu, ds, dh0 = gdn_walk_mgpu.walk(b * LOG2E, _t(dhT), (q, k, w, do), mode="rev", keep=keep,
                                 interpret=interpret)
    return ndu, ds, _t(dh0)


def walk_maps(k, w, u, b, *, interpret):
    maps = gdn_walk_mgpu.walk(b * LOG2E, None, (k, w, u), mode="maps", interpret=interpret)
    d = k.shape[-1]
    return _t(maps[..., :d, :]), _t(maps[..., d:, :])


def grads(q, k, vn, do, ndu, s, ds, b, *, interpret):
    dq, dk, dw, db = gdn_grads_mgpu.backward(q, k, vn, do, ndu, s, ds, b * LOG2E,
                                             interpret=interpret)
    return dq, dk, dw, db.sum(0)   # the key blocks' shares


def ut_backward(k, v, b, beta, x, dw, ndu, dk, *, interpret):
    return gdn_ut_mgpu.backward(k, v, b * LOG2E, beta, x, dw, ndu, dk, interpret=interpret)
