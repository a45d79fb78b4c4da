"""The stacked MQAR sweep: on-device MQAR batches (invariants, the distribution of
``MQAR.example``), stacked training equal to single runs, and the CLI (outputs, resume, shards)."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from scipy.stats import chi2_contingency

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from helpers import assert_close  # noqa: E402

from experiments import mqar  # noqa: E402
from hla_jax import data  # noqa: E402
from hla_jax.train import sharding, stacked  # noqa: E402
from hla_jax.train.config import check_config  # noqa: E402
from hla_jax.train.optim import make_optimizer  # noqa: E402
from hla_jax.train.steps import make_eval_step, make_train_step  # noqa: E402
from hla_jax.train.trainer import init_state  # noqa: E402


def _queries(inputs, n):
    """``[N, n]``: the query offset (after the kv block, in tokens) of each example's key j."""
    keys = inputs[:, 0:2 * n:2]
    hits = inputs[:, 2 * n:, None] == keys[:, None, :]
    assert np.all(hits.sum(1) == 1), "each key must reappear exactly once after the kv block"
    return hits.argmax(1)


@pytest.mark.parametrize("n", [8, 16])  # 16: every query slot of T=64 is used
def test_mqar_batch_invariants(rng, n):
    T, V, size = 64, 64, 256
    b = jax.device_get(data.MQAR(T, V, n).batch(jax.random.key(int(rng.integers(2**31))), size))
    inputs, targets, mask = b["inputs"], b["targets"], b["mask"]
    assert inputs.shape == targets.shape == mask.shape == (size, T)
    keys, values = inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2]
    assert keys.min() >= 1 and keys.max() < V // 2 and values.min() >= V // 2 and values.max() < V
    assert all(len(set(k)) == n and len(set(v)) == n for k, v in zip(keys, values))
    offsets = _queries(inputs, n)
    assert np.all(offsets % 2 == 0)
    pos = 2 * n + offsets
    rows = np.arange(size)[:, None]
    np.testing.assert_array_equal(targets[rows, pos], values)  # the answer is the key's value
    expect = np.zeros((size, T), bool)
    expect[rows, pos] = True
    np.testing.assert_array_equal(mask, expect.astype(np.float32))  # exactly the answers count
    assert np.all(targets[~expect] == 0) and np.all(inputs[:, 2 * n:][~expect[:, 2 * n:]] == 0)


def test_mqar_batch_matches_example_distribution(rng):
    """Chi-square two-sample tests, jax batch vs numpy ``example``: the ordered key triple and the
    query offsets of the first two keys (order matters: Plackett–Luce, small gaps drawn first).
    Sorting the offsets (same set, wrong order) must fail the same test."""
    n, N, src = 3, 6000, data.MQAR(20, 12, 3)  # 5 keys, 6 values, 7 query slots
    ref = np.stack([src.example(rng)[0] for _ in range(N)])
    got = jax.device_get(src.batch(jax.random.key(int(rng.integers(2**31))), N)["inputs"])

    def p_value(a, b):
        cats = {c: i for i, c in enumerate(sorted(set(map(tuple, a)) | set(map(tuple, b))))}
        table = np.zeros((2, len(cats)))
        for r, x in enumerate((a, b)):
            np.add.at(table[r], [cats[tuple(row)] for row in x], 1)
        return chi2_contingency(table).pvalue

    gaps_ref, gaps_got = _queries(ref, n), _queries(got, n)
    assert p_value(ref[:, 0:2 * n:2], got[:, 0:2 * n:2]) > 1e-3
    assert p_value(gaps_ref[:, :2], gaps_got[:, :2]) > 1e-3
    assert p_value(gaps_ref[:, :2], np.sort(gaps_got, 1)[:, :2]) < 1e-6


