"""Test helpers shared by the operator tests."""

import jax
import jax.numpy as jnp
import numpy as np


def rel_err(out, ref) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; NaN or inf anywhere gives inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not (np.all(np.isfinite(out)) and np.all(np.isfinite(ref))):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def assert_close(out, ref, tol: float, what: str = "output"):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def make_qkv(rng, B=2, T=37, H=2, d=5, dv=3, dtype=np.float32):
    """Random ``q, k: [B,T,H,d]`` scaled by 1/sqrt(d) and ``v: [B,T,H,dv]``."""
    q = rng.normal(size=(B, T, H, d)) / np.sqrt(d)
    k = rng.normal(size=(B, T, H, d)) / np.sqrt(d)
    v = rng.normal(size=(B, T, H, dv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def make_gate(rng, B=2, T=37, H=2, kind="token", dtype=np.float32, low=0.0, high=0.5):
    """Log-decay: ``None``, a per-head constant ``[H]``, or per-token ``[B,T,H]`` in [-high, -low]."""
    if kind is None:
        return None
    shape = (H,) if kind == "head" else (B, T, H)
    return jnp.asarray(-rng.uniform(low, high, size=shape), dtype)


def grads_of(fn, args, argnums, w):
    """Gradients of the linear functional ``sum(fn(*args) * w)`` with respect to ``argnums``."""
    return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=argnums)(*args)
