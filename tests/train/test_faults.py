"""A trainer that survives faults: SIGKILL anywhere (also mid-way through an asynchronous
checkpoint write) resumes to exactly the uninterrupted losses; truncated or corrupted newest
checkpoints are named and skipped; an unwritable workdir or a failing save is a clear error that
keeps the older checkpoints; non-finite steps are skipped or stop the run (``train.nan_policy``);
a bad command line prints one line."""

import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, compilation_cache_restored, tiny_lm_config, tiny_lm_flags, write_docs
from jax.experimental.compilation_cache import compilation_cache

from hla_jax.train import Checkpointer, CheckpointError, read_metrics, train_and_evaluate
from hla_jax.train import trainer as trainer_lib

RUN = {"train.checkpoint_every": 2, "train.eval_every": 4, "train.eval_steps": 1,
       "train.keep_checkpoints": 3, "train.async_checkpoint": True}  # 8 steps


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """A persistent compilation cache shared by this module and its subprocesses (restored
    afterwards): every run of the one config compiles once."""
    path = tmp_path_factory.mktemp("jax_cache")
    with compilation_cache_restored():
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        yield path


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return write_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def uninterrupted(docs, cache_dir, tmp_path_factory):
    """The metrics of 8 uninterrupted steps (checkpoints at 2, 4, 6, 8; evals at 4, 8)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    train_and_evaluate(tiny_lm_config(docs, 8, RUN), workdir)
    return read_metrics(workdir)


def split_metrics(records):
    return ([(r["step"], r["loss"]) for r in records if r["split"] == "train"],
            [(r["step"], r["loss"]) for r in records if r["split"] == "eval"])


def cli(docs, workdir, cache_dir, settings=None, **popen):
    """``python -m hla_jax.main`` on the 8-step run, with this module's compilation cache."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, "-m", "hla_jax.main", *tiny_lm_flags(docs, 8, {**RUN, **(settings or {})}),
           f"--workdir={workdir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)


def kill_when(proc, ready, timeout=120.0):
    """SIGKILL ``proc`` once ``ready()`` holds while it is stopped (SIGSTOP freezes every thread,
    then ``ready`` is asked again); returns whether it was killed before it exited."""
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        if ready():
            proc.send_signal(signal.SIGSTOP)
            if ready():
                proc.kill()
                proc.wait()
                return True
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    return False


def writing(checkpoints: pathlib.Path, after: int) -> bool:
    """An asynchronous write of a step > ``after`` is under way: orbax's temporary directory
    exists and the step's own does not yet."""
    names = os.listdir(checkpoints) if checkpoints.is_dir() else []
    return any(n.endswith(".orbax-checkpoint-tmp") and int(n.split(".")[0]) > after
               and n.split(".")[0] not in names for n in names)


