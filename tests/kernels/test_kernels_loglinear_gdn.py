"""Log-linear Gated DeltaNet Pallas kernels (interpret mode on CPU) vs the quadratic reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, grads_of, keys_around_one_direction, lower_for, make_gate, make_qkv

from hla_jax import ops
from hla_jax.core import fenwick
from hla_jax.kernels import loglinear_gated_deltanet_pallas
from hla_jax.kernels.loglinear_gdn import loglinear_gdn_chunk as chunk
from hla_jax.ops import levels, reference

TOL = 2e-3
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _inputs(rng, B, T, H, d, dv):
    """``q, k, v, g, beta, lam`` as the model passes them: L2-normalised keys, β ∈ (0.1, 0.9)."""
    q, k, v = make_qkv(rng, B, T, H, d, dv)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(B, T, H)), jnp.float32)
    lam = jnp.asarray(rng.uniform(0.2, 1.5, size=(B, T, H, fenwick.num_levels(T))), jnp.float32)
    return q, k, v, make_gate(rng, B, T, H), beta, lam


def _check(rng, args, ker, tol=TOL):
    """Output and the gradients of all six inputs against the reference."""
    ref = reference.loglinear_gated_deltanet
    assert_close(ker(*args), ref(*args), tol)
    w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
    argnums = tuple(range(6))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "lam"), grads_of(ker, args, argnums, w),
                          grads_of(ref, args, argnums, w)):
        assert_close(a, b, tol, "d" + name)


@pytest.mark.parametrize("B,T,H,d,dv,c,bv", [
    (2, 100, 2, 16, 32, 16, 16),   # T not a multiple of the chunk, two value tiles, 3 chunk levels
    (1, 64, 2, 24, 20, 32, 64),    # d and dv padded (24 -> 32, 20 -> 32), two chunks
    (1, 1000, 1, 16, 16, 32, 16),  # 32 chunks: 5 chunk levels
])
def test_matches_reference(rng, B, T, H, d, dv, c, bv):
    _check(rng, _inputs(rng, B, T, H, d, dv),
           lambda *a: loglinear_gated_deltanet_pallas(*a, chunk_size=c, block_v=bv, interpret=True))


def test_tpu_path_interpret(rng):
    """The Mosaic TPU kernels (interpret mode only: no TPU here) match the reference too."""
    _check(rng, _inputs(rng, 2, 100, 2, 16, 16),
           lambda *a: loglinear_gated_deltanet_pallas(*a, chunk_size=16, interpret=True,
                                                      backend="tpu"))


def test_bf16(rng):
    """bf16 inputs: bf16 matmul operands, float32 state; output and gradients of all six inputs
    compared with the float32 reference on the same (bf16-rounded) values."""
    q, k, v, g, beta, lam = _inputs(rng, 2, 100, 2, 32, 32)
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
    bf16 = lambda x: x.astype(jnp.bfloat16)
    ker = lambda q, k, v, *a: loglinear_gated_deltanet_pallas(bf16(q), bf16(k), bf16(v), *a,
                                                             chunk_size=16, interpret=True)
    assert ker(q, k, v, g, beta, lam).dtype == jnp.float32
    _check(rng, (q, k, v, g, beta, lam), ker, 3e-2)


def test_bf16_keys_around_one_direction(rng):
    """bf16 with keys near one direction, β = 0.95 and slow decay (the delta rule's hard case):
    the walk's ``H − K̃ᵀ(W H)`` keeps ``K̃`` in float32, which holds the errors to the plain
    bf16 level (a bf16 ``K̃`` would leave ``dg`` several times the other gradients' error)."""
    B, T, H, d = 1, 256, 1, 64
    q, _, v, g, _, lam = _inputs(rng, B, T, H, d, d)
    k = jnp.asarray(keys_around_one_direction(rng, (B, T, H, d), 0.1), jnp.float32)
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
    bf16 = lambda x: x.astype(jnp.bfloat16)
    ker = lambda q, k, v, *a: loglinear_gated_deltanet_pallas(bf16(q), bf16(k), bf16(v), *a,
                                                             chunk_size=32, interpret=True)
    _check(rng, (q, k, v, g * 0.01, jnp.full_like(g, 0.95), lam), ker, 1e-2)


def _blocks_on_ut(*args):
    """The block form with its chunk terms from the UT kernel (the GPU and Triton interpreters on
    CPU)."""
    from hla_jax.ops.xla import loglinear_gdn_blocks
    return loglinear_gdn_blocks.blocks(*args, 64, "kernel")


@pytest.mark.parametrize("B,T,H,d,dv", [
    (1, 100, 2, 16, 24),   # T not a multiple of the chunk, dv padded to 64
    (1, 200, 1, 16, 64),   # 4 chunks: 2 chunk levels, one value tile
])
def test_block_form_on_the_ut_kernel_matches_reference(rng, B, T, H, d, dv):
    """``loglinear_gdn_blocks.blocks(terms="kernel")``: outputs and all six gradients (``T``'s
    own cotangent handed to the UT backward, which gives the gate's share), and the same outputs
    as the XLA terms to float32 rounding."""
    from hla_jax.ops.xla import loglinear_gdn_blocks

    args = _inputs(rng, B, T, H, d, dv)
    _check(rng, args, _blocks_on_ut)
    assert_close(_blocks_on_ut(*args), loglinear_gdn_blocks.blocks(*args, 64, "xla"), 1e-5)


def test_block_form_on_the_ut_kernel_bf16_and_reset(rng):
    """bf16 inputs against the float32 reference on the rounded values; a −∞ reset (floored by
    the kernel) keeps everything finite and cuts the past off."""
    q, k, v, g, beta, lam = _inputs(rng, 1, 128, 2, 16, 64)
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
    bf16 = lambda x: x.astype(jnp.bfloat16)
    ker = lambda q, k, v, *a: _blocks_on_ut(bf16(q), bf16(k), bf16(v), *a)
    _check(rng, (q, k, v, g, beta, lam), ker, 3e-2)
    g = g.at[:, 64].set(-jnp.inf)
    out = _blocks_on_ut(q, k, v, g, beta, lam)
    tail = _blocks_on_ut(*(x[:, 64:] for x in (q, k, v, g.at[:, 64].set(0.0), beta, lam[..., :7])))
    assert_close(out[:, 64:], tail, 1e-5)
    w = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    for x in grads_of(_blocks_on_ut, (q, k, v, g, beta, lam), tuple(range(6)), w):
        assert np.all(np.isfinite(np.asarray(x)))
    with pytest.raises(ValueError, match="chunk_size=64"):
        from hla_jax.ops.xla import loglinear_gdn_blocks
        loglinear_gdn_blocks.blocks(q, k, v, g, beta, lam, 32, "kernel")
    with pytest.raises(ValueError, match="terms must be"):
        loglinear_gdn_blocks.blocks(q, k, v, g, beta, lam, 64, "triton")


def test_block_form_on_the_ut_kernel_under_vmap(rng):
    """Vmapped over a model axis (MQAR's stacked models), the UT-kernel terms give each model's
    own output and six gradients (the kernels' batching rules and the custom VJP's)."""
    per = [_inputs(rng, 1, 100, 2, 16, 64) for _ in range(2)]
    args = [jnp.stack(xs) for xs in zip(*per)]
    loss = lambda *a: jnp.sum(_blocks_on_ut(*a) ** 2)
    step = jax.value_and_grad(loss, argnums=tuple(range(6)))
    stacked = jax.vmap(step)(*args)
    for m, one in enumerate(per):
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(step(*one))):
            assert_close(a[m], b, 1e-6)


def test_auto_takes_the_ut_terms_where_the_kernel_runs(rng, monkeypatch):
    """``impl="auto"`` on whole rows: the block form with the UT kernel's terms where
    ``gated_deltanet``'s kernel would run (a Hopper GPU with bf16 inputs; faked here), XLA's
    terms with ``impl="chunked"``."""
    from hla_jax.kernels.gdn import gdn_entry
    from hla_jax.ops.families import loglinear
    from hla_jax.ops.xla import loglinear_gdn_blocks

    q, k, v, g, beta, lam = _inputs(rng, 1, 100, 2, 16, 64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    monkeypatch.setattr(loglinear, "kernels_preferred", lambda c: True)
    monkeypatch.setattr(gdn_entry, "supports", lambda *a: True)
    auto = ops.loglinear_gated_deltanet(q, k, v, g, beta, lam)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(_blocks_on_ut(q, k, v, g, beta, lam)))
    chunked = ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl="chunked")
    xla = loglinear_gdn_blocks.blocks(q, k, v, g, beta, lam, 64, "xla")
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(xla), atol=1e-5)


