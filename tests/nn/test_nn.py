"""hla_jax.nn: config validation, every mixer's forward/gradient, causality, decoding against
the full forward, long-sequence bf16 stability, generation, parameter names and FLOPs."""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from experiments.bench_prefill import longest_loop  # noqa: E402
from hla_jax.nn import LM, MIXERS, ModelConfig, flops_per_token, generate, param_count  # noqa: E402
from hla_jax.nn import make_mixer as new_mixer  # noqa: E402
from hla_jax.nn.decoding import sample_token  # noqa: E402
from hla_jax.nn.flops import mixer_core_flops  # noqa: E402

T_TEST = 21
# XLA CPU spends most of these tests compiling; its cheaper pipeline keeps the file fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
AXIS_NAMES = {"vocab", "embed", "heads", "kv", "mlp", "levels", "conv", None}


def tiny(mixer, **kw):
    base = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, mixer_pattern=(mixer,),
                chunk_size=8, num_levels=8, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def make_mixer(cfg, name, seed=0):
    return new_mixer(name, cfg, rngs=nnx.Rngs(seed), out_std=cfg.init_std)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, match", [
    (dict(mixer_pattern=("hla2", "flash")), "unknown mixer"),
    (dict(d_model=16, n_heads=3), "n_heads \\* head_dim must equal d_model"),
    (dict(d_model=16, n_heads=2, head_dim=4), "n_heads \\* head_dim must equal d_model"),
    (dict(dtype="float8"), "dtype"),
    (dict(impl="fast"), "impl"),
    (dict(mixer_pattern=()), "at least one mixer"),
])
def test_config_rejects_inconsistent(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_config_from_dict():
    cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 4, "mixer_pattern": ["hla2", "softmax"]})
    assert cfg.head_dim == 8 and cfg.mixer_pattern == ("hla2", "softmax")
    assert cfg.mlp_dim == 128 and ModelConfig(d_model=64).mlp_dim == 192
    with pytest.raises(ValueError, match="unknown keys \\['n_layer'\\]"):
        ModelConfig.from_dict({"n_layer": 2})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# --------------------------------------------------------------------------- mixers


@pytest.mark.parametrize("name", MIXERS)
def test_mixer_forward_and_gradient(name, rng):
    cfg = tiny(name)
    graphdef, params = nnx.split(make_mixer(cfg, name))
    x = jnp.asarray(rng.normal(size=(2, T_TEST, cfg.d_model)), jnp.float32)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def forward_and_grads(p, x):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), p, x)
        return y, vjp(w)

    y, (gp, gx) = compiled(forward_and_grads, params, x)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    leaves = jax.tree.leaves(gp)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves) and bool(jnp.all(jnp.isfinite(gx)))
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)  # every parameter is used


@pytest.mark.parametrize("name", ["ahla", "loglinear_gated_deltanet"])
def test_mixer_pallas_impl_matches_chunked(name, rng):
    """``ModelConfig.impl="pallas"`` runs the kernels (interpret mode here) with the same result."""
    x = jnp.asarray(rng.normal(size=(2, 20, 16)), jnp.float32)
    outs = [make_mixer(tiny(name, impl=impl, chunk_size=16, hla_decay=True), name)(x)
            for impl in ("chunked", "pallas")]
    assert_close(outs[1], outs[0], 2e-3)


DECODE_CASES = [(name, {"hla_decay": True}) for name in MIXERS] + [
    ("hla2", {"hla_normalize": True}), ("ahla", {"hla_normalize": True}),
    ("hla3", {"hla_normalize": True}), ("hla2", {"hla_conv": True}), ("linear", {"hla_conv": True}),
    ("gated_deltanet", {"conv_size": 0})]


