"""python -m hla_jax.data.prepare: every input format gives the same corpus, whole documents per
split (seeded), an end of document after each, dtype by vocabulary, one-line errors, and a tiny
training run on a prepared BPE corpus that evaluates on its validation split and samples text."""

import json
import shutil
import subprocess
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, data_cfg

from hla_jax import data
from hla_jax.data.corpus import token_dtype
from hla_jax.data.prepare import input_field, prepare
from hla_jax.train import train_and_evaluate
from hla_jax.train.config import base_config

DOCS = [f"document {i}: {'héllo wörld ' * (i % 5 + 1)}→ {i * i}\n" * (i % 3 + 1) for i in range(40)]


def run(inputs, out, **kw):
    return prepare(inputs, out, progress=False, **{"validation_fraction": 0.25, **kw})


def split_documents(directory, split, tok):
    """The texts of the documents of ``split``, cut at the end-of-document id."""
    ids = np.load(directory / f"{split}.npy", mmap_mode="r")
    assert ids[-1] == tok.eod_id
    return [tok.decode(d[:-1]) for d in np.split(ids, np.flatnonzero(ids == tok.eod_id) + 1)[:-1]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The documents ``DOCS`` as text files, JSONL, Parquet and a saved ``datasets`` dataset."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "text").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "text" / f"{i:02d}.txt").write_text(doc)
    (root / "docs.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n"
                                             for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"body": DOCS, "id": range(40)}), root / "docs.parquet",
                   row_group_size=7)
    (root / "bad.jsonl").write_text('{"body": "fine"}\n{"body": cut\n')
    (root / "bad.parquet").write_bytes(b"PAR1 not parquet PAR1")
    (root / "bad.jsonl.gz").write_bytes(b"not gzip")
    (root / "empty.jsonl").write_text("\n")
    pq.write_table(pa.table({"content": DOCS[:10]}), root / "content.parquet")
    (root / "bad.json").write_text('{"not": "a tokenizer"}')
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(root / "saved"))
    return root


def test_every_format_gives_the_same_corpus(inputs, tmp_path):
    ref = run([inputs / "text"], tmp_path / "text")
    for name, args in {"jsonl": [inputs / "docs.jsonl"], "parquet": [inputs / "docs.parquet"],
                       "saved": [f"hf:{inputs / 'saved'}"], "hf_json": [f"hf:{inputs / 'docs.jsonl'}"]
                       }.items():
        info = run(args, tmp_path / name, field="body")
        assert info["splits"] == ref["splits"], name
        for split in ("train", "validation"):
            np.testing.assert_array_equal(np.load(tmp_path / name / f"{split}.npy"),
                                          np.load(tmp_path / "text" / f"{split}.npy"))
    (source,) = ref["sources"]
    size = sum(len(d.encode()) for d in DOCS)
    assert source == {"input": str(inputs / "text"), "format": "text", "files": 40,
                      "documents": 40, "bytes": size}
    assert ref["tokenizer"] == {"kind": "bytes", "eod": True, "vocab_size": 257, "eod_id": 256}
    assert ref["dtype"] == "uint16" and ref["seed"] == 0 and ref["validation_fraction"] == 0.25
    tokens = {s: ref["splits"][s]["tokens"] for s in ("train", "validation")}
    assert sum(tokens.values()) == size + 40  # bytes + one end of document each
    assert json.loads((tmp_path / "text" / "corpus.json").read_text()) == ref


def test_whole_documents_split_by_seed(inputs, tmp_path):
    tok = data.load_tokenizer("bytes+eod")
    run([inputs / "text"], tmp_path / "a")
    train, val = (split_documents(tmp_path / "a", s, tok) for s in ("train", "validation"))
    assert sorted(train + val) == sorted(DOCS) and len(val) >= 5
    assert [d for d in DOCS if d in train] == train  # input order kept
    run([inputs / "text"], tmp_path / "again")
    run([inputs / "text"], tmp_path / "other", seed=1)
    np.testing.assert_array_equal(np.load(tmp_path / "again/validation.npy"),
                                  np.load(tmp_path / "a/validation.npy"))
    assert split_documents(tmp_path / "other", "validation", tok) != val


