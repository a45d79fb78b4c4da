# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Fenwick hierarchy of log-linear attention
#
# Query t sees key s ≤ t at level `ℓ(t, s) = bit_length(t XOR s)` (`ℓ(t, t) = 0`): level ℓ ≥ 1
# is the aligned block of 2^(ℓ−1) keys that is the left sibling on t's path up a binary tree.
# Log-linear attention weights each level by its own `λ_t^(ℓ)`, so the T×T mask is a sum of
# O(log T) structured pieces, and decoding keeps O(log T) states.

# %%
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.ops.families import loglinear as loglinear_family

T = 32
t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
levels = np.where(s <= t, fenwick.level(t, s), -1)

fig, ax = plt.subplots(figsize=(5, 4.3))
im = ax.imshow(np.ma.masked_less(levels, 0), cmap="viridis")
ax.set(title="level ℓ(t, s)", xlabel="key s", ylabel="query t")
fig.colorbar(im, ax=ax, ticks=range(levels.max() + 1))
plt.show()

# %% [markdown]
# ## The λ-weighted hierarchical mask
# With data-dependent `λ_t^(ℓ)` (here random) the effective attention mask is
# `M[t, s] = λ_t^(ℓ(t,s))`; with all λ = 1 it is the plain causal mask of linear attention.

# %%
rng = np.random.default_rng(0)
L = fenwick.num_levels(T)
lam = rng.uniform(0.0, 1.0, size=(T, L))
mask = np.where(levels >= 0, np.take_along_axis(lam, np.maximum(levels, 0), axis=1), 0.0)
fig, axes = plt.subplots(1, 2, figsize=(9, 4))
axes[0].imshow(np.tril(np.ones((T, T))), cmap="Greys")
axes[0].set(title="λ = 1: causal mask", xlabel="key s", ylabel="query t")
axes[1].imshow(mask, cmap="magma")
axes[1].set(title="random λ: hierarchical mask", xlabel="key s")
plt.show()

# %% [markdown]
# ## The binary counter of level states
# Before token t is added, `carry` merges levels 0..z into level z+1, z = trailing_zeros(t),
# exactly as a binary counter propagates a carry. We track which tokens each level state holds.

# %%
N = 16
state = np.zeros((fenwick.num_levels(N), N), np.int32)  # state[ℓ, s] = 1: key s is in level state ℓ
held = np.full((N, N), -1)  # held[t, s]: the level state holding key s after token t
for t in range(N):
    state = np.array(fenwick.carry(jnp.asarray(state), t))
    state[0, t] = 1
    held[t, : t + 1] = np.argmax(state[:, : t + 1], axis=0)
tt, ss = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
assert (held == np.where(ss <= tt, fenwick.level(tt, ss), -1)).all()
print("after every token t < 16 the counter holds key s in level state ℓ(t, s)")
print("levels spanned after t+1 tokens:", [int(held[t].max()) + 1 for t in range(N)])

fig, ax = plt.subplots(figsize=(4.5, 4))
ax.imshow(np.ma.masked_less(held, 0), cmap="viridis")
ax.set(title="binary counter: state holding key s", xlabel="key s", ylabel="after token t")
plt.show()

# %% [markdown]
# ## The block form: the left half writes, the right half reads
# In chunks of `c` tokens, chunk `n' < n` is at level `log2 c + 1 + j` with
# `j = bit_length(n XOR n') − 1`: `n'` lies in the left half and `n` in the right half of the
# aligned block of `2^(j+1)` chunks that holds both. So each chunk level is a set of rectangles
# (left-half keys × right-half queries), and the state of a left half, `H_j = Σ D(m, s) k_s v_sᵀ`,
# is read by every query of its right half: per level, two batched matmuls over half the tokens,
# the levels independent, no walk over chunks (`ops.loglinear_blocks`, and the Pallas kernels).

# %%
c = 4
chunk_level = np.where(levels > fenwick.chunk_log2(c), levels - fenwick.chunk_log2(c) - 1, -1)
fig, ax = plt.subplots(figsize=(5, 4.3))
im = ax.imshow(np.ma.masked_less(chunk_level, 0), cmap="tab10", vmin=0, vmax=9)
for j in range(int(chunk_level.max()) + 1):
    span = c << j
    for lo in range(0, T, 2 * span):  # rows: the right half's queries, columns: the left half's keys
        ax.add_patch(plt.Rectangle((lo - 0.5, lo + span - 0.5), span, span, fill=False, lw=1.5))
