"""The configuration schema shared by ``configs/*.py``, its ``key=value`` argument parser and the
checks that turn a bad value into a ValueError before anything is compiled."""

import ast
import dataclasses
import difflib
import pathlib

import ml_collections

from hla_jax.data import data_vocab_size
from hla_jax.nn import MIXERS, ModelConfig


def base_config() -> ml_collections.ConfigDict:
    """Every field a run reads, with its default. ``configs/*.py`` start from this."""
    c = ml_collections.ConfigDict()
    c.seed = 0                      # parameter init seed; data seeds are data.seed
    # model: the fields of hla_jax.nn.ModelConfig (one decoder-only LM)
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=256,             # token ids in [0, vocab_size); 256 = bytes; 0 = the data's
                                    # (its tokenizer's; check_config writes it in)
        d_model=128,                # residual width; = n_heads * head_dim
        n_layers=2,                 # blocks (mixer + SwiGLU MLP, pre-RMSNorm)
        n_heads=2,                  # heads per mixer
        head_dim=0,                 # 0 -> d_model // n_heads
        mixer_pattern=("hla2",),    # layer i uses mixer_pattern[i % len]; names in hla_jax.nn.MIXERS
        mlp_hidden=0,               # SwiGLU hidden size; 0 -> 8/3 d_model rounded up to 64
        tie_embeddings=True,        # output projection = embedding transpose
        dtype="float32",            # compute dtype "float32" | "bfloat16"; params/optimizer f32
        chunk_size=64,              # chunk length of the chunked operators
        max_seq_len=2048,           # RoPE table length (softmax mixer)
        qk_norm=True,               # L2-normalise q/k in linear/HLA mixers
        conv_size=4,                # short causal depthwise conv width (0 = off)
        num_levels=16,              # log-linear λ levels (T <= 2**(num_levels-1))
        impl="auto",                # operator impl: reference|recurrent|scan|chunked|pallas|auto
        init_std=0.02,              # normal init std of matrices
        rope_theta=10000.0,         # RoPE base (softmax mixer)
        norm_eps=1e-6,              # RMSNorm epsilon
        output_gate="silu",         # mixer output gate: silu | sigmoid | none
        hla_decay=True,             # learned Mamba-style log-decay gate in linear/HLA mixers
        hla_normalize=False,        # ratio-normalised HLA (docs/math.md#hla2 `normalize`)
        hla_conv=True,              # short conv on q, k, v in linear/HLA mixers (as SSM mixers)
    ))
    c.data = ml_collections.ConfigDict(dict(
        kind="text",                # text (bytes of files) | tokens (prepared corpus) | mqar | niah
        path="",                    # text: file/folder/comma list ("" = Python stdlib sources);
                                    # tokens: the directory `python -m hla_jax.data.prepare` wrote
                                    # (or a bare .npy token memmap)
        pattern="*.txt",            # glob for files inside folders named by path (kind=text)
        seq_len=256,                # tokens per example (T)
        batch_size=8,               # global examples per optimizer step (all hosts, all micro-batches)
        seed=0,                     # data seed: batch `step` row `r` = rng([seed, split, step, r])
        eval_fraction=0.01,         # tail of a text corpus / bare memmap held out for eval
                                    # (a prepared corpus has its validation split)
        pack=False,                 # packed documents (text/tokens): segment_ids per row, no
                                    # attention/state/conv across documents, no loss on a
                                    # document's first token (hla_jax/data/pipeline.py)
        separator=-1,               # tokens + pack: the id that ends each document (-1 = the
                                    # tokenizer's end-of-document id)
        mqar=dict(num_kv_pairs=16,  # MQAR: key-value pairs per example (seq_len >= 4 * pairs)
                  power_a=0.01),    # MQAR: query gap distribution p(i) ∝ i^(power_a - 1)
        niah=dict(n_digits=5),      # NIAH: digits of the magic number
    ))
    c.optim = ml_collections.ConfigDict(dict(
        learning_rate=3e-3,         # peak AdamW learning rate (> 0)
        warmup_steps=20,            # linear warmup from 0 (optimizer steps)
        decay_steps=0,              # cosine decay length; 0 = train.num_steps
        min_lr_ratio=0.1,           # final lr = learning_rate * min_lr_ratio
        weight_decay=0.1,           # decoupled weight decay on matrices (ndim >= 2) only
        b1=0.9, b2=0.95, eps=1e-8,  # Adam moments
        clip_norm=1.0,              # global gradient-norm clip (0 = off)
        grad_accum=1,               # micro-batches per optimizer step (optax.MultiSteps)
    ))
    c.train = ml_collections.ConfigDict(dict(
        num_steps=200,              # optimizer steps in total (a resumed run continues to here)
        log_every=10,               # train metrics / NaN check period (steps)
        eval_every=200,             # eval period (0 = only at the end)
        eval_steps=4,               # eval batches (fixed, from the held-out split)
        checkpoint_every=200,       # save period (0 = only at the end)
        keep_checkpoints=2,         # newest checkpoints kept
        async_checkpoint=True,      # write checkpoints in the background
        nan_policy="stop",          # non-finite loss/grad norm: "stop" the run, or "skip" the
                                    # update (parameters and optimizer state unchanged)
        max_bad_steps=10,           # nan_policy=skip: stop after this many consecutive skips
        sample_tokens=128,          # tokens sampled at eval time, decoded by the data's
                                    # tokenizer (text/tokens data; 0 = off)
        sample_prompt=64,           # prompt length taken from an eval example
        sample_temperature=0.8,     # sampling temperature (0 = greedy)
        peak_flops=0.0,             # peak FLOP/s per device for MFU (0 = table by device kind)
        progress_bar=True,          # tqdm bar with loss, tokens/s and MFU
        tensorboard=True,           # also write TensorBoard events when a writer is importable
        wandb_project="",           # also log to this Weights & Biases project ("" = off;
                                    # extra wandb; WANDB_MODE=offline etc. as wandb reads them)
        profile_steps="",           # jax.profiler trace of steps "FIRST:LAST" (inclusive) into
                                    # workdir/profile ("" = off)
    ))
    c.mesh = ml_collections.ConfigDict(dict(
        data=-1, fsdp=1, tensor=1,  # mesh axis sizes; one may be -1 = the remaining devices
        sequence=1,                 # time-axis shards (sequence parallelism; data.seq_len
                                    # divisible by it; recurrent mixers need model.impl
                                    # chunked|auto)
        multihost=False,            # call jax.distributed.initialize() (multi-host pods)
        coordinator="",             # multihost: "host:port" of process 0 ("" = auto-detected)
        num_processes=0,            # multihost: processes in all (0 = auto-detected)
        process_id=-1,              # multihost: this process's id (-1 = auto-detected)
        coordinator_bind="",        # multihost: "host:port" process 0's coordinator listens on
                                    # ("" = JAX's default: every interface, coordinator's port)
        mtls=dict(cert_file="",     # multihost: mutual TLS of the coordination service: this
                  key_file="",      # host's PEM certificate chain, its private key and the CA
                  ca_file="",       # bundle that verifies the peers ("" = plain TCP)
                  peer_uri_prefix="",  # accept a peer iff a URI SAN starts with it ("" = host
                                       # name verification)
                  required=False),  # refuse to start without mTLS (JAX's
                                    # verify_secure_credentials)
        rules=(("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv", None),
               ("mlp", "tensor"), ("levels", None), ("conv", None)),  # logical -> mesh axis
    ))
    return c


