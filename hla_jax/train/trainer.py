"""The training loop, readable top to bottom: ``train_and_evaluate(config, workdir)``.

    from hla_jax.train import train_and_evaluate
    from configs import lm
    train_and_evaluate(lm.get_config("mixer=hla2,size=tiny"), "/tmp/run")

Resumes from the newest checkpoint in ``workdir`` that reads back whole (``Checkpointer``).
When the loss or gradient norm stops being finite it stops with FloatingPointError, without
saving (the last good checkpoint stays), or with ``train.nan_policy="skip"`` skips that update
and stops only after ``train.max_bad_steps`` consecutive skips. A ``workdir`` that cannot be
written is a ValueError before anything is built; a failed save a CheckpointError.
"""

import contextlib
import json
import math
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from absl import logging
from flax import nnx

from hla_jax import data as data_lib
from hla_jax.nn import LM, flops_per_token, generate, param_count
from hla_jax.train import sharding
from hla_jax.train.checkpoint import Checkpointer, abstract_with_shardings
from hla_jax.train.config import check_config, profile_steps
from hla_jax.train.metrics import MetricWriter, StepTrace, peak_flops
from hla_jax.train.optim import make_optimizer, make_schedule
from hla_jax.train.steps import eval_summary, make_eval_step, make_train_step


def init_state(model_cfg, seed, mesh, rules, tx):
    """Sharded ``(graphdef, params, rest, opt_state)`` and their shardings, built inside jit so
    parameters are created directly in place (never fully on one device)."""
    def split(model):
        return nnx.split(model, nnx.Param, ...)

    graphdef, abs_params, abs_rest = split(nnx.eval_shape(lambda: LM(model_cfg, rngs=nnx.Rngs(seed))))
    param_sh = sharding.state_shardings(abs_params, mesh, rules)
    rest_sh = jax.tree.map(lambda _: sharding.replicated(mesh), abs_rest)
    # the key is an argument: a closed-over seed makes the whole init a constant that XLA's
    # GPU compiler folds for minutes at ~150M parameters
    params, rest = jax.jit(lambda key: split(LM(model_cfg, rngs=nnx.Rngs(key)))[1:],
                           out_shardings=(param_sh, rest_sh))(jax.random.key(seed))
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abs_params), param_sh,
                                   transform_non_params=lambda _: sharding.replicated(mesh))
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    return graphdef, params, rest, opt_state, {"params": param_sh, "opt_state": opt_sh, "rest": rest_sh}


class Throughput:
    """Tokens/s and MFU over the steps since the last ``reset`` (compile/eval/save excluded)."""

    def __init__(self, tokens_per_step, flops_per_tok, peak_total):
        self.tokens_per_step, self.flops_per_tok, self.peak_total = tokens_per_step, flops_per_tok, peak_total
        self.reset()

    def reset(self):
        self.start, self.steps = time.perf_counter(), 0

    def read(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tok_s = self.steps * self.tokens_per_step / elapsed
        mfu = tok_s * self.flops_per_tok / self.peak_total if self.peak_total else None
        return {"tokens_per_s": tok_s, "mfu": mfu}


def check_writable(workdir: pathlib.Path):
    """ValueError naming ``workdir`` when its checkpoint folder cannot be created or written."""
    try:
        (workdir / "checkpoints").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir / "checkpoints"):
            pass
    except OSError as e:
        raise ValueError(f"workdir {workdir} cannot be written ({e.strerror or e}): give a "
                         f"--workdir on writable storage (all hosts must see it)") from e


def saved_config(c):
    """``c`` as the run's ``config.json`` records it: ``data.path`` (each of a comma list) made
    absolute, so that sampling and evaluation find the run's corpus and tokenizer from any
    directory."""
    saved = c.copy_and_resolve_references()
    if saved.data.path:
        saved.data.path = ",".join(str(pathlib.Path(p).absolute())
                                   for p in str(saved.data.path).split(","))
    return saved


def _bar_postfix(m: dict) -> dict:
    mfu = "n/a" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}%"
    return {"loss": f"{m['loss']:.4f}", "tok/s": f"{m['tokens_per_s']:.0f}", "mfu": mfu}


def evaluate(eval_step, params, rest, source, c, mesh, proc) -> dict:
    """Mean masked loss, token accuracy and whole-row accuracy over ``train.eval_steps`` fixed
    batches of the eval split."""
    micro = c.data.batch_size // c.optim.grad_accum
    it = data_lib.DataIterator(source, micro, c.data.seed, split=data_lib.EVAL, **proc)
    sums = None
    for _ in range(c.train.eval_steps):
        out = eval_step(params, rest, sharding.global_batch(next(it), mesh, micro))
        sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    return {k: float(v) for k, v in eval_summary(sums).items()}


