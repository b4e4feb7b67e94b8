"""Tests for taco_jax.data: Shakespeare split, BPE tokenizer cache, batching."""

import os

import numpy as np
import pytest

from taco_jax.data import DEFAULT_VAL_PLAYS, EOT, TokenStream, available_plays, eval_batches, load_shakespeare
from taco_jax.data.shakespeare import play_text

pytestmark = pytest.mark.fast
#: The tests that train a BPE tokenizer on the plays (8-11 s each on 2 loaded cores, no compile): in `make test`,
#: where `ds` is the session's 512-entry tokenizer that the model tests train too (conftest `shakespeare512`).
trains_a_tokenizer = pytest.mark.slow


@pytest.fixture
def cache_dir(tokenizer_dir):
    return str(tokenizer_dir)


@pytest.fixture
def ds(shakespeare512):
    return shakespeare512


@trains_a_tokenizer
def test_dataset_basics(ds):
    assert ds.train.dtype == np.int32 and ds.val.dtype == np.int32
    assert ds.train.ndim == 1 and ds.val.ndim == 1
    assert ds.vocab_size == 512
    assert ds.val_plays == DEFAULT_VAL_PLAYS
    assert 0 <= ds.train.min() and ds.train.max() < ds.vocab_size
    assert 0 <= ds.val.min() and ds.val.max() < ds.vocab_size
    n_train_plays = len(available_plays()) - len(DEFAULT_VAL_PLAYS)
    assert (ds.train == ds.eot_id).sum() == n_train_plays and ds.train[-1] == ds.eot_id
    assert (ds.val == ds.eot_id).sum() == len(DEFAULT_VAL_PLAYS) and ds.val[-1] == ds.eot_id
    assert os.path.isfile(ds.tokenizer_path)
    assert not ds.train.flags.writeable


@trains_a_tokenizer
def test_split_by_play(ds):
    assert set(DEFAULT_VAL_PLAYS) <= set(available_plays())
    train_plays = [p for p in available_plays() if p not in DEFAULT_VAL_PLAYS]
    train_text = ds.decode(ds.train)
    val_text = ds.decode(ds.val)
    # exact round trip of both splits: each play's text followed by <|endoftext|>
    assert train_text == "".join(play_text(p) + EOT for p in train_plays)
    assert val_text == "".join(play_text(p) + EOT for p in DEFAULT_VAL_PLAYS)
    for line in ["To be, or not to be", "We are such stuff", "Friends, Romans, countrymen"]:
        assert line in val_text and line not in train_text


def test_markdown_is_plain_text():
    text = play_text("hamlet")
    assert text.startswith("Hamlet\n\nACT I\n")
    assert "BERNARDO:\nWho's there?\n" in text
    for marker in ["**", "_", "#", "\\", "  \n", "&amp;"]:
        assert marker not in text


@trains_a_tokenizer
def test_encode_decode_roundtrip(ds):
    sample = play_text("hamlet")[5000:7000] + "Zoë's naïve café — 1.5 & ☃\n\n" + EOT
    ids = ds.encode(sample)
    assert ids.dtype == np.int32
    assert ds.decode(ids) == sample
    assert ds.decode(list(ids)) == sample
    assert ds.encode(EOT).tolist() == [ds.eot_id]


@trains_a_tokenizer
def test_cache_hit_and_rebuild_on_change(ds, cache_dir, tmp_path, monkeypatch):
    mtime = os.path.getmtime(ds.tokenizer_path)
    again = load_shakespeare(512, cache_dir=cache_dir)
    assert again.tokenizer_path == ds.tokenizer_path and os.path.getmtime(ds.tokenizer_path) == mtime
    np.testing.assert_array_equal(again.train, ds.train)
    np.testing.assert_array_equal(again.val, ds.val)

    # a different held-out list (and vocab) gets its own tokenizer; cache_dir=None reads $TACO_JAX_CACHE
    monkeypatch.setenv("TACO_JAX_CACHE", str(tmp_path))
    other = load_shakespeare(1024, val_plays=["macbeth"])
    assert other.tokenizer_path.startswith(str(tmp_path))
    assert other.vocab_size == 1024 and other.val_plays == ("macbeth",)
    assert other.decode(other.val) == play_text("macbeth") + EOT


@trains_a_tokenizer
def test_token_stream_deterministic(ds):
    def take(seed, n=3):
        it = TokenStream(ds.train, 4, 32, seed=seed)
        return [next(it) for _ in range(n)]

    a, b, c = take(0), take(0), take(1)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert not all(np.array_equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    assert not np.array_equal(a[0][0], a[1][0])  # successive batches differ


def test_token_stream_windows():
    tokens = np.arange(100, dtype=np.uint16)
    it = TokenStream(tokens, 8, 10, seed=0)
    for _ in range(50):
        x, y = next(it)
        assert x.shape == y.shape == (8, 10) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(y, x + 1)  # targets are inputs shifted by one
        np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # contiguous windows
        assert x.min() >= 0 and y.max() <= 99
    # the shortest valid input has exactly one window
    x, y = next(TokenStream(np.arange(11), 2, 10, seed=0))
    np.testing.assert_array_equal(x, [np.arange(10)] * 2)


def test_eval_batches():
    tokens = np.arange(1000)
    batches = eval_batches(tokens, 4, 16)
    assert len(batches) == 999 // 16 // 4  # partial final batch dropped
    for i, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x.reshape(-1), np.arange(i * 64, (i + 1) * 64))  # non-overlapping, in order
        np.testing.assert_array_equal(y, x + 1)
    assert len(eval_batches(tokens, 4, 16, max_batches=2)) == 2
    assert len(eval_batches(tokens, 4, 16, max_batches=100)) == len(batches)
    again = eval_batches(tokens, 4, 16)
    assert all(np.array_equal(x, x2) for (x, _), (x2, _) in zip(batches, again))


@trains_a_tokenizer
def test_eval_batches_on_val(ds):
    batches = eval_batches(ds.val, 8, 128, max_batches=5)
    assert len(batches) == 5
    np.testing.assert_array_equal(batches[0][0][0], ds.val[:128])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"vocab_size": 256}, "vocab_size=256"),
        ({"val_plays": ["hamlet", "not-a-play"]}, "not-a-play"),
        ({"val_plays": []}, "val_plays"),
        ({"val_plays": available_plays()}, "no plays for training"),
    ],
)
def test_load_shakespeare_bad_args(kwargs, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_shakespeare(cache_dir=str(tmp_path), **kwargs)
    assert not os.listdir(tmp_path)  # nothing built


@pytest.mark.parametrize(
    "fn, args, kwargs, match",
    [
        (TokenStream, (np.arange(100), 4, 0), {"seed": 0}, "seq_len=0"),
        (TokenStream, (np.arange(100), 0, 8), {"seed": 0}, "batch_size=0"),
        (TokenStream, (np.arange(8), 4, 8), {"seed": 0}, "seq_len=8"),
        (TokenStream, (np.zeros((10, 10)), 4, 8), {"seed": 0}, "1-D"),
        (eval_batches, (np.arange(100), 4, -1), {}, "seq_len=-1"),
        (eval_batches, (np.arange(100), 4, 8), {"max_batches": 0}, "max_batches=0"),
        (eval_batches, (np.arange(20), 4, 8), {}, "batch_size=4"),  # too short for one full batch
    ],
)
def test_batching_bad_args(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)  # TokenStream validates eagerly, before the first next()
