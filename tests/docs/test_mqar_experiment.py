"""The stacked MQAR sweep: on-device MQAR batches (invariants, the distribution of
``MQAR.example``, mixtures of pair counts), stacked training equal to single runs, the protocol
(early stop, frozen stopped models, exact resume mid-program, compaction) and the CLI (outputs,
resume, time budget, shards, mixtures)."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from scipy.stats import chi2_contingency

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from helpers import assert_close, compilation_cache_restored  # noqa: E402

from experiments import common, mqar  # noqa: E402
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


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
    """One persistent compilation cache for the file: programs of equal shapes compile once
    (turned off again after the file)."""
    with compilation_cache_restored():
        yield str(tmp_path_factory.mktemp("jit"))


# A task a tiny softmax model learns in tens of steps at lr 3e-2 (not at 1e-4); all protocol tests
# share its shapes (steps included: the schedule is compiled in), hence its compiled programs.
TINY = ["--dims", "16", "--pairs", "1,2", "--lrs", "3e-2,1e-4", "--steps", "80", "--seq_len", "16",
        "--vocab", "16", "--batch", "16", "--eval_steps", "1", "--eval_every", "5"]
TINY_LRS = "lr0.0001+0.03"  # a TINY cell's program, named by its learning rates
FAST = (1, 3e-2)  # pairs, lr
RESULT_FIELDS = ("accuracy", "row_accuracy", "loss", "train_loss", "curve", "steps", "stopped_at")


def _fields(runs):
    return {k: [r[f] for f in RESULT_FIELDS] for k, r in runs.items()}


def test_mqar_sweep_resumes_and_shards(tmp_path, monkeypatch, jit_cache, free):
    """Two shards, one cut by ``--time_budget`` and resumed; their merge is the unsharded sweep
    (``free``: the softmax cell trained in one go); a finished sweep trains nothing again."""
    argv = TINY + ["--mixers", "softmax,linear", "--target", "0", "--out", str(tmp_path),
                   "--jit_cache", jit_cache, "--tag", "s"]
    # a call always takes a step, then checkpoints and stops (exit, no runs yet)
    cut = mqar.main(argv + ["--shard", "0/2", "--time_budget", "1e-3"])
    part = json.loads((tmp_path / "mqar_s.shard0of2.json").read_text())
    assert part["runs"] == {} and cut["runs"] == {}
    assert part["cells"][f"softmax/d16/{TINY_LRS}"]["steps"] == 1
    assert (tmp_path / "mqar_s.ckpt" / f"softmax_d16_{TINY_LRS}.npz").exists()
    for i in range(2):  # the same command goes on; shards take the same cells in every call
        mqar.main(argv + ["--shard", f"{i}/2"])
        part = json.loads((tmp_path / f"mqar_s.shard{i}of2.json").read_text())
        assert {r["mixer"] for r in part["runs"].values()} == {("softmax", "linear")[i]}
    assert part["cells"][f"linear/d16/{TINY_LRS}"]["calls"] == 1 and not (tmp_path / "mqar_s.ckpt").exists()
    res = mqar.main(argv + ["--merge"])
    assert _fields({k: r for k, r in res["runs"].items() if r["mixer"] == "softmax"}) == _fields(
        free.records())  # an exact resume
    res, md = _outputs(tmp_path, "mqar_s")
    assert len(res["runs"]) == 8
    assert set(res["cells"]) == {f"linear/d16/{TINY_LRS}", f"softmax/d16/{TINY_LRS}"}
    run = res["runs"]["softmax/d16/kv2/lr0.03"]
    assert run["steps"] == 80 and 0.0 <= run["accuracy"] <= 1.0 and not run["diverged"]
    assert run["curve"]["step"] == list(range(5, 85, 5)) and run["curve"]["accuracy"][-1] == run["accuracy"]
    assert np.isfinite(run["train_loss"]) and res["cells"][f"linear/d16/{TINY_LRS}"]["models"] == 4
    assert res["cells"][f"linear/d16/{TINY_LRS}"]["step_ms"] > 0 and run["stopped_at"] is None
    assert res["cells"][f"softmax/d16/{TINY_LRS}"]["calls"] == 2
    assert res["best"]["linear"]["16"]["1"]["lr"] in (3e-2, 1e-4)
    assert res["settings"]["seq_len"] == 16 and res["paper"]["accuracy"]["mamba2"]["16"] == 46.9
    assert res["settings"]["protocol"] == "zoology" and res["settings"]["batch"] == 16
    assert "| linear | 16 |" in md and "d=16 paper" in md

    before = (tmp_path / "mqar_s.json").read_text()
    with monkeypatch.context() as m:  # resume: nothing left to train, results unchanged
        m.setattr(mqar, "Program", lambda *a, **k: pytest.fail("trained a finished cell"))
        mqar.main(argv)
    assert json.loads((tmp_path / "mqar_s.json").read_text())["runs"] == json.loads(before)["runs"]


def test_mqar_calls_on_one_shard_file_keep_each_others_results(tmp_path, monkeypatch, jit_cache):
    """Two calls writing one shard file at once (other ``--lrs`` of the shard): each write merges
    into the file as it is then, so a call never drops what the other wrote after it began; a
    finished run leaves ``partial``; the file's settings, and its merge's, sweep both calls' lrs."""
    shard = tmp_path / "mqar_w.shard0of2.json"
    other = {"mixer": "softmax", "dim": 16, "pairs": 1, "lr": 0.5, "accuracy": 0.5, "row_accuracy": 0.1}
    ours = "softmax/d16/kv1/lr0.03"
    shard.write_text(json.dumps({"runs": {}, "partial": {ours: {**other, "lr": 0.03}}}))

    class Concurrent(mqar.Program):
        def run(self, stop=None):  # the other call writes its runs while this one trains
            common.write_json(shard, {**json.loads(shard.read_text()),
                                      "settings": {"mixers": ["softmax"], "dims": [16], "lrs": [0.5]},
                                      "runs": {"softmax/d16/kv1/lr0.5": other},
                                      "partial": {"softmax/d16/kv2/lr0.5": {**other, "pairs": 2,
                                                                            "cut_at": 40}}})
            return super().run(stop)

    monkeypatch.setattr(mqar, "Program", Concurrent)
    mqar.main(TINY + ["--mixers", "softmax", "--target", "0", "--out", str(tmp_path),
                      "--jit_cache", jit_cache, "--tag", "w", "--shard", "0/2"])
    part = json.loads(shard.read_text())
    assert set(part["runs"]) == {"softmax/d16/kv1/lr0.5"} | {
        mqar.run_key("softmax", 16, p, lr) for p in (1, 2) for lr in (0.03, 1e-4)}
    assert set(part["partial"]) == {"softmax/d16/kv2/lr0.5"}
    assert part["cells"][f"softmax/d16/{TINY_LRS}"]["steps"] == 80
    assert part["settings"]["lrs"] == [1e-4, 0.03, 0.5]
    merged = mqar.main(TINY + ["--mixers", "softmax", "--out", str(tmp_path), "--jit_cache", jit_cache,
                               "--tag", "w", "--merge"])
    assert merged["settings"]["lrs"] == [1e-4, 0.03, 0.5] and merged["settings"]["dims"] == [16]


