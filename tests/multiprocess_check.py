"""One process of a multi-process run on this machine (started by test_multiprocess.py through
``hla_jax.launch.run_all``, each with its emulated CPU devices):

``python tests/multiprocess_check.py PROCESS_ID NUM_PROCESSES PORT DOCS WORKDIR`` joins the
run, checks that the sequence-parallel operators with the time axis split over every device of
every process equal the unsharded ones (float64, 1e-10), then resumes the
tiny LM of ``helpers.tiny_lm_config`` in ``WORKDIR`` (a checkpoint written by one process)
on a ``data=2 × sequence=2`` mesh up to step 8. Exits 1 on a mismatch.
"""

import functools
import sys

import jax
import numpy as np
from helpers import tiny_lm_config
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec


def check_sequence_ops(mesh) -> bool:
    """hla2 (a chain of two passes) and log-linear Mamba-2 (Fenwick levels) with the time axis
    over ``mesh``'s devices = the unsharded chunked forms on this process's first device (the
    gradients across processes: the training losses)."""
    jax.devices()  # the backend is up before sequence_check adds its device count to XLA_FLAGS
    import sequence_check as sc

    ok = True
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        for name in ("hla2", "loglinear_mamba2"):
            op, extra, kw = sc.CASES[name]
            kw = {"chunk_size": sc.CHUNK} | kw
            args = [np.asarray(a) for a in sc.inputs(rng, extra)]
            with jax.default_device(jax.local_devices()[0]):
                ref = jax.jit(functools.partial(op, impl="chunked", **kw))(*args)
            split = NamedSharding(mesh, Spec(None, "seq"))
            placed = [jax.make_array_from_process_local_data(split, a, a.shape) for a in args]
            out = jax.jit(sc.sharded(op, kw, len(args), mesh))(*placed)
            err = sc.rel_err(multihost_utils.process_allgather(out, tiled=True), ref)
            ok &= err <= 1e-10
            print(f"{'ok' if err <= 1e-10 else 'FAIL'} {name} over {mesh.size} devices of "
                  f"{jax.process_count()} processes: {err:.1e}")
    return ok


def main(process_id, num_processes, port, docs, workdir) -> int:
    from hla_jax.train import sharding, train_and_evaluate

    c = tiny_lm_config(docs, 8, {"mesh.data": 2, "mesh.sequence": 2, "mesh.multihost": True,
                                 "mesh.coordinator": f"127.0.0.1:{port}",
                                 "mesh.coordinator_bind": f"127.0.0.1:{port}",
                                 "mesh.num_processes": int(num_processes),
                                 "mesh.process_id": int(process_id)})
    sharding.maybe_initialize_distributed(c.mesh)
    mesh = jax.make_mesh((jax.device_count(),), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    ok = check_sequence_ops(mesh)
    train_and_evaluate(c, workdir)
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
