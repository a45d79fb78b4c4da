"""Training: the loop, optimizer, orbax checkpoints, metrics/MFU, mesh and sharding rules."""

from hla_jax.train.checkpoint import Checkpointer, CheckpointError
from hla_jax.train.config import base_config, check_config, mixer_pattern, parse_arg, take_args
from hla_jax.train.metrics import MetricWriter, peak_flops, read_metrics
from hla_jax.train.optim import make_optimizer, make_schedule
from hla_jax.train.sharding import make_mesh, state_shardings
from hla_jax.train.steps import loss_fn, make_eval_step, make_train_step
from hla_jax.train.trainer import init_state, train_and_evaluate

__all__ = [
    "CheckpointError", "Checkpointer", "MetricWriter", "base_config", "check_config", "init_state", "loss_fn",
    "make_eval_step", "make_mesh", "make_optimizer", "make_schedule", "make_train_step",
    "mixer_pattern", "parse_arg", "peak_flops", "read_metrics", "state_shardings", "take_args",
    "train_and_evaluate",
]
