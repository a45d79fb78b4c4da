"""hla_jax.train: the tiny config learns, resume reproduces an uninterrupted run, a sharded mesh
matches one device, bad configs fail before compiling, a NaN stops the run and keeps the last
good checkpoint."""

import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx
from helpers import devices_env, persistent_compilation_cache

from hla_jax import data
from hla_jax.nn import LM, ModelConfig, param_count
from hla_jax.train import (
    MetricWriter,
    check_config,
    make_schedule,
    peak_flops,
    read_metrics,
    train_and_evaluate,
)
from hla_jax.train import trainer as trainer_lib
from hla_jax.train.config import base_config
from hla_jax.train.optim import decay_mask

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent compilation cache for this module: repeated runs of one config (resume)
    compile once. Restored afterwards."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


def load_config(name: str, arg: str):
    spec = importlib.util.spec_from_file_location(f"configs_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def small(mixer="softmax", n_layers=1, **train):
    """The tiny LM config shrunk for tests (d=32, T=64, batch 4), quiet, log every step."""
    c = load_config("lm", f"mixer={mixer},size=tiny")
    c.model.update(d_model=32, n_heads=2, n_layers=n_layers)
    c.data.update(seq_len=64, batch_size=4)
    c.optim.update(warmup_steps=5)
    c.train.update(num_steps=30, log_every=1, eval_every=0, eval_steps=0, checkpoint_every=0,
                   sample_tokens=0, progress_bar=False, tensorboard=False, async_checkpoint=False)
    c.train.update(train)
    return c


def losses(workdir):
    return np.array([r["loss"] for r in read_metrics(workdir, "train")])


def test_tiny_config_trains_and_loss_falls(tmp_path):
    c = small("hla2", n_layers=2, eval_steps=2, sample_tokens=8, sample_prompt=8)
    out = train_and_evaluate(c, tmp_path)
    loss = losses(tmp_path)
    assert len(loss) == 30 and np.all(np.isfinite(loss))
    assert loss[-5:].mean() < loss[:5].mean() - 1.0, loss
    assert out["step"] == 30 and np.isfinite(out["eval"]["loss"]) and out["eval"]["loss"] < 4.5
    assert len(out["sample"]["continuation"]) > 0
    assert (tmp_path / "checkpoints" / "30").is_dir() and (tmp_path / "config.json").is_file()
    assert [r["split"] for r in read_metrics(tmp_path)][-2:] == ["eval", "sample"]


def test_resume_reproduces_uninterrupted_run(tmp_path):
    def run(workdir, steps):
        c = small(num_steps=steps, checkpoint_every=10)
        c.optim.decay_steps = 40  # the same schedule whether or not the run stops at 20
        train_and_evaluate(c, workdir)

    run(tmp_path / "a", 20)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:  # logged by a run cut after step 22
        f.writelines(json.dumps({"step": s, "split": "train", "loss": -1.0}) + "\n" for s in (21, 22))
    run(tmp_path / "a", 40)
    run(tmp_path / "b", 40)
    resumed, straight = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(resumed) == len(straight) == 40  # the cut run's steps 21, 22 are re-done once
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["30", "40"]


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """grad_accum=2 (optax.MultiSteps over two micro-batches of 2) = one batch of 4."""
    runs = {}
    for accum in (1, 2):
        c = small(num_steps=3)
        c.optim.grad_accum = accum
        train_and_evaluate(c, tmp_path / str(accum))
        runs[accum] = losses(tmp_path / str(accum))
    np.testing.assert_allclose(runs[2], runs[1], rtol=0, atol=1e-5)
    assert runs[1][2] != runs[1][0]  # parameters moved


def test_schedule_and_decay_mask():
    c = small()
    c.optim.update(learning_rate=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    lr = make_schedule(c.optim, 1000)
    np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(60), lr(110), lr(500)],
                               [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], atol=1e-6)
    mask = decay_mask({"w": np.zeros((2, 3)), "scale": np.zeros(3)})
    assert mask == {"w": True, "scale": False}


def test_peak_flops_and_jsonl(tmp_path):
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("cpu") is None and peak_flops("cpu", 1e12) == 1e12
    writer = MetricWriter(tmp_path, tensorboard=False)
    writer.write(3, "train", {"loss": 1.5})
    writer.write(3, "eval", {"loss": 1.0})
    assert read_metrics(tmp_path, "eval") == [{"step": 3, "split": "eval", "loss": 1.0}]


