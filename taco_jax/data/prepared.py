"""Your own corpus as token files (nanoGPT's layout): `taco-jax prepare-data` writes them, `taco-jax
train --data DIR` memory-maps them.

A prepared folder holds
    train.bin, val.bin   token ids, raw little-endian uint16 (uint32 when an id exceeds 65535),
                         documents separated by the end-of-text id
    tokenizer.json       the tokenizer that made them (`tokenizers` JSON; copied, or trained here)
    meta.json            format, tokenizer sha256 (of its canonical JSON), vocab_size (the tokenizer's
                         largest id + 1: a vocabulary with holes counts up to its largest id),
                         dtype, eot_id / eot_token, the source files with their sizes in bytes and
                         documents, val_fraction and the token counts of both splits

Documents: a text file, or a line of a `.jsonl` file (its `text_field`). The stream is each
document's ids then the end-of-text id, sources in order; its last `val_fraction` (at least 2
tokens) is the validation split, as nanoGPT's. The ids equal whole-document encoding, with exactly
one end-of-text id per document. Files are written to temporaries and renamed only when all are
complete: a refused input leaves the folder as it was.
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


# --- tokenizers


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


# --- sources


def source_files(inputs: Sequence[str]) -> list[pathlib.Path]:
    """The files of `inputs` (files, or folders read recursively: their `.txt` / `.md` / `.text` /
    `.jsonl` files sorted by path; `_folder_files`). Raises ValueError naming a missing input, a folder
    without such files, or a file of another kind named directly."""
    files = []
    for item in inputs:
        p = pathlib.Path(item)
        if p.is_dir():
            found = _folder_files(p)
            if not found:
                raise ValueError(f"{item!r} holds no {' / '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} file")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"input {item!r} is neither a file nor a folder")
    return files


def _folder_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The source files under folder `root`, sorted by path, symlinked folders followed, each folder
    once (a loop adds nothing). Raises ValueError naming a folder that cannot be listed, or a dangling
    symlink named as a source or without a suffix (`Path.rglob` would skip it without a word)."""
    def unreadable(e: OSError):
        raise ValueError(f"folder {e.filename!r} under {str(root)!r} cannot be read ({e.strerror or e})")

    def ident(path) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_dev, st.st_ino

    seen, found = {ident(root)}, []
    for folder, subs, names in os.walk(root, onerror=unreadable, followlinks=True):
        keep = []
        for d in sorted(subs):  # the first name of a folder reached twice is the one kept
            key = ident(os.path.join(folder, d))
            if key not in seen:
                seen.add(key)
                keep.append(d)
        subs[:] = keep  # os.walk enters only these
        for name in names:
            f = pathlib.Path(folder) / name
            source = f.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES
            if f.is_symlink() and not f.exists() and (source or not f.suffix):  # a source, or maybe a folder
                raise ValueError(f"{str(f)!r} is a symlink to {os.readlink(f)!r}, which does not exist")
            if source and f.is_file():
                found.append(f)
    return sorted(found)


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


# --- prepare


