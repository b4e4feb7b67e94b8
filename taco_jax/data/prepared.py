"""Your own corpus as token files (nanoGPT's layout): `taco-jax prepare-data` writes them, `taco-jax
train --data DIR` memory-maps them.

A prepared folder holds
    train.bin, val.bin   token ids, raw little-endian uint16 (uint32 when the vocabulary has more
                         than 65536 entries), documents separated by the end-of-text id
    tokenizer.json       the tokenizer that made them (`tokenizers` JSON; copied, or trained here)
    meta.json            format, tokenizer sha256 (of its canonical JSON), vocab_size, dtype, eot_id /
                         eot_token, the source files with their sizes in bytes and documents,
                         val_fraction and the token counts of both splits

Documents: each text file is one document; each line of a `.jsonl` file is one, its `text_field`.
The token stream is every document's ids followed by the end-of-text id, in the order of the
sources (a folder: its files sorted by path); the last `val_fraction` of the stream (at least 2
tokens; training needs more than one window) is the validation split (nanoGPT's split of one
stream; a document may straddle it). Encoding runs in parallel (the `tokenizers` library's batch
encode on documents, long documents cut into pieces at line starts where the pre-tokenizer splits
anyway, so the ids equal whole-document encoding; `_splits_at_line_starts`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer

from taco_jax.data.shakespeare import EOT, _train_tokenizer, load_shakespeare

FORMAT = 1
#: Cut documents longer than this (characters) into pieces for parallel encoding.
PIECE_CHARS = 64 << 10
#: Characters per batch handed to the tokenizer's parallel batch encode (bounds the memory of its
#: `Encoding` objects, ~100 bytes per token).
BATCH_CHARS = 4 << 20
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)


# -----------------------------------------------------------------------------
# tokenizers


@functools.lru_cache(maxsize=16)
def _canonical(path: str, mtime_ns: int) -> str:
    return Tokenizer.from_file(path).to_str()


def tokenizer_hash(path) -> str:
    """sha256 (hex) of a `tokenizers` JSON file's canonical form (`Tokenizer.to_str()`: the same
    tokenizer gives the same hash however its file was formatted). Raises ValueError naming an
    unreadable file."""
    path = pathlib.Path(path)
    try:
        text = _canonical(str(path.resolve()), path.stat().st_mtime_ns)
    except Exception as e:  # missing file, not a tokenizer
        raise ValueError(f"{path} is not a readable tokenizers JSON file ({type(e).__name__}: {e})") from None
    return hashlib.sha256(text.encode()).hexdigest()


def _splits_at_line_starts(tok: Tokenizer) -> bool:
    """Whether cutting a text right after a newline (before a non-space character) leaves its ids
    unchanged: true when a regex pre-tokenizer splits there anyway (GPT-2's ByteLevel regex, or a
    Split regex as Qwen's) and nothing adds a prefix space to every piece (add_prefix_space, a
    Metaspace prepend). Other tokenizers encode whole documents."""
    spec = json.loads(tok.to_str())
    nodes = []

    def walk(node):
        if isinstance(node, dict):
            nodes.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec.get("normalizer"))
    walk(spec.get("pre_tokenizer"))
    if any(n.get("add_prefix_space") is True or n.get("type") == "Metaspace" for n in nodes):
        return False
    return any(n.get("type") == "ByteLevel" and n.get("use_regex", True) or
               n.get("type") == "Split" and "Regex" in (n.get("pattern") or {}) for n in nodes)


def _pieces(text: str, limit: int) -> Iterator[str]:
    """`text` cut into pieces of about `limit` characters, each cut right after a newline and before a
    non-whitespace character (a pre-token boundary); a text without such a place stays whole."""
    start = 0
    while len(text) - start > limit:
        cut = start + limit
        while True:
            cut = text.find("\n", cut)
            if cut < 0 or cut + 1 >= len(text):
                yield text[start:]
                return
            if not text[cut + 1].isspace():
                break
            cut += 1
        yield text[start:cut + 1]
        start = cut + 1
    if start < len(text):
        yield text[start:]


# -----------------------------------------------------------------------------
# sources


def source_files(inputs: Sequence[str]) -> list[pathlib.Path]:
    """The files of `inputs` (files, or folders read recursively: their `.txt` / `.md` / `.text` /
    `.jsonl` files sorted by path). Raises ValueError naming a missing input, a folder without such
    files, or a file of another kind named directly."""
    files = []
    for item in inputs:
        p = pathlib.Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not found:
                raise ValueError(f"{item!r} holds no {' / '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} file")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"input {item!r} is neither a file nor a folder")
    return files


def _documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    """The documents of one source file (JSONL: one per line; else the whole file). Raises ValueError
    naming the file and line of undecodable text, bad JSON or a missing / non-string field."""
    try:
        if path.suffix not in JSONL_SUFFIXES:
            yield path.read_text(encoding="utf-8")
            return
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not JSON ({e})") from None
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{n} has no string field text_field={text_field!r} "
                                     f"(keys: {sorted(rec) if isinstance(rec, dict) else type(rec).__name__})")
                yield text
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None


# -----------------------------------------------------------------------------
# prepare


def prepare_data(inputs: Sequence[str], out, *, tokenizer: str = "", init_from: str = "", vocab_size: int = 0,
                 text_field: str = "text", val_fraction: float = 0.1, eot_token: str = EOT,
                 progress: bool = True) -> dict:
    """Tokenizes `inputs` (text files, folders of them, JSONL files) into `out` (see the module docstring).

    Tokenizer: `tokenizer` (a `tokenizers` JSON file, e.g. a Hugging Face `tokenizer.json`), else
    `init_from`'s `tokenizer.json` (an HF checkpoint folder), else a byte-level BPE of `vocab_size`
    entries (default 2048) trained on these documents with the Shakespeare recipe.
    `eot_token`: the token that separates documents (must be in the vocabulary).
    `progress`: a tqdm bar over the input bytes (on a terminal).
    Returns the meta.json dict. Raises ValueError naming a bad input, tokenizer, field or fraction
    (before anything is written), or a corpus too small for a validation split.
    """
    from tqdm.auto import tqdm

    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    if tokenizer and init_from:
        raise ValueError(f"give tokenizer={tokenizer!r} or init_from={init_from!r}, not both")
    if vocab_size and (tokenizer or init_from):
        raise ValueError(f"vocab_size={vocab_size} trains a BPE; it cannot be combined with a given tokenizer")
    if vocab_size and vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must be >= 257 (256 byte tokens + {eot_token})")
    files = source_files(inputs)
    if init_from:
        tokenizer = str(pathlib.Path(init_from) / "tokenizer.json")
        if not pathlib.Path(tokenizer).is_file():
            raise ValueError(f"init_from={init_from!r} has no tokenizer.json; give --tokenizer PATH")
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is an existing file; give a folder")
    total = sum(f.stat().st_size for f in files)

    def docs(desc):
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None if progress else True) as bar:
            for f in files:
                for d in _documents(f, text_field):
                    yield f, d
                bar.update(f.stat().st_size)

    if tokenizer:
        tokenizer_hash(tokenizer)  # readable
        tok = Tokenizer.from_file(tokenizer)
        source = str(pathlib.Path(tokenizer).resolve())
    else:
        # fed in pieces (the byte-level regex splits at line starts anyway): the trainer's memory stays bounded
        tok = _train_tokenizer((p for _, d in docs("train BPE") for p in _pieces(d, PIECE_CHARS)), vocab_size or 2048)
        source = f"byte-level BPE, vocab_size={vocab_size or 2048}, trained on these documents"
    eot_id = tok.token_to_id(eot_token)
    if eot_id is None:
        raise ValueError(f"eot_token={eot_token!r} is not in the tokenizer's vocabulary ({source}); "
                         "give --eot-token with its end-of-text token")
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if n_vocab <= 1 << 16 else np.uint32
    cut = _splits_at_line_starts(tok)
    out.mkdir(parents=True, exist_ok=True)
    stream = out / f"tokens.tmp{os.getpid()}"
    counts = {}
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    with open(stream, "wb") as f:
        def flush(batch, ends):
            encs = encode(batch, add_special_tokens=False)
            ids = []
            for enc, end in zip(encs, ends, strict=True):
                ids.extend(enc.ids)
                if end:
                    ids.append(eot_id)
            np.asarray(ids, dtype=dtype).tofile(f)

        batch, ends, chars = [], [], 0
        for path, doc in docs("tokenize"):
            counts[path] = counts.get(path, 0) + 1
            parts = (list(_pieces(doc, PIECE_CHARS)) if cut else [doc]) or [""]  # an empty document: its eot
            for i, part in enumerate(parts):
                batch.append(part)
                ends.append(i == len(parts) - 1)
                chars += len(part)
                if chars >= BATCH_CHARS:
                    flush(batch, ends)
                    batch, ends, chars = [], [], 0
        if batch:
            flush(batch, ends)
    itemsize = np.dtype(dtype).itemsize
    n = stream.stat().st_size // itemsize
    n_val = int(round(n * val_fraction))
    if n_val < 2 or n - n_val < 2:
        stream.unlink()
        raise ValueError(f"{n} tokens are too few to split with val_fraction={val_fraction}")
    with open(stream, "rb") as src:
        for name, count in (("train.bin", n - n_val), ("val.bin", n_val)):
            with open(out / name, "wb") as dst:
                left = count * itemsize
                while left:
                    chunk = src.read(min(left, 64 << 20))
                    dst.write(chunk)
                    left -= len(chunk)
    stream.unlink()
    if tokenizer:
        if pathlib.Path(tokenizer).resolve() != (out / "tokenizer.json").resolve():
            shutil.copyfile(tokenizer, out / "tokenizer.json")
    else:
        tok.save(str(out / "tokenizer.json"))
    meta = {"format": FORMAT, "tokenizer": {"sha256": tokenizer_hash(out / "tokenizer.json"), "source": source},
            "vocab_size": n_vocab, "dtype": np.dtype(dtype).name, "eot_id": eot_id, "eot_token": eot_token,
            "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "documents": counts.get(p, 0)}
                        for p in files],
            "text_field": text_field, "val_fraction": val_fraction, "train_tokens": n - n_val, "val_tokens": n_val}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# -----------------------------------------------------------------------------
# load


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared folder (`prepare_data`), memory-mapped: the token files are never read whole.

    train, val: read-only np.memmap [n] of uint16 / uint32 token ids
    vocab_size: the tokenizer's vocabulary size (ids are in [0, vocab_size))
    eot_id: id of the end-of-text token between documents
    tokenizer_path: the folder's tokenizer.json
    meta: the folder's meta.json
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eot_id: int
    tokenizer_path: str
    meta: dict

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(self.tokenizer_path)


def load_prepared(path) -> PreparedData:
    """The prepared folder `path` (`taco-jax prepare-data`). Raises ValueError naming the folder when
    meta.json, tokenizer.json or a token file is missing, or a token file's size disagrees with meta.json."""
    path = pathlib.Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"data={str(path)!r} is not a prepared folder (no meta.json); make one with "
                         "`taco-jax prepare-data`")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT}")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"data={str(path)!r} has no tokenizer.json")
    dtype = np.dtype(meta["dtype"])
    arrays = {}
    for split in ("train", "val"):
        f = path / f"{split}.bin"
        want = meta[f"{split}_tokens"]
        if not f.is_file() or f.stat().st_size != want * dtype.itemsize:
            size = f.stat().st_size if f.is_file() else None
            raise ValueError(f"{f}: {size} bytes, meta.json says {want} {dtype.name} tokens "
                             f"({want * dtype.itemsize} bytes); prepare the folder again")
        arrays[split] = np.memmap(f, dtype=dtype, mode="r", shape=(want,))
    return PreparedData(train=arrays["train"], val=arrays["val"], vocab_size=int(meta["vocab_size"]),
                        eot_id=int(meta["eot_id"]), tokenizer_path=str(path / "tokenizer.json"), meta=meta)


