"""AdamW with linear warmup + cosine decay, global-norm clipping and gradient accumulation."""

import jax
import optax


def make_schedule(optim, num_steps: int):
    """``lr(step)``: 0 -> ``learning_rate`` over ``warmup_steps``, cosine to
    ``learning_rate · min_lr_ratio`` at ``decay_steps`` (0 = ``num_steps``), flat after."""
    decay = optim.decay_steps or num_steps
    return optax.warmup_cosine_decay_schedule(
        0.0, optim.learning_rate, optim.warmup_steps, max(decay, optim.warmup_steps + 1),
        end_value=optim.learning_rate * optim.min_lr_ratio)


def decay_mask(params):
    """Weight decay on matrices only (ndim >= 2), not on norm scales, biases or gates."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim, num_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw(schedule)``, wrapped in ``optax.MultiSteps`` when
    ``grad_accum > 1`` (the update is applied once every ``grad_accum`` micro-batches, on the
    mean gradient; the schedule counts optimizer updates)."""
    tx = optax.adamw(make_schedule(optim, num_steps), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                     weight_decay=optim.weight_decay, mask=decay_mask)
    if optim.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(optim.clip_norm), tx)
    return optax.MultiSteps(tx, optim.grad_accum) if optim.grad_accum > 1 else tx
