"""Pieces shared by every operator family: input checks, gates, chunking, decays.

Shapes (docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay,
``<= 0``), ``beta: [B,T,H]``, ``lam: [B,T,H,L]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas", "auto")


def state_dtype(*xs) -> jnp.dtype:
    """float32 state whatever the inputs; float64 when any input is float64."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in xs if x is not None])


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_impl(impl: str, allowed: Sequence[str] = IMPLS, *, name: str = "operator") -> str:
    if impl not in allowed:
        raise ValueError(f"{name}: impl={impl!r} is not one of {tuple(allowed)}")
    return impl


def check_chunk_size(chunk_size: int) -> int:
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def check_qkv(q, k, v, *, name: str = "operator"):
    """Validate ``q, k: [B,T,H,d]`` and ``v: [B,T,H,dv]``; return ``(B, T, H, d, dv)``."""
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            shape = getattr(x, "shape", None)
            want = "[B,T,H,dv]" if arg == "v" else "[B,T,H,d]"
            raise ValueError(f"{name}: {arg} must have rank 4 {want}, got shape {shape}")
    if q.shape != k.shape:
        raise ValueError(f"{name}: k must have the shape of q [B,T,H,d]={q.shape}, got {k.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{name}: v must have shape [B,T,H,dv] with [B,T,H]={q.shape[:3]}, got {v.shape}"
        )
    B, T, H, d = q.shape
    return B, T, H, d, v.shape[-1]


def check_gate(g, B: int, T: int, H: int, *, name: str = "operator", required: bool = False):
    """Normalise a log-decay to ``[B,T,H]`` (or ``None``).

    ``g`` may be ``None`` (no decay), a per-head constant ``[H]``, or per-token ``[B,T,H]``.
    Raises ValueError for another shape or (when the values are concrete) a positive entry.
    """
    if g is None:
        if required:
            raise ValueError(f"{name}: g (log-decay [B,T,H]) is required")
        return None
    g = jnp.asarray(g)
    if g.shape == (H,):
        g = jnp.broadcast_to(g, (B, T, H))
    elif g.shape != (B, T, H):
        raise ValueError(f"{name}: g must have shape [B,T,H]={(B, T, H)} or [H]={(H,)}, got {g.shape}")
    if _is_concrete(g) and bool(np.any(np.asarray(g) > 0)):
        raise ValueError(f"{name}: g is a log-decay and must be <= 0 everywhere")
    return g


def check_per_token(x, B: int, T: int, H: int, arg: str, *, name: str = "operator"):
    """Check a per-token per-head tensor such as ``beta: [B,T,H]``."""
    x = jnp.asarray(x)
    if x.shape != (B, T, H):
        raise ValueError(f"{name}: {arg} must have shape [B,T,H]={(B, T, H)}, got {x.shape}")
    return x


def check_segment_ids(segment_ids, B: int, T: int, *, name: str = "operator"):
    """``segment_ids: [B,T]`` int (docs/math.md#packed-documents: consecutive equal ids form one
    document) or ``None``;
    ValueError naming the argument otherwise."""
    if segment_ids is None:
        return None
    s = jnp.asarray(segment_ids)
    if s.shape != (B, T) or not jnp.issubdtype(s.dtype, jnp.integer):
        raise ValueError(f"{name}: segment_ids must be an integer array [B,T]={(B, T)}, got "
                         f"{s.dtype}{list(s.shape)}")
    return s


def doc_starts(segment_ids, seq_axis=None):
    """``[B,T]`` bool: True where a document begins, i.e. where the id differs from the previous
    token's.  The row's first token is never a start: whatever precedes it (an initial state, or
    under ``seq_axis`` the previous shard, whose last id is fetched by a ``ppermute``) continues
    into it; with nothing before it there is nothing to reset."""
    prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    if seq_axis is not None:
        n = jax.lax.axis_size(seq_axis)
        left = jax.lax.ppermute(segment_ids[:, -1:], seq_axis, [(i, i + 1) for i in range(n - 1)])
        first = jnp.where(jax.lax.axis_index(seq_axis) > 0, left, segment_ids[:, :1])
        prev = jnp.concatenate([first, prev[:, 1:]], axis=1)
    return segment_ids != prev


def reset_gate(g, segment_ids, B: int, T: int, H: int, dtype, seq_axis=None):
    """The log-decay with ``-inf`` at every document start (docs/math.md#packed-documents: a gated
    operator on packed
    documents is the operator with its state reset there).  ``g``: ``[B,T,H]`` or ``None`` (no
    decay: zeros); returns ``g`` unchanged when ``segment_ids`` is ``None``."""
    if segment_ids is None:
        return g
    g = gate_or_zeros(g, B, T, H, dtype)
    return jnp.where(doc_starts(segment_ids, seq_axis)[..., None], -jnp.inf, g)


