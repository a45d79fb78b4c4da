"""Sampling and evaluation of a trained run: nucleus sampling, streamed decoding equal to the
one-jit loop, restoring a run's parameters, the lm-eval adapter's log-likelihoods equal to a
direct forward, rolling windows that score every token once, bits per byte on text files, a
custom lm-eval task set (multiple choice, generation, rolling) and the sampling command line."""

import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import persistent_compilation_cache
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from hla_jax import evaluate as evaluate_lib
from hla_jax import sample as sample_lib
from hla_jax.nn import LM, generate, generate_stream
from hla_jax.nn.decoding import sample_token
from hla_jax.train import train_and_evaluate
from hla_jax.train.config import base_config, mixer_pattern
from hla_jax.train.restore import load_run

CORPUS = "".join(f"def f{i}(x):\n    return x + {i % 10}\n\n" for i in range(300))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A hybrid (hla2 + softmax) byte model trained 4 steps, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("run")
    (root / "corpus.txt").write_text(CORPUS)
    c = base_config()
    c.model.update(d_model=32, n_layers=2, n_heads=2, mixer_pattern=mixer_pattern("linear+softmax"))
    c.data.update(kind="text", path=str(root / "corpus.txt"), seq_len=32, batch_size=4, pack=True)
    c.optim.update(learning_rate=1e-2, warmup_steps=1)
    c.train.update(num_steps=4, log_every=2, eval_every=0, eval_steps=0, checkpoint_every=2,
                   sample_tokens=0, progress_bar=False, tensorboard=False, async_checkpoint=False)
    train_and_evaluate(c, root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def run(workdir):
    return load_run(workdir)


def test_top_p_keeps_the_nucleus():
    """Probabilities 0.5, 0.3, 0.15, 0.05: the nucleus of 0.5 is the first token, of 0.7 the
    first two, of 0.85 the first three; top_k applies first."""
    logits = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]]))
    keys = jax.random.split(jax.random.key(0), 400)
    for top_p, top_k, support in [(0.5, 0, {1}), (0.7, 0, {1, 3}), (0.85, 0, {0, 1, 3}),
                                  (1.0, 0, {0, 1, 2, 3}), (0.85, 2, {1, 3})]:
        draws = jax.vmap(lambda k, top_k=top_k, top_p=top_p: sample_token(logits, k, 1.0, top_k, top_p))(keys)
        assert set(np.unique(draws).tolist()) == support, (top_p, top_k)
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(temperature=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            generate_stream(nnx.Module(), jnp.zeros((1, 2), jnp.int32), 3, **bad)


def test_load_run_restores_each_checkpoint(workdir, run):
    assert run.step == 4 and run.tokenizer.name == "bytes" and run.seq_len == 32
    older = load_run(workdir, step=2).model
    fresh = LM(run.model.cfg, rngs=nnx.Rngs(0))
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (run.model, older, fresh)]
    assert not np.allclose(leaves[0][0], leaves[1][0]) and not np.allclose(leaves[1][0], leaves[2][0])
    assert jax.tree.leaves(nnx.state(run.model, nnx.Param))[0].devices() == {jax.devices()[0]}
    with pytest.raises(ValueError, match=r"step: checkpoint 3 .* saved: \[2, 4\]"):
        load_run(workdir, step=3)
    with pytest.raises(ValueError, match="workdir: .*config.json does not exist"):
        load_run(workdir / "checkpoints")


def test_streamed_tokens_equal_the_one_jit_loop(run):
    """Ragged prompts, nucleus sampling: the host-driven steps give generate's tokens."""
    tokens, lengths = sample_lib.encode_prompts(run.tokenizer, ["def f1(x):\n", "def"])
    settings = dict(temperature=1.0, top_p=0.9, rng=jax.random.key(3), prompt_lengths=lengths)
    out = np.asarray(generate(run.model, tokens, 6, **settings))
    streamed = np.stack(list(generate_stream(run.model, tokens, 6, **settings)), axis=1)
    np.testing.assert_array_equal(streamed, [row[n:n + 6] for row, n in zip(out, lengths)])