@pytest.mark.parametrize("name, kw", DECODE_CASES)
def test_decode_matches_forward(name, kw, rng):
    """Prefill of 7 tokens, then one-token steps: equals the full forward (float32, 1e-4)."""
    cfg = tiny(name, init_std=0.3, **kw)
    mixer = make_mixer(cfg, name)
    T, P = T_TEST, 7
    x = jnp.asarray(rng.normal(size=(2, T, cfg.d_model)), jnp.float32)
    full = mixer(x)
    y, cache = mixer.prefill(x[:, :P], mixer.init_cache(2, T, jnp.float32))
    step = nnx.jit(lambda m, x_t, c, t: m.step(x_t, c, t))
    outs = [y]
    for t in range(P, T):
        y_t, cache = step(mixer, x[:, t], cache, t)
        outs.append(y_t[:, None])
    assert_close(jnp.concatenate(outs, 1), full, 1e-4, f"{name} decode")


@pytest.mark.parametrize("name", MIXERS)
def test_lm_is_causal(name, rng):
    cfg = tiny(name, n_layers=2, init_std=0.3)
    model = LM(cfg, rngs=nnx.Rngs(1))
    tok = rng.integers(0, cfg.vocab_size, size=(2, T_TEST))
    other = tok.copy()
    t = 13
    other[:, t + 1:] = rng.integers(0, cfg.vocab_size, size=(2, T_TEST - t - 1))
    a, b = model(jnp.asarray(tok)), model(jnp.asarray(other))
    assert a.shape == (2, T_TEST, cfg.vocab_size) and a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a[:, :t + 1]), np.asarray(b[:, :t + 1]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(a[:, t + 1:]), np.asarray(b[:, t + 1:]))


@pytest.mark.parametrize("name", MIXERS)
def test_long_bf16_stable(name):
    """Default settings, T=16384 random tokens in bfloat16 (softmax, which carries no state
    along T: 4096, a sixteenth of its quadratic cost on the CPU): finite logits and gradients."""
    T = 4096 if name == "softmax" else 16384
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer_pattern=(name,),
                      chunk_size=64, dtype="bfloat16", max_seq_len=T)
    model = LM(cfg, rngs=nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(0), (1, T), 0, cfg.vocab_size)
    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tok[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))

    value, grads = compiled(jax.value_and_grad(loss), params)
    assert bool(jnp.isfinite(value))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


# --------------------------------------------------------------------------- LM


def test_hybrid_pattern_and_generation(rng):
    cfg = tiny("hla2", n_layers=3, mixer_pattern=("hla2", "gated_deltanet", "softmax"),
               tie_embeddings=False, init_std=0.3)
    model = LM(cfg, rngs=nnx.Rngs(0))
    assert [b.mixer_name for b in model.blocks] == ["hla2", "gated_deltanet", "softmax"]
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(2, 5)), jnp.int32)
    out = generate(model, prompt, 6, temperature=0.0)
    assert out.shape == (2, 11) and bool(jnp.all(out[:, :5] == prompt))
    greedy = jnp.argmax(model(out)[:, 4:-1], axis=-1)  # full forward agrees with decoding
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(out[:, 5:]))


@pytest.mark.parametrize("name", MIXERS)
def test_ragged_generation_equals_each_prompt_alone(name, rng):
    """Prompts of lengths 9, 3, 14 in one batch (``prompt_lengths``) continue greedily exactly as
    each prompt alone; the first new token's logits match too (float32)."""
    cfg = tiny(name, n_layers=2, init_std=0.3, hla_conv=True)
    model = LM(cfg, rngs=nnx.Rngs(2))
    lengths = [9, 3, 14]
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(3, 14)), jnp.int32)
    out = generate(model, prompt, 5, temperature=0.0, prompt_lengths=lengths)
    assert out.shape == (3, 19)
    for b, n in enumerate(lengths):
        alone = generate(model, prompt[b:b + 1, :n], 5, temperature=0.0)
        np.testing.assert_array_equal(np.asarray(out[b, :n + 5]), np.asarray(alone[0]))
        assert not np.any(np.asarray(out[b, n + 5:]))