def doc_positions(segment_ids, first=None, seq_axis=None):
    """``[B,T]`` int32: each token's position in its document, ``t − t0`` (``t0`` its document's
    first token).  The tokens before the row's first document start continue from ``first: [B]``
    (the position of an initial state, or of a shard's first token in its document; None: 0);
    ``seq_axis`` as for ``doc_starts``."""
    T = segment_ids.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)
    since = jax.lax.cummax(jnp.where(doc_starts(segment_ids, seq_axis), t, -1), axis=1)
    before = t if first is None else first[:, None] + t
    return jnp.where(since < 0, before, t - since)


def same_doc(segment_ids):
    """``[B,T,T]`` bool: tokens ``t`` and ``s`` lie in one document (the quadratic oracles' mask)."""
    doc = jnp.cumsum(doc_starts(segment_ids), axis=1)
    return doc[:, :, None] == doc[:, None, :]


STATE_IMPLS = ("recurrent", "chunked", "pallas", "auto")


def wants_state(initial_state, return_final_state, impl, seq_axis, *, name: str) -> bool:
    """Whether a call passes state arguments (``initial_state`` / ``return_final_state``); they
    are taken by the ``STATE_IMPLS`` only, and not under ``seq_axis``: ValueError otherwise."""
    if initial_state is None and not return_final_state:
        return False
    if impl not in STATE_IMPLS or seq_axis is not None:
        raise ValueError(f"{name}: initial_state / return_final_state need impl in {STATE_IMPLS} "
                         f"and seq_axis=None, got impl={impl!r}, seq_axis={seq_axis!r}")
    return True


def gate_or_zeros(g, B: int, T: int, H: int, dtype) -> jax.Array:
    """``g`` as ``[B,T,H]`` in ``dtype``, zeros (no decay) when ``g is None``."""
    if g is None:
        return jnp.zeros((B, T, H), dtype)
    return g.astype(dtype)


def clamp_signed(x, eps: float):
    """``sign(x) * max(|x|, eps)`` with ``sign(0) = +1`` (docs/math.md#hla2)."""
    return jnp.where(x >= 0, jnp.maximum(x, eps), jnp.minimum(x, -eps))


def pad_time(x, multiple: int):
    """Zero-pad axis 1 (time) up to a multiple of ``multiple``.

    Padding is appended after the real tokens, so with causal operators it never changes the
    outputs of real positions (a zero log-decay and zero keys/values add nothing).
    """
    T = x.shape[1]
    pad = (-T) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)


def to_chunks(x, c: int):
    """``[B,T,H,...] -> [B,H,N,c,...]`` with T a multiple of c (pad first)."""
    B, T, H = x.shape[:3]
    x = x.reshape(B, T // c, c, H, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x, T: int):
    """``[B,H,N,c,...] -> [B,T,H,...]``, dropping padding beyond ``T``."""
    B, H, N, c = x.shape[:4]
    x = jnp.moveaxis(x, 1, 3).reshape(B, N * c, H, *x.shape[4:])
    return x[:, :T]


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


def pallas_entry(name: str):
    """``hla_jax.kernels.<name>_pallas``, the Pallas kernel of the operator ``name`` (``la_pallas``
    for linear_attention and mamba2, or a log-linear kernel), imported at call time (the kernels
    import ops)."""
    from hla_jax import kernels

    return getattr(kernels, f"{name}_pallas")


def pallas_preferred(seq_axis, chunk_size: int, *xs) -> bool:
    """Whether ``impl="auto"`` takes an operator's Pallas form (its kernel; for hla2, ahla and
    causal hla3 the chain of ``la_pallas`` passes, ``chains.over_pallas``): on a GPU, all inputs
    bf16, time not sharded, a chunk the kernels take (a power of two >= 16); the configuration
    the GPU check covers and in which the kernels beat the XLA chunked form (see the kernel
    benchmarks on the results page).  Float32 at d=128 needs smaller Triton tiles
    (``kernels.wrap.F32_GPU_TILE``), and the TPU kernels have never run on a TPU: XLA chunked
    there."""
    return (seq_axis is None and jax.default_backend() == "gpu" and chunk_size >= 16
            and chunk_size & (chunk_size - 1) == 0 and all(x.dtype == jnp.bfloat16 for x in xs))


def matmul_precision(*xs):
    """The matmul precision an operator call runs under, chosen from its inputs' dtypes.

    float32/float64 inputs: ``"highest"`` (exact float32 products, no TF32 on GPU), which the
    1e-4 / 1e-10 tolerances need.  16-bit inputs: ``"tensorfloat32"``: the state stays float32 but
    products may use the tensor cores, within the bf16 tolerance 2e-2 (docs/math.md#tolerances).  A context
    manager; jit's cache key includes it.
    """
    low = any(jnp.dtype(x.dtype).itemsize < 4 for x in xs if x is not None)
    return jax.default_matmul_precision("tensorfloat32" if low else "highest")


def precision_from_inputs(entry):
    """Decorate an operator entry ``entry(q, k, v, ...)`` to run under ``matmul_precision(q, k, v)``."""

    @functools.wraps(entry)
    def wrapped(q, k, v, *args, **kwargs):
        with matmul_precision(q, k, v):
            return entry(q, k, v, *args, **kwargs)

    return wrapped


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
