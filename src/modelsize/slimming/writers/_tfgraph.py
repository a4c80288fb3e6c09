"""Rewriting a TF2 checkpoint's object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``) after a slim.

``tf.train.Checkpoint.restore`` matches Python objects to the graph's nodes by walking the
edges from the root (``model``, ``layer_with_weights-0``, ``kernel``...) and reads each
variable's value under the key its node names. A graph that still lists the optimizer, its
slot variables or its step counter after their values are gone would leave restores with
unmatched objects (``assert_consumed`` fails) or with keys missing from the bundle. So:

1. an optimizer (a node with slot variables, or reached by an ``optimizer`` edge) goes with
   everything only it reaches (its list of the variables it trains excepted: those are the
   model's) when none of those nodes' values is kept;
2. the attributes of dropped tensors go; a node left with neither values nor children, that
   had some, goes; and so, in turn, do nodes whose every child went;
3. nodes no longer reachable from the root (children and slot-variable references) go.

The survivors are renumbered in their order, edges and slot references to removed nodes are
cut, and ``has_checkpoint_values`` is recomputed as TensorFlow computes it
(``add_checkpoint_values_check``: a node with values, slot variables or a registered saver,
and every node above it). Everything else is copied byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelsize.formats._protobuf import LEN, VARINT, Field, iter_fields
from modelsize.formats.tensorflow import _OPTIMIZER_EDGES, _TRAINABLE_EDGES
from modelsize.slimming.writers._tftable import field_bytes, field_varint

__all__ = ["rewrite_object_graph"]

_HAS_VALUES = 5
_REGISTERED_SAVER = 4


@dataclass
class _Node:
    fields: list[Field]
    children: list[tuple[int, str]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)
    saver: bool = False


def _parse(buf: bytes) -> tuple[list[Field], list[_Node]]:
    top: list[Field] = []
    nodes: list[_Node] = []
    for f in iter_fields(buf, 0, len(buf)):
        top.append(f)
        if f.number != 1 or f.wire_type != LEN:
            continue
        node = _Node(list(iter_fields(buf, f.data_start, f.end)))
        for g in node.fields:
            if g.wire_type != LEN:
                continue
            if g.number == 1:
                child, local = 0, ""
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number == 1 and h.wire_type == VARINT:
                        child = h.value
                    elif h.number == 2 and h.wire_type == LEN:
                        local = h.text(buf)
                node.children.append((child, local))
            elif g.number == 2:
                key = ""
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number == 3 and h.wire_type == LEN:
                        key = h.text(buf)
                node.keys.append(key)
            elif g.number == 3:
                original, slot = -1, -1
                for h in iter_fields(buf, g.data_start, g.end):
                    if h.number == 1 and h.wire_type == VARINT:
                        original = h.value
                    elif h.number == 3 and h.wire_type == VARINT:
                        slot = h.value
                node.slots.append((original, slot))
            elif g.number == _REGISTERED_SAVER:
                node.saver = True
        nodes.append(node)
    count = len(nodes)
    for node in nodes:
        ends = [c for c, _ in node.children] + [i for pair in node.slots for i in pair]
        if any(not 0 <= i < count for i in ends):
            raise ValueError("object graph refers to a node outside the graph")
    return top, nodes


def _reach(nodes: list[_Node], starts: list[int], gone: set[int],
           skip_edges: frozenset[str] = frozenset(), slots: bool = False) -> set[int]:
    seen: set[int] = set()
    stack = [s for s in starts if s not in gone]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        nxt = [c for c, local in nodes[i].children if local not in skip_edges]
        if slots:
            nxt += [s for o, s in nodes[i].slots if o not in gone]
        stack.extend(c for c in nxt if c not in seen and c not in gone)
    return seen


def _removed(nodes: list[_Node], kept: set[str]) -> set[int]:
    """The nodes the slim output's graph no longer has."""
    optimizers = {i for i, n in enumerate(nodes) if n.slots}
    for node in nodes:
        optimizers.update(c for c, local in node.children if local in _OPTIMIZER_EDGES)
    optimizers.discard(0)
    model = _reach(nodes, [0], optimizers)
    gone: set[int] = set()
    for o in sorted(optimizers):
        own = _reach(nodes, [o], set(), _TRAINABLE_EDGES)
        own.update(s for i in list(own) for _, s in nodes[i].slots)
        own -= model
        if not any(k in kept for i in own for k in nodes[i].keys):
            gone |= own

    def empty(i: int) -> bool:
        n = nodes[i]
        children = [c for c, _ in n.children if c not in gone]
        values = [k for k in n.keys if k in kept]
        had = bool(n.keys) or bool(n.children)
        return had and not children and not values and not n.saver and not n.slots

    changed = True
    while changed:
        changed = False
        for i in range(1, len(nodes)):
            if i not in gone and empty(i):
                gone.add(i)
                changed = True
    reachable = _reach(nodes, [0], gone, slots=True)
    return gone | (set(range(len(nodes))) - reachable)


