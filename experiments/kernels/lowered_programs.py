"""Lower every Pallas kernel entry for the GPU backends (Mosaic GPU, Triton) and Mosaic TPU on
this machine, forward and forward+backward, and print a hash per case: two checkouts whose
kernels are the same print the same kernel hashes.

    PYTHONPATH=$PWD python -m experiments.kernels.lowered_programs [--out FILE] [--only SUBSTR]

Each case is ``jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))`` of a kernel entry
(``hla_jax.kernels``, each backend named) or of an operator's ``impl="pallas"`` form
(``hla_jax.ops``, the composition around the kernels: packed documents, continued states, the
HLA chains), on abstract inputs.  Two hashes per case, of the program printed without source
locations: ``kernels`` over the kernel bodies alone (the ``backend_config`` of every Pallas
custom call, whose Triton and Mosaic payloads are the compiled kernels' IR), ``glue`` over the
rest of the module (the XLA around them).  The Triton lowering is told it targets an H200
(sm_90); nothing runs on a device.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

from hla_jax import ops
from hla_jax.kernels import (
    gated_deltanet_pallas,
    la_pallas,
    loglinear_gated_deltanet_pallas,
    loglinear_mamba2_pallas,
)

B, T, H, D = 1, 256, 2, 64
# a Pallas kernel's call: its target (Triton, Mosaic GPU, Mosaic TPU), operands, then the
# attributes that carry the kernel's IR
KERNEL_CALL = re.compile(r"(stablehlo\.custom_call @(?:__gpu\$xla\.gpu\.triton|mosaic_gpu_v2|"
                         r"tpu_custom_call)\([^)]*\)) (\{.*)$", re.M)
LOCATION = re.compile(r"\s*loc\(.*?\)$|^#loc.*$", re.M)


def spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def inputs(dtype, *, beta=False, lam=False, state=False):
    """Abstract ``q, k, v, g[, beta][, lam][, h0]`` at ``B, T, H, D``."""
    xs = [spec(B, T, H, D, dtype=dtype)] * 3 + [spec(B, T, H, dtype=jnp.float32)]
    if beta:
        xs.append(spec(B, T, H, dtype=jnp.float32))
    if lam:
        xs.append(spec(B, T, H, 10, dtype=jnp.float32))
    if state:
        xs.append(spec(B, H, D, D, dtype=jnp.float32))
    return xs


def loss(f, args):
    """The gradient of ``Σ o`` (``o = f(*args)``, or its first output) in every float input."""
    def scalar(*xs):
        o = f(*xs)
        return jnp.sum(o[0] if isinstance(o, tuple) else o)

    floats = tuple(i for i, x in enumerate(args) if jnp.issubdtype(x.dtype, jnp.floating))
    return jax.grad(scalar, argnums=floats)


def kernel_cases():
    """``(name, platform, f, args)`` of every kernel entry and backend."""
    bf = jnp.bfloat16
    for backend, platform in (("mosaic_gpu", "cuda"), ("triton", "cuda"), ("tpu", "tpu")):
        yield (f"la_pallas/{backend}", platform,
               lambda q, k, v, g, b=backend: la_pallas(q, k, v, g, backend=b, interpret=False),
               inputs(bf))
        yield (f"la_pallas_state/{backend}", platform,
               lambda q, k, v, g, h, b=backend: la_pallas(q, k, v, g, initial_state=h,
                                                          return_final_state=True, backend=b,
                                                          interpret=False),
               inputs(bf, state=True))
    for backend, platform in (("mosaic_gpu", "cuda"), ("tpu", "tpu")):
        yield (f"gated_deltanet_pallas/{backend}", platform,
               lambda q, k, v, g, beta, b=backend: gated_deltanet_pallas(
                   q, k, v, g, beta, backend=b, pieces=1, interpret=False),
               inputs(bf, beta=True))
    for backend, platform, c in (("triton", "cuda", 64), ("tpu", "tpu", 128)):  # TPU: (8,128) tiles
        yield (f"loglinear_mamba2_pallas/{backend}", platform,
               lambda q, k, v, g, lam, b=backend, c=c: loglinear_mamba2_pallas(
                   q, k, v, g, lam, chunk_size=c, backend=b, interpret=False),
               inputs(bf, lam=True))
        yield (f"loglinear_gated_deltanet_pallas/{backend}", platform,
               lambda q, k, v, g, beta, lam, b=backend, c=c: loglinear_gated_deltanet_pallas(
                   q, k, v, g, beta, lam, chunk_size=c, backend=b, interpret=False),
               inputs(bf, beta=True, lam=True))


def operator_cases():
    """``(name, "cuda", f, args)`` of every operator's ``impl="pallas"`` form, with packed
    documents and with a continued state where it takes them."""
    bf = jnp.bfloat16
    seg = spec(B, T, dtype=jnp.int32)
    pallas = dict(impl="pallas")
    for name in ("hla2", "ahla", "hla3"):
        entry = getattr(ops, name)
        yield name, "cuda", lambda q, k, v, g, e=entry: e(q, k, v, g, **pallas), inputs(bf)
        yield (f"{name}_normalize", "cuda",
               lambda q, k, v, g, e=entry: e(q, k, v, g, normalize=True, **pallas), inputs(bf))
        yield (f"{name}_segments", "cuda",
               lambda q, k, v, g, s, e=entry: e(q, k, v, g, segment_ids=s, **pallas),
               inputs(bf) + [seg])
    for name in ("linear_attention", "mamba2"):
        entry = getattr(ops, name)
        yield name, "cuda", lambda q, k, v, g, e=entry: e(q, k, v, g, **pallas), inputs(bf)
        yield (f"{name}_segments", "cuda",
               lambda q, k, v, g, s, e=entry: e(q, k, v, g, segment_ids=s, **pallas),
               inputs(bf) + [seg])
    yield ("loglinear_mamba2", "cuda",
           lambda q, k, v, g, lam: ops.loglinear_mamba2(q, k, v, g, lam, **pallas),
           inputs(bf, lam=True))
    yield ("loglinear_mamba2_segments", "cuda",
           lambda q, k, v, g, lam, s: ops.loglinear_mamba2(q, k, v, g, lam, segment_ids=s,
                                                           **pallas),
           inputs(bf, lam=True) + [seg])
    yield ("loglinear_mamba2_state", "cuda",
           lambda q, k, v, g, lam: ops.loglinear_mamba2(q, k, v, g, lam, return_final_state=True,
                                                        **pallas),
           inputs(bf, lam=True))
    yield ("loglinear_gated_deltanet", "cuda",
           lambda q, k, v, g, beta, lam: ops.loglinear_gated_deltanet(q, k, v, g, beta, lam,
                                                                      **pallas),
           inputs(bf, beta=True, lam=True))
    yield ("loglinear_gated_deltanet_segments", "cuda",
           lambda q, k, v, g, beta, lam, s: ops.loglinear_gated_deltanet(
               q, k, v, g, beta, lam, segment_ids=s, **pallas),
           inputs(bf, beta=True, lam=True) + [seg])


def lower(platform: str, fn, args) -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for ``platform``, without locations; for
    "cuda" the default backend reads as "gpu" while tracing, so the operators' kernels compile
    (not the CPU's interpret mode) and pick their GPU backends."""
    from jax._src.pallas.triton import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as triton_call

    h200 = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="9.0",  # noqa: E731
                                    compute_capability=90)
    saved = triton_call.gpu_info_lib.get_gpu_info, jax.default_backend
    triton_call.gpu_info_lib.get_gpu_info = h200
    if platform == "cuda":
        jax.default_backend = lambda: "gpu"
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
        return LOCATION.sub("", lowered.as_text(debug_info=False))
    finally:
        triton_call.gpu_info_lib.get_gpu_info, jax.default_backend = saved