def test_tokenizer_files_and_dtype(inputs, tmp_path):
    info = run([inputs / "docs.jsonl"], tmp_path / "bpe", tokenizer="bpe", vocab_size=300,
               field="body")
    tok = data.load_tokenizer(tmp_path / "bpe")
    assert info["tokenizer"] == {"kind": "hf", "file": "tokenizer.json", "eod": "<|endoftext|>",
                                 "vocab_size": 300, "eod_id": 0}
    assert info["dtype"] == "uint16" and (tmp_path / "bpe" / "tokenizer.json").is_file()
    train, val = (split_documents(tmp_path / "bpe", s, tok) for s in ("train", "validation"))
    assert sorted(train + val) == sorted(DOCS)
    assert info["splits"]["train"]["tokens"] < info["splits"]["train"]["bytes"] / 2
    # a given tokenizer file is copied beside the corpus
    info = run([inputs / "text"], tmp_path / "hf", tokenizer=str(tmp_path / "bpe/tokenizer.json"))
    assert data.load_tokenizer(tmp_path / "hf").path == tmp_path / "hf" / "tokenizer.json"
    assert [token_dtype(v) for v in (256, 257, 65536, 65537)] == [np.uint8, np.uint16, np.uint16,
                                                                  np.uint32]


@pytest.mark.parametrize("args, kw, match", [
    (["text"], dict(validation_fraction=0.0), "--validation_fraction must be in \\(0, 1\\)"),
    (["missing"], {}, "INPUT: .*missing does not exist"),
    (["text"], dict(pattern="*.md"), "INPUT: folder .* holds no file matching '\\*.md'"),
    (["docs.jsonl"], dict(field="text"), "--field='text': .*docs.jsonl:1 has no such field"),
    (["docs.parquet"], dict(field="id"), "--field='id': .* has no such text column"),
    (["bad.jsonl"], dict(field="body"), "bad.jsonl:2 is not a JSON line"),
    (["text", "bad.parquet"], {}, "bad.parquet: cannot be read as parquet \\(ArrowInvalid: "),
    (["text", "bad.jsonl.gz"], {}, "bad.jsonl.gz: cannot be read as jsonl \\(BadGzipFile: "),
    (["text", "empty.jsonl"], {}, "^no documents in .*empty.jsonl$"),
    (["text", "docs.jsonl:title"], {}, "--field='title': .*docs.jsonl:1 has no such field"),
    (["hf:saved"], dict(field="text"), "--field='text': hf:.* has no such column"),
    (["text"], dict(tokenizer="gpt2"), "tokenizer must be bytes"),
    (["text"], dict(tokenizer="bad.json"), "bad.json is not a tokenizer.json"),
    (["text"], dict(tokenizer="bpe", vocab_size=100), "vocab_size must be at least 257"),
    (["text"], dict(validation_fraction=0.001), "left the validation split without documents"),
    ([], {}, "give at least one INPUT"),
])
def test_bad_settings(inputs, tmp_path, args, kw, match):
    """One error naming the flag or the input; nothing is left behind, not even the folders
    created for ``--output``."""
    paths = [f"hf:{inputs / a[3:]}" if a.startswith("hf:") else f"{inputs}/{a}" for a in args]
    if kw.get("tokenizer", "").endswith(".json"):
        kw = dict(kw, tokenizer=str(inputs / kw["tokenizer"]))
    with pytest.raises(ValueError, match=match):
        run(paths, tmp_path / "new" / "out", **kw)
    assert list(tmp_path.iterdir()) == []