def prepare_data(inputs: Sequence[str], out, *, tokenizer: str = "", init_from: str = "", vocab_size: int = 0,
                 text_field: str = "text", val_fraction: float = 0.1, eot_token: str = EOT,
                 progress: bool = True) -> dict:
    """Tokenizes `inputs` (text files, folders of them, JSONL files) into `out` (see the module docstring).

    Tokenizer: `tokenizer` (a `tokenizers` JSON file, e.g. a Hugging Face `tokenizer.json`), else
    `init_from`'s `tokenizer.json` (an HF checkpoint folder), else a byte-level BPE of `vocab_size`
    entries (default 2048) trained on these documents with the Shakespeare recipe.
    `eot_token`: the token that separates documents (must be in the vocabulary).
    `progress`: a tqdm bar over the input bytes (on a terminal).
    Returns the meta.json dict. Raises ValueError naming a bad input, tokenizer, field or fraction,
    a corpus too small for a validation split, or an `eot_token` that is not a special token and
    occurs in a document's text; `out` then stays as it was.
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
        if not pathlib.Path(init_from).is_dir():
            raise ValueError(f"init_from={init_from!r}: {not_a_local_folder(init_from)}")
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
    n_vocab = vocab_size_of(tok)
    dtype = np.dtype(np.uint16 if n_vocab <= 1 << 16 else np.uint32)
    tmp = {name: out / f".{name}.tmp{os.getpid()}" for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json")}
    created = [d for d in (out, *out.parents) if not d.exists()]  # removed again when refused
    out.mkdir(parents=True, exist_ok=True)
    try:
        counts = _write_stream(tok, docs("tokenize"), tmp["train.bin"], eot_id, eot_token, dtype)
        n = tmp["train.bin"].stat().st_size // dtype.itemsize
        n_val = int(round(n * val_fraction))
        if n_val < 2 or n - n_val < 2:
            raise ValueError(f"{n} tokens are too few to split with val_fraction={val_fraction}")
        with open(tmp["train.bin"], "rb") as src, open(tmp["val.bin"], "wb") as dst:  # the stream's tail
            src.seek((n - n_val) * dtype.itemsize)
            shutil.copyfileobj(src, dst, 64 << 20)
        os.truncate(tmp["train.bin"], (n - n_val) * dtype.itemsize)  # the stream's head, not copied
        if tokenizer:
            shutil.copyfile(tokenizer, tmp["tokenizer.json"])
        else:
            tok.save(str(tmp["tokenizer.json"]))
        meta = {"format": FORMAT, "tokenizer": {"sha256": tokenizer_hash(tmp["tokenizer.json"]), "source": source},
                "vocab_size": n_vocab, "dtype": dtype.name, "eot_id": eot_id, "eot_token": eot_token,
                "sources": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "documents": counts.get(p, 0)}
                            for p in files],
                "text_field": text_field, "val_fraction": val_fraction, "train_tokens": n - n_val,
                "val_tokens": n_val}
        tmp["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        for name, path in tmp.items():  # meta.json last: it describes the files before it
            os.replace(path, out / name)
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        for d in created:  # innermost first; only the empty folders made here
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return meta


def not_a_local_folder(path) -> str:
    """Why `path`, given as a Hugging Face checkpoint folder (`--init-from`), is none: it does not exist,
    or is a file. A name like "Qwen3-0.6B" reads as a Hub id, but nothing is downloaded."""
    p = pathlib.Path(path)
    return (f"the folder {str(p.absolute())!r} {'is a file' if p.exists() else 'does not exist'}; --init-from "
            "takes a local Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) and nothing "
            f"is downloaded: fetch it first (e.g. `huggingface-cli download ORG/{p.name} --local-dir {path}`)")


def vocab_size_of(tok: Tokenizer) -> int:
    """Vocabulary size of a tokenizer as a model must see it: its largest id + 1 (added tokens
    included), so a vocabulary with holes (e.g. 300 entries with the end-of-text token at id 60000)
    counts up to its largest id. `Tokenizer.get_vocab_size` counts entries instead."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _write_stream(tok: Tokenizer, docs, path: pathlib.Path, eot_id: int, eot_token: str, dtype) -> dict:
    """Writes the token stream of `docs` ((source path, text) pairs) to `path`: each document's ids as
    text, then `eot_id`. Returns {source path: documents}. Raises ValueError naming the document
    whose text encodes to `eot_id` (an end-of-text token that is not a special token)."""
    cut = _splits_at_line_starts(tok)
    enc_tok = Tokenizer.from_str(tok.to_str())
    enc_tok.encode_special_tokens = True  # special tokens' text in a document is text, not a token
    encode = getattr(enc_tok, "encode_batch_fast", enc_tok.encode_batch)
    counts = {}
    with open(path, "wb") as f:
        def flush(batch, ends):
            encs = encode(batch, add_special_tokens=False)
            ids = []
            for enc, end in zip(encs, ends, strict=True):
                ids.extend(enc.ids)
                if end:
                    ids.append(eot_id)
            ids = np.asarray(ids, dtype=dtype)
            if np.count_nonzero(ids == eot_id) != sum(e is not None for e in ends):
                k = next(k for k, enc in enumerate(encs) if eot_id in enc.ids)
                src, doc = next(e for e in ends[k:] if e)  # the document of that piece
                raise ValueError(f"{src}: document {doc} encodes to the end-of-text id {eot_id} "
                                 f"(eot_token={eot_token!r} is not a special token of the tokenizer, so its "
                                 "text cannot be told from the separator); give --eot-token with a special token")
            ids.tofile(f)

        batch, ends, chars = [], [], 0
        for src, doc in docs:
            counts[src] = counts.get(src, 0) + 1
            parts = (list(_pieces(doc, PIECE_CHARS)) if cut else [doc]) or [""]  # an empty document: its eot
            for i, part in enumerate(parts):
                batch.append(part)
                ends.append((src, counts[src]) if i == len(parts) - 1 else None)
                chars += len(part)
                if chars >= BATCH_CHARS:
                    flush(batch, ends)
                    batch, ends, chars = [], [], 0
        if batch:
            flush(batch, ends)
    return counts


# --- load


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedData:
    """A prepared folder (`prepare_data`), memory-mapped: the token files are never read whole.

    train, val: read-only np.memmap [n] of uint16 / uint32 token ids
    vocab_size: the tokenizer's largest id + 1 (`vocab_size_of`; ids are in [0, vocab_size))
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


def read_meta(path) -> dict:
    """The meta.json of the prepared folder `path`. Raises ValueError naming the folder when it has
    none, or one of another format."""
    meta_file = pathlib.Path(path) / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"data={str(path)!r} is not a prepared folder (no meta.json); make one with "
                         "`taco-jax prepare-data`")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file}: format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def load_prepared(path) -> PreparedData:
    """The prepared folder `path` (`taco-jax prepare-data`). Raises ValueError naming the folder when
    meta.json, tokenizer.json or a token file is missing, or a token file's size disagrees with meta.json."""
    path = pathlib.Path(path)
    meta = read_meta(path)
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


