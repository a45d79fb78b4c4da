"""The first-order Gated DeltaNet kernel (``kernels/gdn/gdn_entry.py`` over its Mosaic GPU
kernels) on this CPU: the Mosaic GPU kernels (UT transform and its backward, walks, products) in the GPU
interpreter against the float32 recurrence (outputs, final state and every gradient: q, k, v, g, β, the
initial state), with a ragged T, value tiles padded, a reset gate, sequences cut into pieces,
packed documents through ``ops.gated_deltanet(impl="pallas")``, the entry's refusals, the walks
without their residuals, the pieces' maps walk, the lowering for CUDA, and the
chunk-level pieces in float64 (the UT transform's backward, the walk's products, the scans over
sequence pieces) against autodiff and the recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, keys_around_one_direction, lower_for, state_loss

from hla_jax import ops
from hla_jax.kernels import gated_deltanet_pallas
from hla_jax.kernels.gdn import gdn_entry

TOL = 2e-2  # docs/math.md#tolerances: bf16 inputs with float32 state


def operands(rng, B, T, H, d, dv):
    q = rng.normal(size=(B, T, H, d)) / np.sqrt(d)
    k = rng.normal(size=(B, T, H, d))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, rng.normal(size=(B, T, H, dv)))]
    g = jnp.asarray(-rng.uniform(0, 0.3, (B, T, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    h0 = jnp.asarray(0.3 * rng.normal(size=(B, H, d, dv)), jnp.float32)
    return (*bf, g, beta, h0)


def kernel(q, k, v, g, beta, h0, backend="mosaic_gpu", pieces=1):
    return gated_deltanet_pallas(q, k, v, g, beta, initial_state=h0, return_final_state=True,
                                 pieces=pieces, backend=backend, interpret=True)


def oracle(q, k, v, g, beta, h0):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return ops.gated_deltanet(*f32, g, beta, initial_state=h0, return_final_state=True,
                              impl="recurrent")


@pytest.mark.parametrize("B,T,H,d,dv,case", [
    (1, 100, 1, 64, 160, "plain"),  # two chunks (the last ragged), values padded to three tiles
    (2, 128, 1, 128, 64, "reset"),  # head dim 128, a −∞ gate mid-chunk and at a chunk start
    (1, 128, 1, 64, 64, "aligned"),  # keys near one direction, β ≈ 1, slow decay: the UT
])                                   # inverse's ill-conditioned case (NaN in LM training once)
def test_matches_recurrence(rng, B, T, H, d, dv, case):
    check_against_recurrence(rng, B, T, H, d, dv, case, "mosaic_gpu")


@pytest.mark.parametrize("B,T,H,d,dv,case,pieces", [
    (1, 300, 1, 64, 128, "plain", 3),   # 5 chunks padded to 6: 3 pieces of 2; maps walk 3 tiles
    (2, 256, 1, 128, 64, "reset", 2),   # resets inside a piece and at the second one's start
])
def test_pieces_match_recurrence(rng, B, T, H, d, dv, case, pieces):
    """Each sequence cut into pieces (the maps walk, the scans, the reverse walk without its
    residuals): outputs, final state and all six gradients against the recurrence."""
    check_against_recurrence(rng, B, T, H, d, dv, case, "mosaic_gpu", pieces)


@pytest.mark.parametrize("B,T,H,d,dv,case", [
    (1, 100, 1, 64, 160, "plain"),
    (2, 128, 1, 32, 64, "reset"),
    (1, 100, 2, 32, 48, "float32"),   # which only the TPU backend takes
])
def test_tpu_backend_matches_recurrence(rng, B, T, H, d, dv, case):
    """The TPU backend (``kernels/gdn/gdn_tpu.py``) in Mosaic's interpreter."""
    check_against_recurrence(rng, B, T, H, d, dv, case, "tpu")


