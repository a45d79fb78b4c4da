"""hla_jax.train.sharding: mesh sizes from config, logical axis names -> mesh PartitionSpecs."""

import jax
import ml_collections
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from hla_jax.nn import LM, ModelConfig
from hla_jax.train import sharding


def mesh_cfg(**sizes):
    c = ml_collections.ConfigDict(dict(data=-1, fsdp=1, sequence=1, tensor=1, multihost=False))
    c.update(sizes)
    return c


def test_mesh_shape_fills_the_rest():
    assert sharding.mesh_shape(mesh_cfg(), 8) == (8, 1, 1, 1)
    assert sharding.mesh_shape(mesh_cfg(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 1, 2)
    assert sharding.mesh_shape(mesh_cfg(data=1), 8) == (1, 1, 1, 1)
    assert sharding.mesh_shape(mesh_cfg(sequence=4), 8) == (2, 1, 4, 1)
    mesh = sharding.make_mesh(mesh_cfg())
    assert mesh.axis_names == sharding.AXES and sharding.batch_size_per_shard(mesh) == 1


@pytest.mark.parametrize("sizes, n, match", [
    (dict(data=-1, fsdp=-1), 8, "at most one -1"),
    (dict(data=3, fsdp=-1), 8, "not divisible"),
    (dict(data=4, fsdp=4), 8, "needs 16 devices"),
    (dict(tensor=0), 8, "positive"),
])
def test_mesh_shape_errors(sizes, n, match):
    with pytest.raises(ValueError, match=match):
        sharding.mesh_shape(mesh_cfg(**sizes), n)


def test_logical_to_mesh_rules():
    mesh = AbstractMesh((2, 4, 1, 2), sharding.AXES)
    assert sharding.logical_to_mesh(("embed", "mlp"), (64, 256), mesh) == P("fsdp", "tensor")
    assert sharding.logical_to_mesh(("vocab", "embed"), (256, 6), mesh) == P("tensor", None)
    assert sharding.logical_to_mesh(("heads", "mlp"), (4, 8), mesh) == P("tensor", None)
    assert sharding.logical_to_mesh((None, "kv"), (3, 8), mesh) == P(None, None)
    assert sharding.logical_to_mesh(("embed",), (64, 3), mesh) == P("fsdp", None)


def test_state_shardings_cover_every_param():
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=2, mixer_pattern=("hla2", "softmax"))
    _, params, _ = nnx.split(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    mesh = AbstractMesh((2, 4, 1, 2), sharding.AXES)
    shardings = sharding.state_shardings(params, mesh)
    leaves = jax.tree.leaves(shardings)
    assert len(leaves) == len(jax.tree.leaves(params))
    specs = {s.spec for s in leaves}
    assert P("tensor", "fsdp") in specs or P("fsdp", "tensor") in specs  # embedding / MLP
    for s, x in zip(leaves, jax.tree.leaves(params)):
        for axis, dim in zip(s.spec, x.shape):
            assert axis is None or dim % mesh.shape[axis] == 0
