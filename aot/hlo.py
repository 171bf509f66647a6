"""Collectives of a compiled program, counted from its HLO text with loop trip counts.

``collectives(hlo_text)`` returns, per kind (all-gather, reduce-scatter, all-reduce, all-to-all,
collective-permute), how many run per step and their bytes per step on one device, where a
collective inside a ``while`` body counts once per trip (scanned layers, gradient accumulation,
decode steps). Two byte figures per kind:
  * ``bytes``: the collective's full buffer on one device: an all-gather's output, a
    reduce-scatter's input, an all-reduce's or all-to-all's operand, a permute's operand;
  * ``ici_bytes``: what one device sends over its links in a ring implementation: (n-1)/n of
    the buffer for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce, all of
    it for a permute (n: the devices in its group).
Trip counts come from the loop's ``known_trip_count`` when the compiler states it, else from
its condition (``i < N`` on a tuple counter starting at a constant); a loop whose count cannot
be read counts once and is listed in ``unknown_loops``. The group size n comes from the replica
groups in each form XLA prints (``{{0,1},...}``, ``[G,n]<=[...]``, ``mesh[...] {axes}`` with or
without ``device_ids=(...)``); a collective whose groups cannot be read keeps its ``bytes`` and
count, is charged the ring's bound as ``ici_bytes`` (all of its buffer, an all-reduce twice:
an overestimate, never a free collective) and is listed in ``unknown_groups``. TPU's
reduce-scatter appears as a fusion around an all-reduce (``all-reduce-scatter``); it is counted
as a reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type_str: str
    opcode: str
    rest: str  # operands and attributes


@dataclasses.dataclass
class KindStats:
    count: int = 0
    bytes: float = 0.0
    ici_bytes: float = 0.0
    largest: float = 0.0  # the largest single buffer (an all-gather of one layer vs all)


@dataclasses.dataclass
class Collectives:
    by_kind: dict[str, KindStats]
    unknown_loops: list[str]
    unknown_groups: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> float:
        return sum(s.bytes for s in self.by_kind.values())

    @property
    def total_ici_bytes(self) -> float:
        return sum(s.ici_bytes for s in self.by_kind.values())

    def to_json(self) -> dict:
        return {k: dataclasses.asdict(s) for k, s in self.by_kind.items() if s.count}


def array_bytes(type_str: str) -> list[float]:
    """Bytes of each array in an HLO type (``bf16[4,8]{1,0}`` or a tuple of them)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * size)
    return out


def _split_type(text: str) -> tuple[str, str]:
    """(the type at the start of ``text``, what follows it)."""
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[:i + 1], text[i + 1:].lstrip()
    head, _, tail = text.partition(" ")
    return head, tail


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations by name (their instructions) and the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_str, tail = _split_type(line[m.end():])
        op, _, rest = tail.partition("(")
        comps[current].append(Instr(m.group(1), type_str, op.strip(), rest))
    return comps, entry


