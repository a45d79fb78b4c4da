"""Shared fixtures: fresh random inputs per test (seeded by the test's name), x64 switching, and
each module's compiled programs freed when it ends.

The suite runs XLA's CPU backend without its optimisation passes (set here, before JAX starts
a backend; a caller's own XLA_FLAGS are kept): it compiles far more than it computes, so this
takes a quarter to a third off its time on 2 cores, and nothing in it is timed."""

import gc
import os
import pathlib
import zlib

os.environ["XLA_FLAGS"] = " ".join(filter(None, (
    os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true")))

import jax  # noqa: E402
import numpy as np
import pytest

MAPS = "/proc/self/maps"


def _memory_maps() -> int:
    with open(MAPS) as f:
        return sum(1 for _ in f)


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's node id: fresh per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def x64():
    """Enable float64 for one test."""
    with jax.enable_x64(True):
        yield


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs(request):
    """Drop every compiled program when a test module ends.

    XLA's CPU backend loads each compiled program's machine code into memory maps of its own
    (three per object file; one test of a Pallas kernel in interpret mode adds up to 1,800),
    and jit's caches keep every program alive: 73 tests of the kernel modules alone left 25,000
    maps. A worker that kept all it compiled reached Linux's limit on memory maps per process
    (``vm.max_map_count``, 65530 by default), late in a full run: the next compile's mmap failed
    and XLA's CPU compiler crashed in ``backend_compile_and_load``, in whichever test compiled
    then, with a segfault ("LLVM compilation error: Cannot allocate memory") or an abort ("LLVM
    ERROR: Unable to allocate section memory!"). Freed per module (not per test: a module's
    tests share programs), a worker holds one module's programs at a time; a module that alone
    holds half the limit fails here, by name, instead of crashing a later test.
    """
    yield
    held = _memory_maps() if os.path.exists(MAPS) else 0
    jax.clear_caches()
    gc.collect()
    limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text()) if held else 0
    assert held <= limit // 2, (f"{held} memory maps held at the end of {request.module.__name__} "
                                f"(a process may hold {limit}): it must compile less")