def test_tensorboard_events(tmp_path):
    """Scalars are mirrored to a TensorBoard event file (read back record by record)."""
    import struct

    from tensorboardX.proto import event_pb2

    writer = MetricWriter(tmp_path)
    writer.write(7, "train", {"loss": 2.5, "tokens_per_s": 100.0, "mfu": None})
    writer.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data, scalars = path.read_bytes(), {}
    while data:  # TFRecord: u64 length, u32 crc, payload, u32 crc
        (n,) = struct.unpack("<Q", data[:8])
        event = event_pb2.Event.FromString(data[12:12 + n])
        data = data[16 + n:]
        scalars.update({(v.tag, event.step): v.simple_value for v in event.summary.value})
    assert scalars == {("train/loss", 7): 2.5, ("train/tokens_per_s", 7): 100.0}


MESH_SCRIPT = """
import json, sys
import jax
sys.path[:0] = {paths!r}  # this file's folder, then the tests' helpers
from test_train import small, losses
from hla_jax.train import check_config, make_optimizer, sharding, train_and_evaluate
from hla_jax.train.trainer import init_state
assert jax.device_count() == 8
{checks}
out = {{}}
for name, mesh in {meshes!r}.items():
    c = small(**{small_kw!r})
    c.update_from_flattened_dict({overrides!r})
    c.mesh.update(mesh)
    train_and_evaluate(c, {tmp!r} + "/" + name)
    out[name] = losses({tmp!r} + "/" + name).tolist()
print("LOSSES" + json.dumps(out))
"""


def losses_on_meshes(tmp_path, meshes: dict, small_kw: dict, overrides: dict, checks: str = ""):
    """Train losses (name -> list) of ``small(**small_kw)`` with the flattened ``overrides``
    (e.g. ``{"data.batch_size": 8}``) on each mesh of ``meshes`` (name -> mesh sizes), in a
    subprocess with 8 emulated CPU devices; ``checks``: code run there first (``c`` unset)."""
    env = devices_env(8, JAX_PLATFORMS="cpu")
    paths = [str(ROOT / "tests" / "train"), str(ROOT / "tests")]
    script = MESH_SCRIPT.format(paths=paths, tmp=str(tmp_path), checks=checks, meshes=meshes,
                                small_kw=small_kw, overrides=overrides)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("LOSSES", 1)[1])


FSDP_CHECKS = """
c = small()
c.mesh.update(data=2, fsdp=4)
mesh = sharding.make_mesh(c.mesh)
*_, sh = init_state(check_config(c), 0, mesh, sharding.DEFAULT_RULES, make_optimizer(c.optim, 8))
assert any("fsdp" in s.spec for s in jax.tree.leaves(sh["params"]))
assert any("fsdp" in s.spec for s in jax.tree.leaves(sh["opt_state"]))
"""


def test_data_fsdp_mesh_matches_one_device(tmp_path):
    out = losses_on_meshes(tmp_path, {"one": dict(data=1, fsdp=1), "sharded": dict(data=2, fsdp=4)},
                           dict(num_steps=8), {"data.batch_size": 8}, FSDP_CHECKS)
    assert len(out["one"]) == 8
    np.testing.assert_allclose(out["sharded"], out["one"], rtol=0, atol=1e-5)