@pytest.mark.parametrize("mixer,tol", [("softmax", 1e-5), ("hla2", 1e-4)])
def test_stacked_training_equals_single_runs(mixer, tol):
    """Three models in one program (two pair counts, two lrs, and an infinite lr that diverges)
    against ``train_and_evaluate``'s pieces run one model at a time: same init, same batches.
    The first step agrees to the bit; then vmap's different float rounding (HLA's chunked sums)
    grows through Adam (updates ≈ m/√v of tiny gradients), hence hla2's looser tolerance."""
    args = mqar.parse_args(["--seq_len", "32", "--vocab", "64", "--batch", "4", "--steps", "4",
                            "--warmup", "2"])
    todo = [(4, 3e-3), (2, 2e-2), (4, np.inf)]
    configs = [mqar.make_config(args, mixer, 16, p, lr) for p, lr in todo]
    rows = data.rows_for_process(4)
    batches = [[data.make_batch(data.make_sources(c.data, 64)[0], 0, data.TRAIN, s, rows)
                for c in configs] for s in range(4)]
    stack = lambda bs: jax.tree.map(lambda *xs: np.stack(xs), *bs)

    graphdef, params, rest, opt_state, tx = stacked.init(configs[0], len(todo))
    step = jax.jit(stacked.make_train_step(graphdef, tx))
    lrs = np.asarray([lr for _, lr in todo], np.float32)
    losses = []
    for bs in batches:
        params, opt_state, m = step(params, opt_state, rest, lrs, stack(bs))
        losses.append(m["loss"])
    losses = np.asarray(losses)
    assert np.isfinite(losses[:, :2]).all() and not np.isfinite(losses[1:, 2]).any()
    evals = jax.jit(stacked.make_eval_step(graphdef))(params, rest, stack(batches[0]))

    for j, c in enumerate(configs[:2]):
        tx1 = make_optimizer(c.optim, c.train.num_steps)
        mesh = sharding.make_mesh(c.mesh, jax.local_devices()[:1])
        g1, p1, r1, o1, _ = init_state(check_config(c), c.seed, mesh, c.mesh.rules, tx1)
        step1 = jax.jit(make_train_step(g1, tx1))
        for s, bs in enumerate(batches):
            p1, o1, m1 = step1(p1, o1, r1, bs[j])
            assert_close(losses[s, j], m1["loss"], 0.0 if s == 0 else tol, f"model {j} loss, step {s}")
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1),
                                jax.tree.leaves(jax.tree.map(lambda x, j=j: x[j], params))):
            assert_close(b, a, tol, f"model {j} {jax.tree_util.keystr(path)}")
        e1 = jax.jit(make_eval_step(g1))(p1, r1, batches[0][j])
        for k in e1:
            assert_close(evals[k][j], e1[k], tol, f"model {j} eval {k}")


def _outputs(out, stem):
    res = json.loads((out / f"{stem}.json").read_text())
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / f"{stem}.md").read_text()
    assert md.count("|---|") >= 1
    return res, md