def check_against_recurrence(rng, B, T, H, d, dv, case, backend, pieces=1):
    """Outputs, final state and all six gradients of ``backend``'s kernels (interpret mode)
    against the float32 recurrence."""
    args = list(operands(rng, B, T, H, d, dv))
    tol = TOL
    if case == "float32":
        args[:3], tol = [x.astype(jnp.float32) for x in args[:3]], 2e-3   # docs/math.md#tolerances
    if case == "reset":
        args[3] = args[3].at[0, 40, 0].set(-jnp.inf).at[1, T // 2, 0].set(-jnp.inf)
    if case == "aligned":
        args[1] = jnp.asarray(keys_around_one_direction(rng, (B, T, H, d), 0.1), jnp.bfloat16)
        args[3], args[4] = args[3] * 0.01, jnp.full_like(args[4], 0.95)
    run = lambda *a: kernel(*a, backend=backend, pieces=pieces)  # noqa: E731
    for a, b, what in zip(run(*args), oracle(*args), ("o", "H_T")):
        assert_close(a, b, tol, what)
    wo = jnp.asarray(rng.normal(size=(B, T, H, dv)), jnp.float32)
    wh = jnp.asarray(rng.normal(size=(B, H, d, dv)), jnp.float32)

    got = jax.grad(state_loss(run, wo, wh), argnums=range(6))(*args)
    want = jax.grad(state_loss(oracle, wo, wh), argnums=range(6))(*args)
    for a, b, what in zip(got, want, ("dq", "dk", "dv", "dg", "dbeta", "dh0")):
        assert_close(a, b, tol, what)


def test_gate_gradient_does_not_drift_over_long_sequences(rng):
    """``dg`` over 40 chunks (bf16, the GPU kernels in interpret mode) against the float64
    recurrence: taken in the chunk-local decays, each chunk's gradient is its own, so the error
    does not grow with T (a running sum of per-chunk terms carried back from the end gave
    1.96e-2 here)."""
    B, T, H, d, dv = 2, 2560, 1, 128, 128
    q, k = (rng.normal(size=(B, T, H, d)) / np.sqrt(d) for _ in range(2))
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, rng.normal(size=(B, T, H, dv)))]
    args += [jnp.asarray(-rng.uniform(0, 0.2, (B, T, H)), jnp.float32),
             jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32),
             jnp.asarray(rng.normal(size=(B, H, d, dv)), jnp.float32)]
    wo = rng.normal(size=(B, T, H, dv))
    wh = rng.normal(size=(B, H, d, dv))

    narrow = [jnp.asarray(w, jnp.float32) for w in (wo, wh)]
    got = jax.grad(state_loss(kernel, *narrow), argnums=3)(*args)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in args]
        want = jax.grad(state_loss(oracle64, *map(jnp.asarray, (wo, wh))), argnums=3)(*wide)
    assert_close(got, want, 4e-3, "dg")


def oracle64(q, k, v, g, beta, h0):
    return ops.gated_deltanet(q, k, v, g, beta, initial_state=h0, return_final_state=True,
                              impl="recurrent")


def test_packed_documents_equal_the_documents_alone(rng):
    """``ops.gated_deltanet(impl="pallas", segment_ids=…)`` (the reset gate into the kernel)
    equals the quadratic reference of the packed row."""
    q, k, v, g, beta, _ = operands(rng, 1, 100, 2, 64, 64)
    seg = jnp.asarray(np.repeat(np.arange(4), [30, 1, 50, 19])[None])
    o = ops.gated_deltanet(q, k, v, g, beta, segment_ids=seg, impl="pallas")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(o, ops.gated_deltanet(*f32, g, beta, segment_ids=seg, impl="reference"), TOL)


