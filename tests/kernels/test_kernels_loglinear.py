"""Log-linear Mamba-2 Pallas kernels (interpret mode on CPU) vs the quadratic reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, lower_for, make_gate, make_qkv

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.kernels import loglinear_mamba2_pallas
from hla_jax.kernels.loglinear.loglinear_chunk import (
    chunk_backward_kv,
    chunk_backward_q,
    chunk_forward,
    half_state,
    live,
)
from hla_jax.ops import levels, reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _lam(rng, B, T, H, extra=0, dtype=jnp.float32):
    return jnp.asarray(rng.uniform(0.2, 1.5, size=(B, T, H, fenwick.num_levels(T) + extra)), dtype)


def _check(rng, ker, q, k, v, g, lam, tol=TOL):
    """Output and the gradients of every input (q, k, v, g, lam) against the reference."""
    args = (q, k, v, g, lam)
    assert_close(ker(*args), reference.loglinear_mamba2(*args), tol)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    argnums = tuple(range(len(args)))
    got = grads_of(ker, args, argnums, w)
    want = grads_of(reference.loglinear_mamba2, args, argnums, w)
    for name, a, b in zip(["q", "k", "v", "g", "lam"], got, want):
        assert_close(a, b, tol, "d" + name)


@pytest.mark.parametrize("B,T,H,d,dv,c,gate,extra", [
    (2, 64, 2, 16, 32, 16, "token", 0),   # B, H > 1, d != dv, two value tiles, 4 chunks
    (1, 100, 2, 24, 20, 32, "head", 2),   # T, d, dv padded; per-head gate; spare λ levels
    (1, 1000, 1, 16, 16, 32, "token", 0),  # 32 chunks: five chunk levels
    (1, 16, 1, 16, 16, 16, "token", 0),   # one chunk: no chunk level
])
def test_loglinear_mamba2_pallas_matches_reference(rng, B, T, H, d, dv, c, gate, extra):
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    g = make_gate(rng, B, T, H, kind=gate)
    g = g if gate == "token" else jnp.broadcast_to(g, (B, T, H))  # the oracle takes [B,T,H]
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=c, block_v=16, block_v_bwd=16,
                                             interpret=True)
    _check(rng, ker, q, k, v, g, _lam(rng, B, T, H, extra))


def test_loglinear_mamba2_pallas_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; compared with the float32 reference."""
    q, k, v = (x.astype(jnp.bfloat16) for x in make_qkv(rng, 1, 100, 2, 16, 16))
    g = make_gate(rng, 1, 100, 2)
    lam = _lam(rng, 1, 100, 2)
    out = loglinear_mamba2_pallas(q, k, v, g, lam, chunk_size=16, interpret=True)
    assert out.dtype == jnp.float32
    f32 = lambda x: x.astype(jnp.float32)
    assert_close(out, reference.loglinear_mamba2(f32(q), f32(k), f32(v), g, lam), 3e-2)


def test_loglinear_mamba2_pallas_reset_gate(rng):
    """A log-decay of -inf (a state reset) keeps outputs and gradients finite and exact."""
    q, k, v = make_qkv(rng, 1, 80, 2, 16, 16)
    g = make_gate(rng, 1, 80, 2).at[:, 37].set(-jnp.inf).at[:, 48].set(-jnp.inf)
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=16, interpret=True)
    _check(rng, ker, q, k, v, g, _lam(rng, 1, 80, 2))


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_packed_documents_equal_documents_alone(rng, backend):
    """``segment_ids`` (documents of 13, 1, 28, 19 tokens, starting mid-chunk, and a row of one
    document) through the aligned layout (``ops.levels.packed`` over the kernel entry): outputs and
    every gradient equal the reference with the documents' own levels, and through ``ops``
    (impl="pallas")."""
    B, T, H = 2, 61, 2
    q, k, v = make_qkv(rng, B, T, H, 16, 16)
    seg = jnp.asarray(np.stack([np.repeat([0, 1, 2, 3], [13, 1, 28, 19]), np.zeros(T, int)]))
    kernel = functools.partial(loglinear_mamba2_pallas, chunk_size=16, block_v=16,
                               block_v_bwd=16, interpret=True, backend=backend)
    ker = lambda q, k, v, g, lam: levels.packed(kernel, q, k, v, g, (), lam, seg)  # noqa: E731
    args = (q, k, v, make_gate(rng, B, T, H), _lam(rng, B, T, H))
    want = lambda *a: reference.loglinear_mamba2(*a, segment_ids=seg)
    assert_close(ker(*args), want(*args), TOL)
    w = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
    for name, a, b in zip("q k v g lam".split(), grads_of(ker, args, range(5), w),
                          grads_of(want, args, range(5), w)):
        assert_close(a, b, TOL, "d" + name)
    if backend == "triton":
        via_ops = ops.loglinear_mamba2(*args, segment_ids=seg, impl="pallas", chunk_size=16)
        assert_close(via_ops, want(*args), TOL, "ops, impl='pallas'")