def test_block_form_ut_terms_lower_for_cuda():
    """The kernel chunk terms, forward and backward, go through the real lowering at the
    benchmark's head dim 128: Mosaic GPU's UT transform, Triton's chunk terms, then Mosaic GPU's
    chunk-terms backward and the UT backward with ``T``'s own cotangent."""
    from hla_jax.kernels.loglinear_gdn import gdn_blocks

    x = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1, 256, 2), jnp.float32)
    loss = lambda *a: sum(jnp.sum(t) for t in gdn_blocks.chunk_terms(*a, 256, interpret=False))
    text = lower_for("cuda", jax.value_and_grad(loss, argnums=range(5)), x, x, x, s, s)
    assert text.count("__gpu$xla.gpu.triton") == 1, "the chunk terms"
    for kernel in ("gdn_ut_fwd", "gdn_terms_bwd", "gdn_ut_bwd"):
        assert text.count(f"{kernel}_mosaic_gpu") == 1, kernel


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 192)])   # one value tile; three of 64
def test_chunk_terms_backward_kernel_is_the_vjp(rng, d, dv):
    """``gdn_terms_mgpu.backward`` (GPU interpreter, float32) against autodiff of the chunk
    terms by XLA (``loglinear_chunked.delta_terms``, exact float32 products): ``dq, dk, dw, dU``,
    ``T``'s cotangent and ``∂L/∂b``, two chunks."""
    from hla_jax.kernels.la.la_chunk import decays
    from hla_jax.kernels.loglinear_gdn import gdn_terms_mgpu
    from hla_jax.kernels.mosaic_gpu import LOG2E
    from hla_jax.ops.xla.loglinear_chunked import delta_terms

    B, H, C, N = 1, 2, 64, 2
    Tp = N * C
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, k, w, u = normal(B, Tp, H, d), normal(B, Tp, H, d), 0.3 * normal(B, Tp, H, d), normal(B, Tp, H, dv)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    x = 0.1 * normal(B, H, Tp, C)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (B, H, Tp)), jnp.float32)
    t = (x.reshape(B, H, N, C, C) * beta.reshape(B, H, N, 1, C)).reshape(B, H, Tp, C)
    b = jnp.cumsum(-jnp.asarray(rng.uniform(0, 0.1, (B, H, N, C)), jnp.float32), -1).reshape(B, H, Tp)
    cts = (normal(B, H, Tp, C), normal(B, H, Tp, d), normal(B, H, N, d, d), normal(B, H, N, d, dv))

    def xla(q, k, w, u, t, b):
        chunked = lambda x: jnp.moveaxis(x, 2, 1).reshape(B, H, N, C, -1)  # noqa: E731
        bb = b.reshape(B, H, N, C)
        Gam = jnp.vectorize(lambda x: decays(x)[3], signature="(c)->(c,c)")(bb)
        M, Qh, A_c, Kt = delta_terms(chunked(q), chunked(k), Gam, jnp.exp(bb),
                                     t.reshape(B, H, N, C, C), chunked(w))
        return (M.reshape(B, H, Tp, C), Qh.reshape(B, H, Tp, d), A_c,
                jnp.einsum("...cd,...cv->...dv", Kt, chunked(u)))

    with jax.default_matmul_precision("highest"):
        want = jax.vjp(xla, q, k, w, u, t, b)[1](cts)
    dq, dk, dw, ndu, dt, db = gdn_terms_mgpu.backward(q, k, w, u, x, beta, b * LOG2E, *cts,
                                                      interpret=True)
    for name, got, ref in zip(("dq", "dk", "dw", "du", "dT", "db"), (dq, dk, dw, -ndu, dt, db), want):
        assert_close(got, ref, 1e-5, name)