@pytest.mark.parametrize("name", [m for m in MIXERS if m != "softmax"])
def test_prefill_has_no_serial_scan_over_the_prompt(name):
    """The prefill's final states come from the chunked forms: its jaxpr holds no loop over
    the prompt's T tokens (only over its T / chunk_size chunks)."""
    cfg = tiny(name, n_layers=1, hla_conv=True)
    model = LM(cfg, rngs=nnx.Rngs(0))
    T = 64
    tok = jnp.zeros((1, T), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t: model.prefill(t, model.init_cache(1, T)))(tok)
    assert longest_loop(jaxpr) < T


def test_sample_token():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, -1.0]])
    np.testing.assert_array_equal(sample_token(logits, jax.random.key(0), 0.0, 0), [1, 0])
    np.testing.assert_array_equal(sample_token(logits, jax.random.key(0), 1.0, 1), [1, 0])
    draws = jax.vmap(lambda k: sample_token(logits, k, 2.0, 2))(jax.random.split(jax.random.key(1), 200))
    assert set(np.unique(draws[:, 0])) == {1, 3} and set(np.unique(draws[:, 1])) == {0, 2}


def test_decode_length_checks():
    with pytest.raises(ValueError, match="num_levels"):
        LM(tiny("loglinear_mamba2", num_levels=4), rngs=nnx.Rngs(0)).init_cache(1, 9)
    with pytest.raises(ValueError, match="max_seq_len"):
        LM(tiny("softmax", max_seq_len=8), rngs=nnx.Rngs(0)).init_cache(1, 9)


def test_params_are_named_and_counted():
    cfg = tiny("hla2", n_layers=len(MIXERS), mixer_pattern=MIXERS, hla_decay=True)
    model = LM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    specs = jax.tree.leaves(nnx.get_partition_spec(params),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    leaves = jax.tree.leaves(params)
    assert len(specs) == len(leaves)
    for spec, x in zip(specs, leaves):
        assert len(spec) == x.ndim and set(spec) <= AXIS_NAMES, (spec, x.shape)
        assert x.dtype == jnp.float32
    untied = LM(dataclasses.replace(cfg, tie_embeddings=False), rngs=nnx.Rngs(0))
    assert param_count(untied) - param_count(model) == cfg.vocab_size * cfg.d_model
    assert param_count(model) == sum(x.size for x in leaves)


def test_flops_per_token():
    soft, lin = (ModelConfig(d_model=64, n_heads=2, n_layers=2, mixer_pattern=(m,), hla_conv=False)
                 for m in ("softmax", "hla2"))
    f1, f2 = flops_per_token(soft, 1024), flops_per_token(soft, 2048)
    # causal attention core: 3 × H × 2·d·(T+1) per layer
    assert f2 - f1 == pytest.approx(3 * 2 * 2 * 2 * 32 * 1024)
    assert flops_per_token(lin, 1024) == flops_per_token(lin, 4096)  # chunked: flat in T
    assert flops_per_token(lin, 1024) > 3 * 2 * 2 * (3 * 64 * lin.mlp_dim)
    for name in MIXERS:
        assert mixer_core_flops(name, 4096, 64, 64) > 0
    conv = dataclasses.replace(lin, hla_conv=True)
    # training = 3 × forward, 2 layers of a width-4 conv over q, k, v (3 × 64 channels)
    assert flops_per_token(conv, 1024) - flops_per_token(lin, 1024) == 3 * 2 * (2 * 4 * 3 * 64)
    assert "conv" in str(nnx.state(LM(dataclasses.replace(conv, n_layers=1), rngs=nnx.Rngs(0))))
    ll = [mixer_core_flops("loglinear_mamba2", T, 64, 64) for T in (1024, 4096)]
    assert ll[1] > ll[0]  # one chunk-level state read per extra level
