"""Pieces shared by the operator families: the ``impl`` names, state arguments, decays inside a
chunk, scans over time, the normalisation column, and the matmul precision of a call (input
checks, documents and chunk layouts are in ``hla_jax.core``).

Shapes (docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay,
``<= 0``), ``beta: [B,T,H]``, ``lam: [B,T,H,L]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hla_jax.core.state import state_dtype


def clamp_signed(x, eps: float):
    """``sign(x) * max(|x|, eps)`` with ``sign(0) = +1`` (docs/math.md#hla2)."""
    return jnp.where(x >= 0, jnp.maximum(x, eps), jnp.minimum(x, -eps))


def segsum(g):
    """Log of the decay matrix: ``out[..., t, s] = g[s+1] + ... + g[t]`` for ``s <= t``, else -inf.

    Built by masked cumulative sums (no differences of cumulative sums), so it stays finite
    and exact even when a log-decay is -inf.  ``g: [..., c] -> [..., c, c]``.
    """
    c = g.shape[-1]
    x = jnp.broadcast_to(g[..., :, None], (*g.shape, c))  # x[..., t, s] = g[t]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    x = jnp.cumsum(jnp.where(strict, x, 0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((c, c), bool)), x, -jnp.inf)


def decay_matrix(g):
    """``Γ[..., t, s] = D(t, s)`` for ``s <= t`` and 0 above the diagonal; ``[..., c] -> [..., c, c]``."""
    return jnp.exp(segsum(g))


def causal_mask(T: int, dtype=bool):
    """``L``: lower-triangular ones including the diagonal, ``[T, T]``."""
    return jnp.tril(jnp.ones((T, T), dtype))


def exclusive_scan(combine, identity, elems, axis: int):
    """Exclusive prefix of ``elems`` under ``combine`` along ``axis`` (earlier segments first).

    ``combine(a, b)`` is a family's segment combine (a before b), broadcasting over leading
    axes; ``identity`` is the empty segment's summary with ``axis`` of length 1.  Uses
    ``jax.lax.associative_scan``, so the depth is O(log N).
    """
    inclusive = jax.lax.associative_scan(combine, elems, axis=axis)
    n = jax.tree.leaves(elems)[0].shape[axis]
    return jax.tree.map(
        lambda e, x: jnp.concatenate([e.astype(x.dtype), jax.lax.slice_in_dim(x, 0, n - 1, axis=axis)], axis),
        identity, inclusive)


def scan_time(step, state, *xs, **kw):
    """Serial recurrence over time: ``o_t, state = step(state, x_t..., **kw)`` for each t.

    ``step`` follows the families' decode convention (output first).  ``xs`` are
    ``[B,T,H,...]`` (``None`` entries are passed through as ``None``); ``step`` sees ``[B,H,...]``
    slices.  Returns ``(outputs [B,T,H,...], final_state)``.
    """
    present = [x for x in xs if x is not None]
    moved = [jnp.moveaxis(x, 1, 0) for x in present]

    def body(s, sl):
        it = iter(sl)
        o, s = step(s, *[None if x is None else next(it) for x in xs], **kw)
        return s, o

    state, out = jax.lax.scan(body, state, moved)
    return jax.tree.map(lambda o: jnp.moveaxis(o, 0, 1), out), state


def with_ones_column(v):
    """``[..., dv] -> [..., dv+1]``: V with a column of ones appended.

    Every HLA operator is linear in V and its normalisation denominator is the same operator with
    V replaced by ones, so one pass over ``[V | 1]`` yields numerator and denominator together.
    """
    return jnp.concatenate([v, jnp.ones_like(v[..., :1])], -1)


def ratio_last_column(o, eps: float):
    """``o[..., :-1] / clamp_signed(o[..., -1:], eps)``: undo ``with_ones_column``."""
    return o[..., :-1] / clamp_signed(o[..., -1:], eps)


HIGHEST = jax.lax.Precision.HIGHEST


def matmul_precision(*xs):
    """The matmul precision an operator call runs under, chosen from its inputs' dtypes.

    float32/float64 inputs: ``"highest"`` (exact float32 products, no TF32 on GPU), which the
    1e-4 / 1e-10 tolerances need.  16-bit inputs: ``"tensorfloat32"``: the state stays float32 but
    products may use the tensor cores, within the bf16 tolerance 2e-2 (docs/math.md#tolerances).  A context
    manager; jit's cache key includes it.
    """
    low = any(jnp.dtype(x.dtype).itemsize < 4 for x in xs if x is not None)
    return jax.default_matmul_precision("tensorfloat32" if low else "highest")


def ein(spec: str, *xs):
    """``jnp.einsum`` at the precision of the enclosing ``matmul_precision``."""
    return jnp.einsum(spec, *xs)


def mm(a, b):
    """Batched ``a @ b`` at the precision of the enclosing ``matmul_precision``."""
    return jnp.matmul(a, b)


def tr(x):
    """Transpose of the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def outer(a, b):
    """Batched outer product ``a bᵀ``: ``[...,m], [...,n] -> [...,m,n]``."""
    return a[..., :, None] * b[..., None, :]


def cast_inputs(q, k, v, g, normalize: bool):
    """Cast ``q, k, v, g`` to the state dtype; with ``normalize`` append a ones column to ``v``."""
    dt = state_dtype(q, k, v, g)
    v = v.astype(dt)
    return (q.astype(dt), k.astype(dt), with_ones_column(v) if normalize else v,
            None if g is None else g.astype(dt))