def _output_inputs(rng, dtype, B=1, H=2, N=13, c=16, d=16, dv=32):
    """The block form's output's inputs: ``M [B,H,N·c,c]`` (lower triangular),
    ``V [B,N·c,H,dv]``, ``Q̂ [B,H,N·c,d]``, ``Π [B,H,N,d,d]``, ``Z [B,H,N,d,dv]``, ``Λ [B,H,N·c,L]``
    (13 chunks: 4 chunk levels, the last blocks partial)."""
    L = fenwick.num_levels(N * c)
    normal = lambda scale, *shape: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    m = np.tril(rng.normal(size=(B, H, N, c, c)) * 0.3).reshape(B, H, N * c, c)
    return (jnp.asarray(m, jnp.float64), normal(1.0, B, N * c, H, dv), normal(0.5, B, H, N * c, d),
            normal(0.2, B, H, N, d, d), normal(1.0, B, H, N, d, dv),
            jnp.asarray(rng.uniform(0.2, 1.5, size=(B, H, N * c, L)), jnp.float64))


def _output_of(kernel, c=16):
    """``gdn_blocks.output`` (the Triton interpreter), or XLA's window and levels
    (``core.block_levels.chunk_window``, ``ops.loglinear_gdn_blocks._levels``), tokens first."""
    from hla_jax.core.block_levels import chunk_window
    from hla_jax.kernels.loglinear_gdn import gdn_blocks
    from hla_jax.ops.xla import loglinear_gdn_blocks

    lc = fenwick.chunk_log2(c)
    if kernel:
        return lambda *a: gdn_blocks.output(*a, lc, interpret=True)

    def xla(m, v, qh, pi, z, lam):
        out = chunk_window(m, v, lam)
        return jnp.moveaxis(out + loglinear_gdn_blocks._levels(qh, pi, z, lam, lc, m.shape[2] // c), 1, 2)
    return xla


NAMES = ("M", "V", "Q̂", "Π", "Z", "Λ")


def test_output_kernel_matches_xla_x64(x64, rng):
    """The block form's output on Triton kernels (interpreter: the window and the reads in one
    program per chunk, tokens first) against XLA's window, up-sweep and pass per level in float64
    (13 chunks: odd node counts, the last blocks partial): the output and the gradients of
    ``M``, ``V``, ``Q̂``, ``Π``, ``Z``, ``Λ`` (the sweep's and the reads' backward kernels)."""
    args = _output_inputs(rng, jnp.float64)
    assert_close(_output_of(True)(*args), _output_of(False)(*args), 1e-12)
    _assert_output_grads_match_xla(rng, args)


def test_output_kernel_of_one_chunk_x64(x64, rng):
    """One chunk (no chunk levels): the window alone, and its gradients."""
    args = _output_inputs(rng, jnp.float64, N=1)
    assert_close(_output_of(True)(*args), _output_of(False)(*args), 1e-12)
    _assert_output_grads_match_xla(rng, args)


def _assert_output_grads_match_xla(rng, args):
    """The kernels' gradients of every input equal XLA's within 1e-12 (float64) for a random
    cotangent."""
    w = jnp.asarray(rng.normal(size=args[1].shape))
    for name, a, b in zip(NAMES, grads_of(_output_of(True), args, range(6), w),
                          grads_of(_output_of(False), args, range(6), w)):
        assert_close(a, b, 1e-12, "d" + name)


def test_levels_backward_in_runs_x64(x64, rng, monkeypatch):
    """Right halves summed in runs of 2 chunks (``gdn_levels_triton.RUN``; runs of 16 at the benchmark's
    sizes), the runs of a pair then by XLA, a run past the last chunk empty: the gradients equal
    XLA's in float64 (13 chunks)."""
    from hla_jax.kernels.loglinear_gdn import gdn_levels_triton

    monkeypatch.setattr(gdn_levels_triton, "RUN", 2)
    _assert_output_grads_match_xla(rng, _output_inputs(rng, jnp.float64))


def test_output_kernel_bf16(rng):
    """bf16 ``V``, ``Q̂``, ``Π``, ``Z``: the kernels against the float64 output on the same (bf16)
    values, as close as XLA's bf16 path (16-bit operands, float32 accumulation, nodes and ``r``
    rounded per level), output and gradients; ``d = 24``, ``dv = 20`` zero-padded to 32."""
    with jax.enable_x64(True):
        args = _output_inputs(rng, jnp.float64, d=24, dv=20)
        args = args[:1] + tuple(x.astype(jnp.bfloat16).astype(jnp.float64) for x in args[1:5]) + args[5:]
        ref = _output_of(False)(*args)
        w = jnp.asarray(rng.normal(size=ref.shape))
        refs = [ref] + list(grads_of(_output_of(False), args, range(6), w))
    low = (args[0].astype(jnp.float32),) + tuple(x.astype(jnp.bfloat16) for x in args[1:5]) + (
        args[5].astype(jnp.float32),)
    w = w.astype(jnp.float32)
    for kernel in (True, False):
        f = _output_of(kernel)
        for name, a, b in zip(("o",) + NAMES, [f(*low)] + list(grads_of(f, low, range(6), w)), refs):
            assert_close(a.astype(jnp.float32), b.astype(jnp.float32), 2e-2, name)


def test_output_kernels_lower_for_cuda():
    """The output's kernels go through Triton's real lowering at the benchmark's chunk and head
    dims (8 chunks of 64, 3 levels, d = dv = 128): the up-sweep's 2 combining levels and the
    window with the reads; the gradient's program has those (the reads saving their queries)
    and, per level, one kernel for the reads' backward and the sweep's (runs of at most
    ``gdn_levels_triton.RUN`` chunks)."""
    from hla_jax.kernels.loglinear_gdn import gdn_blocks

    N, c, d = 8, 64, 128
    m = jax.ShapeDtypeStruct((1, 2, N * c, c), jnp.float32)
    v = jax.ShapeDtypeStruct((1, N * c, 2, d), jnp.bfloat16)
    qh = jax.ShapeDtypeStruct((1, 2, N * c, d), jnp.bfloat16)
    pi = jax.ShapeDtypeStruct((1, 2, N, d, d), jnp.bfloat16)
    lam = jax.ShapeDtypeStruct((1, 2, N * c, 10), jnp.float32)
    loss = lambda *a: jnp.sum(gdn_blocks.output(*a, 6, interpret=False))
    assert lower_for("cuda", loss, m, v, qh, pi, pi, lam).count("__gpu$xla.gpu.triton") == 3
    grad = jax.grad(loss, argnums=tuple(range(6)))
    assert lower_for("cuda", grad, m, v, qh, pi, pi, lam).count("__gpu$xla.gpu.triton") == 6


def test_reset_gate_stays_finite(rng):
    """A log-decay of -inf (a state reset) keeps the kernel and its gradients finite, and the
    tokens after it see nothing before it (the cut at 32 keeps the Fenwick levels of T = 64)."""
    q, k, v, g, beta, lam = _inputs(rng, 1, 64, 1, 16, 16)
    g = g.at[:, 32].set(-jnp.inf)
    ker = lambda *a: loglinear_gated_deltanet_pallas(*a, chunk_size=16, interpret=True)
    out = ker(q, k, v, g, beta, lam)
    assert np.all(np.isfinite(np.asarray(out)))
    tail = ker(*(x[:, 32:] for x in (q, k, v, g.at[:, 32].set(0.0), beta, lam[..., :6])))
    assert_close(out[:, 32:], tail, 1e-5)
    w = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    for x in grads_of(ker, (q, k, v, g, beta, lam), tuple(range(6)), w):
        assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize("backend", ["triton", "tpu"])
def test_packed_documents_equal_documents_alone(rng, backend):
    """``segment_ids`` (documents of 13, 1, 28, 19 tokens, starting mid-chunk, and a row of one
    document) through the aligned layout (``ops.levels.packed`` over the kernel entry): output and
    all six gradients equal the reference with the documents' own levels, and through ``ops``
    (impl="pallas")."""
    B, T, H = 2, 61, 2
    args = _inputs(rng, B, T, H, 16, 16)
    seg = jnp.asarray(np.stack([np.repeat([0, 1, 2, 3], [13, 1, 28, 19]), np.zeros(T, int)]))
    kernel = functools.partial(loglinear_gated_deltanet_pallas, chunk_size=16, interpret=True,
                               backend=backend)
    ker = lambda q, k, v, g, beta, lam: levels.packed(kernel, q, k, v, g, (beta,), lam, seg)  # noqa: E731
    want = lambda *a: reference.loglinear_gated_deltanet(*a, segment_ids=seg)
    assert_close(ker(*args), want(*args), TOL)
    w = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "lam"), grads_of(ker, args, range(6), w),
                          grads_of(want, args, range(6), w)):
        assert_close(a, b, TOL, "d" + name)
    if backend == "triton":
        via_ops = ops.loglinear_gated_deltanet(*args, segment_ids=seg, impl="pallas",
                                               chunk_size=16)
        assert_close(via_ops, want(*args), TOL, "ops, impl='pallas'")