def test_sigkill_anywhere_resumes_to_the_uninterrupted_losses(docs, cache_dir, uninterrupted, tmp_path):
    """Killed while checkpoint 4 or later is being written, then between checkpoints: the
    third run ends with exactly the uninterrupted train and eval losses."""
    checkpoints = tmp_path / "checkpoints"
    assert kill_when(cli(docs, tmp_path, cache_dir, stderr=subprocess.DEVNULL),
                     lambda: writing(checkpoints, after=2))
    left = sorted(os.listdir(checkpoints))
    assert any(n.endswith(".orbax-checkpoint-tmp") for n in left), left  # a write cut short

    def between_checkpoints():  # a step logged past the newest complete checkpoint, none writing
        steps = [int(n) for n in os.listdir(checkpoints) if n.isdigit()]
        logged = [r["step"] for r in read_metrics(tmp_path, "train")]
        return (logged and steps and logged[-1] > max(steps) and logged[-1] % 2
                and not writing(checkpoints, after=0))
    assert kill_when(cli(docs, tmp_path, cache_dir, stderr=subprocess.DEVNULL), between_checkpoints)
    proc = cli(docs, tmp_path, cache_dir, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err and not any(n.endswith("tmp") for n in os.listdir(checkpoints))
    assert split_metrics(read_metrics(tmp_path)) == split_metrics(uninterrupted)  # exactly


def damage(checkpoint: pathlib.Path, how: str):
    """Truncate (to 0 bytes) or corrupt (flip 64 bytes mid-way) the largest file of a checkpoint."""
    path = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(0)
        else:
            f.seek(path.stat().st_size // 2)
            data = f.read(64)
            f.seek(path.stat().st_size // 2)
            f.write(bytes(b ^ 0xFF for b in data))


def test_unreadable_newest_checkpoints_are_named_and_skipped(docs, uninterrupted, tmp_path,
                                                             cache_dir, caplog):
    """Checkpoint 6 truncated, 4 corrupted (tensorstore reads it; its checksum does not match):
    each is named in a warning and set aside, the run resumes from 2 and ends with the
    uninterrupted losses. With every checkpoint unreadable: CheckpointError saying what a
    checkpoint must hold and what the newest holds, nothing trained; on the command line one
    line, status 1 (the metric writers closed: no traceback at exit)."""
    train_and_evaluate(tiny_lm_config(docs, 6, RUN), tmp_path)
    damage(tmp_path / "checkpoints" / "6", "truncate")
    damage(tmp_path / "checkpoints" / "4", "corrupt")
    train_and_evaluate(tiny_lm_config(docs, 8, RUN), tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for step, cause in ((6, "has empty files state/ocdbt.process_0/d/"), (4, "checksum")):
        assert any(f"checkpoints/{step} is unreadable" in w and cause in w
                   and "resuming from step 2" in w for w in warnings), warnings
    assert sorted(os.listdir(tmp_path / "checkpoints-unreadable")) == ["4", "6"]
    assert split_metrics(read_metrics(tmp_path)) == split_metrics(uninterrupted)

    for step in os.listdir(tmp_path / "checkpoints"):
        damage(tmp_path / "checkpoints" / step, "truncate")
    (tmp_path / "checkpoints" / "8" / "meta" / "metadata").write_text("")
    steps = sorted((int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()),
                   reverse=True)
    message = (f"no checkpoint in {tmp_path}/checkpoints can be restored (steps {steps}): each "
               f"must hold, whole, this config's parameters and optimizer state (state/) and the "
               f"step and data position (meta/); the newest, step 8, has empty files "
               f"meta/metadata, state/ocdbt.process_0/d/")
    with pytest.raises(CheckpointError) as e:
        train_and_evaluate(tiny_lm_config(docs, 10, RUN), tmp_path)
    assert str(e.value).startswith(message) and "JSONDecodeError: Expecting value" in str(e.value)
    assert max(r["step"] for r in read_metrics(tmp_path)) == 8
    proc = cli(docs, tmp_path, cache_dir, {"train.num_steps": 10, "train.tensorboard": True},
               stderr=subprocess.PIPE)
    err = proc.communicate(timeout=120)[1]
    lines = [line for line in err.splitlines() if line.strip() and not re.match(r"[IWEF]\d{4} ",
                                                                               line)]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(message), err
    assert "Traceback" not in err and "RuntimeError" not in err


def test_unwritable_workdir_fails_before_building(docs, tmp_path, monkeypatch):
    def no_init(*args, **kwargs):
        raise AssertionError("reached model initialisation")

    monkeypatch.setattr(trainer_lib, "init_state", no_init)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="workdir .*/file/run cannot be written"):
        train_and_evaluate(tiny_lm_config(docs, 8, RUN), tmp_path / "file" / "run")


def test_failed_save_says_so_and_keeps_older_checkpoints(docs, uninterrupted, tmp_path, monkeypatch):
    """The disk fills while checkpoint 6 is written (in the background): CheckpointError naming
    step 6 and the kept steps; checkpoints 2 and 4 stay (none deleted for the failed 6) and a
    rerun resumes from 4 to the uninterrupted losses."""
    save = ocp.handlers.JsonCheckpointHandler._save_fn

    async def disk_full_at_6(self, meta, directory):
        if meta["step"] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await save(self, meta, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", disk_full_at_6)
    c = tiny_lm_config(docs, 8, {**RUN, "train.keep_checkpoints": 2})
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 6 .* failed .*No space left"
                                              r".* steps \[2, 4\] are kept"):
        train_and_evaluate(c, tmp_path)
    monkeypatch.undo()
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == ["2", "4"]
    train_and_evaluate(c, tmp_path)
    assert split_metrics(read_metrics(tmp_path)) == split_metrics(uninterrupted)


def test_nan_policy_skip_stops_after_max_bad_steps(docs, tmp_path):
    """An update that throws the parameters to inf (learning rate 1e30 from step 1): with
    ``nan_policy="skip"`` steps 2 and 3 are skipped (logged; their checkpoints hold bit for bit
    the state of step 1: the checksums of parameters and optimizer state are equal) and the
    third bad step in a row stops the run. (``stop``: test_train.py.)"""
    c = tiny_lm_config(docs, 8, {**RUN, "train.checkpoint_every": 1, "train.eval_steps": 0,
                                 "train.async_checkpoint": False, "optim.learning_rate": 1e30,
                                 "optim.warmup_steps": 0, "optim.clip_norm": 0.0,
                                 "train.nan_policy": "skip", "train.max_bad_steps": 3})
    with pytest.raises(FloatingPointError, match=r"at step 4 \(3 in a row = train.max_bad_steps\)"):
        train_and_evaluate(c, tmp_path)
    assert [r.get("skipped_steps", 0) for r in read_metrics(tmp_path, "train")] == [0, 1, 1]
    metas = [json.loads((tmp_path / "checkpoints" / str(s) / "meta" / "metadata").read_text())
             for s in (1, 2, 3)]
    assert metas[0]["checksum"] == metas[1]["checksum"] == metas[2]["checksum"]


@pytest.mark.parametrize("args, message", [
    (["--config=configs/lm.py:mixer=nope"], "flag --config=configs/lm.py:mixer=nope: unknown mixer"),
    (["--config=configs/lm.py", "--config.train.nope=1"], "no config field 'nope'"),
    (["--config=configs/lm.py", "--config.train.nan_policy=maybe"],
     "train.nan_policy must be 'stop' or 'skip', got 'maybe'"),
    (["--config=configs/lm.py", "--config.train.profile_steps=12:10"],
     "train.profile_steps must be 'FIRST:LAST' with 1 <= FIRST <= LAST"),
])
def test_bad_command_line_prints_one_line(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hla_jax.main", *args, f"--workdir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines()  # less absl's log lines
             if line.strip() and not re.match(r"[IWEF]\d{4} ", line)]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr


@pytest.mark.parametrize("error, message, status", [
    (OSError(errno.ENOSPC, "No space left on device"),
     "OSError: [Errno 28] No space left on device (the traceback: --verbosity=1)", 1),
    (KeyboardInterrupt(), "interrupted", 130),
])
def test_any_other_error_is_one_line(monkeypatch, capsys, error, message, status):
    """Errors the trainer does not name itself are still one line, without a traceback."""
    from hla_jax import main as main_lib

    def fail(config, workdir):
        raise error

    monkeypatch.setattr(main_lib, "train_and_evaluate", fail)
    monkeypatch.setattr(main_lib, "_CONFIG", type("Flag", (), {"value": {}})())
    monkeypatch.setattr(main_lib, "_WORKDIR", type("Flag", (), {"value": "unused"})())
    with pytest.raises(SystemExit) as e:
        main_lib.main(["main"])
    assert e.value.code == status and capsys.readouterr().err == message + "\n"


def test_checkpointer_keeps_the_first_error(tmp_path, monkeypatch, caplog):
    """Leaving a ``with Checkpointer`` block on an error: a save in flight that failed too is
    logged, the first error propagates, orbax's manager is closed either way."""
    closed = []
    with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        monkeypatch.setattr(ckpt.manager, "close", lambda: closed.append(True))
    assert closed == [True]

    def failed_save():
        raise CheckpointError("saving checkpoint step 6 failed")

    with pytest.raises(ValueError, match="^the first error$"):
        with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
            monkeypatch.setattr(ckpt, "wait", failed_save)
            monkeypatch.setattr(ckpt.manager, "close", lambda: closed.append(True))
            raise ValueError("the first error")
    assert closed == [True, True]
    assert "while stopping on an error: CheckpointError: saving checkpoint step 6 failed" in caplog.text
    with pytest.raises(CheckpointError, match="step 6 failed"):  # alone, it is the error
        with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
            monkeypatch.setattr(ckpt, "wait", failed_save)
