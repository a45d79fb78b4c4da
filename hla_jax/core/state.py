"""Decode-state types and the state dtype: the plain operators' state is one ``[B,H,d,dv]``
array, the log-linear ones' a ``LevelState``; states are float32 whatever the inputs."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def state_dtype(*xs) -> jnp.dtype:
    """float32 state whatever the inputs; float64 when any input is float64."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in xs if x is not None])


class LevelState(NamedTuple):
    """Decode state of the log-linear operators (docs/math.md#loglinear).

    ``H: [L,B,H,d,dv]``: ``H[ℓ]`` holds the keys at level ℓ of the last token (``H[0]`` the
    token itself), carried through the transitions up to it; ``t: [B] int32``: the position of
    the next token in its document, one per row (rows may be at different positions).
    """

    H: jax.Array
    t: jax.Array