def _called(instr: Instr) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction runs: body, condition, calls, branches."""
    out = [(k, v) for k, v in re.findall(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)",
                                         instr.rest)]
    for names in re.findall(r"branch_computations=\{([^}]*)\}", instr.rest):
        out += [("branch", n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    return out


def trip_count(instr: Instr, comps: dict[str, list[Instr]], caller: list[Instr]) -> int | None:
    """Trips of a ``while``: its stated count, else ``N - start`` from an ``i < N`` condition."""
    known = re.search(r'known_trip_count[^0-9]*([0-9]+)', instr.rest)
    if known:
        return int(known.group(1))
    cond = dict(_called(instr)).get("condition")
    body = comps.get(cond or "", [])
    root = body[-1] if body else None
    if root is None or root.opcode != "compare":
        return None
    names = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0])
    direction = re.search(r"direction=(\w+)", root.rest)
    by_name = {i.name: i for i in body}
    if len(names) != 2 or not direction or direction.group(1) not in ("LT", "GT"):
        return None
    a, b = (by_name.get(n) for n in names)
    if direction.group(1) == "GT":
        a, b = b, a
    if not (a and b and b.opcode == "constant" and a.opcode == "get-tuple-element"):
        return None
    bound = int(re.match(r"\s*(-?[0-9]+)", b.rest).group(1))
    index = int(re.search(r"index=([0-9]+)", a.rest).group(1))
    return bound - _initial(instr, caller, index)


def _initial(loop: Instr, caller: list[Instr], index: int) -> int:
    """The loop counter's start: element ``index`` of the while's operand tuple, when that is
    a constant in the caller; else 0 (what lax.scan and fori_loop start from)."""
    by_name = {i.name: i for i in caller}
    operand = re.match(r"\s*%([\w.\-]+)", loop.rest)
    tup = by_name.get(operand.group(1)) if operand else None
    if tup is None or tup.opcode != "tuple":
        return 0
    elems = re.findall(r"%([\w.\-]+)", tup.rest.split(")")[0])
    elem = by_name.get(elems[index]) if index < len(elems) else None
    if elem is not None and elem.opcode == "constant":
        m = re.match(r"\s*(-?[0-9]+)", elem.rest)
        return int(m.group(1)) if m else 0
    return 0


# A mesh-form group list: ``mesh['a'=4,'b'=2][, device_ids=(...)] {'a'}``. ``device_ids`` (a
# device order, e.g. ``[2,2,2]T(0,2,1)``: parentheses inside) reorders the devices and leaves
# the group size alone; an axis in the set may be a sub-axis ``'a':(pre)size``.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"^'?([\w.\-]+)'?(?::\(([0-9]+)\)([0-9]+))?$")


def _group_size(instr: Instr) -> int | None:
    """Devices in each replica group of a collective, or None when its group list is in a
    form not read here (or absent, or ``{}``: all devices, whose count the instruction does
    not state), so the caller can count it as unknown instead of as a free one-device group."""
    rest = instr.rest
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = _MESH_GROUPS.search(rest)
    if not m:
        return None
    sizes = {k: int(v) for k, v in re.findall(r"'?([\w.\-]+)'?=([0-9]+)", m.group(1))}
    n = 1
    for axis in filter(None, (a.strip() for a in m.group(2).split(","))):
        ref = _MESH_AXIS.match(axis)
        if not ref or ref.group(1) not in sizes:
            return None
        n *= int(ref.group(3)) if ref.group(3) else sizes[ref.group(1)]
    return n


def _kind(opcode: str, computation: str) -> str | None:
    base = opcode.removesuffix("-start")
    if base not in KINDS:
        return None
    if base == "all-reduce" and "reduce-scatter" in computation:
        return "reduce-scatter"  # TPU's reduce-scatter: a fusion around an all-reduce
    return base


def _buffer_bytes(kind: str, instr: Instr, by_name: dict[str, Instr]) -> float:
    """The buffer of ``instr`` on one device, every operand of a combined collective (XLA
    merges a step's gradient all-reduces into one with many operands) counted."""
    out = sum(array_bytes(instr.type_str))
    srcs = [by_name[n] for n in _operands(instr) if n in by_name]
    in_bytes = sum(sum(array_bytes(s.type_str)) for s in srcs)
    if kind == "all-gather":
        # The gathered outputs; a -start returns (operands..., outputs...).
        return out - in_bytes if instr.opcode.endswith("-start") else out
    return in_bytes if srcs else out


def multiplicities(comps: dict[str, list[Instr]], entry: str
                   ) -> tuple[dict[str, int], dict[str, str], list[str]]:
    """How often each computation runs per call of ``entry`` (loop bodies once per trip), how
    each is reached (``body``, ``calls``, ...), and the loops whose trip count is unknown."""
    mult: dict[str, int] = {}
    how: dict[str, str] = {entry: "entry"}
    unknown: list[str] = []

    def visit(name: str, times: int) -> None:
        # Every call path adds its own count: a computation called from two places (or from a
        # loop body) runs once per call.
        mult[name] = mult.get(name, 0) + times
        for instr in comps.get(name, []):
            trips = 1
            if instr.opcode == "while":
                trips = trip_count(instr, comps, comps[name])
                if trips is None:
                    unknown.append(instr.name)
                    trips = 1
            for attr, callee in _called(instr):
                if attr != "to_apply" and callee in comps:
                    how.setdefault(callee, attr)
                    # A loop's condition runs once more than its body.
                    visit(callee, times * {"body": trips, "condition": trips + 1}.get(attr, 1))

    if entry:
        visit(entry, 1)
    return mult, how, unknown


def collectives(hlo_text: str) -> Collectives:
    """Per-kind counts and bytes per step of the compiled program ``hlo_text`` (see module)."""
    comps, entry = parse(hlo_text)
    mult, _, unknown = multiplicities(comps, entry)
    stats = {k: KindStats() for k in KINDS}
    unknown_groups: list[str] = []
    for name, count in mult.items():
        by_name = {i.name: i for i in comps[name]}
        for instr in comps[name]:
            kind = _kind(instr.opcode, name)
            if kind is None:
                continue
            size = _buffer_bytes(kind, instr, by_name)
            n = None if kind == "collective-permute" else _group_size(instr)
            if kind == "collective-permute":
                share = 1.0  # pairs, not groups: a device sends its whole operand
            elif n is None:
                # Unread: charged the ring's bound (n -> infinity) rather than nothing, and named.
                share = 2.0 if kind == "all-reduce" else 1.0
                unknown_groups.append(instr.name)
            else:
                share = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
            s = stats[kind]
            s.count += count
            s.bytes += size * count
            s.ici_bytes += size * share * count
            s.largest = max(s.largest, size)
    return Collectives(stats, unknown, unknown_groups)


# Instructions that move no HBM bytes of their own (views, plumbing, control flow).
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
         "conditional", "after-all", "partition-id", "replica-id", "iota", "opt-barrier",
         "custom-call", "copy-done", "all-gather-done", "all-reduce-done",
         "collective-permute-done", "async-done", "async-update"}