def test_failure_leaves_an_empty_output_as_it_was(inputs, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="no documents in"):
        run([inputs / "text", inputs / "empty.jsonl"], tmp_path / "out", tokenizer="bpe",
            vocab_size=300)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())
    run([inputs / "text"], tmp_path / "out")  # the same directory takes a rerun
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "corpus.json", "train.npy", "validation.npy"]


def test_a_field_per_input(inputs, tmp_path):
    """``PATH:FIELD`` names one input's field; the others take ``--field``."""
    info = run([f"{inputs}/docs.jsonl:body", f"{inputs}/content.parquet:content",
                f"hf:{inputs}/saved"], tmp_path / "out", field="body")
    assert [(s["input"], s["field"], s["documents"]) for s in info["sources"]] == [
        (f"{inputs}/docs.jsonl", "body", 40), (f"{inputs}/content.parquet", "content", 10),
        (f"hf:{inputs}/saved", "body", 40)]
    assert [input_field(a, "text") for a in ("hf:org/name:content", "hf:org/name", "a.jsonl",
                                             "dir/a.jsonl:body", "c:/x")] == [
        ("hf:org/name", "content"), ("hf:org/name", "text"), ("a.jsonl", "text"),
        ("dir/a.jsonl", "body"), ("c:/x", "text")]
    (tmp_path / "odd:name").write_text("a document")  # an existing path is taken whole
    assert input_field(str(tmp_path / "odd:name"), "text") == (str(tmp_path / "odd:name"), "text")


def test_a_smaller_vocabulary_than_asked_is_said(inputs, tmp_path, caplog):
    info = run([inputs / "text"], tmp_path / "bpe", tokenizer="bpe", vocab_size=5000)
    got = info["tokenizer"]["vocab_size"]
    assert got < 5000
    assert (f"--vocab_size=5000: the BPE learned only {got} ids from these documents"
            in caplog.text)
    assert info["splits"]["train"]["max_id"] < got


