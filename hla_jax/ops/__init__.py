"""Pure-function operators: one module per family (its algebra and forms), the public entries in
``operators`` and one dispatcher (``dispatch``: input checks, the ``impl="auto"`` rule, the
table of forms).

    o = ops.hla2(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64)
    o = ops.ahla(q, k, v, g=None, *, normalize=False, eps=1e-6, impl="auto", chunk_size=64)
    o = ops.hla3(q, k, v, g=None, *, mask="causal", normalize=False, impl="auto", chunk_size=64)
    o = ops.linear_attention(q, k, v, g=None, *, impl="auto")
    o = ops.mamba2(q, k, v, g, *, impl="auto", chunk_size=64)
    o = ops.gated_deltanet(q, k, v, g, beta, *, impl="auto", chunk_size=64)
    o = ops.loglinear_mamba2(q, k, v, g, lam, *, impl="auto", chunk_size=64)
    o = ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, *, impl="auto", chunk_size=64)

q, k: [B,T,H,d]; v: [B,T,H,dv]; g: [B,T,H] log-decay (<= 0); beta: [B,T,H];
lam: [B,T,H,levels]; impl: "reference" | "recurrent" | "scan" | "chunked" | "pallas" | "auto".
Every entry also takes ``segment_ids: [B,T]`` int (packed documents: the operator on each
document alone, docs/math.md#packed-documents), ``initial_state`` / ``return_final_state`` (recurrent,
chunked, pallas:
start from the family's decode state and return ``(o, final_state)``) and ``seq_axis`` (the mesh
axis time is sharded over, ``ops.sequence``).
"""

from hla_jax.core import fenwick
from hla_jax.ops import ahla as ahla_family
from hla_jax.ops import hla2 as hla2_family
from hla_jax.ops import hla3 as hla3_family
from hla_jax.ops import linear as linear_family
from hla_jax.ops import loglinear as loglinear_family
from hla_jax.ops import reference
from hla_jax.ops.operators import (
    ahla,
    gated_deltanet,
    hla2,
    hla3,
    linear_attention,
    loglinear_gated_deltanet,
    loglinear_mamba2,
    mamba2,
)

__all__ = [
    "ahla", "hla2", "hla3", "linear_attention", "mamba2", "gated_deltanet",
    "loglinear_mamba2", "loglinear_gated_deltanet", "reference", "fenwick",
    "hla2_family", "ahla_family", "hla3_family", "linear_family", "loglinear_family",
]
