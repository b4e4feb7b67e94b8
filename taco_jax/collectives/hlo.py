"""Wire bytes of the collectives in a compiled XLA program, per mesh axis (read from HLO text).

Counts bytes *sent per device* for one execution, with the usual bandwidth-optimal algorithms:
all-gather and all-to-all (P-1)/P of the result, reduce-scatter (P-1)/P of the operand, all-reduce 2(P-1)/P (ring),
collective-permute the whole operand. Collectives inside loops (`while` bodies) are counted once. Each collective's
communication site (`CommPolicy`'s ar_fwd, ..., pp_send) is read off the `site_scope` its op_name metadata names
(`collectives`), and the codec's kernels and scoped work off theirs (`codec_calls`)."""

from __future__ import annotations

import collections
import itertools
import re

import numpy as np

_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_LINE = re.compile(r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dt>pred|[sfu]\d+|bf16|f8e4m3fn|f8e5m2|f8e4m3|f8e5m2fnuz|f8e4m3fnuz)\[(?P<dims>[\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_COMMENT = re.compile(r"/\*.*?\*/")
_PAIRS = re.compile(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}")


def _itemsize(dt: str) -> int:
    if dt == "pred":
        return 1
    return max(1, int(re.sub(r"\D", "", dt.split("e")[0]) or 8) // 8) if dt.startswith("f8") is False else 1


def _array_bytes(type_str: str) -> tuple[int, str]:
    total, dts = 0, set()
    for m in _ARRAY.finditer(type_str):
        dims = [int(d) for d in m["dims"].split(",") if d]
        total += int(np.prod(dims, dtype=np.int64)) * _itemsize(m["dt"])
        dts.add(m["dt"])
    return total, "+".join(sorted(dts))


_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\(\[(?P<ids>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
    r"\s*\{(?P<over>[^}]*)\}"
)


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(line: str) -> list[tuple[int, ...]] | None:
    if m := _GROUPS_MESH.search(line):  # mesh['axis_0'=4,...], device_ids=([2,4]T(1,0)) {'axis_0'}
        names = re.findall(r"'([^']+)'=(\d+)", m["axes"])
        shape = [int(n) for _, n in names]
        ids = _iota([int(d) for d in m["ids"].split(",")], m["perm"]) if m["ids"] else np.arange(int(np.prod(shape)))
        ids = ids.reshape(shape)
        over = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m["over"]]
        keep = [i for i in range(len(shape)) if i not in over]
        ids = ids.transpose(keep + over)
        return [tuple(r) for r in ids.reshape(-1, int(np.prod([shape[i] for i in over]))).tolist()]
    if m := _GROUPS_LIST.search(line):
        return [tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d,]*)\}", m[1])]
    if m := _GROUPS_IOTA.search(line):
        n_groups, size = int(m[1]), int(m[2])
        ids = _iota([int(d) for d in m[3].split(",")], m[4])
        return [tuple(r) for r in ids.reshape(n_groups, size).tolist()]
    return None


def mesh_axis_groups(mesh) -> dict[str, set[frozenset[int]]]:
    """For each mesh axis, the groups of logical device ids it spans; and for each set of two or more
    axes, named "a+b" in mesh order, the groups they span together. Logical ids (what replica groups
    name) are positions in `mesh.devices` flattened, not `Device.id`s (which differ across processes)."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    out = {}
    for i, name in enumerate(mesh.axis_names):
        moved = np.moveaxis(ids, i, -1).reshape(-1, ids.shape[i])
        out[name] = {frozenset(r.tolist()) for r in moved}
    for k in range(2, len(mesh.axis_names) + 1):  # groups over several axes at once (XLA:GPU combines, e.g.
        for axes in itertools.combinations(range(len(mesh.axis_names)), k):  # data+stage gradient all-reduces)
            moved = np.moveaxis(ids, axes, range(ids.ndim - k, ids.ndim))
            size = int(np.prod([ids.shape[a] for a in axes]))
            out["+".join(mesh.axis_names[a] for a in axes)] = {frozenset(r.tolist()) for r in moved.reshape(-1, size)}
    return out


#: Prefix of the named scope a communication site's collectives run under (`site_scope`): the
#: compiled HLO's op_name metadata then names the site (`collectives`).
SITE_SCOPE = "site_"
_SITE = re.compile(SITE_SCOPE + r"(ar_fwd|ar_bwd|all_gather|reduce_scatter|dp_grads|pp_send)\b")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CODEC_SCOPE = re.compile(r"\b(taco_encode|taco_decode|taco_reduce)\b")


def site_scope(site: str):
    """`jax.named_scope` naming a communication site (a `CommPolicy` site: ar_fwd, ..., pp_send) in
    the op_name metadata of the collectives traced inside it, forward and backward (a custom_vjp
    rule called inside keeps it). Names only: the computation is unchanged."""
    import jax

    return jax.named_scope(SITE_SCOPE + site)


def _sites(op_name: str) -> str:
    """The site of an op_name: the one `site_scope` it names, "+"-joined when XLA combined several
    collectives of different sites into one, "" when none."""
    return "+".join(sorted(set(_SITE.findall(op_name))))


def collectives(hlo_text: str, mesh) -> list[dict]:
    """Every collective of an HLO module, one record each (a `-start` / `-done` pair once).

    Record: "axis" (mesh axis, "+"-joined for multi-axis groups, "?" when the groups match no axis), "op" (HLO op),
    "dtype" ("+"-joined result element types), "result_bytes", "message_bytes" (one rank's operand), "sent" (bytes
    sent per device, module docstring), "ranks" (P), "site" (`site_scope` in its op_name, "" if none), "op_name".
    Collectives with P <= 1 are left out."""
    axis_groups = mesh_axis_groups(mesh)
    done_type = _done_types(hlo_text)
    out = []
    for raw in hlo_text.splitlines():
        m = _LINE.search(_COMMENT.sub("", raw))
        if not m or "-done(" in raw:
            continue
        line = _COMMENT.sub("", raw)
        op = m["op"]
        start = _NAME.match(line) if f"{op}-start(" in line else None  # (operand, result) tuple: the done's type
        nbytes, dts = _array_bytes(done_type.get(start[1], m["type"]) if start else m["type"])
        name = _OP_NAME.search(raw)
        if op == "collective-permute":
            pairs = _PAIRS.search(line)
            axis, p, sent, message = _permute_axis(pairs[1] if pairs else "", axis_groups), 2, float(nbytes), nbytes
        else:
            groups = _groups(line)
            if not groups or len(groups[0]) <= 1:
                continue
            gset = {frozenset(g) for g in groups}
            p = len(groups[0])
            axis = next((a for a, s in axis_groups.items() if s == gset), "?")
            frac = (p - 1) / p
            sent = {"all-reduce": 2 * frac * nbytes, "reduce-scatter": (p - 1) * nbytes}.get(op, frac * nbytes)
            message = {"all-gather": nbytes // p, "reduce-scatter": nbytes * p}.get(op, nbytes)
        op_name = name[1] if name else ""
        inst = _NAME.match(line)
        out.append(dict(axis=axis, op=op, dtype=dts, result_bytes=nbytes, message_bytes=message, sent=sent, ranks=p,
                        site=_sites(op_name), op_name=op_name, name=inst[1] if inst else ""))
    return out


_NAME = re.compile(r"\s*(?:ROOT\s+)?%?([\w.-]+)\s*=")
_DONE = re.compile(r"=\s*(?P<type>.*?)\s+(?:" + "|".join(_OPS) + r")-done\(%?(?P<start>[\w.-]+)\)")


def _done_types(hlo_text: str) -> dict[str, str]:
    """{name of an async collective's `-start`: the result type its `-done` gives} (XLA:GPU's
    scheduled HLO; a start's own type is the (operand, result) tuple)."""
    found = (_DONE.search(_COMMENT.sub("", line)) for line in hlo_text.splitlines() if "-done(" in line)
    return {m["start"]: m["type"] for m in found if m}


#: What may run between an async collective's start and done in a schedule, by kind (`async_overlap`).
_MATMUL = re.compile(r"gemm|cublas|\bdot\(|convolution\(|__triton_gemm")
_CODEC = re.compile(r'custom_call_target="(taco_[^"]*|__gpu\$xla\.gpu\.triton|triton_kernel_call)"')
_TRIVIAL = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-start", "copy-done",
            "partition-id", "replica-id", "after-all")
_OPCODE = re.compile(r"\)?\s([a-z][a-z0-9-]*)\(")


def _kind(line: str) -> str | None:
    """The kind of work an instruction of a schedule is: "collective", "codec", "matmul", "compute",
    or None (bookkeeping: parameters, tuples, bitcasts, ...)."""
    rhs = line.split("=", 1)[1] if "=" in line else line
    op = _OPCODE.search(rhs)
    opcode = op[1] if op else ""
    if opcode in _TRIVIAL or not opcode:
        return None
    if any(opcode.startswith(o) for o in _OPS):
        return "collective"
    name = _OP_NAME.search(line)
    if _CODEC.search(line) or (name and _CODEC_SCOPE.search(name[1])):
        return "codec"
    if _MATMUL.search(line):
        return "matmul"
    return "compute"


def async_overlap(hlo_text: str, mesh) -> list[dict]:
    """What a scheduled program (XLA:GPU's `compiled.as_text()`) runs between each async collective's
    `-start` and `-done`: one record per start with `collectives`' fields plus "sync" (XLA's
    `is_sync`), "between" ({`_kind`: count} of the instructions in between) and "overlapped" (not
    sync, and compute scheduled in between). Collectives that are not async (XLA:CPU's) are left out."""
    starts = {c["name"]: c for c in collectives(hlo_text, mesh) if "-start" in c["name"]}
    out = []
    for comp in _computations(hlo_text):
        for i, line in enumerate(comp):
            inst = _NAME.match(line)
            if not inst or inst[1] not in starts:
                continue
            done = re.compile(r"-done\(%?" + re.escape(inst[1]) + r"\)")
            j = next((j for j in range(i + 1, len(comp)) if done.search(comp[j])), i)
            between = collections.Counter(k for ln in comp[i + 1:j] if (k := _kind(ln)))
            sync = '"is_sync":true' in line
            out.append({**starts[inst[1]], "sync": sync, "between": dict(between),
                        "overlapped": not sync and any(between[k] for k in ("matmul", "codec", "compute"))})
    return out


def overlap_by_site(records: list[dict]) -> list[dict]:
    """`async_overlap`'s records summed per (axis, site): "collectives", "sync", "overlapped" (counts),
    "bytes" (sent) and "overlapped_bytes", "overlapped_frac" (bytes-weighted), "between" (summed)."""
    by = {}
    for r in records:
        e = by.setdefault((r["axis"], r["site"]), {"axis": r["axis"], "site": r["site"], "collectives": 0, "sync": 0,
                                                   "overlapped": 0, "bytes": 0.0, "overlapped_bytes": 0.0,
                                                   "between": collections.Counter()})
        e["collectives"] += 1
        e["sync"] += r["sync"]
        e["overlapped"] += r["overlapped"]
        e["bytes"] += r["sent"]
        e["overlapped_bytes"] += r["sent"] * r["overlapped"]
        e["between"].update(r["between"])
    return [{**e, "bytes": int(e["bytes"]), "overlapped_bytes": int(e["overlapped_bytes"]),
             "overlapped_frac": e["overlapped_bytes"] / e["bytes"] if e["bytes"] else 0.0,
             "between": dict(e["between"])}
            for _, e in sorted(by.items())]


def _computations(hlo_text: str) -> list[list[str]]:
    """The instruction lines of each computation of an HLO module, in their (scheduled) order."""
    comps, cur = [], None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            cur = [] if line.rstrip().endswith("{") else None
            if cur is not None:
                comps.append(cur)
        elif cur is not None and "=" in line:
            cur.append(_COMMENT.sub("", line))
    return comps


def codec_calls(hlo_text: str) -> list[dict]:
    """The codec work of an HLO module: each "taco_..." custom-call, and each other top-level instruction inside a
    `taco_encode` / `taco_decode` / `taco_reduce` scope (not those inside fusions or reducer regions). Record:
    "kind" (encode, decode, reduce), "target" (the custom-call target, or the HLO op), "site" (as `collectives`)."""
    out, fused = [], False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation header: fusion bodies and reducers are skipped
            fused = line.lstrip("%").startswith(("fused", "region"))
            continue
        if fused or "=" not in line:
            continue
        name = _OP_NAME.search(line)
        scope = _CODEC_SCOPE.search(name[1]) if name else None
        target = _TARGET.search(line)
        if target and target[1].startswith("taco_"):
            kind = next((k for k in ("encode", "decode", "reduce") if k in target[1]), "other")
            out.append(dict(kind=kind, target=target[1], site=_sites(name[1]) if name else ""))
        elif scope and not target:
            op = _OPCODE.search(line.split("=", 1)[1])
            if op and op[1] not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast") + _OPS:
                out.append(dict(kind=scope[1].removeprefix("taco_"), target=op[1], site=_sites(name[1])))
    return out


def collective_bytes(hlo_text: str, mesh) -> dict:
    """Bytes sent per device per execution, by mesh axis (as `collectives`), op and dtype:
    {"by_axis": {axis: bytes}, "detail": [{"axis", "op", "dtype", "count", "bytes"}]}."""
    detail = collections.defaultdict(lambda: [0, 0.0])
    for c in collectives(hlo_text, mesh):
        key = (c["axis"], c["op"], c["dtype"])
        detail[key][0] += 1
        detail[key][1] += c["sent"]
    rows = [dict(axis=a, op=o, dtype=d, count=c, bytes=int(b)) for (a, o, d), (c, b) in sorted(detail.items())]
    by_axis = collections.Counter()
    for r in rows:
        by_axis[r["axis"]] += r["bytes"]
    return {"by_axis": dict(by_axis), "detail": rows}


def _permute_axis(pairs: str, axis_groups) -> str:
    pr = [tuple(int(v) for v in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", pairs)]
    for a, groups in axis_groups.items():
        if pr and all(any(s in g and t in g for g in groups) for s, t in pr):
            return a
    return "?"
