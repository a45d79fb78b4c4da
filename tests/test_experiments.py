"""Smoke runs of the experiment scripts at tiny settings: results JSON, PNG and Markdown table
(MQAR: tests/test_mqar_experiment.py)."""

import json
import pathlib
import statistics
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from experiments import bench_ops, long_context, niah, position_loss  # noqa: E402
from hla_jax.data import ByteTokenizer, corpus  # noqa: E402


def _outputs(out, stem):
    res = json.loads((out / f"{stem}.json").read_text())
    png = (out / f"{stem}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / f"{stem}.md").read_text()
    assert md.count("|---|") >= 1
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


def test_bench_kernels_interleaves_rounds(tmp_path):
    """``--rounds 3``: each method of an input set keeps three rounds of medians, forward and
    forward+backward, and its time is their median."""
    from experiments import bench_kernels

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
    from experiments import bench_kernels

    monkeypatch.setitem(sys.modules, "jla", None)  # as if the wheel were not installed
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


def test_bench_gdn_inverse_swaps_the_solve_for_the_doubling_inverse(tmp_path):
    """The UT-inverse benchmark on a tiny shape (the times mean nothing on a CPU): both inverses
    timed for chunk_terms and the two operators, and the outputs agree between them (so the
    patched solve was the one used, and it computes the same function)."""
    from experiments import bench_gdn_inverse

    res = bench_gdn_inverse.main(["--T", "64", "--tokens", "128", "--shape", "2,16,32", "--chunk",
                                  "16", "--repeats", "1", "--out", str(tmp_path), "--name", "tiny"])
    assert json.loads((tmp_path / "tiny.json").read_text())["rel_diff"] == res["rel_diff"]
    names = ("chunk_terms",) + bench_gdn_inverse.OPERATORS
    assert set(res["rows"]) == {f"{n}/{k}" for n in names for k in ("solve", "doubling")}
    assert all(r["fwd_bwd_ms"] > 0 and "error" not in r for r in res["rows"].values())
    assert all(0 < d < 1e-5 for d in res["rel_diff"].values()), res["rel_diff"]


def test_bench_gdn_blocks_parts_times_each_part(tmp_path):
    """The block form's parts benchmark on a tiny shape (the times mean nothing on a CPU): both
    chunk terms, every part timed forward and forward+backward (the kernel row's output, XLA's
    window and levels), and the record written."""
    from experiments import bench_gdn_blocks_parts

    res = bench_gdn_blocks_parts.main(["--T", "128", "--tokens", "128", "--shape", "1,16,64",
                                       "--repeats", "1", "--out", str(tmp_path), "--name", "tiny"])
    assert json.loads((tmp_path / "tiny.json").read_text()) == json.loads(json.dumps(res))
    assert [r["terms"] for r in res["rows"]] == ["kernel", "xla"]
    kernel, xla = res["rows"]
    assert all(t > 0 for part in ("chunk_parts", "output", "whole") for t in kernel[part])
    assert all(t > 0 for part in ("chunk_parts", "window", "levels", "whole") for t in xla[part])
    assert "output" not in xla and "window" not in kernel


def test_bench_gdn_parts_times_each_step_in_the_interpreters(tmp_path):
    """The Gated DeltaNet parts benchmark on a tiny shape in Pallas' interpreters (the times mean
    nothing on a CPU): the five steps, the core forward and backward, the record; with each
    sequence in two pieces, the maps walk and the reverse walk without residuals too."""
    from experiments import bench_gdn_parts

    timed = ("ut_fwd", "walk_out", "walk_rev", "grads", "ut_bwd", "fwd", "bwd", "gates")
    for pieces in (1, 2):
        row = bench_gdn_parts.main(["--T", "128", "--tokens", "128", "--shape", "1,64,64",
                                    "--repeats", "1", "--interpret", "--pieces", str(pieces),
                                    "--out", str(tmp_path), "--name", f"tiny{pieces}"])
        assert json.loads((tmp_path / f"tiny{pieces}.json").read_text()) == json.loads(json.dumps(row))
        more = ("walk_maps", "walk_rev_own") if pieces > 1 else ()
        assert all(row[name] > 0 for name in timed + more) and row["pieces"] == pieces, row
        assert pieces > 1 or "walk_maps" not in row
    with pytest.raises(SystemExit):
        bench_gdn_parts.main(["--T", "128", "--tokens", "128", "--pieces", "3", "--interpret"])


def test_gdn_gate_error_records_each_length(tmp_path):
    """The error-by-length run on one short T in the interpreters: every output and gradient's
    relative error recorded, all of them small, and the table written."""
    from experiments import gdn_gate_error

    res = gdn_gate_error.main(["--T", "100", "--gate", "reset", "--out", str(tmp_path),
                               "--name", "tiny"])
    assert json.loads((tmp_path / "tiny.json").read_text()) == json.loads(json.dumps(res))
    (row,) = res["rows"]
    assert set(row["rel"]) == {"out", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert all(0 < e < 3e-2 for e in row["rel"].values()), row
    assert (tmp_path / "tiny.md").read_text().splitlines()[-1].startswith("| 100 | ")


def test_profile_gdn_summary_reads_ncu_csv(tmp_path):
    """The ncu summary: the five steps in launch order, XLA's fusions left out, counters read
    with their thousands separators; a profile missing a step is refused, naming what it found."""
    from experiments import profile_gdn

    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    kernels = ["kernel", "loop_broadcast_fusion", "gdn_walk_out_mosaic_gpu_kernel",
               "gdn_walk_rev_mosaic_gpu_kernel", "kernel", "kernel"]
    lines = ["==PROF== Connected", header]
    for i, name in enumerate(kernels):
        lines += [f'"{i}","{name}","Duration","ns","{1000 * (i + 1):,}"',
                  f'"{i}","{name}","Local Memory Spilling Requests","","{i * 1_000_000:,}"']
    (tmp_path / "ncu.csv").write_text("\n".join(lines) + "\n")
    table = profile_gdn.summary(str(tmp_path / "ncu.csv")).splitlines()
    assert [r.split(" | ")[0].lstrip("| ") for r in table[2:]] == list(profile_gdn.STEPS)
    assert table[-1].startswith("| ut_bwd | kernel | 6 | – | 5,000,000 |")
    (tmp_path / "short.csv").write_text("\n".join(lines[:-2]) + "\n")
    with pytest.raises(ValueError, match="expected 5 kernels of ours"):
        profile_gdn.summary(str(tmp_path / "short.csv"))


def test_trace_gdn_blocks_reads_kernels_from_a_perfetto_trace():
    """The trace table: the GPU's kernel events only (not the host's), averaged over the calls by
    launch position, each fusion named from the optimized HLO; a trace that does not split into
    the calls is refused."""
    from experiments import trace_gdn_blocks

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 7, "ts": 0, "dur": 99, "name": "host_op"}]
    for call in range(2):
        for i, (name, dur) in enumerate((("loop_add_fusion_1", 10 + call), ("kernel__3", 30))):
            events.append({"ph": "X", "pid": 1, "ts": 100 * call + i, "dur": dur, "name": name,
                           "args": {"kernel_details": "regs:24 grid:8,16,2 block:128,1,1"}})
    hlo = ('  %loop_add_fusion.1 = f32[8,16]{1,0} fusion(%a, %b), kind=kLoop, '
           'metadata={op_name="jit(f)/transpose(jvp())/add_any"}\n')
    rows = trace_gdn_blocks.kernels(events, hlo, calls=2)
    assert [(r["name"], r["us"], r["grid"]) for r in rows] == [("loop_add_fusion_1", 10.5, "8,16,2"),
                                                              ("kernel__3", 30.0, "8,16,2")]
    assert rows[0]["shape"] == "f32[8,16]{1,0}" and rows[0]["op"].endswith("add_any")
    assert trace_gdn_blocks.table(rows).splitlines()[-1] == "2 kernels, 0.04 ms a call"
    with pytest.raises(ValueError, match="do not split into 3"):
        trace_gdn_blocks.kernels(events, hlo, calls=3)


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
