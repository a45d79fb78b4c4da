"""Packed documents end to end: the data pipeline's packed rows (segment_ids, loss mask at
document starts, deterministic and resumable), the LM on a packed row equal to its documents run
alone for every mixer, the short conv and softmax attention not leaking across documents, and
clear errors for settings that cannot pack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close
from helpers import data_cfg as plain_data_cfg

from hla_jax import data
from hla_jax.data.prepare import prepare
from hla_jax.nn import LM, MIXERS, ModelConfig, make_mixer
from hla_jax.nn.layers import ShortConv
from hla_jax.train.steps import token_nll

LENGTHS = (13, 1, 28, 19)  # the documents of packed row 0; row 1 lies inside one document
T = sum(LENGTHS)
SPANS = [(s, s + n) for s, n in zip(np.cumsum((0,) + LENGTHS[:-1]), LENGTHS)]
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def tiny(mixer, **kw):
    """Two layers, conv and decay on, chunks of 8 (documents start mid-chunk), float32."""
    base = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer_pattern=(mixer,),
                chunk_size=8, num_levels=8, max_seq_len=64, init_std=0.3, hla_conv=True,
                hla_decay=True)
    return ModelConfig(**{**base, **kw})


def data_cfg(**over):
    return plain_data_cfg(**{"pack": True, "eval_fraction": 0.2, **over})


def row_segments():
    return np.repeat(np.arange(len(LENGTHS)), LENGTHS)


def stream(rng, vocab):
    """A packed source over documents ``LENGTHS + (80,)`` and its tokens."""
    lengths = LENGTHS + (80,)
    tokens = rng.integers(0, vocab, sum(lengths))
    return data.TextSource(tokens, T, doc_starts=np.cumsum((0,) + lengths[:-1])), tokens


def stack(examples) -> dict:
    return {name: jnp.asarray(np.stack(x)) for name, x in zip(data.pipeline.FIELDS, zip(*examples))}


def test_packed_row_segments_and_loss_mask(rng):
    """Row 0 numbers its four documents from 0; the targets that start a document are masked."""
    source, tokens = stream(rng, 32)
    inputs, targets, mask, segments = source.window(0)
    np.testing.assert_array_equal(inputs, tokens[:T])
    np.testing.assert_array_equal(targets, tokens[1:T + 1])
    np.testing.assert_array_equal(segments, row_segments())
    np.testing.assert_array_equal(np.flatnonzero(~mask), [e - 1 for _, e in SPANS])
    inside = source.window(T + 5)  # within the last document: one segment, nothing masked
    assert np.all(inside[3] == 0) and inside[2].all()
    cut = source.window(20)  # starts inside document 2, which is just numbered 0
    np.testing.assert_array_equal(cut[3][:22], 0)
    assert cut[3][22] == 1


@pytest.mark.parametrize("name", MIXERS)
def test_packed_lm_equals_documents_alone(name, rng):
    """Per-token nll of a packed batch (row 0: documents 13, 1, 28, 19; row 1: one document) =
    each document run alone (right-padded: the model is causal), so the masked mean loss is
    the mean over the documents' own predictions."""
    cfg = tiny(name)
    graphdef, state = nnx.split(LM(cfg, rngs=nnx.Rngs(0)))
    source, tokens = stream(rng, cfg.vocab_size)
    packed = stack([source.window(0), source.window(T + 5)])
    docs = [(s, e) for s, e in SPANS if e - s > 1]
    alone = {"inputs": jnp.asarray(np.stack([np.pad(tokens[s:e], (0, T - e + s)) for s, e in docs]
                                            + [tokens[T + 5:2 * T + 5]])),
             "targets": jnp.asarray(np.stack([np.pad(tokens[s + 1:e + 1], (0, T - e + s))
                                              for s, e in docs] + [tokens[T + 6:2 * T + 6]])),
             "mask": jnp.ones((len(docs) + 1, T))}
    nll = lambda state, batch: token_nll(nnx.merge(graphdef, state), batch)[0]
    got = jax.jit(nll).lower(state, packed).compile(FAST_COMPILE)(state, packed)
    ref = jax.jit(nll).lower(state, alone).compile(FAST_COMPILE)(state, alone)
    got_docs = jnp.concatenate([got[0, s:e - 1] for s, e in docs] + [got[1]])
    ref_docs = jnp.concatenate([ref[i, :e - s - 1] for i, (s, e) in enumerate(docs)] + [ref[-1]])
    assert_close(got_docs, ref_docs, 1e-4, f"{name} packed nll")
    loss = jnp.sum(got * packed["mask"]) / jnp.sum(packed["mask"])  # steps.loss_fn's mean
    assert_close(loss, jnp.mean(ref_docs), 1e-4, f"{name} packed loss")


def test_short_conv_does_not_leak_across_documents(rng):
    conv = ShortConv(4, 2, 3, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(2, T, 2, 3)), jnp.float32)
    segments = jnp.asarray(np.stack([row_segments(), np.zeros(T, int)]))
    packed = conv(x, segments)
    for s, e in SPANS:
        assert_close(packed[0, s:e], conv(x[:1, s:e])[0], 1e-6, f"conv document {s}:{e}")
    np.testing.assert_array_equal(packed[1], conv(x[1:])[0])
    assert not np.allclose(packed[0, 13], conv(x[:1])[0, 13])  # the unmasked conv does leak


