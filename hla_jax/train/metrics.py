"""Metrics: JSONL always, TensorBoard event files when a writer library is importable, Weights &
Biases when a project is named, the peak-FLOPs table behind MFU = achieved model FLOP/s ÷ (peak
FLOP/s per device × devices), and ``jax.profiler`` traces of chosen steps."""

import contextlib
import importlib
import json
import pathlib
import secrets
import time

import jax
from absl import logging

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity), matched by substring of
# ``jax.devices()[0].device_kind``; first match wins, so longer names come first.
PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12), ("L4", 121e12),
    ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v4", 275e12), ("TPU v3", 123e12),
)


def peak_flops(device_kind: str, override: float = 0.0):
    """Peak FLOP/s of one device: ``override`` when > 0, else the table, else None (e.g. CPU)."""
    if override > 0:
        return float(override)
    return next((f for name, f in PEAK_FLOPS if name in device_kind), None)


def _tensorboard(logdir: pathlib.Path):
    """``scalar(tag, value, step)``, ``flush()`` and ``close()`` from tensorboardX, tensorboard
    or TensorFlow, whichever imports first; None when none does."""
    with contextlib.suppress(ImportError):
        from tensorboardX import SummaryWriter
        writer = SummaryWriter(str(logdir))
        return writer.add_scalar, writer.flush, writer.close
    with contextlib.suppress(ImportError):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        writer = EventFileWriter(str(logdir))

        def scalar(tag, value, step):
            value = summary_pb2.Summary.Value(tag=tag, simple_value=value)
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                             summary=summary_pb2.Summary(value=[value])))
        return scalar, writer.flush, writer.close
    try:
        import tensorflow as tf
        tf.config.set_visible_devices([], "GPU")  # keep TensorFlow off the accelerators
        writer = tf.summary.create_file_writer(str(logdir))

        def scalar(tag, value, step):
            with writer.as_default():
                tf.summary.scalar(tag, value, step=step)
        return scalar, writer.flush, writer.close
    except ImportError:
        return None


def _wandb_run(workdir: pathlib.Path, project: str, config: dict):
    """A Weights & Biases run of ``project`` for ``workdir`` (its files under ``workdir/wandb``):
    the same run again when the workdir resumes (its id is kept in ``workdir/wandb_run_id``).
    ValueError naming ``train.wandb_project`` when wandb is not installed."""
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as e:
        raise ValueError(f"train.wandb_project={project!r} needs wandb, which is not installed: "
                         f"pip install 'hla_jax[wandb]' (or train.wandb_project='')") from e
    id_file = workdir / "wandb_run_id"
    if not id_file.exists():
        id_file.write_text(secrets.token_hex(4))
    return wandb.init(project=project, dir=str(workdir), name=workdir.name, config=config,
                      id=id_file.read_text().strip(), resume="allow")


class MetricWriter:
    """Appends ``{"step", "split", **metrics}`` lines to ``workdir/metrics.jsonl`` and mirrors
    the scalars to TensorBoard (``workdir/tensorboard``) when available and to the Weights &
    Biases project ``wandb_project`` when one is named (``wandb_config``: the run's config).
    Only process 0 writes."""

    def __init__(self, workdir, enabled: bool = True, tensorboard: bool = True,
                 wandb_project: str = "", wandb_config: dict | None = None):
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / "metrics.jsonl"
        if wandb_project:
            self.wandb = _wandb_run(workdir, wandb_project, wandb_config or {})
        if tensorboard:
            self.tb = _tensorboard(workdir / "tensorboard")
            if self.tb is None:
                logging.info("TensorBoard: no tensorboardX / tensorboard / tensorflow importable; "
                             "writing %s only", self.path)

    def drop_after(self, step: int):
        """Forget the records past ``step``: a run resumed from its step-``step`` checkpoint does
        those steps again (the log of a run stopped between checkpoints would repeat them)."""
        if self.enabled and self.path.exists():
            kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, step: int, split: str, metrics: dict):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "split": split, **metrics}) + "\n")
        scalars = {f"{split}/{k}": float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            scalar, flush, _ = self.tb
            for tag, v in scalars.items():
                scalar(tag, v, int(step))
            flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=int(step))

    def close(self, failed: bool = False):
        """Flush and close the TensorBoard writer (its events may be queued until then) and
        finish the Weights & Biases run (marked failed when ``failed``)."""
        if self.tb is not None:
            self.tb[2]()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=int(failed))
            self.wandb = None

    def __enter__(self):
        return self

    def __exit__(self, error_type, *_):
        self.close(failed=error_type is not None)


class StepTrace:
    """A ``jax.profiler`` trace of the train steps ``first..last`` (``steps``; None: off) into
    ``directory`` (TensorBoard's profile plugin and Perfetto read it): ``before(step)`` and
    ``after(step, outputs)`` around each step (the last waits for its outputs before the trace
    stops); ``close`` stops a trace still running (a run that stopped inside the range)."""

    def __init__(self, directory: pathlib.Path, steps: tuple[int, int] | None):
        self.directory, self.steps, self.running = directory, steps, False

    def before(self, step: int):
        """Start the trace at the range's first step (or the first one run: a resumed run)."""
        if self.steps is not None and not self.running and self.steps[0] <= step <= self.steps[1]:
            jax.profiler.start_trace(str(self.directory))
            self.running = True
            logging.info("profiling steps %d to %d into %s", step, self.steps[1], self.directory)

    def after(self, step: int, outputs):
        if self.running and step == self.steps[1]:
            jax.block_until_ready(outputs)
            self.close()

    def close(self):
        if self.running:
            jax.profiler.stop_trace()
            self.running = False

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def read_metrics(workdir, split: str | None = None) -> list[dict]:
    """The JSONL records of ``workdir`` (optionally one split), in order."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [r for r in records if split is None or r["split"] == split]
