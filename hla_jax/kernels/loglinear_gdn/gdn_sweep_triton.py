"""One level of the up-sweep of log-linear Gated DeltaNet's block form (``ops.xla.loglinear_gdn_blocks``)
for NVIDIA GPUs: ``pallas_call`` lowered through Triton, one program per (batch, head, pair).

Node pairs ``L = 2m``, ``R = 2m + 1`` of ``(Π [B,H,n,d,d], Z [B,H,n,d,dv])`` combine, ``L``
before ``R``, into

    (Π, Z)_m = (Π_R Π_L,  Π_R Z_L + Z_R)

(an odd ``n``'s last node pairs with the identity: ``(Π_L, Z_L)``), products accumulated in
float32 and rounded to the nodes' dtype, as XLA's ``ssm.combine`` on ``dot16`` products.  The
backward takes the combined nodes' cotangents ``(∂Π, ∂Z)_m`` and those the left nodes got from
the reads, ``(∂Π_L, ∂Z_L)``, and gives every node's::

    ∂Π_R = ∂Π Π_Lᵀ + ∂Z Z_Lᵀ,   ∂Z_R = ∂Z,   ∂Π_L += Π_Rᵀ ∂Π,   ∂Z_L += Π_Rᵀ ∂Z.

``d``, ``dv`` powers of two ≥ 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hla_jax.kernels.la.la_chunk import F32, dot
from hla_jax.kernels.triton import compiler_params


def _call(kernel, out_shape, pairs, interpret, *args):
    B, H = args[0].shape[:2]
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(B, H, pairs),
                          compiler_params=compiler_params(8, interpret), interpret=interpret)(*args)


def _pair(n):
    """``(m, L, R, has_right)`` of this program's pair of ``n`` nodes (``R`` clamped to ``L``
    for an odd ``n``'s last node, which pairs with the identity)."""
    m = pl.program_id(2)
    left = 2 * m
    return m, left, jnp.minimum(left + 1, n - 1), left + 1 < n


@functools.partial(jax.jit, static_argnames=("interpret",))
def forward(pi, z, *, interpret=False):
    """The combined nodes ``(Π [B,H,⌈n/2⌉,d,d], Z [B,H,⌈n/2⌉,d,dv])`` in the nodes' dtype."""
    n, acc = pi.shape[2], jnp.result_type(F32, pi.dtype)

    def kernel(pi_ref, z_ref, pi2_ref, z2_ref):
        b, h = pl.program_id(0), pl.program_id(1)
        m, L, R, right = _pair(n)
        PiR, PiL = pi_ref[b, h, R, :, :], pi_ref[b, h, L, :, :]
        pi2_ref[b, h, m, :, :] = jnp.where(right, dot(PiR, PiL), PiL.astype(acc)).astype(pi.dtype)
        ZL = z_ref[b, h, L, :, :]
        z2 = jnp.where(right, dot(PiR, ZL) + z_ref[b, h, R, :, :].astype(acc), ZL.astype(acc))
        z2_ref[b, h, m, :, :] = z2.astype(z.dtype)

    pairs = -(-n // 2)
    out_shape = [jax.ShapeDtypeStruct(pi.shape[:2] + (pairs,) + pi.shape[3:], pi.dtype),
                 jax.ShapeDtypeStruct(z.shape[:2] + (pairs,) + z.shape[3:], z.dtype)]
    return _call(kernel, out_shape, pairs, interpret, pi, z)


def pair_backward(pi_ref, z_ref, dpi2_ref, dz2_ref, dpi_ref, dz_ref, own_pi, own_z):
    """In the program of pair ``m`` (``_pair``) of a level of ``n`` nodes: the pair's nodes'
    cotangents into ``dpi_ref``, ``dz_ref`` (module docstring) from the combined node's
    ``dpi2_ref[m]``, ``dz2_ref[m]`` and the left node's own ``own_pi``, ``own_z`` (float32)."""
    b, h, acc = pl.program_id(0), pl.program_id(1), own_pi.dtype
    m, L, R, right = _pair(pi_ref.shape[2])
    dPi, dZ = dpi2_ref[b, h, m, :, :], dz2_ref[b, h, m, :, :]
    PiR = pi_ref[b, h, R, :, :]
    dPiL = jnp.where(right, dot(PiR, dPi, ta=True), dPi.astype(acc)) + own_pi
    dZL = jnp.where(right, dot(PiR, dZ, ta=True), dZ.astype(acc)) + own_z
    dpi_ref[b, h, L, :, :] = dPiL.astype(dpi_ref.dtype)
    dz_ref[b, h, L, :, :] = dZL.astype(dz_ref.dtype)

    @pl.when(right)
    def _():
        dPiR = dot(dPi, pi_ref[b, h, L, :, :], tb=True) + dot(dZ, z_ref[b, h, L, :, :], tb=True)
        dpi_ref[b, h, R, :, :] = dPiR.astype(dpi_ref.dtype)
        dz_ref[b, h, R, :, :] = dZ


@functools.partial(jax.jit, static_argnames=("interpret",))
def backward(pi, z, dpi2, dz2, dpil, dzl, *, interpret=False):
    """``(∂Π [B,H,n,d,d], ∂Z [B,H,n,d,dv])`` of the level's nodes ``pi, z`` from the combined
    nodes' cotangents ``dpi2, dz2`` and the left nodes' own ``dpil, dzl`` (``[B,H,⌈n/2⌉,…]``)."""
    acc = jnp.result_type(F32, pi.dtype)

    def kernel(pi_ref, z_ref, dpi2_ref, dz2_ref, dpil_ref, dzl_ref, dpi_ref, dz_ref):
        b, h, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        pair_backward(pi_ref, z_ref, dpi2_ref, dz2_ref, dpi_ref, dz_ref,
                      dpil_ref[b, h, m, :, :].astype(acc), dzl_ref[b, h, m, :, :].astype(acc))

    out_shape = [jax.ShapeDtypeStruct(pi.shape, pi.dtype), jax.ShapeDtypeStruct(z.shape, z.dtype)]
    return _call(kernel, out_shape, -(-pi.shape[2] // 2), interpret, pi, z, dpi2, dz2, dpil, dzl)
