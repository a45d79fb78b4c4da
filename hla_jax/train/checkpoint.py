"""Orbax checkpoints of the whole training state: params, optimizer state, step, data position.

Layout: ``workdir/checkpoints/<step>/{state,meta}``; ``state`` holds the (sharded) arrays,
``meta`` a small JSON ``{"step", "data_position", "checksum"}``. Restoring takes an abstract
target with shardings, so a checkpoint reloads straight onto the current mesh (any number of
processes and devices).

Faults: a save in flight when the process dies leaves only orbax's temporary directory, which is
never read (and is removed at the next start); a checkpoint whose files were truncated or
corrupted afterwards fails to read or to match its ``checksum`` (``checksum``), and
``restore_latest`` then resumes from the newest one that reads back whole, moving the bad ones
to ``checkpoints-unreadable/``; a save that fails raises ``CheckpointError`` and keeps the older
checkpoints (old steps are deleted only once a newer one is known to be complete: orbax's own
``max_to_keep`` deletes them even after a failed save).
"""

import asyncio
import contextlib
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from hla_jax.core.errors import first_line


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint of a run could be read back."""


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first lets the tasks still pending on it finish."""

    def close(self):
        pending = [t for t in asyncio.all_tasks(self) if not t.done()]
        if pending and not self.is_running():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


@contextlib.contextmanager
def draining_event_loops():
    """Event loops created inside finish their pending tasks before they close.

    orbax runs a restore in a new event loop that it closes as soon as the result, or the first
    error, is in: after a failed read of one array (a damaged checkpoint) the reads of the
    others are still pending, and TensorStore completes them into the closed loop ("Event loop
    is closed", coroutines destroyed while pending). Here they finish first."""

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self):
            return _DrainingLoop()

    saved = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(Policy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(saved)


def _words(x):
    """The bits of ``x`` as uint32 words (8-byte elements give two words each)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _leaf_sum(x):
    """``Σ word · (2·position + 1)`` mod 2^32 over the words of one array: an odd weight per
    position, so changing any one word, or moving words, changes the sum."""
    w = _words(x)
    strides = np.cumprod((1,) + w.shape[:0:-1])[::-1] if w.ndim else ()
    pos = sum((jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(int(s) % 2**32)
               for d, s in enumerate(strides)), jnp.uint32(0))
    return jnp.sum(w * (2 * pos + 1), dtype=jnp.uint32)


@jax.jit
def _checksum(tree):
    total = jnp.uint32(0)
    for leaf in jax.tree.leaves(tree):
        total = total * jnp.uint32(1_000_003) + _leaf_sum(leaf)
    return total


def checksum(tree) -> int:
    """A uint32 fingerprint of every bit of the arrays of ``tree`` (sharded arrays reduce where
    they lie: only a scalar crosses devices)."""
    return int(_checksum(tree))


def _found(directory: pathlib.Path, error: BaseException) -> str:
    """What a failed restore of the checkpoint ``directory`` found: its empty files (a
    checkpoint has none), else the error."""
    empty = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                   if p.is_file() and p.stat().st_size == 0)
    if empty:
        return f"has empty files {', '.join(empty)} ({first_line(error)})"
    return f"gives {first_line(error)}"


class Checkpointer:
    """``ocp.CheckpointManager`` keeping the ``max_to_keep`` latest complete steps, with the
    fault handling of the module docstring."""

    def __init__(self, directory, max_to_keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self.unreadable = self.directory.with_name(self.directory.name + "-unreadable")
        self.max_to_keep = max_to_keep
        options = ocp.CheckpointManagerOptions(create=True,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))
        self.in_flight = None  # step of a save not yet known to be complete

    def latest_step(self):
        """The newest saved step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state, data_position: int):
        """Save ``state`` (a pytree of arrays) with the iterator position (asynchronously:
        the next ``save`` or ``wait`` reports a failure). CheckpointError when it fails."""
        self.wait()
        meta = {"step": int(step), "data_position": int(data_position), "checksum": checksum(state)}
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # e.g. OSError: no space left on the device
            raise CheckpointError(self._failed(step, e)) from e
        self.in_flight = step

    def wait(self):
        """Block until the save in flight is written, then delete the steps past the newest
        ``max_to_keep``; CheckpointError (nothing deleted) if it was not written."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(self._failed(self.in_flight, e)) from e
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self.manager.reload()
            if step not in self.manager.all_steps():
                raise CheckpointError(self._failed(step, None))
            for old in sorted(self.manager.all_steps())[:-self.max_to_keep]:
                self.manager.delete(old)

    def _failed(self, step, error) -> str:
        kept = sorted(self.manager.all_steps())
        cause = first_line(error) if error is not None else "it is not among the saved steps"
        return (f"saving checkpoint step {step} in {self.directory} failed ({cause}); the "
                f"checkpoints of steps {kept} are kept")

    def restore(self, step: int, abstract_state):
        """``(state, meta)`` of ``step``; ``abstract_state`` = ShapeDtypeStructs with shardings.
        ValueError when the arrays do not match the checksum saved with them."""
        with draining_event_loops():
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        state, meta = out["state"], out["meta"]
        if "checksum" in meta and checksum(state) != meta["checksum"]:
            raise ValueError("its arrays do not match the checksum saved with them")
        return state, meta

    def restore_latest(self, abstract_state):
        """``(state, meta)`` of the newest checkpoint that reads back whole, or None when there
        is none. Newer unreadable ones (truncated or corrupted files) are named in a warning and
        moved to ``checkpoints-unreadable/``; CheckpointError when no checkpoint reads back."""
        failed = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as e:  # tensorstore / OCDBT / JSON errors, a checksum mismatch
                failed.append((step, e))
                continue
            for bad, e in failed:
                self._set_aside(bad, e, step)
            return state, meta
        if failed:
            step, e = failed[0]
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be restored (steps "
                f"{[s for s, _ in failed]}): each must hold, whole, this config's parameters and "
                f"optimizer state (state/) and the step and data position (meta/); the newest, "
                f"step {step}, {_found(self.directory / str(step), e)}")
        return None

    def _set_aside(self, step: int, error, resumed: int):
        source = self.directory / str(step)
        target = self.unreadable / str(step)
        logging.warning("checkpoint %s is unreadable: it %s; moved to %s; resuming from step %d",
                        source, _found(source, error), target, resumed)
        if jax.process_index() == 0:
            self.unreadable.mkdir(exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            source.rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        self.manager.reload()

    def close(self):
        """Wait for the save in flight (CheckpointError when it failed), then release orbax's
        threads and event loop (also when the wait failed)."""
        try:
            self.wait()
        finally:
            self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, error_type, *_):
        """``close``; while another error propagates, a failure of the save in flight is only
        logged (the first error is the one to report)."""
        if error_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # its context is the error in flight: not first_line
            logging.warning("while stopping on an error: %s: %s", type(e).__name__,
                            (str(e).splitlines() or [""])[0])


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
