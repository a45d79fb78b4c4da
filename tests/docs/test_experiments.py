"""Smoke runs of the experiment scripts at tiny settings: results JSON (with its provenance), PNG
and Markdown table (MQAR: tests/docs/test_mqar_experiment.py); the kernel tools on a CPU."""

import json
import pathlib
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import bench_decode, bench_ops, long_context, niah, position_loss  # noqa: E402
from hla_jax.data import ByteTokenizer, corpus  # noqa: E402


def _outputs(out, stem):
    res = json.loads((out / f"{stem}.json").read_text())
    assert set(res["provenance"]) >= {"commit", "date", "command", "jax", "device", "platform",
                                      "device_count"}
    png = (out / f"{stem}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / f"{stem}.md").read_text()
    assert md.startswith("Commit `") and md.count("|---|") >= 1
    return res, md


def test_position_loss_trains_and_reads_checkpoints(tmp_path):
    position_loss.main(["--train", "--mixers", "linear", "--steps", "4", "--d_model", "16",
                        "--n_layers", "1", "--train_seq_len", "32", "--train_batch", "4",
                        "--batch", "2", "--batches", "2", "--workroot", str(tmp_path / "runs"),
                        "--tag", "t", "--out", str(tmp_path)])
    res, md = _outputs(tmp_path, "position_loss_t")
    run = res["runs"]["linear"]
    assert run["step"] == 4 and run["seq_len"] == 32 and len(run["per_position"]) == 32
    edges = [(b["lo"], b["hi"]) for b in run["buckets"]]
    assert edges == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 33)]
    assert all(np.isfinite(b["loss"]) for b in run["buckets"])
    # a uniform model would have log(256) = 5.5 nats: 4 steps cannot be far from it
    assert 3.0 < run["mean_loss"] < 7.0 and "| linear (decay, conv) | 4 |" in md  # the defaults
    assert run["train"]["steps"] == 4 and run["train"]["train_loss"] > 0  # the trainer's log


def test_niah_trains_and_evaluates_lengths(tmp_path):
    niah.main(["--train", "--mixers", "linear", "--train_seq_len", "128", "--steps", "3",
               "--d_model", "16", "--train_batch", "4", "--lengths", "128,256", "--needles", "2",
               "--examples", "4", "--batch", "4", "--workroot", str(tmp_path / "runs"), "--tag", "t",
               "--out", str(tmp_path)])
    res, md = _outputs(tmp_path, "niah_t")
    run = res["runs"]["linear"]
    assert run["train_seq_len"] == 128 and run["step"] == 3
    for kind in ("single", "multi"):
        assert set(run[kind]) == {"128", "256"}
        for v in run[kind].values():
            assert 0.0 <= v["accuracy"] <= 1.0 and 0.0 <= v["row_accuracy"] <= 1.0
    assert "multi (2 needles)" in md


def test_multi_niah_hides_the_needle_among_distractors(rng):
    source = niah.MultiNIAH(300, n_digits=5, n_needles=4)
    inputs, targets, mask = source.example(rng)
    assert inputs.shape == targets.shape == mask.shape == (300,) and mask.sum() == 5
    text = ByteTokenizer().decode(np.append(inputs, targets[-1]))
    answer = ByteTokenizer().decode(targets[mask])
    assert text.count(" number is ") == 4 + 1  # 4 needles + the question's answer
    assert f"The magic number is {answer}. " in text and text.endswith(f"The magic number is {answer}")


