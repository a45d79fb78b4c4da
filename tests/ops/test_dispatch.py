"""The dispatcher: ``impl="auto"``'s rule as a table, every form reachable, every input checked
once, bad input refused with a message naming the argument, and a dispatcher that names no
operator (everything that tells them apart is in their specs)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_gate, make_qkv

from hla_jax import ops
from hla_jax.core import checks, fenwick
from hla_jax.kernels.gdn import gdn_entry
from hla_jax.kernels.la import la_entry
from hla_jax.ops import dispatch, registry
from hla_jax.ops.families import hla3

B, T, H, d = 1, 40, 2, 16
OPS = tuple(registry.OPERATORS)  # every operator of the registry


def _args(rng, name, dtype=jnp.float32):
    q, k, v = (x.astype(dtype) for x in make_qkv(rng, B, T, H, d, d))
    args = [q, k, v, make_gate(rng, B, T, H)]
    if "deltanet" in name:
        args.append(jnp.full((B, T, H), 0.5))
    if name.startswith("loglinear"):
        args.append(jnp.ones((B, T, H, fenwick.num_levels(T))))
    return args


def _auto(rng, name, dtype=jnp.float32, mask="causal", **kw):
    """``auto``'s choice for ``ops.<name>(...)`` without running it."""
    a = _args(rng, name, dtype)
    if mask == "paper":
        a[3] = None
    beta = a[4] if "deltanet" in name else None
    lam = a[-1] if name.startswith("loglinear") else None
    args = dict(impl="auto", chunk_size=64, seq_axis=None, segment_ids=None, initial_state=None,
                return_final_state=False, **({"mask": mask} if name == "hla3" else {}))
    args.update(kw)
    _, c = dispatch.check(registry.OPERATORS[name], *a[:4], beta, lam, **args)
    return c.spec.auto(c)


SEG = np.repeat([0, 1], [15, 25])[None]


@pytest.mark.parametrize("name,rows,want", [
    ("linear_attention", "whole", "pallas"),
    ("mamba2", "packed", "pallas"),
    ("mamba2", "state", "pallas"),
    ("gated_deltanet", "whole", "pallas"),
    ("hla2", "whole", "pallas"),
    ("ahla", "state", "pallas"),
    ("hla3", "whole", "pallas"),
    ("hla3/paper", "whole", "chunked"),
    ("loglinear_mamba2", "whole", "pallas"),
    ("loglinear_mamba2", "packed", "pallas"),
    ("loglinear_mamba2", "state", "pallas"),
    ("loglinear_mamba2", "both", "chunked"),
    ("loglinear_gated_deltanet", "whole", "chunked_ut_kernel"),
    ("loglinear_gated_deltanet", "packed", "pallas"),
    ("loglinear_gated_deltanet", "state", "chunked"),
    ("loglinear_gated_deltanet", "both", "chunked"),
])
def test_auto_on_a_gpu_with_bf16(rng, monkeypatch, name, rows, want):
    """The specs' ``auto`` rules where the kernels are preferred (a Hopper GPU, bf16 inputs;
    faked here)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gdn_entry, "supports", lambda *a: True)
    name, _, mask = name.partition("/")
    kw = {"segment_ids": SEG if rows in ("packed", "both") else None,
          "return_final_state": rows in ("state", "both")}
    got = _auto(rng, name, jnp.bfloat16, mask=mask or "causal", **kw)
    assert got == want


@pytest.mark.parametrize("name", OPS)
def test_auto_elsewhere_is_chunked(rng, monkeypatch, name):
    """float32 inputs on a GPU, bf16 on a CPU, a chunk the kernels do not take, or Gated DeltaNet
    where its Hopper kernel does not run: XLA's chunked forms."""
    assert _auto(rng, name, jnp.bfloat16) == "chunked"  # this machine is a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _auto(rng, name, jnp.float32) == "chunked"
    if not name.startswith("loglinear"):  # the log-linear chunk is a power of two anyway
        assert _auto(rng, name, jnp.bfloat16, chunk_size=24) == "chunked"
    monkeypatch.setattr(gdn_entry, "supports", lambda *a: False)
    if "deltanet" in name:
        assert _auto(rng, name, jnp.bfloat16) == "chunked"


def test_every_operator_has_every_form():
    for name in OPS:
        forms = registry.OPERATORS[name].forms
        assert set(forms) >= {"reference", "recurrent", "scan", "chunked", "pallas"}
    assert "pallas" not in hla3.PAPER_SPEC.forms


def test_the_registry_is_the_public_api():
    """Every operator of the registry is a public entry of its name; every internal form can
    be named as an impl."""
    assert set(registry.OPERATORS) == set(registry.ENTRIES)
    for name in OPS:
        assert getattr(ops, name) is registry.ENTRIES[name]
    q, k, v, g, beta, lam = _args(np.random.default_rng(0), "loglinear_gated_deltanet")
    out = ops.loglinear_gated_deltanet(q, k, v, g, beta, lam, impl="chunked_ut_kernel")
    np.testing.assert_allclose(out, ops.loglinear_gated_deltanet(q, k, v, g, beta, lam,
                                                                 impl="chunked"),
                               atol=1e-4)


def test_dispatch_names_no_operator():
    """``ops/dispatch.py`` is generic: no operator's or family's name in its code (docstrings
    and comments aside), and no ``beta is None``-style test telling families apart."""
    source = (Path(dispatch.__file__)).read_text()
    code = re.sub(r'""".*?"""|#.*|hla_jax', "", source, flags=re.S)  # the package name aside
    names = {*registry.OPERATORS, *registry.MIXERS, "hla", "deltanet", "mamba", "loglinear",
             "paper", "linear_attention"}
    found = sorted(n for n in names if re.search(rf"\b\w*{n}\w*\b", code))
    assert not found, f"ops/dispatch.py names operators: {found}"
    assert not re.search(r"\b(beta|lam) is (not )?None", code)


def test_inputs_are_checked_once(rng, monkeypatch):
    """``ops.mamba2(impl="pallas")`` checks q, k, v at its entry, not again in the kernel."""
    calls = []

    def counted(*a, **kw):
        calls.append(kw.get("name"))
        return checks.check_qkv(*a, **kw)

    monkeypatch.setattr(dispatch, "check_qkv", counted)
    monkeypatch.setattr(la_entry, "check_qkv", counted)
    ops.mamba2(*_args(rng, "mamba2"), impl="pallas", chunk_size=16)
    assert calls == ["mamba2"]


@pytest.mark.parametrize("name", OPS)
def test_empty_inputs_are_refused(rng, name):
    a = [x[:, :0] for x in _args(rng, name)]
    with pytest.raises(ValueError, match=f"{name}: q, k, v must have at least one"):
        getattr(ops, name)(*a)


@pytest.mark.parametrize("name", [n for n in OPS if registry.OPERATORS[n].normalize])
@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_normalize_needs_a_positive_eps(rng, name, eps):
    with pytest.raises(ValueError, match=f"{name}: eps must be > 0"):
        getattr(ops, name)(*_args(rng, name), normalize=True, eps=eps)


def test_paper_mask_refuses_pallas_and_a_gate(rng):
    q, k, v, g = _args(rng, "hla3")
    with pytest.raises(ValueError, match=r"hla3 \(mask='paper'\): impl='pallas' is not one of"):
        ops.hla3(q, k, v, mask="paper", impl="pallas")
    with pytest.raises(ValueError, match="without decay"):
        ops.hla3(q, k, v, g, mask="paper")
    with pytest.raises(ValueError, match="mask='sideways' is not one of"):
        ops.hla3(q, k, v, mask="sideways")

