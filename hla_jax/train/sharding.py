"""Mesh, logical-axis rules and data placement: one config runs on a CPU, a GPU or a TPU slice.

Mesh axes ``(data, fsdp, sequence, tensor)``; sizes come from ``config.mesh`` with -1 = "the
rest" of the devices. The batch is split over ``data × fsdp``; parameters follow their logical
axis names (``nnx.get_partition_spec``) through ``rules``, e.g. ``embed -> fsdp`` (ZeRO-3 style)
and ``heads/mlp/vocab -> tensor`` (Megatron style). ``sequence`` splits the time axis of the
batch (exact sequence parallelism: the recurrent mixers run their op through
``ops.sequence.over_time``, everything else is partitioned automatically by XLA); the steps
then run under ``jax.set_mesh`` (``on_mesh``).
"""

import math
import pathlib

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")
DEFAULT_RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv", None),
                 ("mlp", "tensor"), ("levels", None), ("conv", None))


def maybe_initialize_distributed(mesh_cfg):
    """``jax.distributed.initialize`` when ``mesh.multihost`` is set: the coordinator, process
    count and process id from ``mesh.coordinator``, ``num_processes``, ``process_id`` where given
    (``hla_jax.launch`` gives them), else auto-detected from the cluster's environment; the
    coordinator's listening address from ``mesh.coordinator_bind`` and mutual TLS from
    ``mesh.mtls`` where given. CPU devices of different processes exchange through gloo."""
    if not mesh_cfg.multihost or jax.distributed.is_initialized():
        return
    n, i = mesh_cfg.num_processes, mesh_cfg.process_id
    if n < 0 or i < -1 or (n and i >= n):
        raise ValueError(f"mesh.num_processes={n}, mesh.process_id={i}: need num_processes >= 0 "
                         f"(0 = auto-detected) and -1 <= process_id < num_processes (-1 = "
                         f"auto-detected)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(mesh_cfg.coordinator or None, mesh_cfg.num_processes or None,
                               None if mesh_cfg.process_id < 0 else mesh_cfg.process_id,
                               coordinator_bind_address=mesh_cfg.coordinator_bind or None,
                               **mtls_arguments(mesh_cfg.mtls))


def mtls_arguments(mtls) -> dict:
    """``jax.distributed.initialize``'s mutual-TLS arguments from ``mesh.mtls`` (none when no
    file is given); ValueError naming the field when only some files are given or one is
    missing."""
    files = {k: str(mtls[k]) for k in ("cert_file", "key_file", "ca_file")}
    given = [k for k, v in files.items() if v]
    if given and len(given) < len(files):
        raise ValueError(f"mesh.mtls: give cert_file, key_file and ca_file together, got only "
                         f"{', '.join(given)}")
    for k, v in files.items():
        if v and not pathlib.Path(v).is_file():
            raise ValueError(f"mesh.mtls.{k}: {v} does not exist")
    for k in ("peer_uri_prefix", "required"):
        if mtls[k] and not given:
            raise ValueError(f"mesh.mtls.{k}={mtls[k]!r} needs cert_file, key_file and ca_file")
    out = {f"mtls_{k}": v for k, v in files.items() if v}
    if mtls.peer_uri_prefix:
        out["mtls_peer_uri_prefix"] = str(mtls.peer_uri_prefix)
    if mtls.required:
        out["verify_secure_credentials"] = True
    return out


def mesh_shape(mesh_cfg, n_devices: int) -> tuple:
    """Axis sizes in ``AXES`` order, one -1 replaced by the remaining devices."""
    sizes = [int(mesh_cfg[a]) for a in AXES]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive with at most one -1, got "
                         f"{dict(zip(AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"mesh: {n_devices} devices are not divisible by {known} "
                             f"({dict(zip(AXES, sizes))})")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) > n_devices:
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"only {n_devices} present")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    """The device mesh for ``config.mesh`` (the first prod(sizes) devices when fewer are asked)."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_cfg, len(devices))
    if math.prod(shape) < len(devices):
        logging.info("mesh %s uses %d of %d devices", shape, math.prod(shape), len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices[:math.prod(shape)])


def sequence_shards(mesh) -> int:
    """How many shards split the time axis (``sequence``)."""
    return mesh.shape["sequence"]


def on_mesh(f, mesh):
    """``f`` traced and run under ``jax.set_mesh(mesh)``, where ``ops.sequence.over_time`` finds
    the mesh of its ``shard_map``."""
    def call(*args):
        with jax.set_mesh(mesh):
            return f(*args)
    return call


def batch_size_per_shard(mesh) -> int:
    """How many shards split the batch axis (``data × fsdp``)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def logical_to_mesh(names, shape, mesh, rules=DEFAULT_RULES) -> P:
    """Mesh PartitionSpec for one array: each logical name maps through ``rules``; a mesh axis that
    does not divide its dimension, or is already used by an earlier dimension, is dropped."""
    table, used, spec = dict(rules), set(), []
    for name, dim in zip(tuple(names) + (None,) * (len(shape) - len(names)), shape):
        axis = table.get(name) if name is not None else None
        if axis is None or axis in used or dim % mesh.shape[axis]:
            spec.append(None)
        else:
            used.add(axis)
            spec.append(axis)
    return P(*spec)


def state_shardings(abstract_state, mesh, rules=DEFAULT_RULES):
    """NamedShardings, same tree as ``abstract_state`` (an nnx.State of ShapeDtypeStructs)."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda s, x: NamedSharding(mesh, logical_to_mesh(s, x.shape, mesh, rules)),
                        specs, abstract_state, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
    """For batches ``[accum, b, T]``: rows split over ``data × fsdp``, time over ``sequence``."""
    return NamedSharding(mesh, P(None, BATCH_AXES, "sequence"))


def batch_block(mesh) -> dict:
    """``{"process_index": i, "process_count": n}`` for ``DataIterator``: the rows of a global
    batch split into ``n`` equal blocks and this process addresses block ``i`` (processes that
    split only the time axis or the parameters share a block and load the same rows).
    ValueError when the processes' batch shards are not such blocks."""
    shards = mesh.devices.reshape(batch_size_per_shard(mesh), -1)  # [data*fsdp, sequence*tensor]
    held = [[s for s, devs in enumerate(shards) if any(d.process_index == p for d in devs)]
            for p in range(jax.process_count())]
    size = len(held[jax.process_index()])
    for p, h in enumerate(held):
        if not h or h != list(range(h[0], h[0] + size)) or h[0] % size:
            raise ValueError(f"mesh {describe(mesh)}: process {p} holds the batch shards {h}, "
                             f"not an aligned block of {size}; order the mesh axes so that each "
                             f"process's devices hold consecutive data x fsdp shards")
    return {"process_index": held[jax.process_index()][0] // size,
            "process_count": len(shards) // size}


def global_batch(local: dict, mesh, global_rows: int) -> dict:
    """This process's rows ``[accum, b/blocks, T]`` (``batch_block``) -> global arrays
    ``[accum, b, T]`` on the mesh (each device takes its part of the time axis)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(
        sharding, v, (v.shape[0], global_rows) + v.shape[2:]) for k, v in local.items()}


def describe(mesh) -> str:
    return " ".join(f"{a}={n}" for a, n in mesh.shape.items()) + f" ({np.prod(mesh.devices.shape)} devices)"
