"""Prefill of a long prompt: one parallel pass (the chunked forms' final states) against the
serial recurrence.

    python -m experiments.bench_prefill                          # T=4096
    python -m experiments.bench_prefill --mixers hla2 --T 8192 --repeats 5

For each mixer, a small LM (``--layers`` blocks, d_model ``--d_model``, heads of 64, float32) runs
``LM.prefill`` over a ``[1, T]`` prompt twice: with ``impl="auto"`` (every mixer's outputs and
final decode state from its chunked form in one pass, ``return_final_state``) and with
``impl="recurrent"`` (the state from a ``lax.scan`` of the decode step over the T tokens).
Reported: median wall time after compilation, the longest loop in each program's jaxpr (T for
the serial path, T / chunk or none for the parallel one) and whether the two give the same
logits and decode state.  Results: ``experiments/results/bench_prefill_<backend>.json`` and
``.md``, with their provenance.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments import common
from hla_jax.nn import LM, ModelConfig

MIXERS = "hla2,ahla,hla3,mamba2,gated_deltanet,loglinear_mamba2,loglinear_gated_deltanet"


def longest_loop(jaxpr) -> int:
    """The largest ``scan`` length anywhere in ``jaxpr`` (0 when there is none)."""
    def lengths(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "scan":
                yield eqn.params["length"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from lengths(sub)

    return max(lengths(jaxpr.jaxpr), default=0)


def prefill_fn(cfg):
    """``tokens -> (logits, cache)`` of a fresh model (seed 0) with config ``cfg``, jitted."""
    graphdef, state = nnx.split(LM(cfg, rngs=nnx.Rngs(0)))

    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        return model.prefill(tokens, model.init_cache(*tokens.shape))

    return jax.jit(run), state


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixers", default=MIXERS)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(common.RESULTS))
    args = p.parse_args(argv)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(1, args.T)), jnp.int32)
    rows, records = [], {}
    for mixer in tqdm(args.mixers.split(","), desc="prefill"):
        base = dict(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.d_model // 64, mixer_pattern=(mixer,), max_seq_len=args.T,
                    num_levels=max(16, int(np.ceil(np.log2(args.T))) + 1))
        rec = {}
        outs = {}
        for path, impl in (("parallel", "auto"), ("serial", "recurrent")):
            fn, state = prefill_fn(ModelConfig(**base, impl=impl))
            rec[path] = {"seconds": median_seconds(fn, state, tokens, repeats=args.repeats),
                         "longest_loop": longest_loop(jax.make_jaxpr(fn)(state, tokens))}
            outs[path] = fn(state, tokens)
        (la, ca), (lb, cb) = outs["parallel"], outs["serial"]
        rec["logits_rel_diff"] = float(jnp.linalg.norm(la - lb) / jnp.linalg.norm(lb))
        rec["state_rel_diff"] = max(
            float(jnp.linalg.norm(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))
                  / max(float(jnp.linalg.norm(jnp.asarray(y, jnp.float32))), 1e-30))
            for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)))
        records[mixer] = rec
        rows.append([mixer, f"{1e3 * rec['parallel']['seconds']:.2f}", str(rec["parallel"]["longest_loop"]),
                     f"{1e3 * rec['serial']['seconds']:.1f}", str(rec["serial"]["longest_loop"]),
                     f"{rec['serial']['seconds'] / rec['parallel']['seconds']:.1f}",
                     f"{rec['logits_rel_diff']:.1e} / {rec['state_rel_diff']:.1e}"])
    device = jax.devices()[0].device_kind
    md = (f"Prefill of a [1, {args.T}] prompt, {args.layers} layers, d_model {args.d_model}, "
          f"heads of 64, float32, median of {args.repeats}, {device} ({platform.machine()}, "
          f"{os.cpu_count()} cores).\n\n" + common.markdown_table(
              ["mixer", "one pass ms", "longest loop", "serial ms", "longest loop", "serial / one pass",
               "logits / state rel. diff"], rows))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"bench_prefill_{jax.default_backend()}"
    common.write_json(out / f"{name}.json", {"settings": vars(args), "device": device,
                                             "mixers": records})
    print(common.write_markdown(out / f"{name}.md", md))


if __name__ == "__main__":
    main()