def check_data(ds, model_vocab: int, init_from: str = "", *, batch_size: int = 0, seq_len: int = 0) -> None:
    """Refuses training data the model cannot read: a tokenizer vocabulary larger than `model_vocab`,
    or a tokenizer other than the `init_from` checkpoint's own `tokenizer.json` (when it has one);
    with `batch_size` and `seq_len`, a training split of at most `seq_len` tokens (no window) and a
    validation split shorter than one validation batch (batch_size × seq_len + 1 tokens).
    `ds`: a `TextDataset` or `PreparedData`. Raises ValueError naming both sides (the split's file,
    the tokens it has and those needed)."""
    if ds.vocab_size > model_vocab:
        raise ValueError(f"tokenizer vocab {ds.vocab_size} exceeds the model's vocab_size={model_vocab} "
                         f"(tokenizer {ds.tokenizer_path}{f'; model {init_from}' if init_from else ''}); "
                         + ("prepare the data with the checkpoint's tokenizer" if init_from else
                            "leave --vocab-size out (the data sets it) or give one at least as large"))
    theirs = pathlib.Path(init_from) / "tokenizer.json" if init_from else None
    if theirs is not None and theirs.is_file() and tokenizer_hash(theirs) != tokenizer_hash(ds.tokenizer_path):
        raise ValueError(f"the data's tokenizer {ds.tokenizer_path} differs from the tokenizer of "
                         f"init_from={init_from!r} ({theirs}); prepare the data with it: "
                         f"`taco-jax prepare-data ... --init-from {init_from}`")
    if batch_size and seq_len:
        for split, need, what in (("train", seq_len + 1, f"one training window of seq_len={seq_len}"),
                                  ("val", batch_size * seq_len + 1,
                                   f"one validation batch of batch_size={batch_size} × seq_len={seq_len}")):
            have = len(getattr(ds, split))
            if have < need:
                raise ValueError(f"{_split_name(ds, split)} holds {have} tokens; {what} needs {need}"
                                 + ("; prepare the data with a larger --val-fraction, or lower --batch-size / "
                                    "--seq-len" if split == "val" else ""))


def _split_name(ds, split: str) -> str:
    """The file of a prepared folder's split (`.../val.bin`), or the plays of a Shakespeare split."""
    if isinstance(ds, PreparedData):
        return str(pathlib.Path(ds.tokenizer_path).parent / f"{split}.bin")
    if split == "val" and getattr(ds, "val_plays", None):
        return f"the validation plays ({', '.join(ds.val_plays)})"
    return f"the {split} split"


def check_resumed_data(ds, run_dir, data: str, before: str | None) -> str:
    """Checks the data `ds` (folder `data`, "" = Shakespeare) of a run resumed in `run_dir` against the
    run's `tokenizer.json` and `before`, the data folder its `config.json` records (None: tokenizers
    only). Returns a note (same tokenizer, other data) or "". Raises ValueError naming both
    tokenizers when they differ; a run folder without a tokenizer.json passes."""
    theirs = pathlib.Path(run_dir) / "tokenizer.json"
    if not ds.tokenizer_path or not theirs.is_file():
        return ""
    name = data_label
    if tokenizer_hash(theirs) != tokenizer_hash(ds.tokenizer_path):
        raise ValueError(f"--resume: the data's tokenizer {ds.tokenizer_path} ({name(data)}) differs from the run's "
                         f"tokenizer {theirs}" + (f" ({name(before)})" if before is not None else "")
                         + "; resume with data prepared with the run's tokenizer (`taco-jax prepare-data ... "
                         f"--tokenizer {theirs}`), or start a new run in another --out")
    if before is None or _same_folder(before, data):
        return ""
    return f"--resume with {name(data)}: the run trained on {name(before)} (the same tokenizer); it continues on it"


def data_label(data: str) -> str:
    """How messages and plot titles name a run's data: "Shakespeare" for "" (the default), else
    "data='<folder as given>'"."""
    return f"data={data!r}" if data else "Shakespeare"


def _same_folder(a: str, b: str) -> bool:
    if not a or not b:
        return a == b
    return pathlib.Path(a).resolve() == pathlib.Path(b).resolve()


def training_data(data: str, vocab_size: int):
    """The training data of a run: the prepared folder `data` (`load_prepared`), or Shakespeare's
    plays with a BPE of `vocab_size` entries when `data` is empty (`load_shakespeare`)."""
    return load_prepared(data) if data else load_shakespeare(vocab_size)
