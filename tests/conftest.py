"""Test setup: an 8-device simulated CPU mesh (set before jax is imported) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One persistent compilation cache for every child process of the session (tests/_procs.py): a
    configuration that several tests run (the TINY runs of the multi-process, checkpoint and
    emulated-link tests) compiles once."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="session")
def mesh():
    """data=2 × tensor=4 over the 8 simulated CPU devices."""
    assert len(jax.devices()) == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))


def tp_value_and_grad(mesh, cfg, policy, sp=False, tp_overlap="none"):
    """Jitted (params, ids, targets) -> (loss, grads) of `cfg`'s model under `shard_map` on `mesh`:
    TP over "tensor" with `policy` (± sequence parallelism, ± `tp_overlap`), loss pmean'd over
    "data", gradient taken outside `shard_map` (the data-axis gradient psum comes from its transpose)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from taco_jax.models import make_model
    from taco_jax.parallel import ParallelContext, param_specs

    ctx = ParallelContext("tensor", policy, sp, tp_overlap=tp_overlap)
    abstract = nnx.eval_shape(lambda: make_model(cfg, ctx, rngs=nnx.Rngs(0), tensor_size=mesh.shape["tensor"]))
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = param_specs(state, mesh.axis_names)

    def local(params, ids, tgt):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        return jax.lax.pmean(nnx.merge(graphdef, st).loss(ids, tgt), "data")

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=P())
    return jax.jit(jax.value_and_grad(fn))