@pytest.mark.parametrize("output, args, error", [
    ("full", ["text"], "--output={tmp}/full exists and is not an empty directory"),
    # checked before any input is read: bad.jsonl would fail
    ("file/out", ["bad.jsonl"], "--output={tmp}/file/out cannot be written (Not a directory): "
                                "give a directory on writable storage"),
    ("out", ["text", "bad.parquet"], "{inputs}/bad.parquet: cannot be read as parquet "
                                     "(ArrowInvalid: "),
    ("out", ["text", "empty.jsonl"], "no documents in {inputs}/empty.jsonl"),
])
def test_command_line_error_is_one_line(inputs, tmp_path, output, args, error):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "file").write_text("")
    out = subprocess.run([sys.executable, "-m", "hla_jax.data.prepare",
                          f"--output={tmp_path / output}", *(f"{inputs}/{a}" for a in args)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.startswith("prepare: " + error.format(tmp=tmp_path, inputs=inputs))
    assert out.stderr.count("\n") == 1 and out.stderr.endswith("\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_training_on_a_prepared_bpe_corpus(inputs, tmp_path):
    corpus = tmp_path / "corpus"
    run([inputs / "text"], corpus, tokenizer="bpe", vocab_size=300)
    c = base_config()
    c.model.update(vocab_size=0, d_model=32, n_layers=1, n_heads=2, mixer_pattern=("softmax",))
    c.data.update(kind="tokens", path=str(corpus), seq_len=32, batch_size=4, pack=True)
    c.train.update(num_steps=3, log_every=1, eval_steps=1, sample_tokens=8, sample_prompt=8,
                   progress_bar=False, tensorboard=False, async_checkpoint=False)
    last = train_and_evaluate(c, tmp_path / "run")
    assert np.isfinite(last["eval"]["loss"]) and last["step"] == 3
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["vocab_size"] == 300
    train, val = data.make_sources(c.data, 300)
    assert val.tokens.size == np.load(corpus / "validation.npy").size and val.separator == 0
    sample = last["sample"]
    assert isinstance(sample["continuation"], str) and sample["prompt"] in "".join(DOCS)
    with pytest.raises(ValueError, match="model.vocab_size=256 is smaller than the data's "
                                         "vocabulary \\(300, its tokenizer\\)"):
        data.make_sources(data_cfg(kind="tokens", path=str(corpus)), 256)


def _set_max_id(directory, value):
    info = json.loads((directory / "corpus.json").read_text())
    if value is None:
        del info["splits"]["train"]["max_id"]
    else:
        info["splits"]["train"]["max_id"] = value
    (directory / "corpus.json").write_text(json.dumps(info))


def _big_id(directory):
    """An old corpus (no max_id) whose train.npy holds an id past the vocabulary."""
    _set_max_id(directory, None)
    ids = np.load(directory / "train.npy", mmap_mode="r+")
    ids[3] = 400
    ids.flush()


DAMAGE = {  # how -> (damage(directory), the error after "data.path={dir}: ")
    "missing": (lambda d: (d / "train.npy").unlink(), "token file {dir}/train.npy does not exist"),
    "truncated": (lambda d: (d / "train.npy").write_bytes((d / "train.npy").read_bytes()[:500]),
                  "{dir}/train.npy is not a readable .npy token file (mmap length is greater"),
    "longer": (lambda d: (d / "train.npy").write_bytes((d / "train.npy").read_bytes() + b"x"),
               "{dir}/train.npy is {size} bytes, its header says {size_minus_1}"),
    "overwritten": (lambda d: np.save(d / "validation.npy", np.arange(9, dtype=np.uint8)),
                    "{dir}/validation.npy holds 9 uint8 ids, its corpus.json says"),
    "not npy": (lambda d: (d / "validation.npy").write_text("text"),
                "{dir}/validation.npy is not a .npy file (it does not start with the NumPy magic)"),
    "json cut": (lambda d: (d / "corpus.json").write_text((d / "corpus.json").read_text()[:99]),
                 "{dir}/corpus.json is damaged (JSONDecodeError: "),
    "tokenizer cut": (lambda d: (d / "tokenizer.json").write_text("{"),
                      "its tokenizer does not load: tokenizer: {dir}/tokenizer.json is not a "
                      "tokenizer.json"),
    "tokenizer gone": (lambda d: (d / "tokenizer.json").unlink(),
                       "its tokenizer does not load: tokenizer: {dir}/tokenizer.json is not a "
                       "tokenizer.json (No such file"),
    "max_id": (lambda d: _set_max_id(d, 300), "{dir}/train.npy holds id 300, outside its "
                                              "tokenizer's vocabulary of 300"),
    "old, big id": (_big_id, "{dir}/train.npy holds id 400, outside its tokenizer's vocabulary "
                             "of 300"),
}


@pytest.fixture(scope="module")
def bpe_corpus(inputs, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe") / "corpus"
    run([inputs / "text"], directory, tokenizer="bpe", vocab_size=300)
    return directory


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_corpus_is_named_before_training(bpe_corpus, tmp_path, how):
    """Every file of the corpus is checked before training: the error names ``data.path`` and
    the damaged file."""
    corpus = tmp_path / "corpus"
    shutil.copytree(bpe_corpus, corpus)
    size = (corpus / "train.npy").stat().st_size
    damage, error = DAMAGE[how]
    damage(corpus)
    error = f"data.path={{dir}}: {error}".format(dir=corpus, size=size + 1, size_minus_1=size)
    with pytest.raises(ValueError) as e:
        data.make_sources(data_cfg(kind="tokens", path=str(corpus)), 300)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)
    if how == "truncated":  # the command line: this one line, status 1
        proc = subprocess.run(
            [sys.executable, "-m", "hla_jax.main", "--config=configs/lm.py:size=tiny",
             "--config.data.kind=tokens", f"--config.data.path={corpus}",
             "--config.model.vocab_size=0", f"--workdir={tmp_path / 'run'}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.splitlines()[-1].startswith(error)
        assert "Traceback" not in proc.stderr