def test_pallas_final_state_from_zeros(rng):
    """``return_final_state`` without an initial state: the kernels on the row as it is, and the
    final state equals the counter form's."""
    q, k, v = make_qkv(rng, 1, 40, 2, 16, 16)
    g, lam = make_gate(rng, 1, 40, 2), _lam(rng, 1, 40, 2)
    o, st = ops.loglinear_mamba2(q, k, v, g, lam, impl="pallas", chunk_size=16,
                                 return_final_state=True)
    o_ref, st_ref = ops.loglinear_mamba2(q, k, v, g, lam, impl="recurrent", return_final_state=True)
    assert_close(o, o_ref, TOL)
    assert_close(st.H, st_ref.H, TOL, "final H")
    assert int(st.t[0]) == 40


def test_aligned_layout_puts_every_document_on_its_own_block(rng):
    """Each document starts at a multiple of its length rounded up to a power of two, its
    tokens stay in order and no two tokens share a place in the ``2T`` buffer."""
    from hla_jax.core.layout import aligned_layout

    for T in (1, 2, 5, 16, 17, 31, 64, 65, 89):  # one compile per length, 16 rows of each
        seg = np.cumsum(rng.random((16, T)) < rng.uniform(0.02, 0.5, (16, 1)), axis=1)
        dest, Tb = aligned_layout(jnp.asarray(seg))
        dest = np.asarray(dest)
        assert Tb == 2 * T and dest.max() < Tb
        for row, ids in zip(dest, seg):
            assert len(set(row)) == T
            for doc in np.unique(ids):
                at = row[ids == doc]
                slot = 1 << int(len(at) - 1).bit_length()
                assert at[0] % slot == 0 and np.all(np.diff(at) == 1)


def test_loglinear_mamba2_pallas_tpu_path_interpret(rng):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    B, T, H, d, dv = 2, 100, 1, 16, 32
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    ker = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=16, interpret=True, backend="tpu")
    _check(rng, ker, q, k, v, make_gate(rng, B, T, H), _lam(rng, B, T, H))


def test_all_ones_lambda_is_mamba2(rng):
    q, k, v = make_qkv(rng, 1, 70, 2, 16, 16)
    g = make_gate(rng, 1, 70, 2)
    out = loglinear_mamba2_pallas(q, k, v, g, jnp.ones((1, 70, 2, 8)), chunk_size=16,
                                  interpret=True)
    assert_close(out, reference.linear_attention(q, k, v, g), TOL)


def _chunk_case(rng, P=3, c=16, d=8, bv=4):
    f64 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
    Q, K, V, dO = f64(c, d) / 2, f64(c, d) / 2, f64(c, bv), f64(c, bv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.5, c)))
    lams = list(jnp.asarray(rng.uniform(0.2, 1.5, (5, c))))
    lw = list(jnp.asarray(rng.uniform(0.2, 1.5, (P, c))))
    return Q, K, V, dO, bb, lams, lw, [f64(d, bv) for _ in range(P)], [f64(d, bv) for _ in range(P)]