def parse_arg(arg: str | None) -> dict:
    """``"mixer=hla2,size=tiny,d=64"`` -> ``{"mixer": "hla2", "size": "tiny", "d": 64}``
    (values that read as Python literals become numbers/bools, the rest stay strings)."""
    out = {}
    for item in filter(None, (arg or "").split(",")):
        if "=" not in item:
            raise ValueError(f"config argument {item!r} is not key=value (in {arg!r})")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def take_args(arg: str | None, defaults: dict) -> dict:
    """``parse_arg`` with every key checked against ``defaults`` (unknown -> ValueError)."""
    args = parse_arg(arg)
    unknown = sorted(set(args) - set(defaults))
    if unknown:
        close = [m for u in unknown for m in difflib.get_close_matches(u, defaults, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown config argument(s) {unknown}{hint}; valid: {sorted(defaults)}")
    return {**defaults, **args}


def mixer_pattern(pattern: str) -> tuple:
    """``"hla2+hla2+softmax"`` -> ``("hla2", "hla2", "softmax")``, names checked."""
    names = tuple(pattern.split("+"))
    bad = [m for m in names if m not in MIXERS]
    if bad:
        raise ValueError(f"unknown mixer(s) {bad} in {pattern!r}; valid: {MIXERS}")
    return names


def profile_steps(spec: str) -> tuple[int, int] | None:
    """``train.profile_steps`` -> ``(first, last)`` (inclusive), None when off: ``"10:12"`` or
    ``""``. ValueError naming the field otherwise."""
    if not spec:
        return None
    try:
        first, last = (int(x) for x in str(spec).split(":"))
    except ValueError:
        first = last = 0
    _require(1 <= first <= last, f"train.profile_steps must be 'FIRST:LAST' with 1 <= FIRST <= "
                                 f"LAST (the steps to trace, inclusive), or '' (off); got {spec!r}")
    return first, last


def _require(ok: bool, message: str):
    if not ok:
        raise ValueError(message)


def check_config(c, batch_shards: int = 1, process_count: int = 1,
                 sequence_shards: int = 1) -> ModelConfig:
    """Validate ``c`` (ValueError naming the field); returns the ModelConfig.
    ``batch_shards`` = devices splitting the batch (mesh data × fsdp); ``sequence_shards`` =
    devices splitting the time axis (mesh sequence: the ModelConfig gets ``seq_axis``).
    ``model.vocab_size=0`` is replaced in ``c`` by the data's vocabulary (``data_vocab_size``)."""
    if c.model.vocab_size == 0:
        vocab = data_vocab_size(c.data)
        _require(vocab is not None, f"model.vocab_size=0 takes the data's vocabulary; "
                 f"data.kind={c.data.kind!r} has none: give model.vocab_size")
        c.model.vocab_size = vocab
    model = ModelConfig.from_dict(c.model)
    if sequence_shards > 1:
        _require(c.data.seq_len % sequence_shards == 0,
                 f"data.seq_len={c.data.seq_len} must be divisible by mesh.sequence="
                 f"{sequence_shards} (the time axis is split evenly over it)")
        model = dataclasses.replace(model, seq_axis="sequence")  # checks model.impl
    o, t, d = c.optim, c.train, c.data
    _require(o.learning_rate > 0, f"optim.learning_rate must be positive, got {o.learning_rate}")
    _require(o.warmup_steps >= 0 and o.decay_steps >= 0,
             f"optim.warmup_steps / decay_steps must be >= 0, got {o.warmup_steps}, {o.decay_steps}")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _require(o.weight_decay >= 0 and o.clip_norm >= 0,
             f"optim.weight_decay and clip_norm must be >= 0, got {o.weight_decay}, {o.clip_norm}")
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1 and o.eps > 0, "optim.b1, b2 must be in [0, 1), eps > 0")
    _require(isinstance(o.grad_accum, int) and o.grad_accum >= 1,
             f"optim.grad_accum must be an int >= 1, got {o.grad_accum}")
    _require(t.num_steps >= 1, f"train.num_steps must be >= 1, got {t.num_steps}")
    _require(t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}")
    for name in ("eval_every", "eval_steps", "checkpoint_every", "sample_tokens", "sample_prompt"):
        _require(t[name] >= 0, f"train.{name} must be >= 0, got {t[name]}")
    _require(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    _require(t.nan_policy in ("stop", "skip"),
             f"train.nan_policy must be 'stop' or 'skip', got {t.nan_policy!r}")
    _require(t.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {t.max_bad_steps}")
    profile_steps(t.profile_steps)
    _require(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
    micro, split = divmod(d.batch_size, o.grad_accum)
    _require(split == 0 and micro % batch_shards == 0 and micro % process_count == 0,
             f"data.batch_size={d.batch_size} must be divisible by optim.grad_accum="
             f"{o.grad_accum} x {batch_shards} (the batch-splitting mesh axes data*fsdp)"
             + (f" and by {process_count} processes" if process_count > 1 else ""))
    if "softmax" in model.mixer_pattern:
        _require(d.seq_len <= model.max_seq_len,
                 f"data.seq_len={d.seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    if d.kind in ("text", "tokens") and d.path:
        for p in str(d.path).split(","):
            _require(pathlib.Path(p).exists(), f"data.path: {p} does not exist")
    _require(d.kind != "tokens" or bool(d.path),
             "data.kind=tokens needs data.path (a directory written by python -m "
             "hla_jax.data.prepare)")
    return model
