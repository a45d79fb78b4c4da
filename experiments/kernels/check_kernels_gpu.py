"""Every Pallas kernel vs the quadratic reference on the GPU: outputs, final states and all gradients.

    python -m experiments.kernels.check_kernels_gpu [--kernels mamba2,la_pallas] [--cases 0,3]
                                   [--f32_tile 32] [--name kernels_check_gpu] [--out DIR]
    # in two shorter runs, each with its own results file:
    python -m experiments.kernels.check_kernels_gpu --kernels mamba2,la_pallas,hla2,ahla,hla3 \
        --name kernels_check_gpu_la
    python -m experiments.kernels.check_kernels_gpu --kernels loglinear_mamba2,loglinear_gated_deltanet \
        --name kernels_check_gpu_loglinear
    # four processes share the device (compilation dominates); a second call resumes a cut run:
    python -m experiments.kernels.check_kernels_gpu --workers 4 --resume 1

Kernels (``CASES``), compiled, not interpreted:

- ``mamba2``: ``ops.mamba2(impl="pallas")``, i.e. the first-order kernel ``kernels.la_pallas``;
- ``la_pallas``: ``kernels.la_pallas`` directly, from an initial state and returning the final
  state (``backend`` its default or as the case names it);
- ``hla2``, ``ahla``, ``hla3`` (causal): ``ops.<op>(impl="pallas")``, the chains (docs/math.md#chains) of two
  ``la_pallas`` calls, with and without ratio normalisation;
- ``gated_deltanet``: ``kernels.gated_deltanet_pallas`` from an initial state and returning the
  final state (reference: the float64 recurrence, ``ops.gated_deltanet(impl="recurrent")``), or,
  with packed documents, ``ops.gated_deltanet(impl="pallas")`` (reference: the quadratic one);
  ``gated_deltanet_pieces``: the same with each sequence cut into ``GDN_PIECES`` pieces (``T``
  padded to a multiple of ``64·GDN_PIECES``);
- ``loglinear_mamba2``, ``loglinear_gated_deltanet``: ``kernels.<name>_pallas`` (with packed
  documents: ``ops.<name>(impl="pallas", segment_ids=...)`` against the reference with each
  document's own levels; from a state, ``state``: ``ops.<name>(impl="pallas",
  initial_state=LevelState(H0, STATE_T0), return_final_state=True)``, the kernels on the row
  composed with one first-order pass, against the float64 recurrence from the same state);
- ``loglinear_mamba2_blocks``, ``loglinear_gated_deltanet_blocks``: ``ops.<name>(impl="chunked")``,
  the block forms (``ops.xla.loglinear_blocks``, ``ops.xla.loglinear_gdn_blocks``: XLA matmuls, no kernel
  of their own), GPU numerics checked the same way;
- ``loglinear_gated_deltanet_blocks_ut``: ``ops.xla.loglinear_gdn_blocks.blocks(terms="kernel")``, that
  block form with its chunk terms from the first-order kernel's Mosaic GPU UT transform and the
  Triton chunk-terms kernel (``kernels/loglinear_gdn/gdn_terms_triton.py``), their backward
  Mosaic GPU's (``kernels/loglinear_gdn/gdn_terms_mgpu.py``, then the UT backward), and the
  levels' Triton kernels;
- ``jla_gated_deltanet``: the ``jax-linear-attention`` wheel's Mosaic GPU Gated DeltaNet
  (``linear_attention("gated_deltanet", impl="mosaic_gpu", scale=1)``, from an initial state and
  returning the final state), not ours: its errors under the same oracle and limits, beside our
  kernel's on the same kind of inputs (the numerics its design choices cost, e.g. its bf16 ``T``).

Gates ``g``: per token (``token``), per head (``head``), none, or per token with −∞ entries
(``reset``: in batch element 0 only, at chunk boundaries and at random, so the other element
keeps its initial state's term), or per token with packed documents (``docs``: ``segment_ids``
with documents of ``DOCS`` tokens in turn, starting mid-chunk, in element 0, one document in the
other; the reference is the operator with ``g = −∞`` at each document start,
docs/math.md#packed-documents), or
(``aligned``, delta rules) slow decays, β near 1 and keys around one direction, where the UT
transform's ``(I + A)⁻¹`` is worst conditioned, or (``state``) per token after a state whose
rows are at positions ``STATE_T0``.
Gradients of ``sum(o·w)`` (plus ``sum(h_T·w')`` for the final state) with respect to every
differentiable input (q, k, v, g, the initial state, and β, λ where the operator has them).
The reference runs in float64 (``jax.enable_x64``) on the same inputs:
``reference.linear_attention``, plus ``D(t,−1) q_tᵀ H0`` and ``H_T = Σ_s D(T−1,s) k_s v_sᵀ +
D(T−1,−1) H0`` for ``la_pallas`` (``la_with_state``), and ``hla_jax.ops.reference.<op>``
otherwise.  Every output and gradient records its max abs and relative (Frobenius) error; a case
passes when every relative error is at most 2e-3 for float32 inputs, 3e-2 for bf16 (compared on
the same bf16-rounded values).  Prints one line per case as it finishes (``case`` is its index in
``CASES``, for ``--cases``) and rewrites ``<name>.json`` (with its ``provenance``) and ``.txt`` in
``--out`` (default experiments/results) after each; the exit code is non-zero if any case failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import RESULTS, ROOT, write_json, write_markdown
from hla_jax import kernels, ops
from hla_jax.core import fenwick
from hla_jax.core.documents import doc_starts
from hla_jax.core.state import LevelState
from hla_jax.kernels import wrap
from hla_jax.ops import reference
from hla_jax.ops.xla import loglinear_gdn_blocks

HLA = ("hla2", "ahla", "hla3")
LOGLINEAR = ("loglinear_mamba2", "loglinear_gated_deltanet")
BLOCKS = ("loglinear_mamba2_blocks", "loglinear_gated_deltanet_blocks")  # impl="chunked", XLA
BLOCKS_UT = "loglinear_gated_deltanet_blocks_ut"  # the GDN block form on its Triton kernels
WITH_LAM = LOGLINEAR + BLOCKS + (BLOCKS_UT,)
# keys L2-normalised, a β
DELTA = ("gated_deltanet", "loglinear_gated_deltanet", "loglinear_gated_deltanet_blocks", BLOCKS_UT)
WHEEL_GDN = "jla_gated_deltanet"  # the wheel's, checked beside ours (cases 51-52)
GDN_PIECES = 4  # pieces per sequence of the "gated_deltanet_pieces" cases (the last ones)
WITH_BETA = DELTA + (WHEEL_GDN, "gated_deltanet_pieces")
RESETS = (64, 127, 500)  # positions of −∞ log-decays in a "reset" gate (chunk starts and ends)
DOCS = (300, 1, 137, 64, 211)  # document lengths of a "docs" row, in turn
STATE_T0 = (3000, 77)  # the rows' positions in a "state" case (3000: not aligned to 2^10)


class Case(NamedTuple):
    kernel: str
    B: int
    T: int
    H: int
    d: int
    dv: int
    gate: str | None  # "token" | "head" | "reset" | "docs" | "aligned" (slow decay) | "state" | None
    normalize: bool
    dtype: str
    backend: str | None = None  # la_pallas's (None: its default)


CASES = [
    *[Case("mamba2", 2, 1000, 2, 128, 128, "reset", False, dt) for dt in ("bfloat16", "float32")],
    *[Case("la_pallas", 2, 1000, 2, 128, dv, "reset", False, dt)
      for dv, dt in ((128, "bfloat16"), (256, "bfloat16"), (256, "float32"))],
    *[Case(n, 2, 1000, 2, 128, 128, "token", False, "bfloat16") for n in HLA],
    *[Case(n, 1, 700, 2, 128, 128, "token", True, "float32") for n in HLA],
    *[Case(n, 2, 300, 2, 64, 64, "reset", False, "float32") for n in HLA],
    Case("hla2", 1, 513, 3, 128, 96, None, False, "float32"),
    *[Case(n, 2, 1000, 2, 128, 128, "docs", False, "bfloat16") for n in ("mamba2", *HLA)],
    Case("hla2", 2, 700, 2, 128, 128, "docs", True, "float32"),
    *[Case("gated_deltanet", 2, T, 2, d, dv, gate, False, "bfloat16")
      for T, d, dv, gate in ((1000, 128, 128, "reset"), (700, 64, 192, "token"), (1000, 128, 128, "docs"))],
    *[Case(n, B, T, 2, 128, dv, "token", False, dt) for n in LOGLINEAR
      for B, T, dv, dt in ((2, 300, 64, "float32"), (1, 1000, 128, "float32"), (2, 1000, 128, "bfloat16"))],
    *[Case(n, B, T, 2, 128, 128, "docs", False, dt) for n in LOGLINEAR
      for B, T, dt in ((2, 1000, "bfloat16"), (1, 700, "float32"))],
    *[Case(n, B, T, 2, 128, 128, gate, False, dt) for n, long in zip(BLOCKS, (4100, 1600))
      for B, T, gate, dt in ((2, 1000, "reset", "bfloat16"), (1, long, "token", "bfloat16"),
                             (2, 1000, "reset", "float32"))],  # the delta rule's oracle: O(T²d) memory
    *[Case(n, 1, 1000, 2, 128, 128, "aligned", False, "bfloat16") for n in DELTA],
    *[Case(n, 2, 1000, 2, 128, 128, "state", False, dt)
      for n in LOGLINEAR for dt in ("bfloat16", "float32")],
    *[Case(BLOCKS_UT, B, T, 2, 128, 128, gate, False, "bfloat16")
      for B, T, gate in ((2, 1000, "reset"), (1, 1600, "token"), (1, 1000, "aligned"))],
    Case("gated_deltanet", 2, 1000, 2, 128, 128, "token", False, "bfloat16"),  # the wheel beside
    *[Case(WHEEL_GDN, B, 1000, 2, 128, 128, gate, False, "bfloat16")  # it and case 39 (aligned)
      for B, gate in ((2, "token"), (1, "aligned"))],
    *[Case("gated_deltanet_pieces", B, T, 2, 128, dv, gate, False, "bfloat16")
      for B, T, dv, gate in ((1, 4100, 128, "reset"), (2, 1000, 192, "token"), (1, 1000, 128, "aligned"))],
]


def errors(a, b) -> dict:
    """Max abs and relative (Frobenius) error of ``a`` against ``b`` (inf where ``a`` is not finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return {"max": float("inf"), "rel": float("inf")}
    return {"max": float(np.max(np.abs(a - b))), "rel": float(np.linalg.norm(a - b) / np.linalg.norm(b))}


def operands(rng, case):
    """``(args, names)``: the operator's positional inputs (keys L2-normalised and β in (0, 1)
    for Gated DeltaNet, λ with ⌈log2 T⌉+1 levels for the log-linear ones, the initial state last
    for ``la_pallas``)."""
    B, T, H, d, dv = case.B, case.T, case.H, case.d, case.dv
    dt = jnp.dtype(case.dtype)
    q, k = (rng.normal(size=(B, T, H, d)) / np.sqrt(d) for _ in range(2))
    if case.gate == "aligned":  # keys around one direction: the UT inverse's hard case
        k = rng.normal(size=d) + 0.1 * rng.normal(size=(B, T, H, d))
    if case.kernel in WITH_BETA:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    args = [jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(rng.normal(size=(B, T, H, dv)), dt)]
    names = ["q", "k", "v"]
    if case.gate is not None:
        shape = (H,) if case.gate == "head" else (B, T, H)
        g = -rng.uniform(0, 0.002 if case.gate == "aligned" else 0.2, shape)
        if case.gate == "reset":
            g[0, [t for t in RESETS if t < T]] = -np.inf
            g[0][rng.random((T, H)) < 0.005] = -np.inf
        args.append(jnp.asarray(g, jnp.float32))
        names.append("g")
    if case.kernel in WITH_BETA:
        lo, hi = (0.9, 0.99) if case.gate == "aligned" else (0.1, 0.9)
        args.append(jnp.asarray(rng.uniform(lo, hi, (B, T, H)), jnp.float32))
        names.append("beta")
    if case.kernel in WITH_LAM:
        L = fenwick.num_levels(T + (max(STATE_T0) if case.gate == "state" else 0))
        args.append(jnp.asarray(rng.uniform(0.5, 1.5, (B, T, H, L)), jnp.float32))
        names.append("lam")
    if case.gate == "state":
        args.append(jnp.asarray(rng.normal(size=(L, B, H, d, dv)) / np.sqrt(d), jnp.float32))
        names.append("h0")
    if case.kernel in ("la_pallas", WHEEL_GDN, "gated_deltanet_pieces") or (
            case.kernel == "gated_deltanet" and case.gate != "docs"):
        args.append(jnp.asarray(rng.normal(size=(B, H, d, dv)), jnp.float32))
        names.append("h0")
    return args, names


def la_with_state(q, k, v, g, h0):
    """``(o, h_T)`` of LA from the state ``h0`` (the dtype of the inputs, float64 here):
    ``o_t = reference.linear_attention(q, k, v, g)_t + D(t,−1) q_tᵀ h0`` and
    ``h_T = Σ_s D(T−1,s) k_s v_sᵀ + D(T−1,−1) h0``; the log-decays are sums, never differences,
    so −∞ entries stay exact."""
    from_start = jnp.cumsum(g, axis=1)  # log D(t, −1)
    to_end = jnp.flip(jnp.cumsum(jnp.flip(g, 1), axis=1), 1)  # Σ_{r >= s} g_r
    to_end = jnp.concatenate([to_end[:, 1:], jnp.zeros_like(g[:, :1])], 1)  # log D(T−1, s)
    o = reference.linear_attention(q, k, v, g) + jnp.exp(from_start)[..., None] * jnp.einsum(
        "bthd,bhdv->bthv", q, h0)
    hT = jnp.einsum("bth,bthd,bthv->bhdv", jnp.exp(to_end), k, v) + jnp.exp(
        from_start[:, -1])[..., None, None] * h0
    return o, hT


def segments(case):
    """``segment_ids [B,T]`` of a "docs" case (``DOCS`` in turn in row 0, one document in the
    others), or None."""
    if case.gate != "docs":
        return None
    ids = np.zeros((case.B, case.T), np.int32)
    ids[0] = np.repeat(np.arange(case.T), np.resize(DOCS, case.T))[:case.T]
    return jnp.asarray(ids)


def from_state(name, impl):
    """``f(q, k, v, g, [beta,] lam, h0) -> (o, H_T)``: the log-linear operator ``name`` from
    ``LevelState(h0, STATE_T0)`` by ``impl``."""
    def f(*a):
        o, st = getattr(ops, name)(*a[:-1], impl=impl, initial_state=LevelState(
            a[-1], jnp.asarray(STATE_T0, jnp.int32)), return_final_state=True)
        return o, st.H
    return f


def kernel_fn(case):
    """The kernel under test as ``f(*args) -> tuple of outputs``."""
    if case.gate == "state":
        return from_state(case.kernel, "pallas")
    seg = segments(case)
    if seg is not None:
        op = getattr(ops, case.kernel)
        kw = {"normalize": case.normalize, "eps": 1e-6} if case.kernel in HLA else {}
        return lambda *a: (op(*a, segment_ids=seg, impl="pallas", **kw),)
    if case.kernel == "mamba2":
        return lambda q, k, v, g: (ops.mamba2(q, k, v, g, impl="pallas"),)
    if case.kernel == "la_pallas":
        return lambda q, k, v, g, h0: kernels.la_pallas(q, k, v, g, initial_state=h0, return_final_state=True,
                                                        backend=case.backend)
    if case.kernel in ("gated_deltanet", "gated_deltanet_pieces"):
        pieces = GDN_PIECES if case.kernel == "gated_deltanet_pieces" else 1
        return lambda q, k, v, g, beta, h0: kernels.gated_deltanet_pallas(
            q, k, v, g, beta, initial_state=h0, return_final_state=True, pieces=pieces)
    if case.kernel == WHEEL_GDN:
        from jla.ops import linear_attention
        return lambda q, k, v, g, beta, h0: linear_attention(
            "gated_deltanet", q, k, v, g=g, beta=beta, scale=1.0, impl="mosaic_gpu",
            initial_state=h0, output_final_state=True)
    if case.kernel in HLA:
        return lambda *a: (getattr(ops, case.kernel)(*a, normalize=case.normalize, eps=1e-6, impl="pallas"),)
    if case.kernel in BLOCKS:
        op = getattr(ops, case.kernel.removesuffix("_blocks"))
        return lambda *a: (op(*a, impl="chunked"),)
    if case.kernel == BLOCKS_UT:
        return lambda *a: (loglinear_gdn_blocks.blocks(*a, 64, "kernel"),)
    return lambda *a: (getattr(kernels, f"{case.kernel}_pallas")(*a),)


def reference_fn(case):
    """The quadratic reference as ``f(*args) -> tuple of outputs``."""
    if case.gate == "state":
        return from_state(case.kernel, "recurrent")
    seg = segments(case)
    if seg is not None and case.kernel in LOGLINEAR:  # levels from each document's start
        return lambda *a: (getattr(reference, case.kernel)(*a, segment_ids=seg),)
    if seg is not None:  # the documents' resets, docs/math.md#packed-documents
        plain = (reference_fn(case._replace(gate="token")) if case.kernel != "gated_deltanet"
                 else lambda *a: (reference.gated_deltanet(*a),))
        starts = np.asarray(doc_starts(seg))[..., None]
        return lambda q, k, v, g, *rest: plain(q, k, v, jnp.where(starts, -jnp.inf, g), *rest)
    if case.kernel == "mamba2":
        return lambda q, k, v, g: (reference.linear_attention(q, k, v, g),)
    if case.kernel == "la_pallas":
        return la_with_state
    if case.kernel in ("gated_deltanet", "gated_deltanet_pieces", WHEEL_GDN) and case.gate != "docs":
        return lambda q, k, v, g, beta, h0: ops.gated_deltanet(
            q, k, v, g, beta, initial_state=h0, return_final_state=True, impl="recurrent")
    if case.kernel in HLA:
        def hla(q, k, v, g=None):  # the oracles take [B,T,H] gates
            g = None if g is None else jnp.broadcast_to(g, q.shape[:3])
            return (getattr(reference, case.kernel)(q, k, v, g, normalize=case.normalize, eps=1e-6),)
        return hla
    return lambda *a: (getattr(reference, case.kernel.removesuffix("_ut").removesuffix("_blocks"))(*a),)


def run_case(rng, case) -> dict:
    """``{output or gradient: {"max", "rel"}}`` of the kernel against the float64 reference."""
    args, names = operands(rng, case)
    ker, ref = kernel_fn(case), reference_fn(case)
    argnums = tuple(range(len(args)))

    def loss(fn, weights):
        return lambda *a: sum(jnp.sum(o * w) for o, w in zip(fn(*a), weights))

    outs = jax.jit(ker)(*args)
    weights = [rng.normal(size=o.shape) for o in outs]
    grads = jax.jit(jax.grad(loss(ker, [jnp.asarray(w, jnp.float32) for w in weights]), argnums))(*args)
    got = [np.asarray(x).astype(np.float64) for x in (*outs, *grads)]
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x).astype(np.float64)) for x in args]
        ref_outs = jax.jit(ref)(*wide)
        ref_grads = jax.jit(jax.grad(loss(ref, [jnp.asarray(w) for w in weights]), argnums))(*wide)
        want = [np.asarray(x) for x in (*ref_outs, *ref_grads)]
    labels = ["out", "state"][:len(outs)] + ["d" + n for n in names]
    return {n: errors(a, b) for n, a, b in zip(labels, got, want)}