@pytest.mark.parametrize("n", [0, 1, 2, 5, 6, 7])
def test_chunk_backward_is_the_vjp_of_the_chunk(rng, x64, n):
    """The hand-written query and key/value sides equal ``jax.vjp`` (float64) of the chunk's
    forward (levels it reads) and of ``half_state`` (levels it writes), at chunks that read
    and write different levels."""
    Q, K, V, dO, bb, lams, lw, Hs, dHs = _chunk_case(rng)
    lives = [live(jnp.int32(n), j) for j in range(len(Hs))]
    fwd = lambda Q, K, V, bb, lams, lw: chunk_forward(Q, K, V, bb, lams, lw, lambda j: Hs[j], lives)
    _, vjp = jax.vjp(fwd, Q, K, V, bb, lams, lw)
    dQ, dK, dV, db, dlams, dlw = vjp(dO)
    for j in range(len(Hs)):        # the states the chunk writes: H_j ⊇ (lw_j ∘ K)ᵀ V
        if not (n >> j) & 1:
            _, vjp_w = jax.vjp(lambda K, V, w: half_state(K, V, w, 0.0), K, V, lw[j])
            dk, dv, dw = vjp_w(dHs[j])
            dK, dV, dlw[j] = dK + dk, dV + dv, dlw[j] + dw
    gq, gdb, gdlams, gdlw_q = chunk_backward_q(Q, K, V, bb, lams, lw, lambda j: Hs[j], lives, dO)
    gk, gv, gdlw_kv = chunk_backward_kv(Q, K, V, bb, lams, lw, lambda j: dHs[j], lives, dO)
    got = (gq, gk, gv, gdb, jnp.stack(gdlams), jnp.stack(gdlw_q) + jnp.stack(gdlw_kv))
    want = (dQ, dK, dV, db, jnp.stack(dlams), jnp.stack(dlw))
    for name, a, b in zip(["dQ", "dK", "dV", "db", "dlams", "dlw"], got, want):
        assert_close(a, b, 1e-10, name)


def test_loglinear_mamba2_pallas_rejects_bad_input(rng):
    q, k, v = make_qkv(rng, 1, 40, 1, 16, 16)
    g, lam = make_gate(rng, 1, 40, 1), _lam(rng, 1, 40, 1)
    with pytest.raises(ValueError, match="chunk_size"):
        loglinear_mamba2_pallas(q, k, v, g, lam, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        loglinear_mamba2_pallas(q, k, v, g, lam, block_v=24, interpret=True)
    with pytest.raises(ValueError, match="block_v_bwd"):
        loglinear_mamba2_pallas(q, k, v, g, lam, block_v_bwd=8, interpret=True)
    with pytest.raises(ValueError, match="T=40 needs at least 7"):
        loglinear_mamba2_pallas(q, k, v, g, lam[..., :6], interpret=True)
    with pytest.raises(ValueError, match="lam must have shape"):
        loglinear_mamba2_pallas(q, k, v, g, lam[:, :39], interpret=True)
    with pytest.raises(ValueError, match="log-decay"):
        loglinear_mamba2_pallas(q, k, v, -g, lam, interpret=True)
    with pytest.raises(ValueError, match="g .*required"):
        loglinear_mamba2_pallas(q, k, v, None, lam, interpret=True)
    with pytest.raises(ValueError, match="k must"):
        loglinear_mamba2_pallas(q, k[..., :8], v, g, lam, interpret=True)


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_loglinear_mamba2_pallas_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 1024, 2, 128, 128
    x = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    loss = lambda *a: loglinear_mamba2_pallas(*a, chunk_size=c, interpret=False,
                                              backend="tpu" if platform == "tpu" else "triton").sum()
    text = lower_for(platform, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), x(B, T, H, d),
                     x(B, T, H, d), x(B, T, H, dv), f32(B, T, H), f32(B, T, H, 11))
    # per level the states and their cotangents, and the two backward kernels (grad drops the
    # forward's readout); T=1024 has 4 chunk levels at c=64, 3 at c=128
    assert text.count(KERNEL_CALL[platform]) == 2 * (4 if c == 64 else 3) + 2


def test_float32_at_head_dim_128_gets_smaller_tiles_on_gpu():
    """As for ``la_pallas``: float32 at d=128, compiled for a GPU, caps every tile at
    ``wrap.F32_GPU_TILE`` (Triton's shared memory); bf16 keeps the requested tiles."""
    from hla_jax.kernels import wrap

    for name in ("loglinear_mamba2_pallas", "loglinear_gated_deltanet_pallas"):
        for dtype, want in ((jnp.float32, wrap.F32_GPU_TILE[name]), (jnp.bfloat16, 64)):
            q = jnp.zeros((1, 100, 1, 128), dtype)
            got = wrap.launch(name, q, q, q, chunk_size=64, block_v=64, block_v_bwd=64,
                              interpret=False, backend="triton")
            assert (got.c, got.bv, got.bv_bwd, got.Tp) == (want, want, want, -(-100 // want) * want)