ax.set(title=f"chunk levels j (chunks of {c}): one rectangle per block", xlabel="key s",
       ylabel="query t")
plt.show()

B, Hh, d, dv, Tb = 1, 2, 8, 4, 100
qb, kb = (jnp.asarray(rng.normal(size=(B, Tb, Hh, d)) / np.sqrt(d)) for _ in range(2))
vb = jnp.asarray(rng.normal(size=(B, Tb, Hh, dv)))
gb = jnp.asarray(-rng.uniform(0.0, 0.2, size=(B, Tb, Hh)))
lb = jnp.asarray(rng.uniform(0.5, 1.5, size=(B, Tb, Hh, fenwick.num_levels(Tb))))
jaxpr = str(jax.make_jaxpr(lambda *a: ops.loglinear_mamba2(*a, impl="chunked", chunk_size=16))(
    qb, kb, vb, gb, lb))
print("block form: loops over chunks in its program:", "while" in jaxpr or "scan" in jaxpr)

# %% [markdown]
# Log-linear Gated DeltaNet has the same levels, but between a left half and a query lie
# transitions that are matrices, `A = a (I − β k kᵀ)`. Its block form (`ops.loglinear_gdn_blocks`)
# first combines chunks into aligned blocks, `(Π, Z) = (Π_R Π_L, Π_R Z_L + Z_R)` (transition and
# state from zero), so a left half at level `j` holds `H_j = Z_L`. Then each query carries a
# running `r = Q̂` up the levels: wherever its chunk lies in a right half it reads `λ (r Z_L)` and
# crosses that left half, `r ← r Π_L`. Again `log2 N` rounds of batched matmuls and no loop.

# %%
kg = kb / jnp.linalg.norm(kb, axis=-1, keepdims=True)
beta_b = jnp.asarray(rng.uniform(0.1, 0.9, size=(B, Tb, Hh)))
gdn = lambda impl: ops.loglinear_gated_deltanet(qb, kg, vb, gb, beta_b, lb, impl=impl,  # noqa: E731
                                                 chunk_size=16)
err = float(jnp.linalg.norm(gdn("chunked") - gdn("reference")) / jnp.linalg.norm(gdn("reference")))
jaxpr = str(jax.make_jaxpr(lambda: gdn("chunked"))())
print(f"Gated DeltaNet block form vs reference: {err:.1e}; loops in its program:",
      "while" in jaxpr or "scan" in jaxpr)

# %% [markdown]
# ## All forms agree
# The recurrence (O(log T) states), the per-level associative scan and the O(T log T) chunked
# form (the block form above) equal the quadratic reference; with λ = 1 the operator is plain
# Mamba-2.

# %%
B, Hh, d, dv, T = 1, 2, 8, 4, 100
q, k = (jnp.asarray(rng.normal(size=(B, T, Hh, d)) / np.sqrt(d)) for _ in range(2))
v = jnp.asarray(rng.normal(size=(B, T, Hh, dv)))
g = jnp.asarray(-rng.uniform(0.0, 0.2, size=(B, T, Hh)))
lam = jnp.asarray(rng.uniform(0.5, 1.5, size=(B, T, Hh, fenwick.num_levels(T))))
ref = ops.loglinear_mamba2(q, k, v, g, lam, impl="reference")
for impl in ("recurrent", "scan", "chunked"):
    out = ops.loglinear_mamba2(q, k, v, g, lam, impl=impl, chunk_size=16)
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    print(f"loglinear_mamba2 {impl:9s} vs reference: {err:.1e}")
ones = ops.loglinear_mamba2(q, k, v, g, jnp.ones_like(lam))
print("λ = 1 vs plain mamba2:",
      f"{float(jnp.linalg.norm(ones - ops.mamba2(q, k, v, g)) / jnp.linalg.norm(ones)):.1e}")
state = loglinear_family.init_state(B, Hh, d, dv, levels=lam.shape[-1], dtype=jnp.float64)
print("decode state: level states [levels, B, H, d, dv]", state.H.shape, "and positions", state.t)