def test_mqar_sweep_resumes_and_shards(tmp_path, monkeypatch):
    argv = ["--mixers", "linear,softmax", "--dims", "16", "--pairs", "4,8", "--lrs", "3e-3,1e-2",
            "--steps", "20", "--seq_len", "64", "--vocab", "64", "--batch", "8",
            "--eval_steps", "1", "--eval_every", "10", "--out", str(tmp_path),
            "--jit_cache", str(tmp_path / "jit")]
    mqar.main(argv + ["--tag", "t"])
    res, md = _outputs(tmp_path, "mqar_t")
    assert len(res["runs"]) == 8 and set(res["cells"]) == {"linear/d16", "softmax/d16"}
    run = res["runs"]["softmax/d16/kv8/lr0.01"]
    assert run["steps"] == 20 and 0.0 <= run["accuracy"] <= 1.0 and not run["diverged"]
    assert run["curve"]["step"] == [10, 20] and run["curve"]["accuracy"][-1] == run["accuracy"]
    assert np.isfinite(run["train_loss"]) and res["cells"]["linear/d16"]["models"] == 4
    assert res["best"]["linear"]["16"]["4"]["lr"] in (3e-3, 1e-2)
    assert res["settings"]["seq_len"] == 64 and res["paper"]["accuracy"]["mamba2"]["16"] == 46.9
    assert "| linear | 16 |" in md and "d=16 paper" in md

    before = (tmp_path / "mqar_t.json").read_text()
    with monkeypatch.context() as m:  # resume: nothing left to train, results unchanged
        m.setattr(mqar, "train_cell", lambda *a, **k: pytest.fail("trained a finished cell"))
        mqar.main(argv + ["--tag", "t"])
    assert json.loads((tmp_path / "mqar_t.json").read_text())["runs"] == json.loads(before)["runs"]

    for i in range(2):  # shards split cells; their merge is the unsharded sweep
        mqar.main(argv + ["--tag", "s", "--shard", f"{i}/2"])
        part = json.loads((tmp_path / f"mqar_s.shard{i}of2.json").read_text())
        assert {r["mixer"] for r in part["runs"].values()} == {("linear", "softmax")[i]}
    merged = mqar.main(argv + ["--tag", "s", "--merge"])
    fields = ("accuracy", "row_accuracy", "loss", "train_loss", "curve")
    assert {k: [r[f] for f in fields] for k, r in merged["runs"].items()} == {
        k: [r[f] for f in fields] for k, r in res["runs"].items()}

    small = mqar.main(argv[:-2] + ["--jit_cache", "", "--mixers", "linear", "--lrs", "3e-3",
                                   "--group", "1", "--tag", "g"])  # one model per program
    assert set(small["cells"]) == {"linear/d16/1of2", "linear/d16/2of2"}
    for k, r in small["runs"].items():
        np.testing.assert_allclose(r["train_loss"], res["runs"][k]["train_loss"], rtol=1e-4)


def test_mqar_merge_of_shard_files(tmp_path):
    shard = json.dumps({"runs": {"hla2/d16/kv4/lr0.01": {
        "mixer": "hla2", "dim": 16, "pairs": 4, "lr": 0.01, "accuracy": 0.5, "row_accuracy": 0.1}}})
    (tmp_path / "mqar_m.shard0of2.json").write_text(shard)
    (tmp_path / "mqar_m.shard1of2.json").write_text(shard.replace("0.01", "0.001").replace("0.5", "0.25"))
    mqar.main(["--merge", "--mixers", "hla2", "--dims", "16", "--pairs", "4", "--lrs", "1e-3,1e-2",
               "--tag", "m", "--out", str(tmp_path), "--jit_cache", ""])
    res, md = _outputs(tmp_path, "mqar_m")
    assert len(res["runs"]) == 2 and res["best"]["hla2"]["16"]["4"] == {
        "accuracy": 0.5, "row_accuracy": 0.1, "lr": 0.01}
    assert "| hla2 | 50.0 | – |" in md


def test_loss_read_at_answer_positions_equals_the_full_loss(rng):
    """``positions`` (MQAR's answers, padded) give the same loss and eval sums as scoring every
    position under the mask, from logits at those positions only."""
    from flax import nnx

    from hla_jax.nn import LM, ModelConfig
    from hla_jax.train import steps

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer_pattern=("hla2",))
    model = LM(cfg, rngs=nnx.Rngs(0))
    src = data.MQAR(64, 64, 4)
    batch = src.batch(jax.random.key(int(rng.integers(1 << 30))), 3, positions=9)
    full = {k: v for k, v in batch.items() if k != "positions"}
    logits = model(batch["inputs"])
    picked = np.take_along_axis(np.asarray(logits), np.asarray(batch["positions"])[..., None], axis=1)
    assert_close(model(batch["inputs"], batch["positions"]), picked, 1e-6)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert_close(steps.loss_fn(params, graphdef, rest, batch), steps.loss_fn(params, graphdef, rest, full),
                 1e-6)
    ev = steps.make_eval_step(graphdef)
    add_accum = lambda b: jax.tree.map(lambda x: x[None], b)
    for k, v in ev(params, rest, add_accum(full)).items():
        assert_close(ev(params, rest, add_accum(batch))[k], v, 1e-6, k)
    with pytest.raises(ValueError, match="positions"):
        src.batch(jax.random.key(0), 2, positions=3)
