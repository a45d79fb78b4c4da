"""Input checks shared by the operators and the kernels: each raises a ValueError that names the
argument and the expected shape.

Shapes (docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g: [B,T,H]`` (log-decay,
``<= 0``), ``beta: [B,T,H]``, ``lam: [B,T,H,L]``, ``segment_ids: [B,T]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.core import fenwick


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_impl(impl: str, allowed: Sequence[str], *, name: str = "operator") -> str:
    if impl not in allowed:
        raise ValueError(f"{name}: impl={impl!r} is not one of {tuple(allowed)}")
    return impl


def check_chunk_size(chunk_size: int, *, name: str = "operator") -> int:
    if (not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool)
            or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def check_qkv(q, k, v, *, name: str = "operator"):
    """Validate ``q, k: [B,T,H,d]`` and ``v: [B,T,H,dv]``; return ``(B, T, H, d, dv)``."""
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            shape = getattr(x, "shape", None)
            want = "[B,T,H,dv]" if arg == "v" else "[B,T,H,d]"
            raise ValueError(f"{name}: {arg} must have rank 4 {want}, got shape {shape}")
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: {arg} must be a floating-point array, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"{name}: k must have the shape of q [B,T,H,d]={q.shape}, got {k.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{name}: v must have shape [B,T,H,dv] with [B,T,H]={q.shape[:3]}, got {v.shape}"
        )
    if 0 in q.shape or v.shape[-1] == 0:
        raise ValueError(f"{name}: q, k, v must have at least one batch row, token, head and "
                         f"feature, got q {q.shape}, v {v.shape}")
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
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise ValueError(f"{name}: g must be a floating-point log-decay, got {g.dtype}")
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
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: {arg} must be a floating-point array, got {x.dtype}")
    if x.shape != (B, T, H):
        raise ValueError(f"{name}: {arg} must have shape [B,T,H]={(B, T, H)}, got {x.shape}")
    return x


def check_segment_ids(segment_ids, B: int, T: int, *, name: str = "operator"):
    """``segment_ids: [B,T]`` int (docs/math.md#packed-documents: consecutive equal ids form one
    document) or ``None``; ValueError naming the argument otherwise."""
    if segment_ids is None:
        return None
    s = jnp.asarray(segment_ids)
    if s.shape != (B, T) or not jnp.issubdtype(s.dtype, jnp.integer):
        raise ValueError(f"{name}: segment_ids must be an integer array [B,T]={(B, T)}, got "
                         f"{s.dtype}{list(s.shape)}")
    return s


def check_lam(lam, B, T, H, *, name, T_all=None):
    """``lam: [B,T,H,L]`` with ``L ≥ fenwick.num_levels(T_all)`` (``T_all``: the global length
    of a sharded sequence, default ``T``); ValueError otherwise."""
    lam = jnp.asarray(lam)
    T_all = T if T_all is None else T_all
    need = fenwick.num_levels(T_all)
    if not jnp.issubdtype(lam.dtype, jnp.floating):
        raise ValueError(f"{name}: lam must be a floating-point array, got {lam.dtype}")
    if lam.ndim != 4 or lam.shape[:3] != (B, T, H):
        raise ValueError(f"{name}: lam must have shape [B,T,H,levels] with [B,T,H]={(B, T, H)}, "
                         f"got {lam.shape}")
    if lam.shape[-1] < need:
        raise ValueError(f"{name}: lam has {lam.shape[-1]} levels but T={T_all} needs at least "
                         f"{need} (⌈log2 T⌉+1)")
    return lam