def label(case) -> str:
    """``kernel B=… T=… …``: the case's fields that are set."""
    c = case._asdict()
    return " ".join([c.pop("kernel")] + [f"{k}={v}" for k, v in c.items() if v not in (None, False)])


def report(case, tol, passed, errs, seconds) -> str:
    """The case's line: verdict, case, and per output and gradient its relative (max abs) error."""
    cells = [f"{n}={e['rel']:.2e} (max {e['max']:.1e})" if isinstance(e, dict) else f"{n}={e}"
             for n, e in errs.items()]
    return f"{'PASS' if passed else 'FAIL'} {label(case)} tol={tol:g} {' '.join(cells)} ({seconds:.0f} s)"


def main(argv=None) -> int:
    """Check the picked cases; 0 when every one passed, else 1 (the exit status)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="kernels_check_gpu", help="results go to <out>/<name>.{json,txt}")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    p.add_argument("--f32_tile", type=int, default=-1,
                   help="cap of every kernel's chunk/value tiles for float32 at d >= 128 "
                        "(wrap.F32_GPU_TILE; 0: no cap, -1: the library's)")
    p.add_argument("--resume", type=int, default=0,
                   help="1: keep the cases already in <out>/<name>.json (and its unmerged parts) "
                        "and check only the others")
    p.add_argument("--workers", type=int, default=1,
                   help="check the cases in this many processes sharing the device (compilation "
                        "dominates a case), each writing <name>.part<j>, merged into <name>")
    a = p.parse_args(argv)
    picked = [int(i) for i in a.cases.split(",")] if a.cases else list(range(len(CASES)))
    if a.kernels:
        picked = [i for i in picked if CASES[i].kernel in a.kernels.split(",")]
    done = merge(a.out, a.name) if a.resume else []
    picked = [i for i in picked if i not in {r["index"] for r in done}]
    if a.workers > 1:
        return run_workers(a, picked)
    if a.f32_tile >= 0:
        wrap.F32_GPU_TILE = dict.fromkeys(wrap.F32_GPU_TILE, a.f32_tile or 1 << 30)
    rng = np.random.default_rng(0)
    rows, ok = list(done), all(r["passed"] for r in done)
    for index in picked:
        case = CASES[index]
        t0 = time.perf_counter()
        tol = 2e-3 if case.dtype == "float32" else 3e-2
        try:
            errs = run_case(rng, case)
            passed = all(e["rel"] <= tol for e in errs.values())
        except Exception as e:  # record the failure, keep checking the other cases
            errs, passed = {"error": f"{type(e).__name__}: {str(e)[:400]}"}, False
        ok &= passed
        line = f"{index}: " + report(case, tol, passed, errs, time.perf_counter() - t0)
        rows.append(dict(index=index, case=case._asdict(), tol=tol, passed=passed, errors=errs,
                         line=line))
        print(line, flush=True)
        write(a.out, a.name, rows, info(ok))  # after every case: a run cut short keeps what it checked
    print(write(a.out, a.name, rows, info(ok)))
    return 0 if ok else 1


def run_workers(a, picked) -> int:
    """Check ``picked`` in ``a.workers`` child processes (every ``workers``-th case each, so
    slow and fast kernels spread), then merge their parts into ``<name>``."""
    base = [f"--out={a.out}", f"--f32_tile={a.f32_tile}"]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # the device is shared
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.kernels.check_kernels_gpu", *base,
                               f"--cases={','.join(map(str, part))}", f"--name={a.name}.part{j}"],
                              env=env, cwd=ROOT)
             for j, part in enumerate(picked[j::a.workers] for j in range(a.workers)) if part]
    for proc in procs:
        proc.wait()
    rows = merge(a.out, a.name)
    print("\n".join(r.get("line", "") for r in rows))
    ok = len(rows) > 0 and all(r["passed"] for r in rows)
    return 0 if ok else 1


def merge(out, name) -> list[dict]:
    """The rows of ``<name>.json`` and of its parts ``<name>.part<j>.json`` (a part's row
    replaces one of the same case), written back as ``<name>`` with the parts removed."""
    paths = [os.path.join(out, f"{name}.json"), *sorted(glob.glob(os.path.join(out, f"{name}.part*.json")))]
    found = [json.load(open(p)) for p in paths if os.path.exists(p)]
    rows = sorted({r["index"]: r for f in found for r in f["cases"]}.values(), key=lambda r: r["index"])
    rows = [r for r in rows if not out_of_memory(r)]  # checked again: the device was shared
    if len(found) > 1 or (found and len(paths) > 1):
        ok = all(r["passed"] for r in rows)
        write(out, name, rows, found[-1]["info"].rsplit(" all_passed=", 1)[0] + f" all_passed={ok}",
              prov=found[-1].get("provenance"))
        for p in paths[1:]:
            for suffix in (".json", ".txt"):
                pathlib.Path(p[:-len(".json")] + suffix).unlink(missing_ok=True)
    return rows


def out_of_memory(row) -> bool:
    """Whether a case failed for want of device memory (several workers on one card), not on
    its numerics."""
    error = row["errors"].get("error", "")
    return "RESOURCE_EXHAUSTED" in error or "out of memory" in error.lower()


def info(ok) -> str:
    """The provenance line of this process's checks."""
    return (f"device={jax.devices()[0].device_kind} jax={jax.__version__} "
            f"f32_tile={wrap.F32_GPU_TILE} all_passed={ok}")


def write(out, name, rows, info_line, prov=None) -> str:
    """``<out>/<name>.json`` (the cases, with this call's provenance) and ``.txt`` (the provenance
    line, one line per case, then the summary); the summary."""
    write_json(os.path.join(out, f"{name}.json"), dict(info=info_line, cases=rows), prov)
    lines = [r.get("line", "") for r in rows] + [info_line]
    write_markdown(os.path.join(out, f"{name}.txt"), "\n".join(lines), prov)
    return info_line


if __name__ == "__main__":
    sys.exit(main())
