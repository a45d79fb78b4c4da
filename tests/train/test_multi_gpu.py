"""``python -m experiments.multi_gpu`` on 8 emulated CPU devices at tiny shapes: each part writes
its JSON and Markdown table, ``ops`` measures the all-gather bytes of the summaries' formula,
``exact`` passes, ``train`` records tokens/s.

Each part runs in its own process: the 8 devices must be set in XLA_FLAGS before jax starts.
XLA's CPU backend optimisation is switched off there: it compiles the sharded programs about
twice as fast, and nothing here is timed against a number.
"""

import json
import pathlib
import subprocess
import sys

from helpers import devices_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICES = 8
LM = ["--T", "256", "--chunk", "16", "--steps", "3", "--d_model", "32", "--head_dim", "16",
      "--layers", "1"]
TINY = {
    "ops": ["--T", "256", "--chunk", "16", "--H", "2", "--d", "16", "--dtype", "float32",
            "--repeats", "2"],
    "exact": LM,
    "train": LM + ["--dtype", "float32"],
}


def run_part(part: str, out: pathlib.Path) -> dict:
    """``python -m experiments.multi_gpu <part>`` at the ``TINY`` settings; its results JSON (with
    the provenance of that command)."""
    env = devices_env(DEVICES, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "experiments.multi_gpu", part, *TINY[part], "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stem = out / f"multi_gpu_{part}_cpux{DEVICES}"
    assert "|---|" in stem.with_suffix(".md").read_text()
    res = json.loads(stem.with_suffix(".json").read_text())
    assert res["provenance"]["command"].startswith(f"python -m experiments.multi_gpu {part} ")
    assert res["provenance"]["device_count"] == DEVICES
    return res


def test_ops_bytes_equal_the_formula(tmp_path):
    res = run_part("ops", tmp_path)
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"hla2", "loglinear_mamba2"}, res["rows"]
    P, B, H, d, L = DEVICES, 1, 2, 16, 9  # L = ⌈log2 256⌉ + 1
    assert rows["hla2"]["bytes_measured"] == (P - 1) * B * H * (2 + d * d + d * d) * 4
    assert rows["loglinear_mamba2"]["bytes_measured"] == (P - 1) * B * H * (1 + L * d * d) * 4
    for r in rows.values():
        assert r["bytes_ok"] and r["sharded"]["median_ms"] > 0 and r["one"]["median_ms"] > 0


def test_exact_meshes_reproduce_one_device(tmp_path):
    res = run_part("exact", tmp_path)
    assert res["passed"] and res["losses_moved"]
    rows = res["rows"]
    assert [r["name"] for r in rows] == ["one device", "sequence=8", "data=2 sequence=4"]
    assert all(len(r["losses"]) == 3 for r in rows)
    assert all(r["max_rel_diff"] <= 1e-4 for r in rows[1:])


def test_train_records_tokens_per_s(tmp_path):
    res = run_part("train", tmp_path)
    rows = {r["name"]: r for r in res["rows"]}
    assert "upper bound" in res["method"]
    for mixer in ("hla2", "loglinear_mamba2"):
        sharded, data = rows[f"{mixer} sequence=8"], rows[f"{mixer} data=8 at T/8"]
        assert "error" not in rows[f"{mixer} one device"], rows[f"{mixer} one device"]
        assert (data["T"], data["batch"]) == (32, 8)
        assert sharded["tokens_per_s"] > 0 and data["tokens_per_s"] > 0
        assert sharded["tokens_per_s_per_device"] * DEVICES == sharded["tokens_per_s"]
        assert sharded["params"] > 0 and "collective_bound_s" in sharded
        assert len(sharded["losses"]) == 3 and sharded["max_rel_diff_one"] <= 1e-4
