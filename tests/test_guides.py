"""The guides state contracts, not lab notes (issue 53, item 5).

- README.md and the docstrings of `taco_jax/` name no commit id and no date: a dated measurement
  belongs in docs/results.md with its command, where it can be rerun.
- Docstrings and comments stay a bounded share of `taco_jax/`'s lines (`doc_share`).
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "taco_jax"
#: The most docstring+comment lines `taco_jax/` may hold, as a share of its non-blank lines.
MAX_SHARE = 0.22

#: A commit id as written in prose: 7-40 hex digits holding at least one letter and one digit.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
          r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
#: A date: ISO (2026-12-06) or with a month name (6 December 2026, Dec 6, 2026).
DATE = re.compile(rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}} {_MONTH} \d{{4}}\b|\b{_MONTH}\.? \d{{1,2}},? \d{{4}}\b")


def _docstring_nodes(tree: ast.AST):
    """The docstring expressions of a module: the first statement of the module, of each class and of
    each function when it is a string constant."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield first.value


def doc_share(source: str) -> tuple[int, int]:
    """(docstring+comment lines, non-blank lines) of one Python source.

    The rule: a physical line counts as doc/comment when every token on it is a COMMENT, a STRING
    that is a docstring (the first statement of the module, a class or a function), or NL, NEWLINE,
    INDENT, DEDENT. A line holding any other token (code, or code with a trailing comment) is code.
    A multi-line token covers every line it spans. Blank lines (whitespace only, in or out of a
    docstring) count in neither number.
    """
    starts = {(d.lineno, d.col_offset) for d in _docstring_nodes(ast.parse(source))}
    doc, code = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        span = range(tok.start[0], tok.end[0] + 1)
        is_doc = tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in starts)
        (doc if is_doc else code).update(span)
    nonblank = {i for i, line in enumerate(source.splitlines(), 1) if line.strip()}
    return len((doc - code) & nonblank), len(nonblank)


def package_shares(root: pathlib.Path = PACKAGE) -> dict[str, tuple[int, int]]:
    """`doc_share` summed per top-level package of `root` (a module at the top is its own entry)
    and over all of it (`"total"`)."""
    shares: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        doc, lines = doc_share(path.read_text(encoding="utf-8"))
        for key in (rel.parts[0], "total"):
            entry = shares.setdefault(key, [0, 0])
            entry[0] += doc
            entry[1] += lines
    return {k: (d, n) for k, (d, n) in shares.items()}


def _docstrings():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in _docstring_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            yield f"{path.relative_to(ROOT)}:{node.lineno}", node.value


def _hits(text: str) -> list[str]:
    return [m.group(0) for pattern in (COMMIT, DATE) for m in pattern.finditer(text)]


def test_the_patterns_catch_ids_and_dates_and_spare_numbers():
    assert _hits("at commit 0029bf5, measured 2026-12-01 and on 3 December 2026 (Dec 4, 2026)") == [
        "0029bf5", "2026-12-01", "3 December 2026", "Dec 4, 2026"]
    assert _hits("14,174,508 bytes; 1234567 elements; the dtype float8_e4m3fn; deadbeef; 0x7f800000") == []


def test_readme_names_no_commit_id_and_no_date():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    hits = [(i, h) for i, line in enumerate(text.splitlines(), 1) for h in _hits(line)]
    assert not hits, f"README.md names commit ids or dates (line, text): {hits}; move them to docs/results.md"


def test_docstrings_name_no_commit_id_and_no_date():
    hits = [(where, h) for where, text in _docstrings() for h in _hits(text)]
    assert not hits, f"taco_jax docstrings name commit ids or dates: {hits}; move them to docs/results.md"


def test_doc_share_counts_docstrings_and_comments_not_strings_or_blank_lines():
    source = ('"""Module.\n\nMore."""\n\n# a comment\nX = "not a docstring"  # trailing\n\n\n'
              'def f():\n    """Doc."""\n    return 1\n')
    assert doc_share(source) == (4, 7)


def test_docstrings_and_comments_are_at_most_22_percent_of_taco_jax():
    shares = package_shares()
    doc, lines = shares["total"]
    detail = {k: f"{d / n:.1%}" for k, (d, n) in shares.items()}
    assert doc / lines <= MAX_SHARE, f"docstring+comment share {doc / lines:.1%} > {MAX_SHARE:.0%}: {detail}"