def test_entry_refuses_what_the_kernel_does_not_take(rng):
    q, k, v, g, beta, h0 = operands(rng, 1, 64, 1, 64, 64)
    with pytest.raises(ValueError, match="16-bit"):
        gated_deltanet_pallas(q.astype(jnp.float32), k, v, g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_deltanet_pallas(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="initial_state"):
        gated_deltanet_pallas(q, k, v, g, beta, initial_state=h0[..., :8])
    with pytest.raises(ValueError, match="beta"):
        gated_deltanet_pallas(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="backend"):
        gated_deltanet_pallas(q, k, v, g, beta, backend="cpu")
    with pytest.raises(ValueError, match="float32 q, k, v of one dtype"):
        gated_deltanet_pallas(q, k, v.astype(jnp.float32), g, beta, backend="tpu")
    for pieces, backend in ((0, "mosaic_gpu"), ("2", "mosaic_gpu"), (True, "mosaic_gpu"),
                            (2, "mosaic_gpu"), (2, "tpu")):
        with pytest.raises(ValueError, match="pieces must be None or an int from 1 to 1 "):
            gated_deltanet_pallas(q, k, v, g, beta, pieces=pieces, backend=backend)
    assert not gdn_entry.supports(q, k, v, 64)   # no Hopper GPU here: impl="auto" stays chunked


def test_default_split_only_where_at_least_four_pieces_fit(monkeypatch):
    """``pieces=None``: ``mosaic_gpu.pieces``' count where it reaches ``MIN_PIECES`` (4 at B=1,
    H=16, T=65536 on a 132-SM GPU), else 1 (two pieces' extra walks cost about what they save)."""
    for P, want in ((1, 1), (2, 1), (4, 4), (8, 8)):
        monkeypatch.setattr(gdn_entry.mosaic_gpu, "pieces", lambda B, H, dv, N, P=P: P)
        assert gdn_entry.default_pieces(1, 16, 128, 1024) == want


def test_lowers_for_cuda():
    """Forward and backward (all Mosaic GPU: the UT transform, run once, the two walks, the
    walk's products and the UT backward) go through the real lowering for head dims 64 and 128,
    with one to three value tiles."""
    for d, dv in ((64, 64), (128, 128), (64, 192)):
        x = jax.ShapeDtypeStruct((2, 256, 3, d), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((2, 256, 3, dv), jnp.bfloat16)
        s = jax.ShapeDtypeStruct((2, 256, 3), jnp.float32)
        h0 = jax.ShapeDtypeStruct((2, 3, d, dv), jnp.float32)

        def loss(q, k, v, beta, g, h0):
            o, hT = gdn_entry.core(q, k, v, beta, g, h0, False)
            return jnp.sum(o) + jnp.sum(hT)

        text = lower_for("cuda", jax.grad(loss, argnums=range(6)), x, x, v, s, s, h0)
        for name in ("gdn_walk_out", "gdn_walk_rev", "gdn_grads", "gdn_ut_bwd"):
            assert name in text, name
        # the UT transform once (the backward keeps its W), no Triton
        assert text.count("gdn_ut_fwd_mosaic_gpu") == 1 and "__gpu$xla.gpu.triton" not in text
        text = lower_for("cuda", lambda *a: gdn_entry.core(*a, False), x, x, v, s, s, h0)   # no residuals
        assert text.count("gdn_ut_fwd_mosaic_gpu") == text.count("gdn_walk_out_mosaic_gpu") == 1

        def split_loss(*a):   # two pieces a sequence: the maps walk, a reverse walk from zero
            o, hT = gdn_entry.core(*a, False, "mosaic_gpu", 2)
            return jnp.sum(o) + jnp.sum(hT)

        text = lower_for("cuda", jax.grad(split_loss, argnums=range(6)), x, x, v, s, s, h0)
        assert text.count("gdn_walk_maps_mosaic_gpu") == 1
        assert text.count("gdn_walk_rev_mosaic_gpu") == 2


def test_forward_walk_without_residuals(rng):
    """The warp-specialized forward walk (``gdn_walk_mgpu.walk``, GPU interpreter) without ``keep``
    gives the outputs and final state it gives with it, bitwise, and writes no ``V'`` or states;
    with it, the states it keeps start from ``s0``."""
    from hla_jax.kernels.gdn import gdn_walk_mgpu

    B, Tp, H, d, dv = 1, 192, 2, 64, 128
    q, k, w = (jnp.asarray(0.3 * rng.normal(size=(B, Tp, H, d)), jnp.bfloat16) for _ in range(3))
    u = jnp.asarray(rng.normal(size=(B, Tp, H, dv)), jnp.bfloat16)
    b2 = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.2, (B, H, Tp // 64, 64)), jnp.float32), -1)
    s0 = jnp.asarray(0.3 * rng.normal(size=(B, H, dv, d)), jnp.float32)
    walk = lambda keep: gdn_walk_mgpu.walk(b2.reshape(B, H, Tp), s0, (q, k, w, u), mode="out",  # noqa: E731
                                      keep=keep, interpret=True)
    (o, vn, s, final), (o1, vn1, s1, final1) = walk(True), walk(False)
    assert vn1 is None and s1 is None and vn.shape == u.shape and s.shape == (B, H, 3, dv, d)
    np.testing.assert_array_equal(o1, o)
    np.testing.assert_array_equal(final1, final)
    np.testing.assert_array_equal(s[:, :, 0], s0.astype(jnp.bfloat16))


def test_maps_walk_is_the_forward_walk_on_identity_and_values(rng):
    """``gdn_walk_mgpu.walk(mode="maps")`` (GPU interpreter) gives the final states the forward walk
    gives over the values ``[0 | U]`` from ``[I | 0]``, its chain step for step: ``[Mᵀ; Eᵀ]``;
    the reverse walk without ``keep`` the cotangent it gives with it, and nothing else."""
    from hla_jax.kernels.gdn import gdn_walk_mgpu

    B, Tp, H, d, dv = 2, 192, 1, 128, 64
    q, k, w = (jnp.asarray(0.3 * rng.normal(size=(B, Tp, H, d)), jnp.bfloat16) for _ in range(3))
    u = jnp.asarray(rng.normal(size=(B, Tp, H, dv)), jnp.bfloat16)
    b2 = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.2, (B, H, Tp // 64, 64)), jnp.float32), -1)
    b2 = b2.reshape(B, H, Tp)
    maps = gdn_walk_mgpu.walk(b2, None, (k, w, u), mode="maps", interpret=True)
    s0 = jnp.broadcast_to(jnp.concatenate([jnp.eye(d), jnp.zeros((dv, d))]), (B, H, d + dv, d))
    u0 = jnp.concatenate([jnp.zeros((B, Tp, H, d), u.dtype), u], -1)
    final = gdn_walk_mgpu.walk(b2, s0, (q, k, w, u0), mode="out", keep=False, interpret=True)[-1]
    assert maps.shape == (B, H, d + dv, d) and maps.dtype == jnp.float32
    np.testing.assert_array_equal(maps, final)
    do = jnp.asarray(rng.normal(size=(B, Tp, H, dv)), jnp.bfloat16)
    ds0 = jnp.asarray(rng.normal(size=(B, H, dv, d)), jnp.float32)
    rev = lambda keep: gdn_walk_mgpu.walk(b2, ds0, (q, k, w, do), mode="rev", keep=keep,  # noqa: E731
                                     interpret=True)
    (ndv, _, dh0), (ndv1, ds1, dh01) = rev(True), rev(False)
    assert ndv1 is None and ds1 is None and ndv.shape == do.shape
    np.testing.assert_array_equal(dh01, dh0)


def test_piece_scans_give_the_states_and_cotangents_between_pieces(rng):
    """``gdn_entry._scan`` in float64 on maps from the recurrence (``M``: the state after a piece from
    ``I`` with zero values, ``E`` from zero; the own share: the gradient of a piece's outputs'
    loss at its start): the forward scan gives the recurrence's state where each piece starts,
    the reverse one the gradient of the whole loss at the state each piece leaves with (1e-12)."""
    B, H, d, dv, L, P = 1, 2, 4, 3, 5, 3
    with jax.enable_x64(True):
        x = lambda *s: jnp.asarray(rng.normal(size=s))  # noqa: E731
        q, k, v = x(B, P * L, H, d), x(B, P * L, H, d), x(B, P * L, H, dv)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        g = -jnp.asarray(rng.uniform(0, 0.5, (B, P * L, H)))
        beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, P * L, H)))
        h0, wo, wh = x(B, H, d, dv), x(B, P * L, H, dv), x(B, H, d, dv)

        def run(lo, hi, s, values=None):
            r = slice(lo, hi)
            return ops.gated_deltanet(q[:, r], k[:, r], v[:, r] if values is None else values, g[:, r],
                                      beta[:, r], initial_state=s, return_final_state=True,
                                      impl="recurrent")

        def tail(s, lo):    # the loss of the tokens from lo on, from the state s there
            o, hT = run(lo, P * L, s)
            return jnp.sum(o * wo[:, lo:]) + jnp.sum(hT * wh)

        eye = jnp.broadcast_to(jnp.eye(d), (B, H, d, d))
        m = jnp.stack([run(p * L, p * L + L, eye, jnp.zeros((B, L, H, d)))[1] for p in range(P)], 1)
        e = jnp.stack([run(p * L, p * L + L, 0 * h0)[1] for p in range(P)], 1)
        own = jnp.stack([jax.grad(lambda s, p=p: jnp.sum(run(p * L, p * L + L, s)[0]
                                                          * wo[:, p * L:p * L + L]))(h0)
                         for p in range(P)], 1)
        m, e, own = (y.reshape((B * P,) + y.shape[2:]) for y in (m, e, own))   # the pieces' rows
        starts = gdn_entry._scan(m, e, h0, reverse=False).reshape(B, P, H, d, dv)
        ends = gdn_entry._scan(m, own, wh, reverse=True).reshape(B, P, H, d, dv)
        for p in range(P):
            assert_close(starts[:, p], run(0, p * L, h0)[1] if p else h0, 1e-12, "start")
            want = wh if p == P - 1 else jax.grad(tail)(run(0, p * L + L, h0)[1], p * L + L)
            assert_close(ends[:, p], want, 1e-12, "end")


def test_tpu_backend_lowers_through_mosaic():
    """The TPU backend's five kernels, forward and backward, go through Mosaic TPU's lowering
    (bf16, d=dv=128, and float32 at d=64)."""
    for dt, d in ((jnp.bfloat16, 128), (jnp.float32, 64)):
        x = jax.ShapeDtypeStruct((1, 128, 2, d), dt)
        s = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)
        h0 = jax.ShapeDtypeStruct((1, 2, d, d), jnp.float32)

        def loss(q, k, v, beta, g, h0):
            o, hT = gdn_entry.core(q, k, v, beta, g, h0, False, "tpu")
            return jnp.sum(o) + jnp.sum(hT)

        text = lower_for("tpu", jax.grad(loss, argnums=range(6)), x, x, x, s, s, h0)
        assert text.count("tpu_custom_call") == 5, "UT, two walks, products, UT backward"


