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
# # Scan operators: one algebra, four forms
#
# Every operator in `hla_jax.ops` is a *prefix statistic*: a per-token summary, an associative
# `combine` (segment A before segment B), and a `readout` of the inclusive prefix at t.
# Here we build the summaries ourselves, feed them to `jax.lax.associative_scan`, and check
# that the result equals the serial recurrence (the decode step), the chunked training form
# and the quadratic reference, in float64.

# %%
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np

from hla_jax import ops
from hla_jax.ops.families import ahla as ahla_family
from hla_jax.ops.families import hla2 as hla2_family
from hla_jax.ops.families import hla3 as hla3_family
from hla_jax.ops.families import linear as linear_family

rng = np.random.default_rng(0)
B, T, H, d, dv = 1, 50, 2, 8, 4
q, k = (jnp.asarray(rng.normal(size=(B, T, H, d)) / np.sqrt(d)) for _ in range(2))
v = jnp.asarray(rng.normal(size=(B, T, H, dv)))
g = jnp.asarray(-rng.uniform(0.0, 0.3, size=(B, T, H)))  # per-token log-decay


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# %% [markdown]
# ## Second-order HLA
# Token summary `(a_t, k kᵀ, q vᵀ, 0)`; the combine carries the cross term
# `G = ρ_B² G_A + G_B + ρ_B S_B C_A` (docs/math.md#hla2). The readout of the prefix is `qᵀ(S C − G)`.

# %%
prefix = jax.lax.associative_scan(hla2_family.combine, hla2_family.token_summaries(q, k, v, g), axis=1)
o_scan = hla2_family.readout(prefix, q)
for impl in ("reference", "recurrent", "chunked"):
    print(f"hla2  scan vs {impl:9s}: {rel(o_scan, ops.hla2(q, k, v, g, impl=impl, chunk_size=16)):.1e}")

# %% [markdown]
# ## AHLA, third-order HLA and first-order linear attention
# Same recipe, different summaries. AHLA's `R = Σ k qᵀ` is never decayed; HLA3 carries
# seven fields, all of size O(d² + d·dv).

# %%
cases = {
    "ahla": (ahla_family, ops.ahla),
    "hla3": (hla3_family, ops.hla3),
}
for name, (fam, entry) in cases.items():
    pre = jax.lax.associative_scan(fam.combine, fam.token_summaries(q, k, v, g), axis=1)
    o = fam.readout(pre, q)
    print(f"{name}  scan vs reference: {rel(o, entry(q, k, v, g, impl='reference')):.1e}",
          f"  chunked: {rel(entry(q, k, v, g, impl='chunked', chunk_size=16), o):.1e}")

_, Hs = jax.lax.associative_scan(linear_family.combine, linear_family.token_summaries(k, v, g), axis=1)
o = linear_family.readout(Hs, q)
print(f"linear scan vs reference: {rel(o, ops.linear_attention(q, k, v, g, impl='reference')):.1e}")

# %% [markdown]
# ## Associativity, checked directly
# `combine(combine(a, b), c) == combine(a, combine(b, c))` on three random segments.

# %%
s = hla2_family.token_summaries(q, k, v, g)
seg = [jax.tree.map(lambda x, i=i: x[:, i], s) for i in range(3)]
left = hla2_family.combine(hla2_family.combine(seg[0], seg[1]), seg[2])
right = hla2_family.combine(seg[0], hla2_family.combine(seg[1], seg[2]))
print("max |left − right| over all fields:",
      max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(left, right)))

# %% [markdown]
# ## Decoding token by token
# `init_state` + `step` is the O(1)-memory decode path; it reproduces the full sequence.

# %%
state = hla2_family.init_state(B, H, d, dv, dtype=jnp.float64)
outs = []
for t in range(T):
    o_t, state = hla2_family.step(state, q[:, t], k[:, t], v[:, t], g[:, t])
    outs.append(o_t)
print("hla2 decode vs full sequence:", f"{rel(jnp.stack(outs, 1), o_scan):.1e}")

# %% [markdown]
# ## The paper's "masked third order" is a different operator
# `mask="paper"` is the streaming algebra printed in the HLA paper; it is not
# `(((W Wᵀ) ∘ L) W) V` (docs/math.md#hla3, docs/math.md#paper-differences).

# %%
o_causal = ops.hla3(q, k, v, impl="reference")
o_paper = ops.hla3(q, k, v, mask="paper", impl="reference")
print("causal vs paper (relative difference):", f"{rel(o_paper, o_causal):.2f}")
print("paper: chunked vs reference:", f"{rel(ops.hla3(q, k, v, mask='paper', chunk_size=16), o_paper):.1e}")

# %% [markdown]
# ## Packed documents and chunked states
# `segment_ids` packs several documents into one row: the operator then equals the operator on
# each document alone (docs/math.md#packed-documents). `initial_state` / `return_final_state` let the
# chunked form
# process a sequence in pieces, or prefill a prompt in one parallel pass and hand its state to
# `step`.

# %%
lengths = [9, 1, T - 10]  # three documents in each row, the first ending mid-chunk
seg = jnp.asarray(np.repeat(np.arange(3), lengths))[None].repeat(B, 0)
packed = ops.hla2(q, k, v, g, segment_ids=seg, chunk_size=4)
start = 0
for n in lengths:
    alone = ops.hla2(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n],
                     g[:, start:start + n], impl="reference")
    print(f"document of {n:2d} tokens: packed vs alone {rel(packed[:, start:start + n], alone):.1e}")
    start += n

half = T // 2 + 1
o1, s = ops.hla2(q[:, :half], k[:, :half], v[:, :half], g[:, :half], return_final_state=True)
o2, s = ops.hla2(q[:, half:], k[:, half:], v[:, half:], g[:, half:], initial_state=s,
                 return_final_state=True)
print("two pieces vs one pass:", f"{rel(jnp.concatenate([o1, o2], 1), o_scan):.1e}")
print("final state vs the decode loop's:", f"{rel(s.U, state.U):.1e}")
