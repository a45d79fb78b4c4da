"""The instruments a run plugs in besides metrics.jsonl and TensorBoard: a Weights & Biases run
(offline here) that receives the same scalars, and a ``jax.profiler`` trace of chosen steps
under the workdir; their bad settings are one-line errors naming the field."""

import json
import sys
import time

import pytest
from helpers import persistent_compilation_cache, tiny_lm_config, write_docs

from hla_jax.train import MetricWriter, read_metrics, train_and_evaluate
from hla_jax.train.config import profile_steps


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """The resumed run compiles nothing again (restored afterwards)."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


def test_wandb_and_profile_of_a_tiny_run(tmp_path, monkeypatch):
    """4 steps with ``train.wandb_project`` (WANDB_MODE=offline) and ``train.profile_steps="2:3"``,
    resumed to 6: both parts log to the one W&B run, whose record logs hold every train loss and
    grad norm of metrics.jsonl; the trace files exist under ``workdir/profile``."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = tmp_path / "run"
    c = tiny_lm_config(write_docs(tmp_path / "docs"), 4, {
        "train.wandb_project": "hla-jax-test", "train.profile_steps": "2:3",
        "train.checkpoint_every": 0})
    train_and_evaluate(c, workdir)
    c.train.num_steps = 6
    train_and_evaluate(c, workdir)

    run_id = (workdir / "wandb_run_id").read_text()
    logs = sorted(workdir.glob("wandb/offline-run-*/run-*.wandb"))
    assert [log.name for log in logs] == [f"run-{run_id}.wandb"] * 2
    want = [b"hla-jax-test"] + [s.encode() for r in read_metrics(workdir, "train")
                                for k in ("loss", "grad_norm") for s in (f"train/{k}",
                                                                         json.dumps(r[k]))]
    deadline = time.monotonic() + 20  # wandb's service finishes writing after finish() returns
    while True:
        records = b"".join(log.read_bytes() for log in logs)  # keys, JSON values as written
        missing = [w for w in want if w not in records]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not missing
    assert list((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))


def test_wandb_asked_but_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"^train.wandb_project='p' needs wandb, which is not "
                                         r"installed: pip install 'hla_jax\[wandb\]'"):
        MetricWriter(tmp_path, wandb_project="p")


@pytest.mark.parametrize("spec", ["3:2", "0:2", "5", "a:b", "1:2:3"])
def test_bad_profile_steps(spec):
    with pytest.raises(ValueError, match=f"^train.profile_steps must be 'FIRST:LAST' with 1 <= "
                                         f"FIRST <= LAST .*got '{spec}'$"):
        profile_steps(spec)
    assert profile_steps("10:12") == (10, 12) and profile_steps("") is None
