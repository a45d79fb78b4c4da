"""Sample from a trained run: ``.venv/bin/python -m hla_jax.sample --workdir=RUN --prompt='def f(x):'``.

Loads ``RUN/config.json`` and the newest checkpoint's parameters (``--step`` picks another),
encodes each ``--prompt`` (repeat the flag for several) with the run's tokenizer, and continues
it by ``--max_new_tokens`` tokens: one parallel prefill over the prompts, then the mixers'
decode states (``hla_jax.nn.generate``). One prompt is streamed, its text printed as the tokens
come (``--nostream``: sampled in one compiled call, printed at the end); several prompts are
sampled together (prompts of different lengths in one batch) and printed one after the other.
Sampling stops early at the tokenizer's end-of-document id. ``--temperature=0`` is greedy;
``--top_k`` and ``--top_p`` (nucleus) restrict sampling. A bad flag or run is one line on stderr,
exit status 1.
"""

import sys

import jax
import numpy as np
from absl import flags, logging

from hla_jax import cli
from hla_jax.nn import generate, generate_stream
from hla_jax.nn.decoding import check_sampling
from hla_jax.train.restore import load_run


def until_eod(tokens: np.ndarray, eod_id) -> np.ndarray:
    """``tokens [n]`` up to (without) the first ``eod_id``."""
    if eod_id is None or eod_id not in tokens:
        return tokens
    return tokens[:int(np.argmax(tokens == eod_id))]


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, P], lengths [B])``: the prompts' ids left-aligned, zero-padded to the
    longest."""
    ids = tokenizer.encode_batch(list(prompts))
    empty = [i for i, x in enumerate(ids) if x.size == 0]
    if empty:
        raise ValueError(f"prompt: prompt {empty[0] + 1} encodes to no token; give some text")
    lengths = np.array([x.size for x in ids])
    tokens = np.zeros((len(ids), lengths.max()), np.int32)
    for row, x in zip(tokens, ids):
        row[:x.size] = x
    return tokens, lengths


def stream_text(tokenizer, tokens, write) -> list[int]:
    """Call ``write(piece)`` with the new text as each token of the iterator ``tokens`` (``[1]``
    arrays) arrives, holding back a trailing U+FFFD (an incomplete multi-byte character) until
    it is complete; stops at the end-of-document id. Returns the ids written."""
    ids, shown = [], ""
    for token in tokens:
        if int(token[0]) == tokenizer.eod_id:
            break
        ids.append(int(token[0]))
        text = tokenizer.decode(ids)
        ready = text.rstrip("\ufffd")
        if ready.startswith(shown) and len(ready) > len(shown):
            write(ready[len(shown):])
            shown = ready
    text = tokenizer.decode(ids)
    if text.startswith(shown):
        write(text[len(shown):])
    return ids


def sample(run, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int,
           top_p: float, seed: int, stream: bool, write) -> list[str]:
    """The continuation of each prompt (text up to the end-of-document id). With ``stream`` and
    one prompt, ``write`` gets the prompt and then the continuation piece by piece; otherwise it
    gets each prompt with its continuation once all are sampled."""
    tok = run.tokenizer
    tokens, lengths = encode_prompts(tok, prompts)
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.key(seed))
    if stream and len(prompts) == 1:
        steps = generate_stream(run.model, tokens, max_new_tokens, **settings)
        write(prompts[0])
        ids = stream_text(tok, steps, write)
        write("\n")
        return [tok.decode(ids)]
    out = np.asarray(generate(run.model, tokens, max_new_tokens, prompt_lengths=lengths, **settings))
    texts = [tok.decode(until_eod(row[n:n + max_new_tokens], tok.eod_id)) for row, n in zip(out, lengths)]
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        write(f"=== {i + 1}/{len(prompts)} ===\n{prompt}{text}\n")
    return texts


FLAGS = flags.FLAGS


def define_flags():
    """The command line (defined when run as a program, so that importing this module next to
    the other entry points defines nothing)."""
    flags.DEFINE_string("workdir", None, "The training run's workdir.", required=True)
    flags.DEFINE_multi_string("prompt", None, "Text to continue; repeat for several.", required=True)
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens to sample after each prompt.")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature (0 = greedy).")
    flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0 = all).")
    flags.DEFINE_float("top_p", 1.0, "Sample from the nucleus of this probability (1 = all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("step", None, "Checkpoint step to load (default: the newest).")
    flags.DEFINE_bool("stream", True, "Print one prompt's text as its tokens come.")


def main(argv):
    if not FLAGS["verbosity"].present:  # stdout is the text; orbax's INFO chatter hidden
        logging.set_verbosity(logging.WARNING)
    try:
        check_sampling(FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
        run = load_run(FLAGS.workdir, FLAGS.step)

        def write(text):
            sys.stdout.write(text)
            sys.stdout.flush()

        sample(run, FLAGS.prompt, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.top_p,
               FLAGS.seed, FLAGS.stream, write)
    except ValueError as e:
        cli.fail(str(e))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
