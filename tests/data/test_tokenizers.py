"""hla_jax.data.tokenizers: bytes, a byte-level BPE trained here, a sentencepiece model built
here; round trips, end-of-document ids, loading by spec."""

import io

import numpy as np
import pytest
import sentencepiece
import tokenizers
from helpers import data_cfg

from hla_jax import data
from hla_jax.data.tokenizers import EOD_TEXT, train_bpe

TEXT = "def f(x):\n    return x * 2  # héllo, wörld → ∑\n"
CORPUS = [f"line {i}: the quick brown fox {i * i} jumps over the lazy dog.\n" * 3
          for i in range(60)]  # about 8 KB


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(iter(CORPUS), 400, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A sentencepiece BPE model of 100 pieces (EOS id 2), identity normalization."""
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=100, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    path.write_bytes(out.getvalue())
    return path


def check(tok, text):
    """``encode`` is int32 ids in the vocabulary, ``encode_batch`` the same, ``decode`` inverts."""
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1 and 0 <= ids.min() and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    for got, want in zip(tok.encode_batch([text, "", text[:5]]), [ids, [], tok.encode(text[:5])]):
        np.testing.assert_array_equal(got, want)
    assert tok.eod_id is None or tok.eod_id not in ids  # encode appends no end of document
    return ids


def test_bytes():
    plain, eod = data.ByteTokenizer(), data.ByteTokenizer(eod=True)
    assert (plain.name, plain.vocab_size, plain.eod_id) == ("bytes", 256, None)
    assert (eod.name, eod.vocab_size, eod.eod_id) == ("bytes+eod", 257, 256)
    ids = check(plain, TEXT)
    np.testing.assert_array_equal(ids, np.frombuffer(TEXT.encode(), np.uint8))
    check(eod, TEXT)
    assert eod.decode(np.concatenate([ids, [256], ids[:3]])) == TEXT + EOD_TEXT + "def"
    assert plain.decode([0xFF, 300]) == "\ufffd\ufffd"


def test_trained_bpe_is_byte_level(bpe, tmp_path):
    assert bpe.vocab_size == 400 and bpe.eod_id == 0 and bpe.eod == EOD_TEXT
    ids = check(bpe, TEXT)  # characters never seen in training round-trip through their bytes
    assert check(bpe, CORPUS[7]).size < len(CORPUS[7]) / 2  # merges learned
    assert bpe.decode([0]) == EOD_TEXT
    again = data.load_tokenizer(bpe.path)
    assert again.name == f"hf:{bpe.path}" and (again.vocab_size, again.eod_id) == (400, 0)
    np.testing.assert_array_equal(again.encode(TEXT), ids)
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        train_bpe(iter(CORPUS), 100, tmp_path / "t.json")


def test_fast_encoder_gives_the_library_ids(bpe, tmp_path):
    """A plain byte-level BPE encodes through tiktoken (``tiktoken_twin``) with exactly the
    ``tokenizers`` library's ids, special-token text included; a BPE the twin cannot promise
    (a normalizer, a prefix space) keeps the library's encoder."""
    assert bpe.fast is not None
    texts = [TEXT, *CORPUS[:5], f"a{EOD_TEXT}b  \n\t 𝄞 ☃ 12345 don't", "", "   "]
    want = [e.ids for e in bpe.tokenizer.encode_batch(texts, add_special_tokens=False)]
    for got, ids in zip(bpe.encode_batch(texts), want):
        np.testing.assert_array_equal(got, ids)
    np.testing.assert_array_equal(bpe.encode(texts[6]), want[6])
    for change in ("normalizer", "prefix"):
        tok = tokenizers.Tokenizer.from_file(str(bpe.path))
        if change == "normalizer":
            tok.normalizer = tokenizers.normalizers.NFKC()
        else:
            tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.save(str(tmp_path / f"{change}.json"))
        other = data.load_tokenizer(tmp_path / f"{change}.json")
        assert other.fast is None
        np.testing.assert_array_equal(other.encode_batch([TEXT])[0],
                                      tok.encode(TEXT, add_special_tokens=False).ids)


def test_hf_end_of_document_token(tmp_path):
    """The first known end-of-document token in the vocabulary, the one named, or none."""
    vocab = {"<unk>": 0, "</s>": 1, "<eos>": 2, "a": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(tmp_path / "wl.json"))
    assert data.load_tokenizer(tmp_path / "wl.json").eod_id == 1
    assert data.load_tokenizer(str(tmp_path / "wl.json"), eod="<eos>").eod_id == 2
    with pytest.raises(ValueError, match="'<end>' is not in the vocabulary"):
        data.HFTokenizer(tmp_path / "wl.json", eod="<end>")
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(tmp_path / "none.json"))
    assert data.load_tokenizer(tmp_path / "none.json").eod_id is None


def test_sentencepiece(spm_model):
    tok = data.load_tokenizer(spm_model)
    assert isinstance(tok, data.SentencePieceTokenizer)
    assert tok.name == f"sentencepiece:{spm_model}" and tok.vocab_size == 100 and tok.eod_id == 2
    check(tok, CORPUS[3])
    check(tok, "the lazy fox jumps over 12 dogs.")


def test_load_by_spec_and_for_data(tmp_path):
    assert data.load_tokenizer("bytes").vocab_size == 256
    assert data.load_tokenizer("bytes+eod").eod_id == 256
    for bad in ("gpt2", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="tokenizer must be bytes, bytes\\+eod"):
            data.load_tokenizer(bad)
    with pytest.raises(ValueError, match="data.path must be a corpus directory"):
        data.load_tokenizer(tmp_path)
    assert data.tokenizer_for_data(data_cfg()).name == "bytes"
    assert data.tokenizer_for_data(data_cfg(kind="niah")).vocab_size == 256
    with pytest.raises(ValueError, match="data.kind='mqar' has no tokenizer"):
        data.tokenizer_for_data(data_cfg(kind="mqar"))
    with pytest.raises(ValueError, match="data.path must be a corpus directory"):
        data.tokenizer_for_data(data_cfg(kind="tokens", path=str(tmp_path)))