def test_code_niah_plants_the_needle_in_source_and_the_decoy_pairs_it(rng):
    haystack = corpus.stdlib_tokens()[-100_000:]
    seed = int(rng.integers(1 << 30))
    inputs, targets, mask = niah.CodeNIAH(400, haystack, n_digits=5, n_needles=3).example(
        np.random.default_rng(seed))
    assert inputs.shape == targets.shape == mask.shape == (400,) and mask.sum() == 5
    tok = ByteTokenizer()
    text, answer = tok.decode(np.append(inputs, targets[-1])), tok.decode(targets[mask])
    assert answer.isdigit() and text.endswith(f"\nassert MAGIC_NUMBER == {answer}")
    assert f"\nMAGIC_NUMBER = {answer}\n" in text and text.count("_NUMBER = ") == 3
    decoy = niah.CodeNIAH(400, haystack, n_digits=5, n_needles=1, decoy=True)
    single = niah.CodeNIAH(400, haystack, n_digits=5, n_needles=1)
    (di, dt, dm), (si, st, sm) = (s.example(np.random.default_rng(seed)) for s in (decoy, single))
    shifted = "".join(str((int(c) + 5) % 10) for c in tok.decode(st[sm]))
    assert np.array_equal(dt[dm], st[sm]) and (di != si).sum() == 5  # only the needle's digits
    assert f"\nMAGIC_NUMBER = {shifted}\n" in tok.decode(di)
    with pytest.raises(ValueError, match="haystack of 100 bytes is too short"):
        niah.CodeNIAH(400, haystack[:100])


def test_long_context_trains_evaluates_and_resumes(tmp_path, capsys, monkeypatch):
    args = ["--size", "tiny", "--steps", "3", "--mixers", "linear,mamba2", "--eval_batch", "2",
            "--eval_batches", "1", "--examples", "2", "--needles", "2", "--tag", "t",
            "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "data.batch_size=2",
            "--set", "data.seq_len=128", "--workroot", str(tmp_path / "runs"), "--out", str(tmp_path)]
    long_context.main(args[:5] + ["linear"] + args[6:])
    train = long_context.common.train_workdirs

    def diverges(configs, root):
        if "mamba2" in configs:
            raise FloatingPointError("non-finite loss nan / grad norm nan at step 2")
        return train(configs, root)

    monkeypatch.setattr(long_context.common, "train_workdirs", diverges)
    long_context.main(args)  # mamba2 stops on a non-finite loss: recorded, the call ends normally
    res, md = _outputs(tmp_path, "long_context_t")
    assert list(res["runs"]) == ["linear"] and "non-finite" in res["failed"]["mamba2"]["error"]
    assert "Failed (retried by the next call): mamba2: non-finite" in md
    monkeypatch.setattr(long_context.common, "train_workdirs", train)
    long_context.main(args)  # resumes: linear is kept, mamba2 is tried again and trains
    res, md = _outputs(tmp_path, "long_context_t")
    assert not res["failed"] and "Failed" not in md
    assert list(res["runs"]) == ["linear", "mamba2"] and res["settings"]["eval_seq_len"] == 256
    for run in res["runs"].values():
        assert run["step"] == 3 and len(run["per_position"]) == 256 and run["params"] > 0
        assert [s for s, _ in run["curve"]] == [s for s, _ in run["eval_curve"]] == [3]
        assert set(run["niah"]) == {"single", "multi", "decoy"}
        assert set(run["niah"]["decoy"]) == {"128", "256"} and np.isfinite(long_context.gain(run, 128))
    assert "| linear (decay, conv) |" in md and "gain T=128" in md
    with pytest.raises(SystemExit, match="other settings"):
        long_context.main(args[:3] + ["4"] + args[4:])
    res = long_context.main(args[:3] + ["4", "--mixers", "linear", "--eval_every", "2"] + args[6:-4]
                            + ["--workroot", str(tmp_path / "e"), "--tag", "e", "--out", str(tmp_path)])
    assert res["settings"]["eval_every"] == 2
    assert [s for s, _ in res["runs"]["linear"]["eval_curve"]] == [2, 4]

    def cut(c, workdir):  # a call cut off (killed) after the step-2 checkpoint of 4 steps
        c = c.copy_and_resolve_references()
        c.train.num_steps = 2
        trained(c, workdir)
        raise KeyboardInterrupt

    trained = long_context.common.train_and_evaluate
    resumable = args[:3] + ["4", "--mixers", "linear", "--checkpoint_every", "2"] + args[6:-4] + [
        "--set", "train.log_every=1", "--set", "train.eval_every=1", "--workroot",
        str(tmp_path / "r"), "--tag", "r", "--out", str(tmp_path)]
    monkeypatch.setattr(long_context.common, "train_and_evaluate", cut)
    with pytest.raises(KeyboardInterrupt):
        long_context.main(resumable)
    monkeypatch.setattr(long_context.common, "train_and_evaluate", trained)
    run = long_context.main(resumable)["runs"]["linear"]
    assert run["resumed_at"] == 2 and run["step"] == 4
    assert [s for s, _ in run["curve"]] == [1, 2, 3, 4]  # the resumed call logs steps 3, 4 once
    assert [s for s, _ in run["eval_curve"]] == [1, 2, 3, 4]  # --set applies after quiet()


