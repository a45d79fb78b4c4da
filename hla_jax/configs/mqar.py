""".venv/bin/python -m hla_jax.main --config=configs/mqar.py:mixer=hla2,d_model=32 --workdir=/tmp/mqar

Multi-query associative recall (Zoology / log-linear paper setup) on synthetic tokens.
Arguments: ``mixer`` (or ``pattern=a+b``), ``d_model`` (the paper sweeps 16/32/64),
``num_kv_pairs`` (key-value pairs per example), ``seq_len`` (256 in the paper).
Each example: ``k1 v1 ... kN vN`` then the keys again at random positions; only the values
after the queried keys count (loss mask). Eval reports ``accuracy`` (per query, the paper's
metric) and ``row_accuracy`` (all queries of an example right). Vocabulary 8192: keys from the
first half, values from the second. Field meanings: ``hla_jax/train/config.py``.
"""

from hla_jax.train.config import base_config, mixer_pattern, take_args

ARGS = {"mixer": "hla2", "pattern": "", "d_model": 64, "num_kv_pairs": 16, "seq_len": 256}


def get_config(arg: str | None = None):
    args = take_args(arg, ARGS)
    c = base_config()
    c.model.update(vocab_size=8192, d_model=args["d_model"], n_layers=2, n_heads=1,
                   mixer_pattern=mixer_pattern(args["pattern"] or args["mixer"]))
    c.data.update(kind="mqar", seq_len=args["seq_len"], batch_size=64)
    c.data.mqar.num_kv_pairs = args["num_kv_pairs"]
    c.optim.update(learning_rate=1e-3, warmup_steps=500, weight_decay=0.1)
    c.train.update(num_steps=20_000, log_every=100, eval_every=1000, eval_steps=16,
                   checkpoint_every=2000, sample_tokens=0)
    return c
