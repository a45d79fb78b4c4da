"""Shared fixtures: fresh random inputs per test (seeded by the test's name), x64 switching."""

import zlib

import jax
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