def _f64(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float64)


@pytest.mark.parametrize("spread", [1.0, 0.1, 0.0])
def test_unit_lower_inverse_is_stable_for_correlated_keys(rng, spread):
    """``(I + A)⁻¹`` in float32 at ``c = 64`` for keys around one direction (``spread = 0``:
    all equal), β = 0.95, no decay: the inverse has entries of order 1, the powers of ``A`` up
    to 10¹⁸ (the Neumann product lost everything there: errors 80 to 4e9)."""
    c, d = 64, 128
    K = keys_around_one_direction(rng, (c, d), spread)
    A = np.tril(0.95 * (K @ K.T), -1)
    want = np.linalg.inv(np.eye(c) + A)
    got = np.asarray(chunk.unit_lower_inverse(jnp.asarray(A, jnp.float32)))
    assert np.abs(got - want).max() < 1e-5


def test_ut_backward_is_the_vjp_of_ut_forward(rng, x64):
    """The hand-written UT backward and the chunk-end backward equal ``jax.vjp`` (float64)."""
    c, d, dv = 16, 8, 4
    Q, K, V = _f64(rng, c, d) / 2, _f64(rng, c, d) / 2, _f64(rng, c, dv)
    bb = jnp.cumsum(-jnp.asarray(rng.uniform(0.05, 0.5, c)))
    beta = jnp.asarray(rng.uniform(0.1, 0.9, c))
    lam = tuple(jnp.asarray(rng.uniform(0.2, 1.5, c)) for _ in range(5))
    outs, vjp = jax.vjp(chunk.ut_forward, Q, K, V, bb, beta, lam)
    cts = tuple(_f64(rng, *o.shape) for o in outs)
    *want, dlam = vjp(cts)
    *got, got_dlam = chunk.ut_backward(Q, K, V, bb, beta, lam, *cts)
    for name, a, b in zip(["dQ", "dK", "dV", "dbb", "dbeta"], got, want):
        assert_close(a, b, 1e-10, name)
    assert_close(jnp.stack(got_dlam), jnp.stack(dlam), 1e-10, "dlam")
    (_, vjp_end) = jax.vjp(chunk.chunk_end, K, bb)
    dKt, dgc = _f64(rng, c, d), jnp.asarray(0.7)
    for name, a, b in zip(["dK", "dbb"], chunk.chunk_end_backward(K, bb, dKt, dgc),
                          vjp_end((dKt, dgc))):
        assert_close(a, b, 1e-10, "chunk_end " + name)