def sample_text(graphdef, params, rest, source, c, step, tokenizer) -> dict:
    """``{"prompt", "continuation"}``: tokens sampled after a prompt cut from the first eval
    example, decoded by ``tokenizer`` (the data's: ``data_lib.tokenizer_for_data``)."""
    first = data_lib.make_batch(source, c.data.seed, data_lib.EVAL, 0, [0])["inputs"]
    prompt = first[:, :c.train.sample_prompt]
    model = nnx.merge(graphdef, params, rest)
    out = generate(model, prompt, c.train.sample_tokens, temperature=c.train.sample_temperature,
                   rng=jax.random.key(step))
    return {"prompt": tokenizer.decode(prompt[0]),
            "continuation": tokenizer.decode(np.asarray(out[0, prompt.shape[1]:]))}


def train_and_evaluate(config, workdir) -> dict:
    """Train ``config`` (see ``hla_jax.train.config.base_config``), writing checkpoints,
    ``metrics.jsonl`` and ``config.json`` under ``workdir``. Returns the last train/eval metrics.
    The metric writer, the checkpointer and the progress bar are closed on every exit."""
    with contextlib.ExitStack() as opened:
        return _train(config, pathlib.Path(workdir).absolute(), opened)


def _train(c, workdir: pathlib.Path, opened: contextlib.ExitStack) -> dict:
    sharding.maybe_initialize_distributed(c.mesh)
    mesh = sharding.make_mesh(c.mesh)
    proc = sharding.batch_block(mesh)  # this process's block of the rows of every batch
    model_cfg = check_config(c, sharding.batch_size_per_shard(mesh), proc["process_count"],
                             sharding.sequence_shards(mesh))
    check_writable(workdir)
    rules = tuple(tuple(r) for r in c.mesh.rules)
    train_src, eval_src = data_lib.make_sources(c.data, model_cfg.vocab_size)
    tx = make_optimizer(c.optim, c.train.num_steps)
    schedule = make_schedule(c.optim, c.train.num_steps)
    lead = jax.process_index() == 0
    saved = saved_config(c)
    writer = opened.enter_context(MetricWriter(
        workdir, enabled=lead, tensorboard=c.train.tensorboard,
        wandb_project=c.train.wandb_project, wandb_config=json.loads(saved.to_json_best_effort())))
    if lead:
        (workdir / "config.json").write_text(saved.to_json_best_effort(indent=2))

    graphdef, params, rest, opt_state, sh = init_state(model_cfg, c.seed, mesh, rules, tx)
    ckpt = opened.enter_context(Checkpointer(workdir / "checkpoints", c.train.keep_checkpoints,
                                             c.train.async_checkpoint))
    start, position = 0, 0
    if ckpt.latest_step() is not None:
        abstract = abstract_with_shardings({"params": params, "opt_state": opt_state},
                                           {"params": sh["params"], "opt_state": sh["opt_state"]})
        del params, opt_state
        state, meta = ckpt.restore_latest(abstract)
        params, opt_state = state["params"], state["opt_state"]
        start, position = meta["step"], meta["data_position"]
        writer.drop_after(start)
        logging.info("resumed from %s at step %d", ckpt.directory / str(start), start)
    train_it = data_lib.DataIterator(train_src, c.data.batch_size, c.data.seed,
                                     accum=c.optim.grad_accum, position=position, **proc)

    batch_sh = sharding.batch_sharding(mesh)
    repl = sharding.replicated(mesh)
    train_step = sharding.on_mesh(jax.jit(
        make_train_step(graphdef, tx, skip_nonfinite=c.train.nan_policy == "skip"),
        donate_argnums=(0, 1),
        in_shardings=(sh["params"], sh["opt_state"], sh["rest"], batch_sh),
        out_shardings=(sh["params"], sh["opt_state"], repl)), mesh)
    eval_step = sharding.on_mesh(jax.jit(
        make_eval_step(graphdef), in_shardings=(sh["params"], sh["rest"], batch_sh),
        out_shardings=repl), mesh)

    T, n_dev = c.data.seq_len, mesh.devices.size
    peak = peak_flops(jax.devices()[0].device_kind, c.train.peak_flops)
    fpt = flops_per_token(model_cfg, T)
    meter = Throughput(c.data.batch_size * T, fpt, peak and peak * n_dev)
    logging.info("model %s: %d params, %.3g train FLOPs/token at T=%d; mesh %s; %d tokens/step",
                 "+".join(model_cfg.mixer_pattern), param_count(nnx.merge(graphdef, params, rest)),
                 fpt, T, sharding.describe(mesh), c.data.batch_size * T)
    samples = c.data.kind in ("text", "tokens") and c.train.sample_tokens > 0 and c.train.eval_steps > 0
    tokenizer = data_lib.tokenizer_for_data(c.data) if samples else None

    bar = opened.enter_context(tqdm.tqdm(
        total=c.train.num_steps, initial=start, disable=not (lead and c.train.progress_bar),
        dynamic_ncols=True, desc="train"))
    pending, last, bad_run = [], {"step": start}, 0  # bad_run: consecutive non-finite steps
    trace = opened.enter_context(StepTrace(
        workdir / "profile" / (f"process_{jax.process_index()}" if jax.process_count() > 1 else ""),
        profile_steps(c.train.profile_steps)))

    def flush(step):
        """Fetch the metrics of the steps since the last flush; on a non-finite value stop, or
        (``nan_policy="skip"``: the step changed nothing) go on up to ``max_bad_steps`` in a row."""
        nonlocal bad_run
        values = jax.device_get([m for _, m in pending])
        finite = [math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in values]
        for (s, _), m, ok in zip(pending, values, finite):
            bad_run = 0 if ok else bad_run + 1
            what = f"non-finite loss {float(m['loss'])} / grad norm {float(m['grad_norm'])} at step {s}"
            if ok or (c.train.nan_policy == "skip" and bad_run < c.train.max_bad_steps):
                if not ok:
                    logging.warning("%s: update skipped (%d in a row)", what, bad_run)
                continue
            ckpt.wait()
            good = ckpt.latest_step()
            kept = (f"the last good checkpoint (step {good}) is kept in {ckpt.directory}"
                    if good is not None else f"no checkpoint had been saved in {ckpt.directory}")
            in_a_row = (f" ({bad_run} in a row = train.max_bad_steps)"
                        if c.train.nan_policy == "skip" else "")
            raise FloatingPointError(
                f"{what}{in_a_row}: stopped without saving; {kept}. Lower optim.learning_rate, "
                f"enable optim.clip_norm, check the data or the mixer's impl.")
        good_values = [m for m, ok in zip(values, finite) if ok]
        mean = lambda k: float(np.mean([m[k] for m in good_values])) if good_values else math.nan
        out = {"loss": mean("loss"), "grad_norm": mean("grad_norm"),
               "learning_rate": float(schedule(step - 1)), **meter.read()}
        if len(good_values) < len(values):
            out["skipped_steps"] = len(values) - len(good_values)
        pending.clear()
        writer.write(step, "train", out)
        bar.set_postfix(_bar_postfix(out))
        return out

    for step in range(start + 1, c.train.num_steps + 1):
        batch = sharding.global_batch(next(train_it), mesh, c.data.batch_size // c.optim.grad_accum)
        trace.before(step)
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            params, opt_state, m = train_step(params, opt_state, rest, batch)
        trace.after(step, m)
        pending.append((step, m))
        meter.steps += 1
        bar.update(1)
        if step == start + 1:  # exclude compilation from throughput
            jax.block_until_ready(m)
            meter.reset()
        final = step == c.train.num_steps
        periodic_eval = c.train.eval_every and step % c.train.eval_every == 0
        do_eval = c.train.eval_steps > 0 and (final or periodic_eval)
        do_save = final or (c.train.checkpoint_every and step % c.train.checkpoint_every == 0)
        if step % c.train.log_every == 0 or do_eval or do_save:
            last = {"step": step, "train": flush(step)}
        if do_eval:
            last["eval"] = evaluate(eval_step, params, rest, eval_src, c, mesh, proc)
            writer.write(step, "eval", last["eval"])
            logging.info("step %d eval %s", step, json.dumps(last["eval"]))
            if tokenizer is not None:
                last["sample"] = sample_text(graphdef, params, rest, eval_src, c, step, tokenizer)
                writer.write(step, "sample", last["sample"])
                logging.info("step %d sample: %r -> %r", step, *last["sample"].values())
        if do_save:
            ckpt.save(step, {"params": params, "opt_state": opt_state}, train_it.position)
        if do_eval or do_save:
            meter.reset()
    return last
