"""hla_jax.data: byte tokenizer, corpora, MQAR / NIAH, deterministic resumable batches
(tokenizers: test_tokenizers.py; prepared corpora: test_prepare.py)."""

import numpy as np
import pytest
from helpers import data_cfg

from hla_jax import data


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "héllo, wörld → ∑"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.size == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, 300]) == "\ufffd\ufffd"


def test_stdlib_corpus_is_sorted_python_sources():
    files = data.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    tokens = data.stdlib_tokens()
    assert tokens.dtype == np.uint8 and tokens.size > 1_000_000
    same, starts = data.stdlib_documents()  # one document per file
    assert same is tokens and len(starts) == len(files) and starts[0] == 0
    assert np.all(np.diff(starts) >= 0) and starts[-1] < tokens.size
    assert starts[-1] == tokens.size - files[-1].stat().st_size


def test_text_files_and_missing_paths(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("no")
    files = data.text_files(str(tmp_path))
    assert [f.name for f in files] == ["b.txt", "a.txt"]
    assert bytes(data.read_bytes(files)) == b"secondfirst"
    with pytest.raises(ValueError, match="does not exist"):
        data.text_files(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no file matching"):
        data.text_files(str(tmp_path), "*.json")
    with pytest.raises(ValueError, match="does not exist"):
        data.make_sources(data_cfg(path=str(tmp_path / "nope.txt")), 256)


def test_bare_token_memmap(tmp_path):
    """A ``.npy`` from elsewhere: its tail held out, packed at an explicit separator, no tokenizer."""
    tokens = np.arange(1000, dtype=np.uint16) % 300
    np.save(tmp_path / "t.npy", tokens)
    cfg = data_cfg(kind="tokens", path=str(tmp_path / "t.npy"), pack=True, separator=299)
    train, ev = data.make_sources(cfg, 300)
    assert isinstance(train.tokens, np.memmap) and train.separator == ev.separator == 299
    np.testing.assert_array_equal(np.concatenate([train.tokens, ev.tokens]), tokens)
    assert ev.tokens.size == 100 and data.data_vocab_size(cfg) is None
    with pytest.raises(ValueError, match="bare token memmap without a tokenizer"):
        data.tokenizer_for_data(cfg)


def test_batches_are_deterministic_and_resumable():
    train, _ = data.make_sources(data_cfg(), 256)
    first = data.DataIterator(train, 4, seed=3)
    batches = [next(first) for _ in range(5)]
    resumed = data.DataIterator(train, 4, seed=3, position=3)
    for want in batches[3:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    assert resumed.position == 5
    b = batches[0]
    assert b["inputs"].shape == (1, 4, 32) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][..., 1:], b["targets"][..., :-1])
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
    other = next(data.DataIterator(train, 4, seed=4))
    assert not np.array_equal(other["inputs"], b["inputs"])


def test_host_slices_and_accumulation_tile_the_global_batch():
    src = data.MQAR(64, 512, 4)
    full = data.make_batch(src, 0, data.TRAIN, 7, data.rows_for_process(8, accum=2))
    assert full["inputs"].shape == (2, 4, 64)
    parts = [data.make_batch(src, 0, data.TRAIN, 7, data.rows_for_process(8, 2, p, 2))
             for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts], axis=1),
                                  full["inputs"])
    with pytest.raises(ValueError, match="not divisible"):
        data.rows_for_process(8, accum=3)


def test_mqar_structure(rng):
    n, T, V = 8, 64, 512
    src = data.MQAR(T, V, n)
    inputs, targets, mask = src.example(rng)
    keys, values = inputs[0:2 * n:2], inputs[1:2 * n:2]
    assert len(set(keys)) == n and keys.min() >= 1 and keys.max() < V // 2
    assert values.min() >= V // 2 and values.max() < V
    pos = np.flatnonzero(mask)
    assert len(pos) == n and pos.min() >= 2 * n
    answer = dict(zip(keys, values))
    for p in pos:  # the target after each query key is that key's value
        assert targets[p] == answer[inputs[p]]
    assert np.all(inputs[2 * n:][~mask[2 * n:]] == 0)
    with pytest.raises(ValueError, match="seq_len"):
        data.MQAR(16, V, 8)


def test_niah_needle_and_answer(rng):
    src = data.NIAH(200, n_digits=4)
    inputs, targets, mask = src.example(rng)
    text = data.ByteTokenizer().decode(np.concatenate([inputs, targets[-1:]]))
    assert len(text) == 201 and text.count("The magic number is ") == 2
    number = text[-4:]
    assert number.isdigit() and f"The magic number is {number}. " in text
    assert data.ByteTokenizer().decode(targets[mask > 0]) == number
    assert mask.sum() == 4 and mask[-4:].all()
    with pytest.raises(ValueError, match="too short"):
        data.NIAH(40)


def test_make_sources_rejects_bad_settings():
    with pytest.raises(ValueError, match="data.kind"):
        data.make_sources(data_cfg(kind="images"), 256)
    with pytest.raises(ValueError, match="eval_fraction"):
        data.make_sources(data_cfg(eval_fraction=0.0), 256)
    with pytest.raises(ValueError, match="vocab_size"):
        data.make_sources(data_cfg(), 128)