def test_mqar_processes_run_the_shards_and_merge(tmp_path, jit_cache):
    """``--processes 2``: two shard processes of the command, then their merge (all 8 runs)."""
    argv = TINY + ["--mixers", "softmax,linear", "--target", "0", "--out", str(tmp_path),
                   "--jit_cache", jit_cache, "--tag", "p"]
    res = mqar.main(argv + ["--processes", "2"])
    assert len(res["runs"]) == 8 and {r["mixer"] for r in res["runs"].values()} == {"softmax", "linear"}
    assert sorted(p.name for p in tmp_path.glob("mqar_p.shard*")) == [
        "mqar_p.shard0of2.json", "mqar_p.shard1of2.json"]
    for bad in (["--processes", "2", "--shard", "0/2"], ["--processes", "2", "--merge"], ["--mps"]):
        with pytest.raises(SystemExit):
            mqar.parse_args(argv + bad)


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


def test_mqar_merge_pools_the_shards_mixers(tmp_path):
    """Shards run with different ``--mixers`` merge into one table of all of them, in the sweep's
    mixer order; merging again without shard files keeps the JSON's settings."""
    run = lambda m, acc: {"mixer": m, "dim": 16, "pairs": 4, "lr": 0.01, "accuracy": acc,
                          "row_accuracy": 0.1}
    for i, (m, acc) in enumerate((("hla2", 0.5), ("softmax", 0.75))):
        (tmp_path / f"mqar_u.shard{i}of2.json").write_text(json.dumps({
            "settings": {"mixers": [m], "dims": [16],
                         "pairs": [4], "lrs": [0.01], "seq_len": 256, "steps": 10, "batch": 8},
            "runs": {f"{m}/d16/kv4/lr0.01": run(m, acc)}}))
    mqar.main(["--merge", "--tag", "u", "--out", str(tmp_path), "--jit_cache", ""])
    res, md = _outputs(tmp_path, "mqar_u")
    assert res["settings"]["mixers"] == ["softmax", "hla2"] and res["settings"]["dims"] == [16]
    assert "| hla2 | 50.0 | – |" in md and "| softmax | 75.0 | ≥99.0 |" in md
    assert md.index("| softmax |") < md.index("| hla2 |")
    for shard in tmp_path.glob("mqar_u.shard*.json"):
        shard.unlink()
    mqar.main(["--merge", "--tag", "u", "--out", str(tmp_path), "--jit_cache", ""])
    again, _ = _outputs(tmp_path, "mqar_u")
    assert again["settings"] == res["settings"] and again["runs"] == res["runs"]