def test_softmax_masks_across_documents(rng):
    """Softmax attention on a packed row (RoPE positions from each document's start) = each
    document alone; changing one document changes no other."""
    cfg = tiny("softmax")
    attn = make_mixer("softmax", cfg, rngs=nnx.Rngs(0), out_std=cfg.init_std)
    x = jnp.asarray(rng.normal(size=(1, T, cfg.d_model)), jnp.float32)
    segments = jnp.asarray(row_segments()[None])
    packed = attn(x, segments)
    for s, e in SPANS:
        assert_close(packed[:, s:e], attn(x[:, s:e]), 1e-5, f"softmax document {s}:{e}")
    other = attn(x.at[:, :13].set(0.0), segments)
    np.testing.assert_allclose(other[:, 13:], packed[:, 13:], rtol=1e-6, atol=1e-6)


def letters(tmp_path, counts):
    """Text files of one repeated letter each (a, b, c, ...): document changes are letter changes."""
    for i, n in enumerate(counts):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(bytes([ord("a") + i]) * n)
    return str(tmp_path)


def check_documents(batch):
    """Segments change and targets are masked exactly where the letter changes."""
    x, y, seg = batch["inputs"], batch["targets"], batch["segment_ids"]
    np.testing.assert_array_equal(batch["mask"], (x == y).astype(np.float32))
    np.testing.assert_array_equal(np.diff(seg, axis=-1) != 0, np.diff(x, axis=-1) != 0)
    np.testing.assert_array_equal(seg[..., 0], 0)


def test_text_files_pack_deterministically_and_resume(tmp_path):
    train, ev = data.make_sources(data_cfg(path=letters(tmp_path, [40, 7, 1, 90, 25, 60, 3, 50])),
                                  256)
    first = data.DataIterator(train, 4, seed=3, accum=2)
    batches = [next(first) for _ in range(6)]
    resumed = data.DataIterator(train, 4, seed=3, accum=2, position=4)
    for want in batches[4:]:
        got = next(resumed)
        assert got.keys() == want.keys() == set(data.pipeline.FIELDS)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    b = batches[0]
    assert b["segment_ids"].shape == (2, 2, 32) and b["segment_ids"].dtype == np.int32
    for batch in batches + [next(data.DataIterator(ev, 4, seed=0, split=data.EVAL))]:
        check_documents(batch)
    assert max(int(b["segment_ids"].max()) for b in batches) >= 1  # some rows cross files
    unpacked = next(data.DataIterator(data.make_sources(data_cfg(path=str(tmp_path), pack=False),
                                                        256)[0], 4, seed=3, accum=2))
    assert "segment_ids" not in unpacked and unpacked["mask"].all()
    np.testing.assert_array_equal(unpacked["inputs"], b["inputs"])  # the same windows


def test_token_memmap_packs_at_the_separator(tmp_path):
    """``prepare`` (bytes) ends every file with 256, the separator packing defaults to; it
    belongs to the document it ends (it is a target), the token after it starts the next one
    (not a target)."""
    prepare([letters(tmp_path, [30, 5, 70, 12, 44, 20])], tmp_path / "c", validation_fraction=0.3,
            progress=False)
    train, _ = data.make_sources(data_cfg(kind="tokens", path=str(tmp_path / "c")), 257)
    batch = next(data.DataIterator(train, 8, seed=0))
    x, y, m, seg = (batch[k] for k in data.pipeline.FIELDS)
    np.testing.assert_array_equal(m == 0, x == 256)
    np.testing.assert_array_equal(np.diff(seg, axis=-1) != 0, x[..., :-1] == 256)
    assert np.any(x == 256) and np.all(m[y == 256] == 1)


@pytest.mark.parametrize("over, vocab, match", [
    (dict(kind="tokens", path="x.npy"), 256, "a bare .npy memmap needs data.separator"),
    (dict(kind="tokens", path="x.npy", separator=256), 256, "data.separator must be a token id"),
    (dict(separator=0), 256, "data.separator=0 marks document ends"),
    (dict(kind="tokens", path="x.npy", separator=3, pack=False), 256, "data.separator=3"),
    (dict(kind="mqar"), 512, "data.pack=True packs the documents of a corpus"),
    (dict(kind="niah", seq_len=256), 256, "data.kind='niah' has none"),
])
def test_bad_packing_settings(over, vocab, match):
    with pytest.raises(ValueError, match=match):
        data.make_sources(data_cfg(**over), vocab)


def test_bad_segment_ids_and_separator():
    model = LM(tiny("linear", n_layers=1), rngs=nnx.Rngs(0))
    tok = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids must be an integer array"):
        model(tok, segment_ids=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be an integer array"):
        model(tok, segment_ids=jnp.zeros((2, 8), jnp.float32))
    with pytest.raises(ValueError, match="doc_starts or separator"):
        data.TextSource(np.zeros(10, np.uint8), 4, doc_starts=[0], separator=0)