@pytest.mark.parametrize("n", [1, 2, 5, 6, 7])  # levels read / carried differ with the bits of n
def test_walk_backward_is_the_vjp_of_walk_forward(rng, x64, n):
    c, d, bv, S = 16, 8, 4, 3
    args = (_f64(rng, c, d), _f64(rng, c, d), _f64(rng, c, d) / 3, _f64(rng, c, bv),
            jnp.asarray(0.6), tuple(jnp.asarray(rng.uniform(0.2, 1.5, c)) for _ in range(S)),
            tuple(_f64(rng, d, bv) for _ in range(S)))
    outs, vjp = jax.vjp(lambda *a: chunk.walk_forward(*a, n), *args)
    dO, dH = _f64(rng, c, bv), tuple(_f64(rng, d, bv) for _ in range(S))
    *want, want_dlam, want_dH = vjp((dO, dH))
    load = lambda m: args[6][m - 1]
    dOwn, dH_level = chunk.carry_backward(dH, n)
    *got, got_dlam, got_dH = chunk.walk_backward(*args[:6], dO, load, dOwn, dH_level, n)
    for name, a, b in zip(["dQh", "dW", "dKt", "dU", "dgc", "dlam", "dH"], got + [
            jnp.stack(got_dlam), jnp.stack(got_dH)], want + [jnp.stack(want_dlam),
                                                             jnp.stack(want_dH)]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    # the chunk-parallel form: the read levels' cotangents loaded where read, the rest unused
    *par, par_dlam, _ = chunk.walk_backward(*args[:6], dO, load, dOwn, [jnp.zeros_like(dOwn)] * S, n,
                                            dload=lambda m: dH_level[m - 1])
    for name, a, b in zip(["dQh", "dW", "dKt", "dU", "dgc", "dlam"], par + [jnp.stack(par_dlam)],
                          got + [jnp.stack(got_dlam)]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, err_msg="dload " + name)


def test_rejects_bad_input(rng):
    q, k, v, g, beta, lam = _inputs(rng, 1, 16, 1, 16, 16)
    ker = lambda *a, **kw: loglinear_gated_deltanet_pallas(*a, interpret=True, **kw)
    with pytest.raises(ValueError, match="chunk_size"):
        ker(q, k, v, g, beta, lam, chunk_size=24)
    with pytest.raises(ValueError, match="block_v_bwd"):
        ker(q, k, v, g, beta, lam, block_v_bwd=48)
    with pytest.raises(ValueError, match="g"):
        ker(q, k, v, None, beta, lam)
    with pytest.raises(ValueError, match="beta"):
        ker(q, k, v, g, beta[..., None], lam)
    with pytest.raises(ValueError, match="lam"):
        ker(q, k, v, g, beta, lam[..., :2])
    with pytest.raises(ValueError, match="k"):
        ker(q, k[..., :8], v, g, beta, lam)


@pytest.mark.parametrize("platform,c", [("cuda", 64), ("tpu", 128)])
def test_lowers_for_hardware(platform, c):
    """Forward and backward pass the real Triton (H200) / Mosaic TPU lowering: no device needed."""
    B, T, H, d, dv = 1, 1024, 2, 128, 128
    x = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    loss = lambda *a: loglinear_gated_deltanet_pallas(
        *a, chunk_size=c, interpret=False, backend="tpu" if platform == "tpu" else "triton").sum()
    text = lower_for(platform, jax.grad(loss, argnums=tuple(range(6))), x(B, T, H, d),
                     x(B, T, H, d), x(B, T, H, dv), x(B, T, H, dt=jnp.float32),
                     x(B, T, H, dt=jnp.float32), x(B, T, H, fenwick.num_levels(T), dt=jnp.float32))
    assert text.count(KERNEL_CALL[platform]) >= 4  # UT, saved-state walk, reverse walk, UT backward
