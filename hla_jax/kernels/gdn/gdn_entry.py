"""``gated_deltanet_pallas``: first-order Gated DeltaNet through Pallas chunk kernels.

    o_t = q_tᵀ S_t,   S_t = a_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,   S_{−1} = H0

(``ops.gated_deltanet``; ``q, k [B,T,H,d]``, keys L2-normalised by the caller, ``v [B,T,H,dv]``,
``g = log a`` and ``beta [B,T,H]``, ``initial_state`` ``H0 [B,H,d,dv]``).  Per chunk of 64 tokens
(docs/math.md#loglinear-gdn-chunk), parallel over chunks (``gdn_ut_mgpu.py``, Mosaic GPU, on
``gdn_chunk.py``'s math): the UT transform
``T = (I + strict_tril(diag(β)(K Kᵀ) ∘ Γ))⁻¹ diag(β)`` (the inverse by doubling its diagonal
blocks), ``W = T (ρ∘K)``, ``U = T V``; then one walk over the chunks (``gdn_walk_mgpu.py``, Mosaic
GPU) reads ``V' = U − W S``, the outputs and the state, and keeps the state entering each chunk
(under differentiation only: a forward no backward follows writes no residuals).
The backward, from ``W``, ``V'``, those states and the inverse ``X`` kept by the forward (one
``[B,T,H,d]`` and one ``[B,T,H,dv]`` 16-bit array, the states ``[B,H,T/64,dv,d]`` 16-bit, ``X``
``[B,H,T,64]`` float32), is one reverse walk (``dV'`` and the cotangent of the state leaving
each chunk), then chunk-parallel again: the walk's products (``dQ``, ``dK``'s walk part,
``dW``; ``gdn_grads_mgpu.py``) and the UT transform's backward (``gdn_ut_mgpu.py``, from ``−dV'``
in 16 bits), both Mosaic GPU.

A few long sequences leave most walk CTAs' SMs idle (one CTA per batch, head and 64 value
columns walks all ``T/64`` chunks in order), so on a GPU a sequence can be cut into ``P``
consecutive pieces (``pieces``) that walk in parallel from their true states.  Each piece maps
the state it starts from affinely, ``S_end = M S_start + E`` (``M: d×d``, the delta rule's
transition is a matrix): one extra walk per piece over the values ``[0 | U]`` from ``[I | 0]``
(``walk_maps``, state only) gives ``[M | E]``, the scan ``S_{p+1} = M_p S_p + E_p`` over the
pieces (float32) their starts, and the forward walks the pieces from those.  The backward does the
same in reverse: a reverse walk per piece from a zero cotangent (writing nothing else) gives its
own share ``E'_p`` of ``∂L/∂S_p``, the scan ``G_{p−1} = M_pᵀ G_p + E'_p`` the cotangent each piece
leaves with, and everything after runs on the pieces' rows as on whole sequences.  The split is
exact.  The TPU backend
(``gdn_tpu.py``, Mosaic; the same five steps on the same chunk math, ``gdn_chunk``) keeps
its states ``[B,H,T/64,d,dv]`` in the inputs' dtype.

The gate's gradient is taken in the chunk-local log-decays ``b`` (``∂L/∂g_t = Σ_{t'≥t}
∂L/∂b_{t'}`` within the chunk, ``_gate_grad``): each place ``b`` enters a chunk gives a per-token
share (``gdn_chunk``'s formulas), the pairwise decays ``Γ`` as float32 row sums minus column sums
of one matrix of pair terms, so every pair cancels exactly in the cumulative sum, and the chunk's
end decay ``ρ_c`` the inner product of the two states the walks keep (taken in the products
kernel, which reads both).  The gradient is not taken through the identity
``∂L/∂G_t = q·∂L/∂q − v·∂L/∂v`` in the global decays: carrying the part after each chunk back
from the end sums every chunk's 16-bit noise, so its error would grow with T.

On a GPU it takes 16-bit ``q, k, v`` of one dtype with ``d ∈ {64, 128}`` and chunk 64 (Hopper's
``wgmma``); on a TPU bf16 or float32 of one dtype, any ``d``, chunk 64 (NEVER RUN ON TPU
HARDWARE: the tests run it in interpret mode and through Mosaic's lowering).  ``T`` and ``dv``
are zero-padded to multiples of 64; log-decays are floored at ``wrap.LOG_DECAY_FLOOR`` (a reset
``g = -inf`` stays finite).  On CPU either runs in its interpreter.
``ops.gated_deltanet(impl="chunked")`` serves everything else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hla_jax.core.checks import check_gate, check_per_token, check_qkv
from hla_jax.kernels import mosaic_gpu, wrap
from hla_jax.kernels.gdn import gdn_mgpu, gdn_tpu
from hla_jax.kernels.mosaic_gpu import F32, C

BACKENDS = {"mosaic_gpu": gdn_mgpu, "tpu": gdn_tpu}
TPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MIN_PIECES = 4  # the default split's least count (``default_pieces``)


def _local(g):
    """``g [B,Tp,H]`` (floored) -> ``b [B,H,Tp]``, its cumulative sum within each chunk."""
    return wrap.chunk_log_decay(g, C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def core(q, k, v, beta, g, h0, interpret=False, backend="mosaic_gpu", pieces=1):
    """``(O [B,Tp,H,dv], H_T [B,H,d,dv])`` float32 on padded inputs: ``g [B,Tp,H]`` floored
    log-decays, ``beta [B,Tp,H]``, ``h0 [B,H,d,dv]`` float32; the steps of ``backend``
    (``BACKENDS``: ``gdn_mgpu.py``, ``gdn_tpu.py``), each sequence cut into ``pieces`` (``Tp/64`` a
    multiple of it; module docstring)."""
    return _forward(q, k, v, beta, g, h0, interpret, backend, pieces, keep=False)[:2]


def _heads_first(x):
    """``[B,Tp,H] -> [B,H,Tp]`` float32."""
    return jnp.swapaxes(x, 1, 2).astype(F32)


def _merge(x, P):
    """``mosaic_gpu.split_pieces``' inverse: ``[B·P,Tp/P,...] -> [B,Tp,...]``."""
    return x.reshape((x.shape[0] // P, x.shape[1] * P) + x.shape[2:])


def _forward(q, k, v, beta, g, h0, interpret, backend, P, keep=True):
    """``(O, H_T, V', S, W, X, M)``: the walk's outputs, and ``V'``, the states entering the
    chunks, ``W``, the UT transform's inverse ``X`` and the pieces' transitions ``M`` for the
    backward (``keep``: a backend may skip writing ``V', S, X`` without it); all but ``O, H_T`` on
    the pieces' rows."""
    steps = BACKENDS[backend]
    q, k, v, beta, g = (mosaic_gpu.split_pieces(x, P) for x in (q, k, v, beta, g))
    b = _local(g)
    w, u, x = steps.ut_forward(k, v, b, _heads_first(beta), keep=keep, interpret=interpret)
    starts, m = h0, None
    if P > 1:
        m, e = steps.walk_maps(k, w, u, b, interpret=interpret)
        starts = _scan(m, e, h0, reverse=False)
    o, hT, vn, s = steps.walk_out(q, k, w, u, b, starts, keep=keep, interpret=interpret)
    return _merge(o, P), hT[P - 1::P], vn, s, w, x, m


def _scan(m, e, first, *, reverse):
    """The state each piece starts from, ``S_0 = H0``, ``S_{p+1} = M_p S_p + E_p``, or in
    reverse the cotangent each leaves with, ``G_{P−1} = dH_T``, ``G_{p−1} = M_pᵀ G_p + E_p``
    (``E_p``: piece ``p``'s own share of ``∂L/∂S_p``; ``mosaic_gpu.piece_starts`` with a matrix
    transition); ``m [B·P,H,d,d]``, ``e [B·P,H,d,dv]`` on the pieces' rows, ``first [B,H,d,dv]``
    -> ``[B·P,H,d,dv]`` float32."""
    m, e = (y.reshape((first.shape[0], -1) + y.shape[1:]) for y in (m, e))
    spec = "bhji,bhjv->bhiv" if reverse else "bhij,bhjv->bhiv"
    advance = lambda p, s: jnp.einsum(spec, m[:, p], s, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    return mosaic_gpu.piece_starts(e, first, advance, reverse).reshape((-1,) + first.shape[1:])


def _core_fwd(q, k, v, beta, g, h0, interpret, backend, P):
    o, hT, vn, s, w, x, m = _forward(q, k, v, beta, g, h0, interpret, backend, P)
    return (o, hT), (q, k, v, beta, g, vn, s, w, x, m)


def _core_bwd(interpret, backend, P, res, cts):
    """The backward on the pieces' rows, each walked back from the cotangent it leaves with
    (``_scan`` over the pieces' own shares, a reverse walk from zero without residuals)."""
    q, k, v, beta, g, vn, s, w, x, m = res
    do, dhT = cts
    steps = BACKENDS[backend]
    q, k, v, beta, g, do = (mosaic_gpu.split_pieces(y, P) for y in (q, k, v, beta, g, do.astype(q.dtype)))
    b, beta_h = _local(g), _heads_first(beta)
    ends = dhT
    if P > 1:
        own = steps.walk_rev(q, k, w, do, b, jnp.zeros((q.shape[0],) + dhT.shape[1:], F32), keep=False,
                             interpret=interpret)[2]
        ends = _scan(m, own, dhT, reverse=True)
    ndu, ds, dh0 = steps.walk_rev(q, k, w, do, b, ends, interpret=interpret)
    dq, dk, dw, db_walk = steps.grads(q, k, vn, do, ndu, s, ds, b, interpret=interpret)
    dk, dv, dbeta, db_ut = steps.ut_backward(k, v, b, beta_h, x, dw, ndu, dk, interpret=interpret)
    grads = (dq, dk, dv, jnp.swapaxes(dbeta, 1, 2).astype(beta.dtype), _gate_grad(db_walk + db_ut))
    return (*(_merge(y, P) for y in grads), dh0[::P])


def _gate_grad(db):
    """``∂L/∂g [B,Tp,H]`` from the per-token shares ``db [B,H,Tp]`` of ``∂L/∂b`` (the walk's and
    the UT transform's, ``gdn_chunk``): ``∂L/∂g_t = Σ_{t'≥t} ∂L/∂b_{t'}`` within the chunk
    (``b`` is the chunk-local cumulative sum of ``g``)."""
    B, H, Tp = db.shape
    db = db.reshape(B, H, Tp // C, C)
    dg = jnp.cumsum(db[..., ::-1], -1)[..., ::-1]
    return jnp.swapaxes(dg.reshape(B, H, Tp), 1, 2)


core.defvjp(_core_fwd, _core_bwd)


def default_pieces(B, H, dv, N) -> int:
    """``pieces=None`` on a GPU: ``mosaic_gpu.pieces``' count (one walk CTA an SM) where it is at
    least ``MIN_PIECES``, else 1.  The split adds two walks a piece long (the maps walk, the
    reverse walk of the own shares), so it pays only where the pieces are short against the
    whole sequence: with two pieces those extra walks cost about what the split saves, with
    four or more the parallel walks win (see the kernel benchmarks on the results page)."""
    P = mosaic_gpu.pieces(B, H, dv, N)
    return P if P >= MIN_PIECES else 1


def supports(q, k, v, chunk_size: int) -> bool:
    """Whether the kernel runs these inputs compiled here (``mosaic_gpu.supports``: a Hopper GPU)."""
    return mosaic_gpu.supports(q, k, v, chunk_size)


def gated_deltanet_pallas(q, k, v, g, beta, *, initial_state=None, return_final_state=False,
                          chunk_size=64, pieces=None, backend=None, interpret=None):
    """Gated DeltaNet via the chunk kernels (module docstring).

    Args:
        q: queries ``[B,T,H,d]``.
        k: keys ``[B,T,H,d]``, unit norm.
        v: values ``[B,T,H,dv]``.
        g: log-decay ``[B,T,H]`` or ``[H]`` (``<= 0``).
        beta: write strengths ``[B,T,H]``.
        initial_state: ``[B,H,d,dv]`` to continue, or None (zeros).
        return_final_state: also return the state after the row.
        chunk_size: 64.
        pieces: each sequence's walks cut into this many pieces (GPU only; ``T`` is zero-padded
            to a multiple of ``64·pieces``), or None for ``default_pieces``' choice (1 unless a
            few long rows leave most SMs idle; 1 on a TPU).
        backend: "mosaic_gpu" | "tpu" | None (the default device's: "tpu" on a TPU, else
            "mosaic_gpu").
        interpret: None runs compiled on a GPU/TPU and in the interpreter on CPU.

    Returns:
        ``o [B,T,H,dv]`` float32, or ``(o, final_state [B,H,d,dv] float32)`` with
        ``return_final_state``.

    Raises:
        ValueError: naming the argument (shapes, dtypes, ``g``, ``beta``, ``pieces``, and what
            each backend takes).

    Example:
        >>> import jax.numpy as jnp
        >>> from hla_jax.kernels import gated_deltanet_pallas
        >>> q = k = v = jnp.full((1, 64, 1, 64), 0.125, jnp.bfloat16)
        >>> g, beta = -0.1 * jnp.ones((1, 64, 1)), 0.5 * jnp.ones((1, 64, 1))
        >>> gated_deltanet_pallas(q, k, v, g, beta).shape
        (1, 64, 1, 64)
    """
    name = "gated_deltanet_pallas"
    B, T, H, d, dv = check_qkv(q, k, v, name=name)
    g = check_gate(g, B, T, H, name=name, required=True)
    beta = check_per_token(beta, B, T, H, "beta", name=name)
    if initial_state is not None and jnp.shape(initial_state) != (B, H, d, dv):
        raise ValueError(f"{name}: initial_state must have shape [B,H,d,dv]={(B, H, d, dv)}, got "
                         f"{jnp.shape(initial_state)}")
    return gated_deltanet_kernel(q, k, v, g, beta, initial_state=initial_state,
                                 return_final_state=return_final_state, chunk_size=chunk_size,
                                 pieces=pieces, backend=backend, interpret=interpret)


def gated_deltanet_kernel(q, k, v, g, beta, *, initial_state=None, return_final_state=False,
                          chunk_size=64, pieces=None, backend=None, interpret=None):
    """``gated_deltanet_pallas`` on inputs it has checked (``g``, ``beta`` ``[B,T,H]``): the
    ops' entry, which checks them itself."""
    name = "gated_deltanet_pallas"
    B, T, H, d = q.shape
    dv = v.shape[-1]
    backend = wrap.backend_choice(name, backend, tuple(BACKENDS), "mosaic_gpu")
    if backend == "tpu" and not (chunk_size == C and jnp.dtype(q.dtype) in TPU_DTYPES
                                  and q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{name}: backend='tpu' takes bf16 or float32 q, k, v of one dtype and "
            f"chunk_size={C}; got {q.dtype}/{k.dtype}/{v.dtype}, chunk_size={chunk_size!r} "
            f"(ops.gated_deltanet(impl='chunked') takes any)")
    if backend == "mosaic_gpu" and not mosaic_gpu.takes(q, k, v, chunk_size):
        raise ValueError(
            f"{name}: takes 16-bit q, k, v of one dtype with head dim in {mosaic_gpu.HEAD_DIMS} and "
            f"chunk_size={C}; got {q.dtype}/{k.dtype}/{v.dtype}, d={d}, chunk_size={chunk_size!r} "
            f"(ops.gated_deltanet(impl='chunked') takes any)")
    N = max(1, -(-T // C))   # chunks
    if pieces is not None and (not isinstance(pieces, int) or isinstance(pieces, bool)
                               or not 1 <= pieces <= N or (backend == "tpu" and pieces > 1)):
        raise ValueError(f"{name}: pieces must be None or an int from 1 to {N} "
                         f"(T={T} in chunks of {C}; 1 on backend='tpu', whose walks run their grid "
                         f"in order), got {pieces!r}")
    interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
    dvp = -(-dv // C) * C
    if pieces is None:
        pieces = 1 if backend == "tpu" else default_pieces(B, H, dvp, N)
    Tp = -(-T // (C * pieces)) * C * pieces
    per_token = lambda x: jnp.pad(x.astype(F32), ((0, 0), (0, Tp - T), (0, 0)))  # noqa: E731
    o, hT = core(wrap.pad(q, Tp, d), wrap.pad(k, Tp, d), wrap.pad(v, Tp, dvp), per_token(beta),
                 jnp.maximum(per_token(g), wrap.LOG_DECAY_FLOOR),
                 wrap.pad_state(initial_state, B, H, d, dvp), interpret, backend, pieces)
    o = o[:, :T, :, :dv]
    return (o, hT[..., :dv]) if return_final_state else o
