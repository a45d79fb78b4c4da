""".venv/bin/python -m hla_jax.main --config=configs/lm.py:mixer=hla2,size=tiny --workdir=/tmp/lm_tiny

Language modelling on bytes.

Arguments (after the colon, comma-separated key=value):
  mixer    one of hla_jax.nn.MIXERS (default hla2), used in every layer
  size     tiny | 30m | small | 350m | 1b (default tiny)
  pattern  hybrid stack, e.g. ``pattern=hla2+hla2+softmax`` (layer i uses entry i mod 3);
           overrides ``mixer``
Any field can then be overridden, e.g. ``--config.train.num_steps=1000 --config.mesh.fsdp=-1``.
Data defaults to the embedded corpus (the bytes of this Python's standard library sources),
packed: each source file is one document (``data.pack=True``: no attention or state across files,
no loss on a file's first byte). A real corpus: ``--config.data.kind=tokens
--config.data.path=DIR --config.model.vocab_size=0``, DIR written by ``hla_jax.data.prepare``
(documents packed at its end-of-document token, the vocabulary its tokenizer's).
Field meanings: ``hla_jax/train/config.py``.

Sizes (params with a 256-byte vocabulary; softmax's RoPE table covers twice the training
length, for evaluations beyond it):
  tiny   d=128, 2 layers, T=256, batch 16, 400 steps: about 2-7 minutes on 2 CPU cores,
         depending on the CPU
  30m    d=512, 10 layers, T=4096, batch 8, 1000 steps (32-35M, 33M tokens: about one pass over
         the embedded corpus): one GPU, the long-context comparison (experiments/long_context.py;
         evaluate at 2T: the RoPE table covers it)
  small  d=768, 12 layers, T=2048, batch 64 (~85M): one GPU
  350m   d=1024, 24 layers, T=2048, batch 128 (~300M): a GPU node, fsdp
  1b     d=2048, 24 layers, T=2048, batch 256 (~1.2B): fsdp over a node or pod slice
"""

from hla_jax.train.config import base_config, mixer_pattern, take_args

SIZES = {
    #        d_model layers heads seq_len batch steps  lr     warmup dtype       fsdp
    "tiny": (128, 2, 2, 256, 16, 400, 3e-3, 40, "float32", 1),
    "30m": (512, 10, 4, 4096, 8, 1000, 1.5e-3, 100, "bfloat16", 1),
    "small": (768, 12, 12, 2048, 64, 20_000, 1e-3, 1000, "bfloat16", 1),
    "350m": (1024, 24, 16, 2048, 128, 40_000, 6e-4, 2000, "bfloat16", -1),
    "1b": (2048, 24, 16, 2048, 256, 60_000, 4e-4, 2000, "bfloat16", -1),
}


ARGS = {"mixer": "hla2", "size": "tiny", "pattern": ""}


def get_config(arg: str | None = None):
    args = take_args(arg, ARGS)
    if args["size"] not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {args['size']!r}")
    d, layers, heads, T, batch, steps, lr, warmup, dtype, fsdp = SIZES[args["size"]]
    c = base_config()
    c.model.update(d_model=d, n_layers=layers, n_heads=heads, dtype=dtype, max_seq_len=max(2 * T, 2048),
                   mixer_pattern=mixer_pattern(args["pattern"] or args["mixer"]))
    c.data.update(kind="text", seq_len=T, batch_size=batch, pack=True)
    c.optim.update(learning_rate=lr, warmup_steps=warmup)
    c.train.update(num_steps=steps)
    if args["size"] != "tiny":
        c.train.update(log_every=50, eval_every=1000, eval_steps=20, checkpoint_every=1000)
        c.mesh.update(data=-1 if fsdp == 1 else 1, fsdp=fsdp)
    return c