def test_bench_ops_times_several_forms_at_one_shape(tmp_path):
    bench_ops.main(["--only", "hla2,loglinear_mamba2,mamba2", "--impls", "chunked,reference",
                    "--shape", "B=1,H=1,T=32,d=8,dv=8", "--repeats", "1", "--tag", "t",
                    "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_ops_cpu_t.json").read_text())["rows"]
    names = ("hla2", "loglinear_mamba2", "mamba2")
    assert [(r["op"], r["impl"], r["T"], r["d"]) for r in rows] == [
        (op, impl, 32, 8) for op in names for impl in ("chunked", "reference")]
    assert all(r["median_s"] > 0 for r in rows)
    assert {r["op"] for r in rows if "time_ratio_to_plain" in r} == {"loglinear_mamba2"}
    with pytest.raises(SystemExit):
        bench_ops.main(["--shape", "B=1,X=3", "--out", str(tmp_path)])


def test_bench_ops_jla_mode_without_jla(tmp_path, monkeypatch):
    """``--jla`` without the peer package installed: our forms only, a note, the files written."""
    for name in [m for m in sys.modules if m == "jla" or m.startswith("jla.")] + ["jla"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import jla...` raises ImportError
    bench_ops.main(["--jla", "--shape", "B=1,H=1,T=40,d=8,dv=4", "--repeats", "2", "--tag", "t",
                    "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_ops_jla_cpu_t.json").read_text())["rows"]
    assert [(r["op"], r["T"]) for r in rows] == [
        ("mamba2", 40), ("gated_deltanet", 40), ("loglinear_mamba2", 40)]
    assert all(r["ours_s"] > 0 and len(r["ours_times_s"]) == 2 and r["jla_s"] is None for r in rows)
    md = (tmp_path / "bench_ops_jla_cpu_t.md").read_text()
    assert md.startswith("Commit `") and md.count("| – | – | – |") == 3


def test_bench_ops_jla_mode_same_operators(tmp_path):
    """jla (the ``bench`` extra, part of ``dev``) computes our operators (scale 1): outputs agree."""
    bench_ops.main(["--jla", "--only", "mamba2,gated_deltanet", "--shape", "B=1,H=1,T=40,d=8,dv=4",
                    "--repeats", "1", "--tag", "t", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_ops_jla_cpu_t.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["mamba2", "gated_deltanet"]
    assert all(r["jla_s"] > 0 and r["ratio"] > 0 and r["output_rel_diff"] < 1e-5 for r in rows)


def test_bench_kernels_interleaves_rounds(tmp_path):
    """``--rounds 3``: each method of an input set keeps three rounds of medians, forward and
    forward+backward, and its time is their median."""
    from experiments.kernels import bench_kernels

    bench_kernels.main(["--shape", "2,16,32", "--T", "64", "--tokens", "128", "--repeats", "1",
                        "--rounds", "3", "--methods", "mamba2_pallas,mamba2_xla_chunked",
                        "--out", str(tmp_path), "--name", "rounds", "--matmul_n", "256"])
    rows = json.loads((tmp_path / "rounds.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["mamba2_pallas", "mamba2_xla_chunked"]
    for r in rows:
        for key in ("fwd_ms", "fwd_bwd_ms"):
            assert len(r[key + "_rounds"]) == 3 and r[key] == statistics.median(r[key + "_rounds"])


def test_bench_kernels_runs_a_tiny_shape(tmp_path, monkeypatch):
    """The kernel benchmark end to end on a tiny shape (interpret mode here: the times mean
    nothing on a CPU): rows, the target ratios, JSON and Markdown under ``--name``; a method
    whose import fails is reported unavailable, not a crash."""
    from experiments.kernels import bench_kernels

    for name in [m for m in sys.modules if m == "jla" or m.startswith("jla.")] + ["jla"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the wheel were not installed
    bench_kernels.main(["--shape", "2,16,32", "--T", "64", "--tokens", "128", "--repeats", "1",
                        "--methods", "mamba2_pallas,hla2_pallas,jla_simple_gla,mamba2_xla_chunked",
                        "--out", str(tmp_path), "--name", "tiny", "--matmul_n", "256"])
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert (res["H"], res["d"], res["dv"]) == (2, 16, 32)
    assert list(res["unavailable"]) == ["jla_simple_gla"]
    assert [r["method"] for r in res["rows"]] == ["mamba2_pallas", "hla2_pallas", "mamba2_xla_chunked"]
    assert all("fwd_bwd_ms" in r for r in res["rows"]), [r.get("error") for r in res["rows"]]
    ms = {r["method"]: r["fwd_bwd_ms"] for r in res["rows"]}
    ratio = {r["ratio"]: r for r in res["ratios"]}
    assert ratio["hla2_pallas / mamba2_pallas"]["fwd_bwd"] == pytest.approx(
        ms["hla2_pallas"] / ms["mamba2_pallas"])
    assert ratio["mamba2_pallas / jla_simple_gla"]["fwd_bwd"] is None
    assert "cudnn_causal / hla2_pallas" not in ratio  # its targets are at T = 8192 and 32768 only
    md = (tmp_path / "tiny.md").read_text()
    assert "| hla2_pallas |" in md and "| hla2_pallas / mamba2_pallas | ≤ 2.1 | 64 |" in md
    assert "Unavailable here: jla_simple_gla" in md
    with pytest.raises(ValueError, match="unknown methods"):
        bench_kernels.main(["--methods", "hla2_kernel", "--out", str(tmp_path)])
    # runs at the same shape merge into one table; another shape is refused
    bench_kernels.main(["--shape", "2,16,32", "--T", "32", "--tokens", "128", "--repeats", "1",
                        "--methods", "hla2_pallas", "--out", str(tmp_path), "--name", "tiny32",
                        "--matmul_n", "256"])
    bench_kernels.main(["--merge", f"{tmp_path / 'tiny.json'},{tmp_path / 'tiny32.json'}",
                        "--out", str(tmp_path), "--name", "both"])
    both = json.loads((tmp_path / "both.json").read_text())
    assert sorted((r["method"], r["T"]) for r in both["rows"]) == [
        ("hla2_pallas", 32), ("hla2_pallas", 64), ("mamba2_pallas", 64), ("mamba2_xla_chunked", 64)]
    assert "| T=32 | T=64 |" in (tmp_path / "both.md").read_text()
    assert {r["T"] for r in both["ratios"] if r["ratio"] == "hla2_pallas / mamba2_pallas"} == {32, 64}
    other = dict(res, H=3)
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="not at the shape"):
        bench_kernels.main(["--merge", f"{tmp_path / 'tiny.json'},{tmp_path / 'other.json'}",
                            "--out", str(tmp_path)])


def test_set_overrides_the_trained_config_and_names_it():
    """``--set KEY=VALUE`` (mqar.py, and the ``--train`` of position_loss.py / niah.py): typed
    values on dotted keys; the run's label names the HLA options it turned on."""
    from experiments import common

    c = common.get_config("lm", "mixer=hla2,size=tiny")
    common.apply_set(c, ["model.hla_decay=true", "model.hla_conv=True", "optim.learning_rate=2e-3",
                         "train.num_steps=7"])
    assert (c.model.hla_decay, c.model.hla_conv, c.optim.learning_rate, c.train.num_steps) == (
        True, True, 2e-3, 7)
    assert common.label(c) == "hla2 (decay, conv)"


def test_results_record_their_provenance(tmp_path, monkeypatch):
    """``common.provenance``: the commit (``-dirty`` for changes outside experiments/results,
    ``unknown`` outside git), the command, JAX and the device; ``write_json`` stamps it into
    every results dict and ``write_markdown`` puts its line above a table."""
    import jax

    from experiments import common

    p = common.provenance()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", p["commit"])
    assert (p["jax"], p["device"], p["platform"], p["device_count"]) == (
        jax.__version__, jax.devices()[0].device_kind, jax.devices()[0].platform, jax.device_count())
    assert p["command"].startswith("python ") and "device" not in common.provenance(device=False)
    common.write_json(tmp_path / "r.json", {"rows": [1]})
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["rows"] == [1] and res["provenance"]["commit"] == p["commit"]
    md = common.write_markdown(tmp_path / "r.md", "| a |\n|---|\n| 1 |", res["provenance"])
    assert md == (tmp_path / "r.md").read_text() == (
        f"Commit `{p['commit']}`, jax {p['jax']}, {p['device']} ({p['platform']}) "
        f"x{p['device_count']}, {res['provenance']['date']}: `{p['command']}`\n\n| a |\n|---|\n| 1 |\n")

    def commit_of(root):
        monkeypatch.setattr(common, "ROOT", root)
        common.git_commit.cache_clear()
        return common.git_commit()

    repo = tmp_path / "repo"
    (repo / "experiments" / "results").mkdir(parents=True)
    assert commit_of(repo) == "unknown"
    git = lambda *a: subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",  # noqa: E731
                                     "user.email=t@t", *a], check=True, capture_output=True)
    for f in ("code.py", "experiments/results/r.json"):
        (repo / f).write_text("1")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    head = git("rev-parse", "HEAD").stdout.decode().strip()
    (repo / "experiments" / "results" / "r.json").write_text("2")  # a result rewritten: clean
    assert commit_of(repo) == head
    (repo / "code.py").write_text("2")
    assert commit_of(repo) == head + "-dirty"
    common.git_commit.cache_clear()


def test_profile_kernels_tables_a_method_on_cpu(tmp_path):
    """``python -m experiments.kernels.profile_kernels`` on a CPU at a tiny shape: a trace of
    an XLA method, one row per kernel (thunk) of one call, named after the HLO instruction, and
    the table written with its provenance."""
    cmd = [sys.executable, "-m", "experiments.kernels.profile_kernels", "--method",
           "mamba2_xla_chunked", "--T", "32", "--tokens", "64", "--shape", "1,8,8", "--calls", "2",
           "--out", str(tmp_path), "--name", "tiny"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert res["provenance"]["command"] == "python -m " + " ".join(cmd[2:])
    assert (res["B"], res["T"], res["pass"]) == (2, 32, "fwd_bwd") and len(res["kernels"]) > 3
    assert all(k["us"] > 0 and k["shape"] for k in res["kernels"])
    md = (tmp_path / "tiny.md").read_text()
    assert md.startswith("Commit `") and md.rstrip().endswith("ms a call")


def test_profile_kernels_reads_gpu_kernels_from_a_perfetto_trace():
    """On a GPU trace: the GPU's kernel events only (not the host's), averaged over the calls by
    launch position, each fusion named from the optimized HLO; a trace that does not split into
    the calls is refused."""
    from experiments.kernels import profile_kernels

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 7, "ts": 0, "dur": 99, "name": "host_op"}]
    for call in range(2):
        for i, (name, dur) in enumerate((("loop_add_fusion_1", 10 + call), ("kernel__3", 30))):
            events.append({"ph": "X", "pid": 1, "ts": 100 * call + i, "dur": dur, "name": name,
                           "args": {"kernel_details": "regs:24 grid:8,16,2 block:128,1,1"}})
    hlo = ('  %loop_add_fusion.1 = f32[8,16]{1,0} fusion(%a, %b), kind=kLoop, '
           'metadata={op_name="jit(f)/transpose(jvp())/add_any"}\n')
    rows = profile_kernels.kernels(events, hlo, calls=2)
    assert [(r["name"], r["us"], r["grid"]) for r in rows] == [("loop_add_fusion_1", 10.5, "8,16,2"),
                                                              ("kernel__3", 30.0, "8,16,2")]
    assert rows[0]["shape"] == "f32[8,16]{1,0}" and rows[0]["op"].endswith("add_any")
    assert profile_kernels.table(rows).splitlines()[-1] == "2 kernels, 0.041 ms a call"
    with pytest.raises(ValueError, match="do not split into 3"):
        profile_kernels.kernels(events, hlo, calls=3)


def test_plot_kernels_draws_the_methods_that_exist(tmp_path):
    """One panel per benchmark file, one line per method ``bench_kernels`` still knows (a row of
    a removed method is left out), written as a PNG."""
    from experiments import plot_kernels

    rows = [{"method": m, "T": T, "B": 1, "fwd_ms": 1.0, "fwd_bwd_ms": T / 1000}
            for m in ("mamba2_pallas", "cudnn_causal", "hla2_fused") for T in (2048, 8192)]
    res = {"device": "cpu", "H": 1, "d": 8, "dv": 8, "tokens": 8192, "rows": rows}
    (tmp_path / "bench.json").write_text(json.dumps(res))
    fig = plot_kernels.plot({"tiny": ("bench.json", res, None)})
    assert [line.get_label() for line in fig.axes[0].lines] == [
        plot_kernels.LABELS[m][0] for m in ("mamba2_pallas", "cudnn_causal")]
    out = plot_kernels.main(["--files", str(tmp_path / "bench.json"), "--out", str(tmp_path / "k.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_resumes_rows_and_reports_crossings(tmp_path):
    """``experiments.bench_decode`` at the tiny size in this process: one row per (mixer, prompt,
    batch), a row already in the JSONL (an out-of-memory softmax) kept, then the json (all rows),
    tables, crossing and plot; a second call runs nothing; other settings are refused."""
    args = ["--size", "tiny", "--mixers", "softmax,linear", "--prompts", "16,32", "--new_tokens",
            "4", "--batch", "1", "--repeats", "1", "--isolate", "0", "--ratio_at", "32", "--tag", "t",
            "--out", str(tmp_path)]
    jsonl = tmp_path / "bench_decode_t.jsonl"
    oom = {"mixer": "softmax", "prompt": 32, "batch": 1, "size": "tiny", "new_tokens": 4,
           "repeats": 1, "impl": "auto", "cast_weights": 1, "device": "cpu", "status": "oom",
           "oom_stage": "decode"}
    jsonl.write_text(json.dumps(oom) + "\n")
    md = bench_decode.main(args)
    res, _ = _outputs(tmp_path, "bench_decode_t")
    assert not jsonl.exists()  # the finished grid's rows moved to the json, in grid order
    rows = res["rows"]
    assert [(r["mixer"], r["prompt"], r["status"]) for r in rows] == [
        ("softmax", 16, "ok"), ("linear", 16, "ok"), ("softmax", 32, "oom"), ("linear", 32, "ok")]
    assert rows[2] == oom
    for r in (rows[0], rows[1], rows[3]):
        assert r["tokens_per_s"] == pytest.approx(4 / r["decode_s"]) and r["prefill_s"] > 0
        assert r["kernels_per_step"] > 10 and r["state_bytes_per_seq"] > 0
        assert r["provenance"]["command"].startswith("python")
    assert rows[1]["state_bytes_per_seq"] == rows[3]["state_bytes_per_seq"]  # O(1) in the prompt
    s = res["summary"]["linear"]["1"]
    assert s["softmax_oom_at"] and s["ratio_at"] is None and s["meets_target"]  # 32: softmax OOM
    assert s["crossing_text"] in ("≤ 16", "16–32") and s["crossing"] is None
    assert "| softmax | " in md and "OOM (decode)" in md and "softmax OOM" in md
    bench_decode.main(args)  # every row exists: nothing runs again, the results are rewritten
    assert json.loads((tmp_path / "bench_decode_t.json").read_text())["rows"] == rows
    with pytest.raises(SystemExit, match="holds rows measured with"):
        bench_decode.main(args[:7] + ["8"] + args[8:])
    with pytest.raises(SystemExit, match="--mixers must start with softmax"):
        bench_decode.main(["--mixers", "hla2,softmax"])


def test_bench_decode_crossing_and_kernel_count():
    """The crossing of a mixer's ratio to softmax (log-log interpolation), and the kernels per
    iteration of an optimised program's loop (fusions and copies count; tuples, parameters and
    constants do not; called computations are entered)."""
    prompts = [8192, 32768, 131072]
    assert bench_decode.crossing(prompts, [0.5, 2.0, 4.0]) == (pytest.approx(16384), "≈ 16.0K")
    assert bench_decode.crossing(prompts, [1.2, 2.0, 4.0]) == (None, "≤ 8K")
    assert bench_decode.crossing(prompts, [0.2, 0.5, None]) == (None, "> 128K")
    assert bench_decode.crossing(prompts, [0.2, 0.5, float("inf")]) == (None, "32K–128K")
    hlo = """HloModule m
%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %t = f32[2]{0} tanh(%p)
}
%cmd (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %f1 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused
  ROOT %f2 = f32[2]{0} fusion(%f1), kind=kLoop, calls=%fused
}
%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %c = f32[2]{0} call(%x), to_apply=%cmd
  %y = f32[2]{0} copy(%c)
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %y)
}
%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], f32[2]{0}) parameter(0)
  %n = s32[] constant(5)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[2]{0}) tuple(%z, %x)
  %w = (s32[], f32[2]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[2]{0} get-tuple-element(%w), index=1
}
"""
    assert bench_decode.kernels_per_step(hlo) == 4  # 2 fusions in the call, the copy, the compare


def test_train_throughput_runs_each_mixer_in_its_own_process(tmp_path):
    """``python -m experiments.train_throughput`` at a tiny size on the CPU: each mixer trains in
    a child ``python -m`` process, and its row carries the child's device and this command."""
    cmd = [sys.executable, "-m", "experiments.train_throughput", "--mixers", "softmax,hla2",
           "--steps", "2", "--d_model", "128", "--layers", "1", "--seq_len", "32", "--batch", "2",
           "--set", "model.hla_conv=false", "--logdir", str(tmp_path / "logs"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "train_throughput_cpu.json").read_text())
    assert [r["mixer"] for r in res["rows"]] == ["softmax", "hla2"]
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["set"] == ["model.hla_conv=false"]
        assert r["provenance"]["device"] == "cpu" and r["provenance"]["command"].startswith(
            "python -m experiments.train_throughput --mixers softmax,hla2 ")
    assert "device" not in res["provenance"]  # the parent leaves the accelerator to its children
    assert "| hla2 model.hla_conv=false |" in proc.stdout


def test_check_kernels_gpu_records_the_cases_it_picks(tmp_path):
    """The GPU check's cases by index (here one small float32 case, the kernels in their
    interpreters on a CPU): the case's index, verdict and errors, written with provenance."""
    from experiments.kernels import check_kernels_gpu

    assert check_kernels_gpu.main(["--cases", "11", "--out", str(tmp_path), "--name", "t"]) == 0
    res = json.loads((tmp_path / "t.json").read_text())
    (case,) = res["cases"]
    assert case["index"] == 11 and case["passed"] and case["case"]["kernel"] == "hla2"
    assert set(case["errors"]) == {"out", "dq", "dk", "dv", "dg"} and "provenance" in res
    txt = (tmp_path / "t.txt").read_text().splitlines()
    assert txt[0].startswith("Commit `") and txt[2].startswith("11: PASS hla2 ")