def test_sequence_mesh_matches_one_device(tmp_path):
    """data=2 × sequence=4: T=64 split in shards of 16 (one chunk) for HLA2 and log-linear
    Mamba-2 (whose Fenwick levels cross the shard boundaries) = one device, in float32, on
    packed rows of short documents (5-40 bytes: segment_ids cross the shards too)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(200):
        (docs / f"{i:03d}.txt").write_bytes(rng.integers(32, 127, rng.integers(5, 41)).astype(np.uint8))
    out = losses_on_meshes(
        tmp_path, {"one": dict(data=1, sequence=1), "sharded": dict(data=2, sequence=4)},
        dict(mixer="hla2+loglinear_mamba2", n_layers=2, num_steps=4),
        {"model.chunk_size": 16, "model.num_levels": 8, "data.path": str(docs),
         "data.eval_fraction": 0.1})
    assert len(out["one"]) == 4 and out["one"][3] != out["one"][0]
    np.testing.assert_allclose(out["sharded"], out["one"], rtol=1e-5)


@pytest.mark.parametrize("field, value, match", [
    ("model.mixer_pattern", ("hla2", "nope"), "unknown mixer"),
    ("optim.learning_rate", -1e-3, "learning_rate must be positive"),
    ("optim.grad_accum", 3, "batch_size=4 must be divisible"),
    ("data.path", "/nonexistent/corpus", "does not exist"),
    ("data.kind", "video", "data.kind"),
    ("mesh.sequence", 2, "devices are not divisible by 2"),
    ("mesh.data", 2, "needs 2 devices"),
])
def test_bad_config_fails_before_compiling(tmp_path, monkeypatch, field, value, match):
    def no_init(*args, **kwargs):
        raise AssertionError("reached model initialisation")

    monkeypatch.setattr(trainer_lib, "init_state", no_init)
    c = small()
    section, key = field.split(".")
    c[section][key] = value
    with pytest.raises(ValueError, match=match):
        train_and_evaluate(c, tmp_path)


def test_batch_and_time_must_divide_over_the_mesh():
    with pytest.raises(ValueError, match="data.batch_size=4 must be divisible"):
        check_config(small(), batch_shards=8)
    with pytest.raises(ValueError, match="data.seq_len=64 must be divisible by mesh.sequence=3"):
        check_config(small(), sequence_shards=3)
    c = small("hla2")
    c.model.impl = "recurrent"
    with pytest.raises(ValueError, match="impl must be one of \\('chunked', 'auto'\\) with seq_axis"):
        check_config(c, sequence_shards=4)
    assert check_config(c).seq_axis == "" and check_config(small(), sequence_shards=4).seq_axis
    with pytest.raises(ValueError, match="unknown mixer"):
        load_config("lm", "mixer=transformer")
    with pytest.raises(ValueError, match="unknown config argument"):
        load_config("mqar", "mixer=hla2,kv=3")


@pytest.mark.parametrize("mixer", ["softmax", "loglinear_mamba2"])
def test_30m_size_is_about_30m_parameters_and_reaches_twice_its_length(mixer):
    c = load_config("lm", f"mixer={mixer},size=30m")
    params = param_count(nnx.eval_shape(lambda: LM(ModelConfig.from_dict(c.model.to_dict()),
                                                   rngs=nnx.Rngs(0))))
    assert 30e6 < params < 40e6 and c.data.seq_len == 4096 and c.model.max_seq_len == 8192


def first_bad_step(path, seq_len=64, batch=4, vocab=256):
    """The first 1-based step whose batch holds an out-of-vocabulary id."""
    c = small()
    c.data.update(kind="tokens", path=str(path), seq_len=seq_len, batch_size=batch, eval_fraction=0.1,
                  pack=False)
    it = data.DataIterator(data.make_sources(c.data, vocab)[0], batch, c.data.seed)
    return next(s for s in range(1, 1000) if np.any(next(it)["targets"] >= vocab))


def test_nan_stops_cli_run_and_keeps_last_good_checkpoint(tmp_path):
    path = tmp_path / "bad.npy"
    for bad in range(100, 1800, 37):  # an id outside the vocabulary -> that window's loss is NaN
        tokens = np.arange(2000, dtype=np.uint16) % 256
        tokens[bad] = 300
        np.save(path, tokens)
        fail = first_bad_step(path)
        if 3 <= fail <= 50:
            break
    cmd = [sys.executable, "-m", "hla_jax.main", "--config=configs/lm.py:mixer=softmax,size=tiny",
           f"--workdir={tmp_path / 'run'}", "--config.model.d_model=32",
           "--config.data.kind=tokens", f"--config.data.path={path}", "--config.data.pack=False",
           "--config.data.seq_len=64",
           "--config.data.batch_size=4", "--config.data.eval_fraction=0.1",
           "--config.train.log_every=1", "--config.train.checkpoint_every=1",
           "--config.train.eval_steps=0", "--config.train.progress_bar=False",
           "--config.train.num_steps=60"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"non-finite loss nan / grad norm nan at step {fail}" in proc.stderr
    assert f"last good checkpoint (step {fail - 1}) is kept" in proc.stderr
    records = read_metrics(tmp_path / "run", "train")
    assert [r["step"] for r in records] == list(range(1, fail))
    assert all(np.isfinite(r["loss"]) for r in records)
    saved = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) == fail - 1


def test_base_config_exposes_every_model_field():
    """Every ``ModelConfig`` field can be set from the command line (``--config.model.<f>=...``);
    ``seq_axis`` alone is derived (from ``mesh.sequence``)."""
    import dataclasses

    from hla_jax.nn import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"seq_axis"}
    assert set(base_config().model.keys()) == fields


def test_config_json_records_absolute_data_paths(tmp_path, monkeypatch):
    """A relative ``data.path`` is written absolute, so a run is sampled from any directory."""
    from hla_jax.train.trainer import saved_config

    monkeypatch.chdir(tmp_path)
    c = base_config()
    c.data.path = "corpus,more/texts"
    assert saved_config(c).data.path == f"{tmp_path / 'corpus'},{tmp_path / 'more' / 'texts'}"
    assert c.data.path == "corpus,more/texts"  # the run's own config is left as given
    c.data.path = ""
    assert saved_config(c).data.path == ""
