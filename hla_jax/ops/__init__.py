"""Pure-function operators.  The public entries, one per operator of the registry
(``ops.registry.ENTRIES``; each defined in its family's module, ``ops.families``), for example:

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
document alone, docs/math.md#packed-documents), ``initial_state`` / ``return_final_state``
(recurrent, chunked, pallas: start from the family's decode state and return
``(o, final_state)``) and ``seq_axis`` (the mesh axis time is sharded over, ``ops.sequence``).

Layout: ``spec`` (what an operator is), ``dispatch`` (the one generic dispatcher),
``registry`` (the families), ``families/`` (one module per family: its spec, algebra and public
entries), ``xla/`` (the XLA forms: recurrences, scans, chunked forms), ``chains`` and
``levels`` (compositions over the kernels), ``reference`` (the quadratic oracles).
"""

from hla_jax.ops import families, reference, registry

globals().update(registry.ENTRIES)  # ops.hla2, ops.mamba2, …: the registry's public entries

__all__ = [*registry.ENTRIES, "families", "reference", "registry"]