def check_data(ds, model_vocab: int, init_from: str = "") -> None:
    """Refuses training data the model cannot read: a tokenizer vocabulary larger than `model_vocab`,
    or a tokenizer other than the `init_from` checkpoint's own `tokenizer.json` (when it has one).
    `ds`: a `TextDataset` or `PreparedData`. Raises ValueError naming both sides."""
    if ds.vocab_size > model_vocab:
        raise ValueError(f"tokenizer vocab {ds.vocab_size} exceeds the model's vocab_size={model_vocab} "
                         f"(tokenizer {ds.tokenizer_path}{f'; model {init_from}' if init_from else ''})")
    theirs = pathlib.Path(init_from) / "tokenizer.json" if init_from else None
    if theirs is not None and theirs.is_file() and tokenizer_hash(theirs) != tokenizer_hash(ds.tokenizer_path):
        raise ValueError(f"the data's tokenizer {ds.tokenizer_path} differs from the tokenizer of "
                         f"init_from={init_from!r} ({theirs}); prepare the data with it: "
                         f"`taco-jax prepare-data ... --init-from {init_from}`")


def training_data(data: str, vocab_size: int):
    """The training data of a run: the prepared folder `data` (`load_prepared`), or Shakespeare's
    plays with a BPE of `vocab_size` entries when `data` is empty (`load_shakespeare`)."""
    return load_prepared(data) if data else load_shakespeare(vocab_size)
