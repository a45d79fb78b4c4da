"""Pure step functions on split NNX state (``nnx.split`` -> arrays -> ``nnx.merge`` inside jit).

Batches are dicts ``inputs, targets`` int32 and ``mask`` float32, each ``[accum, b, T]``, and
optionally ``segment_ids`` int32 (packed documents, passed to the model; the data pipeline's mask
already drops the targets that start a new document); the loss is the masked mean next-token
cross-entropy in float32 whatever the compute dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def scored(batch):
    """``(targets, mask)`` where the loss is read: every position ``[b,T]``, or only at
    ``positions`` when the batch has them (e.g. MQAR's answers): ``[b,P]`` per row, or ``[P]``
    flat indices ``row·T + t`` (``LM.__call__``); padding entries point at a position whose
    mask is 0."""
    if "positions" not in batch:
        return batch["targets"], batch["mask"]
    if batch["positions"].ndim == 1:
        at = lambda x: x.reshape(-1)[batch["positions"]]
    else:
        at = lambda x: jnp.take_along_axis(x, batch["positions"], axis=1)
    return at(batch["targets"]), at(batch["mask"])


def token_nll(model, batch):
    """``(nll, correct)``: −log p(target) and argmax == target, float32, at the ``scored``
    positions (``[b,T]``, or ``[b,P]`` / ``[P]`` with ``positions``)."""
    logits = model(batch["inputs"], batch.get("positions"),
                   batch.get("segment_ids")).astype(jnp.float32)
    targets, _ = scored(batch)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return nll, correct


def loss_fn(params, graphdef, rest, batch):
    """Masked mean cross-entropy ``Σ nll·mask / Σ mask`` of one micro-batch ``[b,T]``."""
    nll, _ = token_nll(nnx.merge(graphdef, params, rest), batch)
    _, mask = scored(batch)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(graphdef, tx: optax.GradientTransformation, skip_nonfinite: bool = False):
    """``(params, opt_state, rest, batch, update_scale=None) -> (params, opt_state, metrics)``.

    Scans over the ``accum`` micro-batches; with ``optax.MultiSteps`` the parameters change only
    after the last one (mean gradient). ``metrics``: mean loss and mean micro-batch grad norm.
    ``update_scale`` (a scalar, may be traced) multiplies ``tx``'s updates: a per-model peak
    learning rate when ``tx`` is built with peak 1 (``hla_jax.train.stacked``).
    ``skip_nonfinite``: a step whose loss or gradient norm is not finite in any micro-batch
    returns ``params`` and ``opt_state`` unchanged (``train.nan_policy="skip"``).
    """
    def train_step(params, opt_state, rest, batch, update_scale=None):
        def micro(carry, mb):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, rest, mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            if update_scale is not None:
                updates = jax.tree.map(lambda u: update_scale * u, updates)
            return (optax.apply_updates(params, updates), opt_state), (loss, optax.tree.norm(grads))

        new, (loss, gnorm) = jax.lax.scan(micro, (params, opt_state), batch)
        if skip_nonfinite:
            ok = jnp.all(jnp.isfinite(loss)) & jnp.all(jnp.isfinite(gnorm))
            new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, (params, opt_state))
        return *new, {"loss": jnp.mean(loss), "grad_norm": jnp.mean(gnorm)}
    return train_step


def make_eval_step(graphdef):
    """``(params, rest, batch) -> sums``: masked nll, masked tokens, correct masked tokens, and
    rows whose masked targets are all correct (e.g. a whole MQAR example / NIAH number)."""
    def eval_step(params, rest, batch):
        batch = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
        nll, correct = token_nll(nnx.merge(graphdef, params, rest), batch)
        return masked_sums(nll, correct, scored(batch)[1])
    return eval_step


def masked_sums(nll, correct, mask) -> dict:
    """``eval_step``'s sums from per-token ``nll``, ``correct`` and ``mask`` ``[b,T]``."""
    has_target = jnp.sum(mask, axis=-1) > 0
    row_ok = jnp.all((correct > 0) | (mask == 0), axis=-1) & has_target
    return {"nll": jnp.sum(nll * mask), "tokens": jnp.sum(mask),
            "correct": jnp.sum(correct * mask), "rows_correct": jnp.sum(row_ok),
            "rows": jnp.sum(has_target)}


def eval_summary(sums) -> dict:
    """``loss`` (mean masked nll), ``accuracy`` (masked tokens right) and ``row_accuracy`` from
    summed ``eval_step`` outputs, float64 numpy (scalars, or ``[M]`` for stacked models)."""
    s = {k: np.asarray(v, np.float64) for k, v in jax.device_get(sums).items()}
    tokens = np.maximum(s["tokens"], 1.0)
    return {"loss": s["nll"] / tokens, "accuracy": s["correct"] / tokens,
            "row_accuracy": s["rows_correct"] / np.maximum(s["rows"], 1.0)}