@pytest.mark.parametrize("cb", [4, 8])
def test_ut_backward_is_the_vjp_of_ut_forward(rng, cb):
    """One chunk's UT transform (``kernels/gdn_chunk.py``) in float64: the blocked forward's
    ``W, U`` solve ``(I + A) [W | U] = diag(β) [ρ∘K | V]`` and its ``X`` is ``(I + A)⁻¹``; the
    hand-written backward from that ``X`` equals autodiff of the forward, ``∂L/∂b`` included."""
    from hla_jax.kernels.gdn import gdn_chunk

    c, d, dv = 16, 8, 5
    with jax.enable_x64(True):
        K = jnp.asarray(rng.normal(size=(c, d)) / np.sqrt(d))
        V = jnp.asarray(rng.normal(size=(c, dv)))
        bb = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.3, c)))
        beta = jnp.asarray(rng.uniform(0.1, 0.9, c))

        def forward(K, V, beta, bb=bb):
            Ks, Vs, bs, betas = (jnp.split(x, c // cb) for x in (K, V, bb, beta))
            X = gdn_chunk.ut_inverse(Ks, bs, betas)
            W = gdn_chunk.ut_apply(X, [(bt * jnp.exp(b))[:, None] * k for k, b, bt in zip(Ks, bs, betas)],
                                   False)
            U = gdn_chunk.ut_apply(X, [bt[:, None] * v for v, bt in zip(Vs, betas)], False)
            return jnp.concatenate(W), jnp.concatenate(U), jnp.block(X)

        W, U, X = forward(K, V, beta)
        Gam = jnp.tril(jnp.exp(bb[:, None] - bb[None, :]), -1)
        A = beta[:, None] * (K @ K.T) * Gam
        rhs = beta[:, None] * jnp.concatenate([jnp.exp(bb)[:, None] * K, V], 1)
        assert_close(jnp.concatenate([W, U], 1), jnp.linalg.solve(jnp.eye(c) + A, rhs), 1e-12)
        assert_close(X, jnp.linalg.inv(jnp.eye(c) + A), 1e-12)
        dW, dU = jnp.asarray(rng.normal(size=(c, d))), jnp.asarray(rng.normal(size=(c, dv)))
        _, vjp = jax.vjp(lambda *a: forward(*a)[:2], K, V, beta, bb)
        dK, dbeta, db = gdn_chunk.ut_backward(K, bb, beta, X, dW, dU @ V.T)
        dV = gdn_chunk.ut_backward_values(X, beta, dU, False)
        for a, b, what in zip((dK, dV, dbeta, db), vjp((dW, dU)), ("dK", "dV", "dbeta", "db")):
            assert_close(a, b, 1e-12, what)


def test_walk_grads_are_the_vjp_of_a_chunk(rng):
    """One chunk of the walk with values ``V'`` (``O = diag(ρ) Q S + ((Q Kᵀ) ∘ Γ) V'``, ``S' =
    ρ_c S + (γ̄∘K)ᵀ V'``) in float64: ``walk_products`` over two value tiles and two key blocks,
    then ``walk_grads``, give autodiff's ``dQ``, ``dK`` and, summed over the key blocks,
    ``∂L/∂b`` (``ρ_c⟨S, dS⟩`` at the last token included); ``dW = −dV' Sᵀ``."""
    from hla_jax.kernels.gdn import gdn_chunk
    from hla_jax.kernels.la import la_chunk

    c, d, dv = 16, 8, 6
    with jax.enable_x64(True):
        Q, K = (jnp.asarray(rng.normal(size=(c, d))) for _ in range(2))
        Vn, dO, dVn = (jnp.asarray(rng.normal(size=(c, dv))) for _ in range(3))
        S, dS = (jnp.asarray(rng.normal(size=(d, dv))) for _ in range(2))
        bb = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.3, c)))
        (O, S1), vjp = jax.vjp(lambda Q, K, bb: la_chunk.chunk_forward(Q, K, Vn, bb, S), Q, K, bb)
        dQ_want, dK_want, db_want = vjp((dO, dS))
        db = 0.0
        for keys in (slice(0, 3), slice(3, d)):
            acc = [0.0] * 5
            for cols in (slice(0, 2), slice(2, dv)):
                share = gdn_chunk.walk_products(dO[:, cols], Vn[:, cols], -dVn[:, cols],
                                                S.T[cols, keys], dS.T[cols, keys])
                acc = [a + x for a, x in zip(acc, share)]
            D, dOS, VdS, dW, SdS = acc
            dQ, dK, db_keys = gdn_chunk.walk_grads(Q[:, keys], K[:, keys], bb, D, dOS, VdS, SdS)
            db = db + db_keys
            for a, b, what in ((dQ, dQ_want[:, keys], "dQ"), (dK, dK_want[:, keys], "dK"),
                               (dW, -dVn @ S.T[:, keys], "dW")):
                assert_close(a, b, 1e-12, what)
        assert_close(db, db_want, 1e-12, "db")


