"""Shared pieces of the Pallas Mosaic TPU kernels (NEVER RUN ON TPU HARDWARE: the tests run them
in interpret mode on CPU and check that they lower through Mosaic): the grid ``(B, H, N)`` over
heads-first inputs ``[B,H,Tp,·]`` (every block's last two dims ``(c, ·)``), its per-chunk blocks,
the float32 state carried in VMEM scratch along a sequential chunk axis, and per-token rows as
per-chunk ``[R, c]`` blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32


def heads_first(x):
    return jnp.swapaxes(x, 1, 2)  # [B,Tp,H,·] <-> [B,H,Tp,·]


def compiler_params(interpret, sequential=True):
    """Mosaic's settings on the grid ``(B, H, N)``: the chunk axis walked in order ("arbitrary")
    when ``sequential``, else parallel like the others (None in interpret mode)."""
    return None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary" if sequential else "parallel"))


def chunk_specs(c, N, rev=False):
    """Per-chunk blocks of q, k, v (``tile(width)``) and the gate; ``rev`` walks the chunks
    backwards."""
    n_of = (lambda n: N - 1 - n) if rev else (lambda n: n)
    tile = lambda w: pl.BlockSpec((None, None, c, w), lambda i, h, n: (i, h, n_of(n), 0))
    gate = pl.BlockSpec((None, None, None, 1, c), lambda i, h, n: (i, h, n_of(n), 0, 0))
    return tile, gate


def state_blocks(B, H, n_blocks, d, dv, dtype, at):
    """Shape and block of states ``[B,H,n_blocks,d,dv]``, grid step ``n`` at block ``at(n)``."""
    return (jax.ShapeDtypeStruct((B, H, n_blocks, d, dv), dtype),
            pl.BlockSpec((None, None, None, d, dv), lambda i, h, n: (i, h, at(n), 0, 0)))


def end_state(B, H, d, dv):
    """Shape and block of one float32 state ``[B,H,d,dv]``, the same block at every grid step:
    a walk's initial or last state."""
    return (jax.ShapeDtypeStruct((B, H, d, dv), F32),
            pl.BlockSpec((None, None, d, dv), lambda i, h, n: (i, h, 0, 0)))


def start_carry(S_ref, ref):
    """At the first chunk, set the carried state to ``ref`` (float32), or to zeros if None."""
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = jnp.zeros_like(S_ref) if ref is None else ref[...].astype(F32)


def store_last(S_ref, ref, N):
    """At the last chunk (after its update), copy the carried state to ``ref``."""
    @pl.when(pl.program_id(2) == N - 1)
    def _():
        ref[...] = S_ref[...]


def rows_by_chunk(x, c):
    """``[B,H,R,Tp] -> [B,H,N,R,c]`` (per-token rows as per-chunk blocks)."""
    B, H, R, Tp = x.shape
    return jnp.swapaxes(x.reshape(B, H, R, Tp // c, c), 2, 3)


def rows_from_chunks(x):
    """``[B,H,N,R,c] -> [B,H,R,Tp]``."""
    B, H, N, R, c = x.shape
    return jnp.swapaxes(x, 2, 3).reshape(B, H, R, N * c)
