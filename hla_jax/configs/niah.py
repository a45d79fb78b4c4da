""".venv/bin/python -m hla_jax.main --config=configs/niah.py:mixer=hla2,seq_len=1024 --workdir=/tmp/niah

Needle in a haystack (passkey retrieval) on bytes.
Arguments: ``mixer`` (or ``pattern=a+b``), ``seq_len`` (context length in bytes), ``n_digits``.
Each example: filler sentences with " The magic number is N. " at a uniform random depth, then
" What is the magic number? The magic number is N"; only the digits of the final N are targets.
Eval reports ``accuracy`` (per digit) and ``row_accuracy`` (the whole number right).
Field meanings: ``hla_jax/train/config.py``.
"""

from hla_jax.train.config import base_config, mixer_pattern, take_args

ARGS = {"mixer": "hla2", "pattern": "", "seq_len": 1024, "n_digits": 5}


def get_config(arg: str | None = None):
    args = take_args(arg, ARGS)
    c = base_config()
    c.model.update(d_model=128, n_layers=2, n_heads=2, max_seq_len=max(2048, args["seq_len"]),
                   mixer_pattern=mixer_pattern(args["pattern"] or args["mixer"]))
    c.data.update(kind="niah", seq_len=args["seq_len"], batch_size=16)
    c.data.niah.n_digits = args["n_digits"]
    c.optim.update(learning_rate=1e-3, warmup_steps=200)
    c.train.update(num_steps=5000, log_every=50, eval_every=500, eval_steps=8,
                   checkpoint_every=1000, sample_tokens=0)
    return c