def test_mqar_merge_adds_a_later_sweep_to_the_tag(tmp_path):
    """A second sweep merged into a tag's JSON (another lr, another mixer) keeps the earlier
    sweep's runs, mixers and lrs: the best lr is taken over both."""
    run = lambda m, lr, acc: {"mixer": m, "dim": 16, "pairs": 4, "lr": lr, "accuracy": acc,
                              "row_accuracy": 0.1}
    settings = lambda m, lr: {"mixers": [m], "dims": [16], "pairs": [4], "lrs": [lr],
                              "seq_len": 256, "steps": 10, "batch": 8}
    for m, lr, acc in (("hla2", 0.01, 0.5), ("softmax", 0.001, 0.75)):
        (tmp_path / "mqar_v.shard0of1.json").write_text(json.dumps({
            "settings": settings(m, lr), "runs": {f"{m}/d16/kv4/lr{lr}": run(m, lr, acc)}}))
        mqar.main(["--merge", "--tag", "v", "--out", str(tmp_path), "--jit_cache", ""])
    (tmp_path / "mqar_v.shard0of1.json").write_text(json.dumps({
        "settings": settings("hla2", 0.001), "runs": {"hla2/d16/kv4/lr0.001": run("hla2", 0.001, 0.25)}}))
    mqar.main(["--merge", "--tag", "v", "--out", str(tmp_path), "--jit_cache", ""])
    res, md = _outputs(tmp_path, "mqar_v")
    assert len(res["runs"]) == 3
    assert res["settings"]["mixers"] == ["softmax", "hla2"] and res["settings"]["lrs"] == [0.001, 0.01]
    assert res["best"]["hla2"]["16"]["4"]["lr"] == 0.01
    assert "| hla2 | 50.0 | – |" in md and "| softmax | 75.0 | ≥99.0 |" in md


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


