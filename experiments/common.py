"""Shared pieces of the experiment scripts: configs by file, quiet training runs, checkpoint
loading through the trainer's own machinery, results JSON with their provenance, Markdown
tables and figures."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import jax
import ml_collections
import tqdm
from flax import nnx
from matplotlib.figure import Figure

from hla_jax.train import sharding
from hla_jax.train.checkpoint import Checkpointer, abstract_with_shardings
from hla_jax.train.config import check_config
from hla_jax.train.optim import make_optimizer
from hla_jax.train.steps import token_nll
from hla_jax.train.trainer import init_state, train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def get_config(name: str, arg: str = ""):
    """``configs/<name>.py``'s ``get_config(arg)`` (loaded by path: ``configs`` is no package)."""
    spec = importlib.util.spec_from_file_location(f"configs_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg or None)


def compilation_cache(path: str) -> None:
    """Share compiled programs between runs and processes with the same shapes (e.g. MQAR runs
    that differ only in their data): JAX's persistent compilation cache under ``path`` ("" = off)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def quiet(c, eval_every: int = 0, checkpoint_every: int = 0):
    """Settings for runs inside a sweep (a sweep's ``--set`` applies after them): no per-step
    bar, no TensorBoard, synchronous saves (the workdir may be deleted right after), one save at
    the end (and every ``checkpoint_every`` steps when given, the last one kept) and eval at the
    end (and every ``eval_every`` steps when given)."""
    c.train.update(progress_bar=False, tensorboard=False, async_checkpoint=False, eval_every=eval_every,
                   checkpoint_every=checkpoint_every, keep_checkpoints=1, sample_tokens=0)
    return c


def load_config(workdir) -> ml_collections.ConfigDict:
    """The ``config.json`` the trainer wrote into ``workdir``."""
    d = json.loads((pathlib.Path(workdir) / "config.json").read_text())
    d["model"]["mixer_pattern"] = tuple(d["model"]["mixer_pattern"])
    d["mesh"]["rules"] = tuple(tuple(r) for r in d["mesh"]["rules"])
    return ml_collections.ConfigDict(d)


def load_model(workdir):
    """``(config, model, step)``: the newest checkpoint of a ``train_and_evaluate`` workdir,
    restored with ``trainer.init_state`` shardings and ``Checkpointer`` onto this host's mesh."""
    c = load_config(workdir)
    mesh = sharding.make_mesh(c.mesh)
    model_cfg = check_config(c, sharding.batch_size_per_shard(mesh), jax.process_count(),
                             sharding.sequence_shards(mesh))
    tx = make_optimizer(c.optim, c.train.num_steps)
    rules = tuple(tuple(r) for r in c.mesh.rules)
    graphdef, params, rest, opt_state, sh = init_state(model_cfg, c.seed, mesh, rules, tx)
    with Checkpointer(pathlib.Path(workdir).absolute() / "checkpoints", async_save=False) as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
        abstract = abstract_with_shardings({"params": params, "opt_state": opt_state},
                                           {"params": sh["params"], "opt_state": sh["opt_state"]})
        state, _ = ckpt.restore(step, abstract)
    return c, nnx.merge(graphdef, state["params"], rest), step


def figure(ncols: int = 1, figsize=(6, 4), **kw):
    """``(fig, axes[0..ncols))``: a pyplot-free Figure (no backend needed; a notebook shows it
    with ``display(fig)``)."""
    fig = Figure(figsize=figsize)
    return fig, list(fig.subplots(1, ncols, squeeze=False, **kw)[0])


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_json(path) -> dict:
    path = pathlib.Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def start_mps():
    """Start the CUDA MPS control daemon unless it runs (``echo quit | nvidia-cuda-mps-control``
    stops it): processes started after it share the GPU side by side instead of in turns."""
    try:
        if subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True).returncode:
            subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit("--mps: could not start the CUDA MPS daemon "
                         f"(nvidia-cuda-mps-control -d): {e}") from e


@contextlib.contextmanager
def locked(folder):
    """An exclusive lock on ``folder`` (``flock`` on the folder itself: no lock file left behind)
    for a read-modify-write of results that several processes share."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@functools.cache
def git_commit() -> str:
    """``$HLA_JAX_COMMIT`` when set (a copy of the tree sent to another machine, whose ``.git``
    may be absent or stale), else ``git rev-parse HEAD`` of the repository, ``-dirty`` appended
    when a tracked file outside ``experiments/results`` has changes (the results a run rewrites
    do not count); ``unknown`` outside a git checkout."""
    if os.environ.get("HLA_JAX_COMMIT"):
        return os.environ["HLA_JAX_COMMIT"]

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                            ":!experiments/results") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """This process's command, as it was typed: ``python -m experiments.NAME ARGS`` for a module
    run with ``-m``, else ``python SCRIPT ARGS``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def provenance(command: str | None = None, device: bool = True) -> dict:
    """Where a result comes from: the commit (``git_commit``), the UTC time, the command line
    (``command``, default ``command_line()``), the JAX version and, with ``device``, the first
    device's kind and platform and the device count (this starts JAX's backend: a process that
    must leave the accelerator to its children passes ``device=False``)."""
    out = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": command or command_line(), "jax": jax.__version__}
    if device:
        d = jax.devices()[0]
        out.update(device=d.device_kind, platform=d.platform, device_count=jax.device_count())
    return out


def provenance_line(p: dict | None = None) -> str:
    """One Markdown line of ``provenance()`` (or of ``p``), the header of a results table."""
    p = p or provenance()
    where = (f", {p['device']} ({p['platform']}) x{p['device_count']}" if "device" in p else "")
    return f"Commit `{p['commit']}`, jax {p['jax']}{where}, {p['date']}: `{p['command']}`"


def write_json(path, obj, prov: dict | None = None):
    """Write a results file atomically (a crash mid-sweep never leaves a truncated one); a dict
    gets ``prov`` (default: this call's ``provenance()``) under ``"provenance"``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, dict):
        obj = {**obj, "provenance": prov or provenance()}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False))
    os.replace(tmp, path)


def write_markdown(path, text: str, p: dict | None = None) -> str:
    """Write a results table with ``provenance_line`` above it; returns what was written."""
    text = provenance_line(p) + "\n\n" + text.rstrip("\n") + "\n"
    pathlib.Path(path).write_text(text)
    return text


def fmt(x, digits: int = 1, scale: float = 100.0) -> str:
    """Percent-style cell: ``None`` -> "–"."""
    return "–" if x is None else f"{scale * x:.{digits}f}"


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def token_nll_fn(model):
    """Jitted ``batch -> (nll [b,T], correct [b,T])`` of ``model`` (the trainer's ``token_nll``)."""
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda state, batch: token_nll(nnx.merge(graphdef, state), batch))
    return lambda batch: f(state, batch)


def add_train_args(p, mixers: str, seq_len_default: int, seq_len_help: str):
    """The ``--train`` options shared by the scripts that evaluate trained checkpoints."""
    p.add_argument("--workdirs", default="", help="comma list of trained workdirs")
    p.add_argument("--train", action="store_true", help="train one model per --mixers first")
    p.add_argument("--mixers", default=mixers)
    p.add_argument("--train_seq_len", type=int, default=seq_len_default, help=seq_len_help)
    p.add_argument("--steps", type=int, default=0, help="--train steps (0 = the config's)")
    p.add_argument("--d_model", type=int, default=0, help="--train width override")
    p.add_argument("--train_batch", type=int, default=0, help="--train batch override")
    p.add_argument("--workroot", default="", help="where --train puts workdirs (default: temp)")
    p.add_argument("--set", default=[], action="append", metavar="KEY=VALUE",
                   help="--train config override, e.g. model.hla_decay=true (repeatable)")


def apply_train_args(c, args):
    """Apply the ``--train`` overrides (steps, width, batch) to config ``c`` in place."""
    if args.steps:
        c.train.num_steps = args.steps
        c.optim.warmup_steps = min(c.optim.warmup_steps, args.steps // 10)
    if args.d_model:
        c.model.update(d_model=args.d_model, n_heads=min(c.model.n_heads, args.d_model // 16) or 1)
    c.data.batch_size = args.train_batch or c.data.batch_size
    return apply_set(c, args.set)


def apply_set(c, items):
    """Apply ``KEY=VALUE`` overrides (dotted keys of config ``c``) in place; returns ``c``."""
    for item in items:
        key, _, value = item.partition("=")
        c.update_from_flattened_dict({key: yaml_value(value)})
    return c


def yaml_value(text: str):
    """``true``/``false``, numbers, else the string (the types of ``--config.x=...``)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def checkpoint_step(workdir) -> int | None:
    """The step of ``workdir``'s latest checkpoint (None without one)."""
    with Checkpointer(pathlib.Path(workdir) / "checkpoints", async_save=False) as ckpt:
        return ckpt.latest_step()


def train_workdirs(configs: dict, root) -> dict:
    """Train each ``{name: config}`` (``quiet`` ones, ``--set`` applied after) into
    ``root/<name>`` (resuming, or skipped when already at its last step); returns
    ``{name: workdir}``."""
    out = {}
    for name, c in tqdm.tqdm(configs.items(), desc="train", dynamic_ncols=True):
        workdir = pathlib.Path(root) / name
        if checkpoint_step(workdir) != c.train.num_steps:
            train_and_evaluate(c, workdir)
        out[name] = str(workdir)
    return out


def metrics(workdir, split: str) -> list[dict] | None:
    """The ``split`` records ("train", "eval", "sample") the trainer wrote to
    ``workdir/metrics.jsonl``, in order; None without a log."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("split") == split]


def train_summary(workdir) -> dict | None:
    """What the trainer logged in ``workdir/metrics.jsonl``: the median train ``tokens_per_s``
    (the first record, with its compile, left out), the last train loss and the last eval loss;
    None without a log."""
    train, evals = metrics(workdir, "train"), metrics(workdir, "eval")
    if train is None:
        return None
    speeds = sorted(r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s"))
    return {"tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
            "train_loss": train[-1]["loss"] if train else None,
            "eval_loss": evals[-1]["loss"] if evals else None,
            "steps": train[-1]["step"] if train else 0}


def label(c) -> str:
    """The mixer pattern, plus the linear/HLA options that change the operator (when it has a
    linear or HLA mixer, the ones they apply to)."""
    extras = [name for name, field in (("decay", "hla_decay"), ("normalised", "hla_normalize"),
                                       ("conv", "hla_conv")) if c.model.get(field)]
    if not c.model.get("qk_norm", True):
        extras.append("no qk_norm")
    if not set(c.model.mixer_pattern) & {"linear", "hla2", "ahla", "hla3"}:
        extras = []
    return "+".join(c.model.mixer_pattern) + (f" ({', '.join(extras)})" if extras else "")