@pytest.mark.parametrize("d,dv", [(128, 128), (64, 192)])   # two key blocks; three value tiles
def test_mosaic_products_match_the_chunk_math(rng, d, dv):
    """``gdn_grads_mgpu.backward`` (GPU interpreter; 16-bit operands) against
    ``gdn_chunk.walk_products`` and ``walk_grads`` on each chunk in float32: ``dQ, dK, dW`` to
    their 16-bit rounding, the gate's share (summed over the key blocks) to 1e-5."""
    from hla_jax.kernels.gdn import gdn_chunk, gdn_grads_mgpu
    from hla_jax.kernels.mosaic_gpu import LOG2E

    B, Tp, H, N = 1, 128, 2, 2
    bf = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)  # noqa: E731
    q, k = bf(B, Tp, H, d), bf(B, Tp, H, d)
    vn, do, ndvn = bf(B, Tp, H, dv), bf(B, Tp, H, dv), bf(B, Tp, H, dv)
    s, ds = bf(B, H, N, dv, d), bf(B, H, N, dv, d)
    b = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.1, (B, H, N, 64)), jnp.float32), -1)
    got = gdn_grads_mgpu.backward(q, k, vn, do, ndvn, s, ds, b.reshape(B, H, Tp) * LOG2E,
                                  interpret=True)

    def chunk(Q, K, Vn, dO, nD, sT, dsT, bb):
        D, dOS, VdS, dW, SdS = gdn_chunk.walk_products(dO, Vn, nD, sT, dsT)
        return (*gdn_chunk.walk_grads(Q, K, bb, D, dOS, VdS, SdS), dW)

    per_chunk = lambda x: jnp.moveaxis(x.reshape(B, N, 64, H, -1), 3, 1)  # noqa: E731
    f32 = [per_chunk(x.astype(jnp.float32)) for x in (q, k, vn, do, ndvn)]
    with jax.default_matmul_precision("highest"):
        dQ, dK, db, dW = jax.vmap(jax.vmap(jax.vmap(chunk)))(
            *f32, s.astype(jnp.float32), ds.astype(jnp.float32), b)
    back = lambda x: jnp.moveaxis(x, 1, 3).reshape(B, Tp, H, d)  # noqa: E731
    for a, e, what in ((got[0], back(dQ), "dQ"), (got[1], back(dK), "dK"), (got[2], back(dW), "dW")):
        assert a.dtype == q.dtype and a.shape == e.shape
        assert_close(a.astype(jnp.float32), e, 5e-3, what)
    assert got[3].shape == (d // 64, B, H, Tp)
    assert_close(got[3].sum(0), db.reshape(B, H, Tp), 1e-5, "db")


@pytest.mark.parametrize("d,dv,aligned", [(128, 128, False), (64, 192, True)])  # 1 / 3 value tiles
def test_mosaic_ut_forward_solves_the_chunk(rng, d, dv, aligned):
    """``gdn_ut_mgpu.forward`` (GPU interpreter: the ``16×16`` diagonal blocks' inverse by a
    triangular solve where the GPU substitutes, then the doublings over their nonzero ranges,
    every product on 16-bit halves) against float64 linear algebra on each chunk: ``X = (I + A)⁻¹`` to 1e-4 of
    its largest entry, ``W, U`` (16 bits) to 1e-2, also with keys near one direction, β near 1
    and slow decay (the inverse's ill-conditioned case); without ``keep`` the same ``W, U`` and
    no ``X``."""
    from hla_jax.kernels.gdn import gdn_ut_mgpu
    from hla_jax.kernels.mosaic_gpu import LOG2E

    B, Tp, H, N = 1, 128, 2, 2
    if aligned:
        k = keys_around_one_direction(rng, (B, Tp, H, d), 0.1)
        b = jnp.cumsum(jnp.full((B, H, N, 64), -1e-3, jnp.float32), -1)
        beta = jnp.full((B, H, Tp), 0.99, jnp.float32)
    else:
        k = rng.normal(size=(B, Tp, H, d))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        b = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.1, (B, H, N, 64)), jnp.float32), -1)
        beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, H, Tp)), jnp.float32)
    k = jnp.asarray(k, jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, Tp, H, dv)), jnp.bfloat16)
    w, u, x = gdn_ut_mgpu.forward(k, v, b.reshape(B, H, Tp) * LOG2E, beta, interpret=True)

    chunks = lambda y: np.asarray(y, np.float64).reshape(B, N, 64, H, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    K, V, bb = chunks(k), chunks(v), np.asarray(b, np.float64)
    bt = np.asarray(beta, np.float64).reshape(B, H, N, 64)
    Gam = np.tril(np.exp(bb[..., :, None] - bb[..., None, :]), -1)
    A = bt[..., None] * (K @ np.swapaxes(K, -1, -2)) * Gam
    X = np.linalg.inv(np.eye(64) + A)
    W, U = X @ ((bt * np.exp(bb))[..., None] * K), X @ (bt[..., None] * V)
    back = lambda y: y.transpose(0, 2, 3, 1, 4).reshape(B, Tp, H, -1)  # noqa: E731
    assert x.shape == (B, H, Tp, 64) and x.dtype == jnp.float32
    assert w.shape == k.shape and u.shape == v.shape and w.dtype == u.dtype == jnp.bfloat16
    assert_close(x, X.reshape(B, H, Tp, 64), 1e-4, "X")
    assert_close(w.astype(jnp.float32), back(W), 1e-2, "W")
    assert_close(u.astype(jnp.float32), back(U), 1e-2, "U")
    w1, u1, none = gdn_ut_mgpu.forward(k, v, b.reshape(B, H, Tp) * LOG2E, beta, keep=False,
                                       interpret=True)      # a forward no backward follows
    assert none is None and (w1 == w).all() and (u1 == u).all()


@pytest.mark.parametrize("d,dv,own", [(128, 128, False), (64, 192, True)])  # 1 / 3 value tiles
def test_mosaic_ut_backward_matches_the_chunk_math(rng, d, dv, own):
    """``gdn_ut_mgpu.backward`` (GPU interpreter; 16-bit operands, ``X`` in two halves) against
    ``gdn_chunk.ut_backward`` on each chunk in float32: ``dk, dv`` to their 16-bit rounding,
    ``dβ`` and the gate's share to 1e-4; with the walks' ``dK`` added, or (``own``, the block
    form's way) without it and with ``T``'s own cotangent added to ``dT``."""
    from hla_jax.kernels.gdn import gdn_chunk, gdn_ut_mgpu
    from hla_jax.kernels.mosaic_gpu import LOG2E

    B, Tp, H, N = 1, 128, 2, 2
    bf = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)  # noqa: E731
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    k = f32(bf(B, Tp, H, d))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    v, dw, dkw, ndu = bf(B, Tp, H, dv), bf(B, Tp, H, d), bf(B, Tp, H, d), bf(B, Tp, H, dv)
    dt = jnp.asarray(rng.normal(size=(B, H, Tp, 64)), jnp.float32)
    b = jnp.cumsum(jnp.asarray(-rng.uniform(0, 0.1, (B, H, N, 64)), jnp.float32), -1)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, H, Tp)), jnp.float32)
    x = gdn_ut_mgpu.forward(k, v, b.reshape(B, H, Tp) * LOG2E, beta, interpret=True)[2]
    extra = dict(dt_own=dt) if own else dict(dk_walk=dkw)
    got = gdn_ut_mgpu.backward(k, v, b.reshape(B, H, Tp) * LOG2E, beta, x, dw, ndu,
                               interpret=True, **extra)

    def chunk(K, V, bb, bt, X, dW, dU, dT):
        dK, dbeta, db = gdn_chunk.ut_backward(K, bb, bt, X, dW, dU @ V.T + dT)
        return dK, gdn_chunk.ut_backward_values(X, bt, dU, False), dbeta, db

    tokens = lambda x: jnp.moveaxis(f32(x).reshape(B, N, 64, H, -1), 3, 1)  # noqa: E731
    rows = lambda x: x.reshape(B, H, N, 64, -1)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        dk, dv_, dbeta, db = jax.vmap(jax.vmap(jax.vmap(chunk)))(
            tokens(k), tokens(v), b, beta.reshape(B, H, N, 64), rows(x), tokens(dw),
            -tokens(ndu), rows(dt) if own else jnp.zeros_like(rows(x)))
    back = lambda x: jnp.moveaxis(x, 1, 3).reshape(B, Tp, H, -1)  # noqa: E731
    want = (back(dk) + (0.0 if own else f32(dkw)), back(dv_), dbeta.reshape(B, H, Tp),
            db.reshape(B, H, Tp))
    for a, e, what, tol in zip(got, want, ("dk", "dv", "dbeta", "db"), (5e-3, 5e-3, 1e-4, 1e-4)):
        assert a.shape == e.shape and a.dtype == (k.dtype if what in ("dk", "dv") else jnp.float32)
        assert_close(f32(a), e, tol, what)