def direct_logprobs(model, ids):
    """``log p(ids[t] | ids[:t])`` for t >= 1 from one forward (``len(ids) <= 33``, right-padded
    to 32 inputs: one compiled shape)."""
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :len(ids) - 1] = ids[:-1]
    logp = jax.nn.log_softmax(_forward(*nnx.split(model), jnp.asarray(tokens))[0], axis=-1)
    return np.asarray(logp, np.float64)[np.arange(len(ids) - 1), ids[1:]]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def test_loglikelihood_equals_a_direct_forward(run):
    lm = evaluate_lib.HarnessLM(run=run, batch_size=4)
    prefix = lm.prefix_token_id
    assert prefix == ord("\n")  # bytes without an end-of-document id: a line break
    pairs = [("def f3(x):\n    return", " x + 3"), ("", "def"), ("x" * 40, " + 1")]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        ids = [prefix] if not context else list(context.encode())
        ids = np.array(ids + list(continuation.encode()))[-33:]  # max_length = seq_len = 32
        direct = direct_logprobs(run.model, ids)[-len(continuation):]
        assert logp == pytest.approx(direct.sum(), rel=1e-5, abs=1e-4)
        assert isinstance(greedy, bool)

    text = CORPUS[:100]  # 100 bytes: windows of 32 predictions, the last with full context
    (rolled,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = list(text.encode())
    direct = sum(direct_logprobs(run.model, np.array(inputs + targets))[-len(targets):].sum()
                 for inputs, targets in map(make_disjoint_window,
                                            get_rolling_token_windows(ids, prefix, 32, 1)))
    assert rolled == pytest.approx(direct, rel=1e-5)


@pytest.mark.parametrize("n, width", [(1, 4), (4, 4), (5, 4), (13, 4), (100, 32)])
def test_rolling_windows_score_every_token_once(n, width):
    """The windows are lm-eval's (get_rolling_token_windows with context 1, made disjoint)."""
    ids = list(range(1, n + 1))
    s = [0] + ids
    ours = [(s[a:b], s[b - scored + 1:b + 1]) for a, b, scored in evaluate_lib.rolling_windows(n, width)]
    theirs = [((a + t)[:-1], t) for a, t in map(make_disjoint_window,
                                                 get_rolling_token_windows(ids, 0, width, 1))]
    assert ours == theirs
    assert sum((t for _, t in ours), []) == ids
    assert all(len(a) == min(width, s.index(t[-1])) for a, t in ours)


MC = [("def f1(x):\n    return x +", ["1", "7"], 0), ("def f2(x):\n    return", ["x + 2", "y"], 0),
      ("def f3(x):\n   ", ["return x + 3", "pass"], 0), ("def f4(", ["x):", "y, z):"], 0)]
GEN = [("def f5(x):\n    return x + ", "5"), ("def f6(x):\n", "    return x + 6")]
ROLL = [CORPUS[:50], CORPUS[:90]]


def write_tasks(folder):
    """``MC`` as a multiple-choice task, ``GEN`` as a generation task and ``ROLL`` as a rolling
    log-likelihood task, over local JSONL files."""
    data = {"mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC],
            "gen": [{"prompt": p, "target": t} for p, t in GEN],
            "roll": [{"text": t} for t in ROLL]}
    kinds = {"mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                   'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n'
                   '  - metric: acc\n',
             "gen": 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
                    'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
                    'metric_list:\n  - metric: exact_match\n',
             "roll": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                     'metric_list:\n  - metric: bits_per_byte\n'}
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"tiny_{name}.yaml").write_text(
            f"task: tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder / name}.jsonl\n  cache_dir: {folder / 'cache'}\ntest_split: test\n"
            + kinds[name])


def requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_tasks_and_text_files(workdir, run, tmp_path):
    """lm-eval's metrics over the custom tasks, and the text files' bits per byte, recomputed
    from the adapter's own (forward-checked) log-likelihoods and generations."""
    write_tasks(tmp_path)
    (tmp_path / "a.txt").write_text(ROLL[0])
    (tmp_path / "b.txt").write_text("héllo wörld\n" * 3)  # multi-byte characters
    out = evaluate_lib.evaluate(workdir, ["tiny_mc", "tiny_gen", "tiny_roll"],
                                [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                                include_path=str(tmp_path), batch_size=4, bootstrap_iters=0)
    assert out["step"] == 4 and set(out["tasks"]) == {"tiny_mc", "tiny_gen", "tiny_roll"}
    lm = evaluate_lib.HarnessLM(run=run, batch_size=4)

    right = [max(range(len(c)), key=lambda j: lm.loglikelihood(requests(
        "loglikelihood", [(q, " " + c[j])]))[0][0]) == a for q, c, a in MC]
    assert out["tasks"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(right))
    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    texts = lm.generate_until(requests("generate_until", [(p, kwargs) for p, _ in GEN]))
    assert out["tasks"]["tiny_gen"]["exact_match,none"] == np.mean([x == t for x, (_, t) in zip(texts, GEN)])

    def bits_per_byte(texts):
        logp = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
        return -sum(logp) / math.log(2) / sum(len(t.encode()) for t in texts), sum(logp)

    assert out["tasks"]["tiny_roll"]["bits_per_byte,none"] == pytest.approx(bits_per_byte(ROLL)[0])
    files = out["text_files"]
    texts = [ROLL[0], "héllo wörld\n" * 3]
    bpb, logp = bits_per_byte(texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    assert files[str(tmp_path / "b.txt")]["bytes"] == len(texts[1].encode()) == 3 * 14
    assert files["all"]["tokens"] == files["all"]["bytes"] == n_bytes  # one token per byte
    assert files["all"]["bits_per_byte"] == pytest.approx(bpb, rel=1e-6)
    assert files["all"]["perplexity"] == pytest.approx(math.exp(-logp / n_bytes), rel=1e-6)
    with pytest.raises(ValueError, match="tasks: unknown lm-eval task"):
        evaluate_lib.evaluate(workdir, ["no_such_task"], include_path=str(tmp_path))


def test_generate_until_stops_at_the_stop_string(run):
    lm = evaluate_lib.HarnessLM(run=run, batch_size=4)
    kwargs = {"until": ["\n", "x"], "max_gen_toks": 6}  # as tiny_gen: the same compiled steps
    for text in lm.generate_until(requests("generate_until", [("def f1(x):\n    return", kwargs),
                                                              ("def", kwargs)])):
        assert "\n" not in text and "x" not in text and len(text.encode()) <= 6
    with pytest.raises(ValueError, match="gen_kwargs"):
        lm.generate_until(requests("generate_until", [("a", {"num_beams": 2})]))


def test_sample_streams_and_the_command_line_prints_the_same(workdir, run, tmp_path):
    with persistent_compilation_cache(tmp_path):  # the command line below reads what this compiles
        pieces = []
        (text,) = sample_lib.sample(run, ["def f1(x):"], 6, 0.0, 0, 1.0, 0, True, pieces.append)
    assert "".join(pieces) == f"def f1(x):{text}\n" and len(pieces) > 3  # streamed
    (batched,) = sample_lib.sample(run, ["def f1(x):"], 6, 0.0, 0, 1.0, 0, False, pieces.append)
    assert batched == text and pieces[-1] == f"=== 1/1 ===\ndef f1(x):{text}\n"  # one-jit loop

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, "-m", "hla_jax.sample", f"--workdir={workdir}", "--max_new_tokens=6",
           "--temperature=0", "--prompt=def f1(x):"]
    one = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    assert one.stdout == f"def f1(x):{text}\n"
    bad = subprocess.run(cmd + ["--top_p=0"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "top_p must be in (0, 1]" in bad.stderr
    assert "Traceback" not in bad.stderr
