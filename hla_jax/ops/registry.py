"""The operator registry: every operator family, one line each.  The public entries
(``hla_jax.ops``), the models' mixer names, impls and state-taking impls (``hla_jax.nn``) and
the experiments' operator lists are all read from here.

A family is a module of ``ops.families`` with ``SPECS`` (its operators' ``ops.spec.Spec``) and
one public entry per spec, a function named as the spec.
"""

from __future__ import annotations

from hla_jax.ops.families import ahla, gated_deltanet, hla2, hla3, linear, loglinear, loglinear_hla
from hla_jax.ops.spec import IMPLS, STATE_IMPLS

FAMILIES = (linear, gated_deltanet, loglinear, hla2, ahla, hla3, loglinear_hla)

OPERATORS = {spec.name: spec for family in FAMILIES for spec in family.SPECS}
ENTRIES = {name: getattr(family, name) for family in FAMILIES for name in
           (spec.name for spec in family.SPECS)}
MIXERS = {spec.mixer: spec for spec in OPERATORS.values() if spec.mixer}

__all__ = ["ENTRIES", "FAMILIES", "IMPLS", "MIXERS", "OPERATORS", "STATE_IMPLS"]
