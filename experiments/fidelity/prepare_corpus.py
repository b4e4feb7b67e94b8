"""A corpus nobody here wrote, prepared reproducibly from files every machine of this kind has: the
CPython standard library's source (`.py`: code, comments, docstrings) of the running interpreter.

Source. `sysconfig.get_paths()["stdlib"]` (the interpreter's own `Lib` folder), every `*.py` file
below it except installed third-party packages (`site-packages/`, `dist-packages/`) and bytecode
caches, in sorted order of their paths relative to that folder (POSIX form; the same order on every
machine). License: the Python Software Foundation License Version 2 (the folder's `LICENSE.txt`,
whose sha256 is recorded); CPython's stdlib is the same bytes for the same Python version, so the
input hash below is reproducible on a machine with the same interpreter (version recorded).

Steps.
  1. The files are read as UTF-8; a file that is not valid UTF-8 (a few test files declare
     another encoding on purpose) is listed under "skipped" with the reason, never silently dropped.
  2. Each file becomes one document, written in that order to `<out>/documents.jsonl`
     ({"text": <file contents>}; the file's relative path is in `corpus.json`, not in the text).
  3. `taco_jax.data.prepare_data` (= `taco-jax prepare-data documents.jsonl --out OUT --vocab-size V`)
     trains a byte-level BPE of V entries on it and writes train.bin, val.bin, tokenizer.json and
     meta.json (the last `--val-fraction` of the token stream is the validation split).
  4. `<out>/corpus.json`: the interpreter, the source folder, the license, the files with their
     sizes and sha256, the skipped ones, `input_sha256` (sha256 over "relative path\\0sha256 of the
     file's bytes\\n" for every used file in order), `output_sha256` (sha256 over "name\\0sha256\\n"
     of train.bin, val.bin, tokenizer.json; meta.json holds absolute paths and is left out) and the
     token counts.

    python -m experiments.fidelity.prepare_corpus --out runs/corpus/cpython-stdlib
    python -m experiments.fidelity.prepare_corpus --out /tmp/c --max-files 40      # a small subset, seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import platform
import sysconfig
import time

from experiments.common import run_record

#: Folders below the stdlib that hold software installed into it, not the standard library.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
#: The corpus's license (CPython's `LICENSE.txt` in the stdlib folder).
LICENSE = "Python Software Foundation License Version 2 (PSF-2.0)"
#: BPE entries without --vocab-size: small enough that the embedding and output layer of a CPU-sized
#: model stay a minor part of its step.
DEFAULT_VOCAB = 4096


def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library folder (`sysconfig.get_paths()["stdlib"]`)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root, max_files: int = 0) -> list[pathlib.Path]:
    """The `*.py` files below `root`, sorted by their POSIX path relative to `root`, without those in
    `EXCLUDED_DIRS`; the first `max_files` of them when `max_files` > 0.
    Raises ValueError naming `root` when it is not a folder or holds no such file, or a negative
    `max_files`."""
    root = pathlib.Path(root)
    if max_files < 0:
        raise ValueError(f"max_files={max_files} must be >= 0 (0: all files)")
    if not root.is_dir():
        raise ValueError(f"source folder {str(root)!r} is not a folder")
    files = sorted((f for f in root.rglob("*.py")
                    if f.is_file() and not set(f.relative_to(root).parts[:-1]) & set(EXCLUDED_DIRS)),
                   key=lambda f: f.relative_to(root).as_posix())
    if not files:
        raise ValueError(f"source folder {str(root)!r} holds no .py file outside {EXCLUDED_DIRS}")
    return files[:max_files] if max_files else files


def sha256_file(path) -> str:
    """sha256 (hex) of a file's bytes, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def list_hash(entries) -> str:
    """sha256 (hex) over "name\\0digest\\n" of (name, digest) pairs in the given order."""
    h = hashlib.sha256()
    for name, digest in entries:
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def write_documents(root, files, path) -> tuple[list[dict], list[dict]]:
    """Writes one JSONL line {"text": contents} per UTF-8 file of `files` to `path`, in order.
    Returns (used, skipped): used as {"path", "bytes", "sha256"} (path relative to `root`), skipped
    as {"path", "bytes", "reason"}."""
    root = pathlib.Path(root)
    used, skipped = [], []
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            raw = f.read_bytes()
            rel = f.relative_to(root).as_posix()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                skipped.append({"path": rel, "bytes": len(raw), "reason": f"not UTF-8 ({e.reason} at byte {e.start})"})
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            used.append({"path": rel, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
    return used, skipped


def prepare_corpus(out, *, root=None, max_files: int = 0, vocab_size: int = DEFAULT_VOCAB,
                   val_fraction: float = 0.05, progress: bool = True, run: dict | None = None) -> dict:
    """Prepares the CPython-stdlib corpus into `out` (module docstring) and returns `corpus.json`'s dict.

    `root`: the source folder (default: `stdlib_root()`); `max_files`: only the first N files (0: all);
    `vocab_size`, `val_fraction`: as `taco-jax prepare-data`'s; `run`: the run record kept under "run"
    (`experiments.common.run_record`; None: not recorded).
    Raises ValueError naming a bad folder, count or fraction (from `corpus_files` / `prepare_data`).
    """
    from taco_jax.data import prepare_data

    root = pathlib.Path(root) if root else stdlib_root()
    files = corpus_files(root, max_files)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = out / "documents.jsonl"
    used, skipped = write_documents(root, files, docs)
    meta = prepare_data([str(docs)], out, vocab_size=vocab_size, val_fraction=val_fraction, progress=progress)
    lic = root / "LICENSE.txt"
    outputs = {name: sha256_file(out / name) for name in ("train.bin", "val.bin", "tokenizer.json")}
    n_bytes = sum(u["bytes"] for u in used)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    corpus = {
        "name": "cpython-stdlib",
        "python": platform.python_version(), "implementation": platform.python_implementation(),
        "source": str(root), "pattern": "**/*.py", "excluded_dirs": list(EXCLUDED_DIRS),
        "license": LICENSE, "license_file": str(lic) if lic.is_file() else None,
        "license_sha256": sha256_file(lic) if lic.is_file() else None,
        "max_files": max_files, "files": len(used), "bytes": n_bytes, "skipped": skipped,
        "input_sha256": list_hash((u["path"], u["sha256"]) for u in used),
        "documents_sha256": sha256_file(docs),
        "vocab_size": vocab_size, "val_fraction": val_fraction,
        "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"], "tokens": tokens,
        "bytes_per_token": n_bytes / tokens,
        "outputs": outputs, "output_sha256": list_hash(outputs.items()),
        "prepare_s": time.perf_counter() - t0,
        "run": run,
        "used": used,
    }
    (out / "corpus.json").write_text(json.dumps(corpus, indent=2) + "\n")
    return corpus


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/corpus/cpython-stdlib", help="prepared folder to write")
    p.add_argument("--source", default="", help="stdlib folder (default: this interpreter's)")
    p.add_argument("--max-files", type=int, default=0, help="only the first N files in order (0: all)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="entries of the byte-level BPE")
    p.add_argument("--val-fraction", type=float, default=0.05, help="last fraction of the token stream held out")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    c = prepare_corpus(args.out, root=args.source or None, max_files=args.max_files, vocab_size=args.vocab_size,
                       val_fraction=args.val_fraction, progress=not args.no_progress,
                       run=run_record(__spec__.name, argv))
    print(json.dumps({k: v for k, v in c.items() if k not in ("used", "skipped")}
                     | {"skipped": len(c["skipped"])}, indent=2))
    return c


if __name__ == "__main__":
    main()
