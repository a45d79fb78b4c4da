"""Orbax checkpoints of the whole training state: params, optimizer state, step, data position.

Layout: ``workdir/checkpoints/<step>/{state,meta}``; ``state`` holds the (sharded) arrays,
``meta`` a small JSON ``{"step", "data_position"}``. Restoring takes an abstract target with
shardings, so a checkpoint reloads straight onto the current mesh.
"""

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` keeping the ``max_to_keep`` latest steps."""

    def __init__(self, directory, max_to_keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self):
        """The newest saved step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state, data_position: int):
        """Save ``state`` (a pytree of arrays) with the iterator position (asynchronously)."""
        meta = {"step": int(step), "data_position": int(data_position)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state):
        """``(state, meta)`` of ``step``; ``abstract_state`` = ShapeDtypeStructs with shardings."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
