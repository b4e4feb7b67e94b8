"""Test setup: an 8-device simulated CPU mesh (set before jax is imported) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


@pytest.fixture(scope="session")
def mesh():
    """data=2 × tensor=4 over the 8 simulated CPU devices."""
    assert len(jax.devices()) == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "tensor"))