def _unescape(s: str) -> bytes:
    """The bytes of an MLIR-printed string literal (``\\XX`` hex escapes)."""
    out, i = bytearray(), 0
    while i < len(s):
        if s[i] != "\\":
            out += s[i].encode()
            i += 1
        elif s[i + 1] in '\\"':
            out.append(ord(s[i + 1]))
            i += 2
        else:
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def _context():
    from jax._src.interpreters import mlir
    from jax._src.lib import mosaic_gpu_dialect, tpu, triton

    ctx = mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True
    for dialect in (triton.dialect, tpu, mosaic_gpu_dialect):
        dialect.register_dialect(ctx)
    return ctx


def _module_text(ir_bytes: bytes) -> str:
    """A serialized kernel module printed without locations."""
    from jax._src.lib.mlir import ir

    with _context():
        return ir.Module.parse(ir_bytes).operation.get_asm(enable_debug_info=False)


BYTECODE = re.compile(r'(ir|module) = "((?:[^"\\]|\\.)*)"')
KERNEL_HASH = re.compile(r'kernel_hash = "(?:[^"\\]|\\.)*", ')


def kernel_text(attrs: str) -> str:
    """A Pallas call's attributes with its kernel module printed without locations: Triton's
    ``ir`` and Mosaic GPU's ``module`` (MLIR bytecode; Mosaic GPU's ``kernel_hash``, a hash of
    that bytecode, dropped), Mosaic TPU's ``body`` (base64 bytecode in a JSON config)."""
    if attrs.startswith('{backend_config = "{'):
        config = json.loads(_unescape(re.match(r'\{backend_config = "((?:[^"\\]|\\.)*)"', attrs)[1]))
        body = config["custom_call_config"].pop("body")
        return json.dumps(config, sort_keys=True) + _module_text(base64.b64decode(body))
    m = BYTECODE.search(attrs)
    rest = KERNEL_HASH.sub("", attrs[:m.start()] + attrs[m.end():])
    return rest + _module_text(_unescape(m[2]))


def split(text: str):
    """``(kernels, glue)``: each Pallas call's kernel (``kernel_text``), and the program with
    the kernels cut out."""
    kernels = [kernel_text(m[2]) for m in KERNEL_CALL.finditer(text)]
    glue = KERNEL_CALL.sub(lambda m: m[1] + " <kernel>", text)
    return kernels, glue


def digest(x: str) -> str:
    return hashlib.sha256(x.encode()).hexdigest()[:16]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="write 'case kernels glue' lines here too")
    parser.add_argument("--dump", default="", help="a folder to write each case's program to")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    a = parser.parse_args(argv)
    lines = []
    for name, platform, f, args in (*kernel_cases(), *operator_cases()):
        for mode, fn in (("fwd", f), ("fwd+bwd", loss(f, args))):
            case = f"{name}/{platform}/{mode}"
            if a.only not in case:
                continue
            text = lower(platform, fn, args)
            kernels, glue = split(text)
            line = f"{case} {len(kernels)} {digest(''.join(kernels))} {digest(glue)}"
            print(line, flush=True)
            lines.append(line)
            if a.dump:
                path = pathlib.Path(a.dump) / case.replace("/", "__")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".kernels").write_text("\n\n".join(kernels))
                path.with_suffix(".glue").write_text(glue)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