def _has_values(nodes: list[_Node], ids: list[int], kept: set[str], gone: set[int]) -> set[int]:
    """TensorFlow's ``add_checkpoint_values_check`` on the new graph (old ids)."""
    parents: dict[int, set[int]] = {}
    marked: set[int] = set()
    for i in ids:
        n = nodes[i]
        slots = [p for p in n.slots if p[0] not in gone and p[1] not in gone]
        if any(k in kept for k in n.keys) or slots or n.saver:
            marked.add(i)
        for c, _ in n.children:
            if c not in gone:
                parents.setdefault(c, set()).add(i)
    todo = set(marked)
    while todo:
        up = parents.pop(todo.pop(), set())
        marked |= up
        todo |= up
    return marked


def _renumbered(buf: bytes, f: Field, new_id: dict[int, int], numbers: tuple[int, ...]) -> bytes:
    """A sub-message with its varint fields ``numbers`` (node ids) renumbered."""
    out = bytearray()
    for g in iter_fields(buf, f.data_start, f.end):
        if g.number in numbers and g.wire_type == VARINT:
            if new_id[g.value]:
                out += field_varint(g.number, new_id[g.value])
        else:
            out += buf[g.start : g.end]
    return field_bytes(f.number, bytes(out))


def rewrite_object_graph(buf: bytes, kept: set[str]) -> tuple[bytes, int] | None:
    """The serialized ``TrackableObjectGraph`` for a bundle holding only the ``kept`` keys,
    and how many nodes it lost; ``None`` when it keeps every node and every value (the input's
    bytes stand)."""
    top, nodes = _parse(buf)
    if not nodes:
        return None
    gone = _removed(nodes, kept)
    if not gone and all(k in kept for n in nodes for k in n.keys):
        return None
    ids = [i for i in range(len(nodes)) if i not in gone]
    new_id = {old: new for new, old in enumerate(ids)}
    with_values = _has_values(nodes, ids, kept, gone)
    encoded: list[bytes] = []
    for i in ids:
        node = nodes[i]
        out = bytearray()
        child = attr = slot = 0
        for g in node.fields:
            if g.number == 1 and g.wire_type == LEN:
                target, _ = node.children[child]
                child += 1
                if target not in gone:
                    out += _renumbered(buf, g, new_id, (1,))
            elif g.number == 2 and g.wire_type == LEN:
                key = node.keys[attr]
                attr += 1
                if key in kept:
                    out += buf[g.start : g.end]
            elif g.number == 3 and g.wire_type == LEN:
                original, slot_id = node.slots[slot]
                slot += 1
                if original not in gone and slot_id not in gone:
                    out += _renumbered(buf, g, new_id, (1, 3))
            elif g.number == _HAS_VALUES and g.wire_type == LEN:
                out += field_bytes(_HAS_VALUES, b"\x08\x01" if i in with_values else b"")
            else:
                out += buf[g.start : g.end]
        encoded.append(field_bytes(1, bytes(out)))
    result = bytearray()
    nodes_written = False
    for f in top:
        if f.number == 1 and f.wire_type == LEN:
            if not nodes_written:
                result += b"".join(encoded)
                nodes_written = True
        else:
            result += buf[f.start : f.end]
    return bytes(result), len(gone)
