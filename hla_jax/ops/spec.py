"""What the registry holds and the dispatcher reads: ``Spec``, one operator's specification (its
inputs, its decode state, its forms and its ``impl="auto"`` rule), and ``Call``, one call's checked
inputs, which every form takes.

A form is ``form(c: Call) -> (o [B,T,H,dv], final_state or None)``.  Shapes
(docs/math.md#notation): ``q, k: [B,T,H,d]``, ``v: [B,T,H,dv]``, ``g, beta: [B,T,H]``,
``lam: [B,T,H,L]``, ``segment_ids: [B,T]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from hla_jax.core.documents import gate_or_zeros, reset_gate

IMPLS = ("reference", "recurrent", "scan", "chunked", "pallas")  # every operator's forms
STATE_IMPLS = ("recurrent", "chunked", "pallas")                 # the forms that take a state
GATES = ("optional", "required", "none")
FEATURES = ("qk", "mamba2", "delta")


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """One operator, as the dispatcher and the models read it.

    Inputs: ``gate`` says whether ``g`` is "optional" (None: no decay), "required" or "none"
    (must be None); ``beta`` / ``lam`` whether it takes ``beta [B,T,H]`` / ``lam [B,T,H,L]``
    (with ``lam``, ``chunk_size`` is a power of two); ``normalize`` whether it takes
    ``normalize`` and ``eps`` (ratio normalisation).

    ``forms``: impl name -> ``form(c: Call) -> (o, final_state or None)``; the public ones are
    ``IMPLS`` (an operator may lack "pallas"), others are internal choices of ``auto`` that can
    be named too (``"chunked_ut_kernel"``).  ``auto(c) -> impl``: the ``impl="auto"`` rule.

    State: ``init_state(B, H, d, dv, *, normalize, levels, dtype)`` (the decode state, the layout
    ``initial_state`` must have) and ``step(state, q, k, v, g, beta, lam, *, normalize, eps) ->
    (o_t, state)`` (one token, ``[B,H,·]``); each takes the keywords it does not use.

    ``flops(T, d, c) -> float``: forward matmul FLOPs per token and head of its chunked form at
    context ``T``, chunk ``c`` (dense ``c×c`` products counted in full; cross-chunk work per
    chunk divided by ``c``), which the models' MFU reads (``nn.flops``).

    ``variant(**options) -> Spec``: the operator's options that pick another spec (hla3's
    ``mask``), None when it has none.  ``mixer``: the name of its token mixer in ``hla_jax.nn``
    ("" for none), whose feature map ``features`` is "qk" (L2-normalised q, k, the HLA and
    linear-attention map), "mamba2" (``v = dt·x`` and a ``D`` skip) or "delta" (L2-normalised
    q, k and a β gate).  ``label``: how errors name a variant (``"hla3 (mask='paper')"``).
    """
    name: str
    forms: Mapping[str, Callable]
    auto: Callable
    init_state: Callable
    step: Callable
    gate: str = "optional"
    beta: bool = False
    lam: bool = False
    normalize: bool = False
    flops: Callable | None = None
    variant: Callable | None = None
    mixer: str = ""
    features: str = "qk"
    label: str = ""

    def __post_init__(self):
        if self.gate not in GATES or self.features not in FEATURES:
            raise ValueError(f"Spec {self.name}: gate must be one of {GATES} and features one of "
                             f"{FEATURES}, got {self.gate!r}, {self.features!r}")
        missing = [f for f in IMPLS if f not in self.forms and f != "pallas"]
        if missing:
            raise ValueError(f"Spec {self.name}: forms must include {missing}")

    @property
    def impls(self) -> tuple:
        """The impl names a call may give: every form, and "auto"."""
        return (*self.forms, "auto")

    @property
    def state_impls(self) -> tuple:
        """The impls that take ``initial_state`` / ``return_final_state``."""
        return tuple(f for f in self.impls if f in (*STATE_IMPLS, "auto"))

    def __str__(self) -> str:
        return self.label or self.name


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q", "k", "v", "g", "beta", "lam", "segment_ids", "initial_state",
                                "eps"],
                   meta_fields=["spec", "return_final_state", "chunk_size", "seq_axis",
                                "normalize"])
@dataclasses.dataclass(frozen=True)
class Call:
    """An operator call with checked inputs: ``g`` ``[B,T,H]`` or None (no decay), ``beta`` /
    ``lam`` where the operator has them, ``initial_state`` in the layout of
    ``spec.init_state``."""
    spec: Spec
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: Any = None
    beta: Any = None
    lam: Any = None
    segment_ids: Any = None
    initial_state: Any = None
    return_final_state: bool = False
    chunk_size: int = 64
    seq_axis: Any = None
    normalize: bool = False
    eps: Any = 1e-6

    @property
    def stateful(self) -> bool:
        return self.initial_state is not None or self.return_final_state


def kernels_preferred(c: Call) -> bool:
    """The configuration in which the kernels beat the XLA chunked forms (the kernel benchmarks
    on the results page) and which the GPU check covers: on a GPU, ``q, k, v`` all bf16, time
    not sharded, a chunk the kernels take (a power of two >= 16).  Float32 at d=128 needs
    smaller Triton tiles (``kernels.wrap.F32_GPU_TILE``), and the TPU kernels have never run on
    a TPU: the XLA chunked forms there."""
    return (c.seq_axis is None and jax.default_backend() == "gpu" and c.chunk_size >= 16
            and c.chunk_size & (c.chunk_size - 1) == 0
            and all(x.dtype == jnp.bfloat16 for x in (c.q, c.k, c.v)))


def chunk_levels(T: int, c: int) -> int:
    """``⌈log2 ⌈T/c⌉⌉``: the chunk levels a log-linear operator reads at context ``T``."""
    return math.ceil(math.log2(max(1, math.ceil(T / c))))


def reset(c: Call):
    """The log-decay ``[B,T,H]`` with ``−∞`` at every document start (None: no decay and no
    documents)."""
    B, T, H = c.q.shape[:3]
    return reset_gate(c.g, c.segment_ids, B, T, H, c.q.dtype if c.g is None else c.g.dtype,
                      c.seq_axis)


def gate(c: Call, documents: bool = True):
    """The log-decay ``[B,T,H]``, zeros where there is no decay; reset at the document starts
    unless ``documents=False`` (for forms that take ``segment_ids`` themselves)."""
    B, T, H = c.q.shape[:3]
    g = reset(c) if documents else c.g
    return gate_or_zeros(g, B, T, H, c.q.dtype if g is None else g.dtype)


def with_state(c: Call, out):
    """A kernel's output as ``(o, final_state or None)``: the kernels compute the final state
    only when asked (``return_final_state``)."""
    return out if c.return_final_state else (out, None)