def test_mqar_mixture_batch_mixes_every_pair_count():
    """Row r of a mixture batch comes from count r mod C (its number of answers), each count's
    rows are that source's own batch, and answer positions are padded to the largest count."""
    counts, size = (1, 4, 2), 8
    sources = [data.MQAR(32, 64, n) for n in counts]
    key = jax.random.key(3)
    b = jax.device_get(data.synthetic.MQARMixture(sources).batch(key, size, positions=4))
    np.testing.assert_array_equal(b["mask"].sum(1), [counts[r % 3] for r in range(size)])
    for c, src in enumerate(sources):
        own = jax.device_get(src.batch(jax.random.fold_in(key, counts[c]), len(range(c, size, 3)), 4))
        for k in own:
            np.testing.assert_array_equal(b[k][c::3], own[k], err_msg=f"count {counts[c]} {k}")
    assert b["positions"].shape == (size, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        data.synthetic.MQARMixture(sources).batch(key, 2)


@pytest.mark.parametrize("mixture,accum", [(True, 1), (True, 2), (False, 2)])
def test_flat_answer_positions_give_the_padded_loss(mixture, accum):
    """``draw(flat=True)``'s flat answer indices per micro-batch (what training reads) cover
    every answer once, padded only to the fullest micro-batch, and give the same loss as the
    per-row positions padded to the largest count (what the eval reads)."""
    from flax import nnx

    from hla_jax.nn import LM, ModelConfig
    from hla_jax.train import steps

    counts, size = (1, 4, 2), 6
    sources = [data.MQAR(32, 64, n) for n in counts]
    sources = [data.synthetic.MQARMixture(sources)] if mixture else sources
    pidx = np.arange(len(sources))
    flat = jax.device_get(mqar.draw(sources, 0, data.TRAIN, 5, pidx, size, accum, flat=True))
    rows = jax.device_get(mqar.draw(sources, 0, data.TRAIN, 5, pidx, size, accum))
    for k in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(flat[k], rows[k], err_msg=k)
    per_micro = rows["mask"].sum((-2, -1))
    assert flat["positions"].shape == (len(sources), accum, per_micro.max())
    picked = np.take_along_axis(flat["mask"].reshape(*per_micro.shape, -1), flat["positions"], -1)
    np.testing.assert_array_equal(picked.sum(-1), per_micro)
    model = LM(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=1,
                           mixer_pattern=("linear",)), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda b, m, a: steps.loss_fn(params, graphdef, rest, {k: v[m, a] for k, v in b.items()})
    for m in range(len(sources)):
        for a in range(accum):
            assert_close(loss(flat, m, a), loss(rows, m, a), 1e-6, f"model {m} micro {a}")


def _program(tmp_path, name, models, target):
    args = mqar.parse_args(TINY + ["--mixers", "softmax", "--target", repr(target),
                                   "--compact_steps", "0"])
    return mqar.Program(args, "softmax", 16, models, name, tmp_path / f"{name}.npz")


def _params(prog):
    return [np.asarray(x) for x in jax.tree.leaves(prog.state["params"])]


def _reach(curve, upto):
    """The best accuracy (the worst pair count's) of a model's curve up to step ``upto``."""
    return max(min(e["accuracy"] for e in ev.values()) for s, ev in curve if s <= upto)


def _first_at(curve, target):
    """The first eval step where every pair count of a curve reaches ``target`` (0: never)."""
    return next((s for s, ev in curve if min(e["accuracy"] for e in ev.values()) >= target), 0)


@pytest.fixture(scope="module")
def free(tmp_path_factory, jit_cache):
    """The TINY softmax cell (4 models) trained without early stopping."""
    common.compilation_cache(jit_cache)
    args = mqar.parse_args(TINY + ["--target", "0"])
    prog = _program(tmp_path_factory.mktemp("free"), "free", mqar.cell_models(args), 0.0)
    assert prog.run() and prog.step == 80 and not prog.stopped_at.any()
    slow = max(_reach(c, 80) for (_, lr), c in zip(prog.models, prog.curve) if lr == 1e-4)
    assert _reach(prog.curve[prog.models.index(FAST)], 40) > slow, "lr 3e-2 must learn, 1e-4 not"
    return prog


def test_mqar_early_stop_freezes_and_resumes_exactly(tmp_path, free):
    """With a target the fast model reaches by step 40 and the lr-1e-4 ones never, each model
    stops at its first eval at the target (its accuracy then is its result, its params never
    change again) while the others train on undisturbed; a run cut mid-way (pending metrics)
    and resumed from its checkpoint equals the uninterrupted one; when all stop, it ends early."""
    target = _reach(free.curve[free.models.index(FAST)], 40)
    expect = [_first_at(c, target) for c in free.curve]
    s0, slow = expect[free.models.index(FAST)], [lr == 1e-4 for _, lr in free.models]
    stop = _program(tmp_path, "stop", free.models, target)
    assert stop.run() and stop.step == 80 and stop.stopped_at.tolist() == expect
    runs = stop.records()
    fast = runs["softmax/d16/kv1/lr0.03"]
    assert fast["stopped_at"] == fast["steps"] == s0 and fast["curve"]["step"][-1] == s0
    assert fast["accuracy"] == dict(free.curve[free.models.index(FAST)])[s0]["1"]["accuracy"]
    assert runs["softmax/d16/kv1/lr0.0001"]["stopped_at"] is None
    for a, b in zip(_params(stop), _params(free)):
        np.testing.assert_array_equal(a[slow], b[slow])  # the others are not disturbed

    cut = _program(tmp_path, "cut", free.models, target)
    assert not cut.run(stop=lambda prog: prog.step >= s0 + 3) and cut.path.exists()
    frozen = _params(cut)
    resumed = _program(tmp_path, "cut", free.models, target)
    assert resumed.step == s0 + 3 and len(resumed.pending) == 3
    assert resumed.run() and resumed.timings()["calls"] == 2
    for a, b, f in zip(_params(resumed), _params(stop), frozen):
        np.testing.assert_array_equal(a, b)
        for j, s in enumerate(expect):
            assert np.array_equal(f[j], b[j]) == bool(s and s <= s0 + 3)  # frozen from its stop on
    drop = lambda rs: {k: {f: v for f, v in r.items() if f not in ("seconds", "provenance")}
                      for k, r in rs.items()}
    assert drop(resumed.records()) == drop(runs)
    with pytest.raises(ValueError, match="other settings"):
        _program(tmp_path, "cut", free.models, target / 2)

    fast2 = [m for m in free.models if m[1] == 3e-2]
    low = min(_reach(free.curve[free.models.index(m)], 40) for m in fast2)
    both = _program(tmp_path, "both", fast2 * 2, low)
    end = max(_first_at(free.curve[free.models.index(m)], low) for m in fast2)
    assert both.run() and both.step == end <= 40 and both.stopped_at.all()


def test_mqar_sweep_compacts(tmp_path, free, jit_cache):
    """Once at most half of a program's models still train, it goes on with only those
    (re-compiled) and they end as they do in the full program; the CLI records the stops."""
    target = min(_reach(c, 40) for (_, lr), c in zip(free.models, free.curve) if lr == 3e-2)
    stops = {m: _first_at(c, target) for m, c in zip(free.models, free.curve)}
    res = mqar.main(TINY + ["--mixers", "softmax", "--target", repr(target), "--compact_steps", "10",
                            "--tag", "c", "--out", str(tmp_path), "--jit_cache", jit_cache])
    assert res["cells"][f"softmax/d16/{TINY_LRS}"]["compactions"] == [
        {"step": max(stops.values()), "models": 2}]
    ref, at = free.records(), max(stops.values())
    upto = lambda curve, last: [a for s, a in zip(curve["step"], curve["accuracy"]) if s <= last]
    for k, r in res["runs"].items():
        assert r["stopped_at"] == (stops[r["pairs"], r["lr"]] or None)
        last = r["stopped_at"] or at  # the same program up to the compaction
        assert upto(r["curve"], last) == upto(ref[k]["curve"], last)
        if not r["stopped_at"]:  # then the live ones alone, up to float rounding
            assert len(r["curve"]["step"]) == 16 and r["steps"] == 80
            assert_close(r["loss"], ref[k]["loss"], 1e-4, f"{k} loss")


def test_mqar_mixture_sweep(tmp_path, monkeypatch, jit_cache):
    """``--mixture``: one model per lr on batches of both pair counts, run keys of their own,
    eval per count (the run's accuracy their mean), a ``(mix)`` table row; ``--group 1``.  The
    first call is cut by its budget after an eval: the model still training is recorded under
    ``partial`` (its last eval and ``cut_at``; the Markdown lists it apart from the tables), so
    a lost checkpoint loses no result, and the call that finishes it replaces that entry."""
    argv = TINY + ["--mixers", "softmax", "--mixture", "--group", "1", "--tag", "mix",
                   "--out", str(tmp_path), "--jit_cache", jit_cache]
    run = mqar.Program.run
    with monkeypatch.context() as m:
        m.setattr(mqar.Program, "run", lambda self, stop=None: run(self, lambda p: p.step >= 12))
        cut = mqar.main(argv)
    assert cut["runs"] == {} and list(cut["partial"]) == ["softmax/d16/mix1-2/lr0.03"]
    part = cut["partial"]["softmax/d16/mix1-2/lr0.03"]
    assert part["cut_at"] == part["steps"] == 12 and part["curve"]["step"] == [5, 10]
    assert set(part["per_pairs"]) == {"1", "2"} and part["stopped_at"] is None
    _, md = _outputs(tmp_path, "mqar_mix")
    assert "Cut by --time_budget" in md and "| softmax (mix) | 16 | 0.03 | 12 |" in md
    res = mqar.main(argv)
    _, md = _outputs(tmp_path, "mqar_mix")
    assert res["partial"] == {} and "Cut by" not in md
    assert set(res["runs"]) == {"softmax/d16/mix1-2/lr0.03", "softmax/d16/mix1-2/lr0.0001"}
    assert set(res["cells"]) == {"softmax/d16/mix/lr0.03/1of2", "softmax/d16/mix/lr0.0001/2of2"}
    for r in res["runs"].values():
        assert r["pairs"] == [1, 2] and set(r["per_pairs"]) == {"1", "2"}
        assert_close(r["accuracy"], np.mean([e["accuracy"] for e in r["per_pairs"].values()]), 1e-12)
        assert set(r["curve"]["per_pairs"]) == {"1", "2"}
    fast = res["runs"]["softmax/d16/mix1-2/lr0.03"]
    assert fast["per_pairs"]["1"]["accuracy"] > 0.5  # it learned from the mixed batches
    assert set(res["best"]) == {"softmax (mix)"} and "| softmax (mix) | 16 |" in md
    assert {e["lr"] for e in res["best"]["softmax (mix)"]["16"].values()} == {3e-2}
