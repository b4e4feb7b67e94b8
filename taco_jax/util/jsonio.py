"""Strict JSON (RFC 8259) for every file and line the project writes: non-finite floats become strings;
and `read_table`, the one reader of the TOML / JSON files a user hands in (`--config`, `--hardware`).

Python's `json` writes NaN / ±Inf as bare tokens that are not JSON; here a non-finite float is written as the
*string* "NaN", "Infinity" or "-Infinity" (`null` would lose the sign), which `float(value)` reads back. numpy scalars
become Python numbers. docs/training.md ("Outputs")."""

from __future__ import annotations

import json
import math
import pathlib
import tomllib

import numpy as np

#: How each non-finite float is written (a JSON string).
NONFINITE_STRINGS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def strict(obj):
    """`obj` with every non-finite float (Python or numpy) replaced by its string, numpy scalars and
    arrays made Python numbers / lists, tuples made lists. Raises TypeError for other objects."""
    if isinstance(obj, bool | np.bool_):
        return bool(obj)
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        v = float(obj)
        return v if math.isfinite(v) else NONFINITE_STRINGS[repr(v)]
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict(obj.tolist())
    if obj is None or isinstance(obj, str):
        return obj
    raise TypeError(f"cannot write {type(obj).__name__} {obj!r} as JSON")


def dumps(obj, **kwargs) -> str:
    """`json.dumps` of `strict(obj)`; never writes NaN / Infinity tokens (allow_nan=False)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def write(path, obj, *, indent: int | None = 2) -> pathlib.Path:
    """Writes `dumps(obj)` and a newline to `path`."""
    path = pathlib.Path(path)
    path.write_text(dumps(obj, indent=indent) + "\n")
    return path


def read_metrics(path) -> list[dict]:
    """The records of a run's `metrics.jsonl`, non-finite numbers (written as strings) back as floats."""
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return [{k: float(v) if k in ("loss", "val_loss", "grad_norm") else v for k, v in r.items()} for r in recs]


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs) -> dict:
    """A JSON object's pairs as a dict; raises _DuplicateKey (the key) when a key repeats (`json` would
    keep the last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_table(path, what: str) -> dict:
    """The top-level table of TOML file `path`, or of JSON file `path` when its suffix is ".json".
    `what` names the file in errors (e.g. "--config", "hardware file").

    Raises ValueError naming `what` and the file when it cannot be read, is not UTF-8 (naming the byte, its offset
    and line), does not parse, repeats a key in one object, or does not hold a table / object at the top."""
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")  # UTF-8 whatever the locale (a byte-order mark is dropped)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{what} {str(path)!r}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}, "
                         f"line {line}); save it as UTF-8") from None
    as_json = path.suffix == ".json"
    try:
        values = json.loads(text, object_pairs_hook=_unique_keys) if as_json else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if as_json else "TOML (.json files are read as JSON)"
        raise ValueError(f"{what} {str(path)!r}: not valid {kind}: {e}") from None
    except _DuplicateKey as e:  # TOML refuses a key given twice itself
        raise ValueError(f"{what} {str(path)!r}: key {e.args[0]!r} is given twice in one object") from None
    if not isinstance(values, dict):
        raise ValueError(f"{what} {str(path)!r}: must hold a table / object at the top, not {type(values).__name__}")
    return values
