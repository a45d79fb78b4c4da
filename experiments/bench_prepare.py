"""Throughput of ``python -m hla_jax.data.prepare`` on this machine: MB/s of document text for
the byte tokenizer and for a byte-level BPE.

    python -m experiments.bench_prepare                      # 32k BPE, the embedded corpus
    python -m experiments.bench_prepare --vocab 8000 --repeats 3

The corpus is the embedded default one (``hla_jax.data.corpus.stdlib_files``, this Python's
standard library sources, about 30 MB in some 1,700 files) copied into a temporary folder, one
document per file. Timed, each the median of ``--repeats`` runs of ``prepare`` into a fresh
directory: ``bytes``; ``bpe`` (``--tokenizer=bpe``: the BPE training pass, then the encoding
pass); and the encoding pass alone (``--tokenizer`` = the trained ``tokenizer.json``), the
figure the 10 MB/s target is about. Two last rows time the encoder by itself over the texts
already in memory: ``HFTokenizer.encode_batch`` (a byte-level BPE encodes through its tiktoken
twin, ``hla_jax.data.tokenizers.tiktoken_twin``, with the same ids) and the ``tokenizers``
library's own ``encode_batch``. Wall MB/s and MB per CPU second (user + system time of all
threads) are both reported: other work on the machine (the load average before and after is
recorded) lowers the first, much less the second, and an idle machine of ``n`` cores reaches at
most ``n`` times the second. Results: ``experiments/results/bench_prepare_cpu.json`` and
``.md``, with their provenance.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import statistics
import sysconfig
import tempfile
import time

from experiments import common
from hla_jax.data.corpus import stdlib_files
from hla_jax.data.prepare import prepare
from hla_jax.data.tokenizers import load_tokenizer

TARGET_MB_S = 10.0  # the encoding pass with a 32k BPE, on 2 CPU cores


def copy_corpus(folder: pathlib.Path) -> int:
    """Copy the embedded corpus into ``folder`` (same relative paths); returns its bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for f in stdlib_files():
        target = folder / f.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return sum(f.stat().st_size for f in folder.rglob("*.py"))


def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(corpus, out, repeats: int, **kw) -> tuple[float, float, dict]:
    """Median wall and CPU seconds of ``repeats`` runs of ``prepare(corpus)`` into ``out``
    (emptied first), and the last run's ``corpus.json``."""
    wall, cpu = [], []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        start, start_cpu = time.perf_counter(), cpu_seconds()
        info = prepare([corpus], out, pattern="*.py", progress=False, **kw)
        wall.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), info


def library_alone(corpus, tokenizer_file, library: bool,
                  batch: int = 200) -> tuple[float, float, int, int]:
    """Wall and CPU seconds of encoding the corpus's texts, already in memory (no reading,
    splitting or writing), its text bytes and tokens: through ``HFTokenizer.encode_batch`` (its
    tiktoken twin), or with ``library`` through the ``tokenizers`` library's ``encode_batch``."""
    tok = load_tokenizer(tokenizer_file)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(corpus.rglob("*.py"))]

    def encode(chunk):
        if library:
            return [e.ids for e in tok.tokenizer.encode_batch_fast(chunk, add_special_tokens=False)]
        return tok.encode_batch(chunk)

    start, start_cpu = time.perf_counter(), cpu_seconds()
    tokens = sum(len(ids) for i in range(0, len(texts), batch) for ids in encode(texts[i:i + batch]))
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - start_cpu
    return seconds, cpu, sum(len(t.encode("utf-8")) for t in texts), tokens


def row(name: str, label: str, seconds: float, cpu: float, text: int, tokens: int) -> dict:
    return {"run": name, "label": label, "seconds": seconds, "cpu_seconds": cpu,
            "text_bytes": text, "tokens": tokens, "mb_per_s": text / 1e6 / seconds,
            "mb_per_cpu_s": text / 1e6 / cpu, "bytes_per_token": text / tokens}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32_000, help="BPE vocabulary size")
    p.add_argument("--repeats", type=int, default=1, help="runs per row (median)")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    args = p.parse_args(argv)
    rows, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        corpus_bytes = copy_corpus(tmp / "corpus")
        bpe = f"bpe {args.vocab // 1000}k"
        runs = [("bytes", "bytes (vocab 257)", {}),
                ("bpe", f"{bpe}: training pass + encoding pass", dict(tokenizer="bpe",
                                                                      vocab_size=args.vocab)),
                ("encode", f"{bpe}: encoding pass (tokenizer.json)",
                 dict(tokenizer=str(tmp / "bpe" / "tokenizer.json")))]
        for name, label, kw in runs:
            seconds, cpu, info = timed(tmp / "corpus", tmp / name, args.repeats, **kw)
            rows.append(row(name, label, seconds, cpu,
                            sum(s["bytes"] for s in info["splits"].values()),
                            sum(s["tokens"] for s in info["splits"].values())))
            print(f"{label}: {seconds:.1f} s, {rows[-1]['mb_per_s']:.1f} MB/s", flush=True)
        for name, label, library in (("fast", "encode_batch alone (tiktoken twin)", False),
                                     ("library", "tokenizers' encode_batch alone", True)):
            rows.append(row(name, f"{bpe}: {label}, texts in memory",
                            *library_alone(tmp / "corpus", tmp / "bpe" / "tokenizer.json",
                                           library)))
    load.append(os.getloadavg()[0])
    encode = next(r["mb_per_s"] for r in rows if r["run"] == "encode")
    result = {"cpu_count": os.cpu_count(), "load_average_1min": load, "corpus_files":
              len(stdlib_files()), "corpus_bytes": corpus_bytes, "vocab": args.vocab,
              "repeats": args.repeats, "rows": rows, "target_mb_per_s": TARGET_MB_S,
              "target_met": encode >= TARGET_MB_S}
    table = common.markdown_table(
        ["run", "seconds", "MB/s", "CPU seconds", "MB per CPU second", "tokens", "bytes/token"],
        [(r["label"], f"{r['seconds']:.1f}", f"{r['mb_per_s']:.1f}", f"{r['cpu_seconds']:.1f}",
          f"{r['mb_per_cpu_s']:.1f}", f"{r['tokens']:,}", f"{r['bytes_per_token']:.2f}")
         for r in rows])
    note = (f"\n\n{len(stdlib_files())} files, {corpus_bytes / 1e6:.1f} MB; {os.cpu_count()} CPU "
            f"cores, 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after. Target "
            f">= {TARGET_MB_S:g} MB/s for the BPE encoding pass: "
            f"{'met' if result['target_met'] else 'not met'} ({encode:.1f} MB/s).")
    out = pathlib.Path(args.out)
    prov = common.provenance()
    common.write_json(out / "bench_prepare_cpu.json", result, prov)
    print(common.write_markdown(out / "bench_prepare_cpu.md", table + note, prov))


if __name__ == "__main__":
    main()
