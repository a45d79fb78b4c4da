"""Test helpers shared by the operator and training tests."""

import contextlib
import importlib.util
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np


def devices_env(n: int = 8, **extra) -> dict:
    """``os.environ`` for a subprocess with ``n`` emulated CPU devices (set in XLA_FLAGS before
    JAX starts there), keeping the suite's XLA flags (``conftest.py``) and adding ``extra``."""
    flags = " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                   f"--xla_force_host_platform_device_count={n}")))
    # a test file run as a script from its layer's folder imports these helpers and the package
    path = os.pathsep.join(filter(None, (TESTS, str(ROOT), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path, **extra)


def state_loss(fn, wo, wh):
    """``Σ o·wo + Σ h_T·wh`` of ``fn(*args) -> (o, h_T)``, ``fn`` run once (a kernel run in its
    interpreter is the slow part of a test)."""
    def f(*args):
        o, h = fn(*args)
        return jnp.sum(o * wo) + jnp.sum(h * wh)
    return f


def rel_err(out, ref) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; NaN or inf anywhere gives inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not (np.all(np.isfinite(out)) and np.all(np.isfinite(ref))):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def assert_close(out, ref, tol: float, what: str = "output"):
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def keys_around_one_direction(rng, shape, spread: float) -> np.ndarray:
    """Unit keys ``[..., d]``: one shared random direction plus ``spread`` times noise (0: all
    equal), the hard case of the delta rule's UT inverse."""
    k = rng.normal(size=shape[-1]) + spread * rng.normal(size=shape)
    return k / np.linalg.norm(k, axis=-1, keepdims=True)


def make_qkv(rng, B=2, T=37, H=2, d=5, dv=3, dtype=np.float32):
    """Random ``q, k: [B,T,H,d]`` scaled by 1/sqrt(d) and ``v: [B,T,H,dv]``."""
    q = rng.normal(size=(B, T, H, d)) / np.sqrt(d)
    k = rng.normal(size=(B, T, H, d)) / np.sqrt(d)
    v = rng.normal(size=(B, T, H, dv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def make_gate(rng, B=2, T=37, H=2, kind="token", dtype=np.float32, low=0.0, high=0.5):
    """Log-decay: ``None``, a per-head constant ``[H]``, or per-token ``[B,T,H]`` in [-high, -low]."""
    if kind is None:
        return None
    shape = (H,) if kind == "head" else (B, T, H)
    return jnp.asarray(-rng.uniform(low, high, size=shape), dtype)


def grads_of(fn, args, argnums, w):
    """Gradients of the linear functional ``sum(fn(*args) * w)`` with respect to ``argnums``."""
    return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=argnums)(*args)


def make_inputs(rng, T, gate, normalize, dtype=np.float64, *, B=2, H=2, d=5, dv=3):
    """``q, k, v, g`` for the HLA tests: ``normalize`` takes |q|, |k| (the denominator stays away
    from 0); ``gate`` is a ``make_gate`` kind or "reset" (per-token with a few -inf log-decays:
    segment resets that must keep every form finite and exact)."""
    q, k, v = make_qkv(rng, B=B, T=T, H=H, d=d, dv=dv, dtype=dtype)
    if normalize:
        q, k = jnp.abs(q), jnp.abs(k)
    if gate != "reset":
        return q, k, v, make_gate(rng, B=B, T=T, H=H, kind=gate, dtype=dtype)
    g = make_gate(rng, B=B, T=T, H=H, kind="token", dtype=dtype)
    g = g.at[0, 5, 1].set(-jnp.inf).at[1, 16, 0].set(-jnp.inf).at[1, 17, 0].set(-jnp.inf)
    return q, k, v, g


def assert_grads_match(fn, ref_fn, args, w, tol: float):
    """Gradients of ``sum(fn(*args) * w)`` equal those of ``ref_fn`` for every arg (q, k, v, g)."""
    argnums = tuple(range(len(args)))
    got, want = grads_of(fn, args, argnums, w), grads_of(ref_fn, args, argnums, w)
    for name, a, b in zip("qkvg", got, want):
        assert_close(a, b, tol, f"d/d{name}")


def assert_causal(rng, fn, q, k, v, g, t: int):
    """Redrawing the tokens after ``t`` (and setting their log-decay to -1) leaves ``fn``'s
    outputs up to ``t`` bit-identical and changes the later ones."""
    out = fn(q, k, v, g)
    q2, k2, v2 = (x.at[:, t + 1:].set(jnp.asarray(rng.normal(size=x[:, t + 1:].shape), x.dtype))
                  for x in (q, k, v))
    g2 = None if g is None else g.at[:, t + 1:].set(-1.0)
    out2 = fn(q2, k2, v2, g2)
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(out2[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


def step_outputs(step, state, q, k, v, g=None):
    """``step(state, q_t, k_t, v_t, g_t) -> (o_t, state)`` token by token (``g_t = None`` when ``g``
    is): the outputs ``[B,T,H,dv]`` and the final state."""
    outs = []
    for t in range(q.shape[1]):
        o, state = step(state, q[:, t], k[:, t], v[:, t], None if g is None else g[:, t])
        outs.append(o)
    return jnp.stack(outs, 1), state


def assert_associative(combine, a, b, c, tol: float = 1e-12):
    """``(a ⊕ b) ⊕ c == a ⊕ (b ⊕ c)`` field by field (NamedTuple summaries)."""
    left, right = combine(combine(a, b), c), combine(a, combine(b, c))
    for name, x, y in zip(type(a)._fields, left, right):
        assert_close(x, y, tol, name)


def assert_forms_match(entry, args, want, tol: float, dtype, forms=("recurrent", "scan", "chunked"),
                       **kw):
    """``entry(*args, impl=form, **kw)`` for every form: output dtype ``dtype``, equal to ``want``
    within ``tol``."""
    for impl in forms:
        out = entry(*args, impl=impl, **kw)
        assert out.dtype == dtype, f"{impl}: dtype {out.dtype}"
        assert_close(out, want, tol, impl)


@contextlib.contextmanager
def compilation_cache_restored():
    """JAX's persistent-compilation-cache settings (and its open cache) as they were, on exit: a
    module that turns the cache on must not leave it on for the modules an xdist worker runs
    after it (a later test then serialised its CPU program into the cache and crashed there)."""
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@contextlib.contextmanager
def persistent_compilation_cache(path):
    """Every program compiled in the block goes to (and comes from) JAX's persistent compilation
    cache under ``path``; the settings are restored afterwards (``compilation_cache_restored``)."""
    from jax.experimental.compilation_cache import compilation_cache

    with compilation_cache_restored():
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        yield


def lower_for(platform: str, fn, *args) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for ``platform`` ("cuda" | "tpu") on this CPU-only
    machine: Pallas kernels go through their real Triton (H200, sm_90) or Mosaic TPU lowering, so
    an op or shape those backends reject fails here. ``args``: arrays or ``ShapeDtypeStruct``s."""
    from jax._src.pallas.triton import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as triton_call

    h200 = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    saved, triton_call.gpu_info_lib.get_gpu_info = triton_call.gpu_info_lib.get_gpu_info, h200
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    finally:
        triton_call.gpu_info_lib.get_gpu_info = saved


def data_cfg(**over):
    """A ``config.data`` block for the data tests (byte text, T=32, batch 4), ``over`` applied."""
    import ml_collections

    c = ml_collections.ConfigDict(dict(
        kind="text", path="", pattern="*.txt", seq_len=32, batch_size=4, seed=0,
        eval_fraction=0.1, pack=False, separator=-1, mqar=dict(num_kv_pairs=4, power_a=0.01),
        niah=dict(n_digits=5)))
    c.update(over)
    return c


ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = str(ROOT / "tests")
TINY_LM = {  # configs/lm.py's tiny LM shrunk: d=32, one hla2 layer, T=32 (two chunks), batch 8
    "model.d_model": 32, "model.n_layers": 1, "model.chunk_size": 16, "data.seq_len": 32,
    "data.batch_size": 8, "data.eval_fraction": 0.2, "optim.decay_steps": 8,
    "train.log_every": 1, "train.eval_every": 0, "train.eval_steps": 0,
    "train.checkpoint_every": 4, "train.sample_tokens": 0, "train.progress_bar": False,
    "train.tensorboard": False}


def write_docs(path) -> pathlib.Path:
    """A tiny text corpus in ``path``: 60 files of 20-200 printable bytes."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(60):
        (path / f"{i:02d}.txt").write_bytes(rng.integers(32, 127, rng.integers(20, 200)).astype(np.uint8))
    return path


def tiny_lm_config(docs, num_steps: int, settings: dict | None = None):
    """``configs/lm.py:mixer=hla2,size=tiny`` with ``TINY_LM``, the corpus ``docs``, ``num_steps``
    and the flattened ``settings`` (e.g. ``{"mesh.data": 2}``)."""
    spec = importlib.util.spec_from_file_location("configs_lm", ROOT / "configs" / "lm.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    c = lm.get_config("mixer=hla2,size=tiny")
    c.update_from_flattened_dict({**TINY_LM, "data.path": str(docs), "train.num_steps": num_steps,
                                  **(settings or {})})
    return c


def tiny_lm_flags(docs, num_steps: int, settings: dict | None = None) -> list[str]:
    """``tiny_lm_config``'s settings as ``hla_jax.main`` flags."""
    values = {**TINY_LM, "data.path": docs, "train.num_steps": num_steps, **(settings or {})}
    return (["--config=configs/lm.py:mixer=hla2,size=tiny"]
            + [f"--config.{k}={v}" for k, v in values.items()])