def _operands(instr: Instr) -> list[str]:
    return re.findall(r"%([\w.\-]+)", instr.rest.split(")")[0])


def _param_names(comp: list[Instr]) -> dict[int, str]:
    return {int(re.match(r"\s*([0-9]+)", i.rest).group(1)): i.name
            for i in comp if i.opcode == "parameter"}


def _read_bytes(comps: dict[str, list[Instr]], comp: list[Instr], name: str, full: float,
                depth: int = 0) -> float:
    """Bytes of value ``name`` that ``comp`` (a fused computation) reads from HBM: the slices
    when it is only sliced (directly or inside a nested fusion), nothing when it is only the
    buffer of in-place updates (dynamic-update-slice, scatter), else all of it."""
    total = 0.0
    for user in (i for i in comp if name in _operands(i)):
        ops = _operands(user)
        if user.opcode == "dynamic-slice" and ops[0] == name:
            total += sum(array_bytes(user.type_str))
        elif user.opcode in ("dynamic-update-slice", "scatter") and ops[0] == name and (
                ops.count(name) == 1):
            continue
        elif user.opcode == "fusion" and depth < 4:
            inner = comps.get(dict(_called(user)).get("calls") or "", [])
            params = _param_names(inner)
            total += sum(_read_bytes(comps, inner, params[k], full, depth + 1)
                         for k, n in enumerate(ops) if n == name and k in params)
        else:
            return full
    return min(total, full)


def _written_bytes(by_name: dict[str, Instr], elem: Instr | None) -> float:
    """Bytes an output of a fused computation writes: an in-place update's update (and a
    scatter's), else the whole output."""
    if elem is None:
        return 0.0
    ops = _operands(elem)
    buf = by_name.get(ops[0]) if ops else None
    if buf is not None and buf.opcode == "parameter":
        if elem.opcode == "dynamic-update-slice" and len(ops) > 1 and ops[1] in by_name:
            return sum(array_bytes(by_name[ops[1]].type_str))
        if elem.opcode == "scatter" and len(ops) > 2 and ops[-1] in by_name:
            return sum(array_bytes(by_name[ops[-1]].type_str))
    return sum(array_bytes(elem.type_str))


def _fusion_bytes(comps: dict[str, list[Instr]], fused: list[Instr], sizes: list[float],
                  out: float) -> float:
    """Bytes a fusion moves: what it reads of each operand (``_read_bytes``) and what it writes
    of each output (``_written_bytes``)."""
    if not fused:
        return sum(sizes) + out
    by_name = {i.name: i for i in fused}
    params = _param_names(fused)
    moved = sum(_read_bytes(comps, fused, params[k], size) if k in params else size
                for k, size in enumerate(sizes))
    root = fused[-1]
    elems = [by_name.get(n) for n in _operands(root)] if root.opcode == "tuple" else [root]
    return moved + sum(_written_bytes(by_name, e) for e in elems)


def hbm_bytes(hlo_text: str) -> float:
    """HBM bytes one step reads and writes by the compiled program, counted per instruction
    outside fusions (a fusion's operands and outputs; what it computes inside stays on chip),
    loop bodies once per trip. An in-place update (dynamic-update-slice, scatter) counts its
    update, and an operand a fusion only slices counts the slices, not the whole buffer. An estimate: it ignores caches
    and rematerialised reads inside a fusion, and counts custom calls (kernels) as zero."""
    comps, entry = parse(hlo_text)
    mult, how, _ = multiplicities(comps, entry)
    total = 0.0
    for name, count in mult.items():
        if how.get(name) in ("calls", "to_apply"):
            continue  # a fusion body or a reducer: its traffic is the caller's operands
        by_name = {i.name: i for i in comps[name]}
        for instr in comps[name]:
            if instr.opcode in _FREE or instr.opcode.endswith("-done"):
                continue
            ops = [by_name.get(n) for n in _operands(instr)]
            sizes = [sum(array_bytes(o.type_str)) if o else 0.0 for o in ops]
            out = sum(array_bytes(instr.type_str))
            if instr.opcode == "dynamic-update-slice" and len(sizes) > 1:
                moved = 2 * sizes[1]
            elif instr.opcode == "dynamic-slice":
                moved = 2 * out
            elif instr.opcode == "scatter" and len(sizes) > 2:
                moved = sum(sizes[1:]) + sizes[-1]  # in place: indices, updates read + written
            elif instr.opcode == "fusion":
                callee = dict(_called(instr)).get("calls")
                moved = _fusion_bytes(comps, comps.get(callee or "", []), sizes, out)
            else:
                moved = sum(sizes) + out
            total += moved * count
    return total
