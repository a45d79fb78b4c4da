"""Many models of one architecture trained in ONE program: every array of the single-model state
(params, optimizer state) gets a leading model axis ``[M, ...]`` and ``jax.vmap`` runs the
trainer's own ``steps.make_train_step`` / ``make_eval_step`` over it (one compile for all M; e.g.
``experiments/mqar.py`` trains a whole data x learning-rate grid this way).

Per-model peak learning rates, exactly: optax's AdamW update is ``-η(t)·(adam(g) + wd·p)`` (the
weight decay is multiplied by the lr too) and the warmup+cosine schedule is linear in its peak,
``η(t) = peak·s(t)`` (``optim.make_schedule``). So the optimizer is built once with peak 1
(``unit_lr``) and each model's updates are multiplied by its own peak (``update_scale``): the
update ``-peak·s(t)·(adam(g) + wd·p)`` of ``make_optimizer`` at that peak, up to float rounding
(gradient clipping and the Adam moments never see the lr).

A model that diverges only spoils its own slice (no vmapped op mixes models): the others go on,
and the caller reads which one diverged from the per-model metrics.

``take`` keeps some of the models (a program that goes on without its stopped ones), ``save`` /
``restore`` write and read a stacked state as one ``.npz`` (a program resumed mid-way).
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from hla_jax.train import sharding, steps
from hla_jax.train.config import check_config
from hla_jax.train.optim import make_optimizer
from hla_jax.train.trainer import init_state


def unit_lr(c):
    """``make_optimizer`` for config ``c`` with peak lr 1 (at peak η it is η times this)."""
    optim = c.optim.copy_and_resolve_references()
    optim.learning_rate = 1.0
    return make_optimizer(optim, c.train.num_steps)


def init(c, n: int):
    """``(graphdef, params, rest, opt_state, tx)`` for ``n`` models: ``n`` copies ``[n, ...]`` of
    the state ``train_and_evaluate`` starts config ``c`` from (``trainer.init_state``, seed
    ``c.seed``) on the first local device, ``rest`` shared (not stacked), ``tx = unit_lr(c)``."""
    tx = unit_lr(c)
    mesh = sharding.make_mesh(c.mesh, jax.local_devices()[:1])
    rules = tuple(tuple(r) for r in c.mesh.rules)
    graphdef, params, rest, opt_state, _ = init_state(check_config(c), c.seed, mesh, rules, tx)
    repeat = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.repeat(x[None], n, axis=0), tree))
    return graphdef, repeat(params), rest, repeat(opt_state), tx


def make_train_step(graphdef, tx):
    """``(params, opt_state, rest, lr, batch) -> (params, opt_state, metrics)``:
    ``steps.make_train_step`` with ``update_scale=lr`` vmapped over the model axis of every
    argument but ``rest`` (``lr: [M]``, ``batch: [M, accum, b, T]``, metrics ``[M]``)."""
    step = steps.make_train_step(graphdef, tx)
    return jax.vmap(lambda params, opt_state, rest, lr, batch:
                    step(params, opt_state, rest, batch, update_scale=lr),
                    in_axes=(0, 0, None, 0, 0))


def make_eval_step(graphdef):
    """``(params, rest, batch) -> sums``: ``steps.make_eval_step`` vmapped over the model axis
    (``params [M, ...]``, ``batch [M, accum, b, T]``, sums ``[M]``; ``steps.eval_summary``)."""
    return jax.vmap(steps.make_eval_step(graphdef), in_axes=(0, None, 0))


def take(tree, index):
    """Models ``index`` (ints) of a stacked tree, ``x[index]`` on every leaf (e.g. to go on with
    only the models that are still training)."""
    index = jnp.asarray(index, jnp.int32)
    return jax.tree.map(lambda x: x[index], tree)


def save(path, tree, **arrays) -> None:
    """Write the leaves of ``tree`` (e.g. ``{"params", "opt_state"}``) and the numpy ``arrays`` to
    one ``.npz`` at ``path``, atomically (a call cut off mid-write leaves the previous file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = {f"leaf{i}": np.asarray(x) for i, x in enumerate(jax.device_get(jax.tree.leaves(tree)))}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **leaves, **arrays)
    os.replace(tmp, path)


def restore(path, like) -> tuple:
    """``(tree, arrays)`` from ``save``'s file: ``tree`` with the structure of ``like`` (its
    leaves as saved: the model axis may be shorter than ``like``'s), ``arrays`` the rest."""
    with np.load(path) as f:
        files = {k: f[k] for k in f.files}
    treedef = jax.tree.structure(like)
    tree = jax.tree.unflatten(treedef, [jnp.asarray(files.pop(f"leaf{i}"))
                                        for i in range(treedef.num_leaves)])
    return tree, files
