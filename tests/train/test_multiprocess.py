"""Multi-process training on this machine (processes with emulated CPU devices, gloo
collectives, free localhost ports): 2 and 4 processes train the one-process losses, checkpoints
move between process counts both ways, and the sequence-parallel operators split over processes
equal the unsharded ones."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, persistent_compilation_cache, tiny_lm_config, tiny_lm_flags, write_docs

from hla_jax import launch
from hla_jax.train import read_metrics, train_and_evaluate


def losses(workdir):
    return np.array([r["loss"] for r in read_metrics(workdir, "train")])


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent compilation cache for this module's one-process runs (restored afterwards)."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def one_process(docs, tmp_path_factory):
    """``(workdir at step 4, train losses of steps 1-8)`` of one process on one device (the 8
    steps: resumed from step 4, which reproduces an uninterrupted run: test_train.py)."""
    root = tmp_path_factory.mktemp("one")
    train_and_evaluate(tiny_lm_config(docs, 4), root / "4")
    shutil.copytree(root / "4", root / "8")
    train_and_evaluate(tiny_lm_config(docs, 8), root / "8")
    loss = losses(root / "8")
    assert len(loss) == 8 and loss[7] != loss[0]
    return root / "4", loss


def test_two_processes_fsdp_match_one_and_resume_in_one(docs, one_process, tmp_path):
    """``python -m hla_jax.launch``: 2 processes x 2 devices, parameters sharded over all 4
    (fsdp=4), each process feeding its half of the batch; one process resumes their checkpoint."""
    cmd = [sys.executable, "-m", "hla_jax.launch", "--processes=2", "--devices_per_process=2",
           "--", *tiny_lm_flags(docs, 4, {"mesh.data": 1, "mesh.fsdp": 4}), f"--workdir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=1 fsdp=4 sequence=1 tensor=1 (4 devices)" in proc.stderr
    _, ref = one_process
    np.testing.assert_allclose(losses(tmp_path), ref[:4], rtol=0, atol=1e-5)
    train_and_evaluate(tiny_lm_config(docs, 8), tmp_path)
    np.testing.assert_allclose(losses(tmp_path), ref, rtol=0, atol=1e-5)


def test_four_processes_resume_one_and_split_time(docs, one_process, tmp_path):
    """4 processes x 1 device resume a one-process checkpoint on data=2 x sequence=2 (the time
    axis split across processes) and train the one-process losses; the sequence-parallel
    operators over the 4 processes equal the unsharded ones (tests/multiprocess_check.py)."""
    at_4, ref = one_process
    shutil.copytree(at_4, tmp_path, dirs_exist_ok=True)
    port = launch.free_port()
    commands = [[sys.executable, str(ROOT / "tests" / "multiprocess_check.py"), str(i), "4",
                 str(port), str(docs), str(tmp_path)] for i in range(4)]
    assert launch.run_all(commands, launch.cpu_env(1), timeout=240) == 0
    np.testing.assert_allclose(losses(tmp_path), ref, rtol=0, atol=1e-5)
