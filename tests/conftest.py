"""Shared fixtures: fresh random inputs per test (seeded by the test's name), x64 switching.

The suite runs XLA's CPU backend without its optimisation passes (set here, before JAX starts
a backend; a caller's own XLA_FLAGS are kept): it compiles far more than it computes, so this
takes a quarter to a third off its time on 2 cores, and nothing in it is timed."""

import os
import zlib

os.environ["XLA_FLAGS"] = " ".join(filter(None, (
    os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true")))

import jax  # noqa: E402
import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's node id: fresh per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def x64():
    """Enable float64 for one test."""
    with jax.enable_x64(True):
        yield
