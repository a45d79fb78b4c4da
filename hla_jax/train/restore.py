"""A training run, loaded for inference: its config, its model with a checkpoint's parameters
(on one device of this process, no training mesh) and its tokenizer.

    run = load_run("runs/tiny-hla2")          # the newest checkpoint
    logits = run.model(jnp.asarray(run.tokenizer.encode("def f(x):"))[None])

Only the parameters are read (the optimizer state stays on disk), and nothing in
``workdir/checkpoints`` is written, deleted or tidied, so a run still training can be sampled
from. ``python -m hla_jax.sample`` and ``python -m hla_jax.evaluate`` start here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from hla_jax.data.tokenizers import Tokenizer, tokenizer_for_data
from hla_jax.nn import LM, ModelConfig
from hla_jax.train.checkpoint import draining_event_loops


@dataclasses.dataclass(frozen=True)
class Run:
    """A loaded run: ``config`` (its ``config.json``), ``model`` (the parameters of checkpoint
    ``step``), ``tokenizer`` (the one its data was encoded with)."""

    config: ml_collections.ConfigDict
    model: LM
    tokenizer: Tokenizer
    step: int

    @property
    def seq_len(self) -> int:
        """The training context length (``data.seq_len``)."""
        return int(self.config.data.seq_len)


def load_config(workdir) -> ml_collections.ConfigDict:
    """The ``config.json`` a training run wrote into ``workdir``."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        raise ValueError(f"workdir: {path} does not exist (not the workdir of a training run)")
    return ml_collections.ConfigDict(json.loads(path.read_text()))


def _manager(workdir) -> ocp.CheckpointManager:
    directory = pathlib.Path(workdir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise ValueError(f"workdir: {directory} does not exist (the run has saved no checkpoint)")
    # never saved through, so nothing is deleted (no max_to_keep) or tidied (no tmp clean-up)
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


def load_run(workdir, step: int | None = None, device=None) -> Run:
    """The run in ``workdir`` with the parameters of checkpoint ``step`` (None: the newest),
    placed on ``device`` (None: this process's first device)."""
    config = load_config(workdir)
    model_cfg = ModelConfig.from_dict(config.model)
    tokenizer = tokenizer_for_data(config.data)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"workdir: the run's tokenizer {tokenizer.name} has {tokenizer.vocab_size} "
                         f"ids, more than its model.vocab_size={model_cfg.vocab_size}")
    with contextlib.closing(_manager(workdir)) as manager:
        steps = sorted(manager.all_steps())
        if not steps:
            raise ValueError(f"workdir: {manager.directory} holds no complete checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"step: checkpoint {step} is not in {manager.directory}; saved: "
                             f"{steps}")

        on_device = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])

        def split(model):
            return nnx.split(model, nnx.Param, ...)

        graphdef, abstract, rest = split(nnx.eval_shape(lambda: LM(model_cfg, rngs=nnx.Rngs(0))))
        if jax.tree.leaves(rest):
            # non-parameter state is not checkpointed: rebuilt as the trainer built it (XLA
            # drops the parameter initialisers, whose results are unused)
            rest = jax.jit(lambda key: split(LM(model_cfg, rngs=nnx.Rngs(key)))[2],
                           out_shardings=on_device)(jax.random.key(config.seed))
        target = {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), abstract)}
        with draining_event_loops():
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True)))
    model = nnx.merge(graphdef, restored["state"]["params"], rest)
    return Run(config=config, model=model, tokenizer=tokenizer, step=step)
