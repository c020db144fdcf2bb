"""The gguf package's reader with its metadata arrays read in one pass.

``gguf.GGUFReader`` parses every metadata array element by element, each through a memory-mapped
numpy view (two for a string). A GGUF carries its whole tokenizer as such arrays (qwen2.5's:
151,936 tokens, 151,387 merges, token types), so opening one took 4-12 s on a 2-core machine,
paid by every engine start. :class:`GGUFArrayReader` reads an array of scalars or strings with
one copy of its bytes and cheap views into that copy: the same ``ReaderField`` parts, data
indexes and types as the package's reader (``tests/test_gguf_fields.py`` compares them field
by field), so everything that reads fields (``field.contents()``, ``parts[data[i]]``) is unchanged.
Nested arrays and byte-swapped files go through the package's own code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_HEAD = 12  # an array's item type (uint32) and length (uint64)


class GGUFArrayReader(GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if n == 0 or (nptype is None and itype != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        start = orig_offs + _HEAD
        if nptype is not None:
            size, parts = _scalars(self.data, start, n, np.dtype(nptype))
        else:
            size, parts = _strings(self.data, start, n)
        first = 2  # parts[0:2] are the item type and the length
        step = 1 if nptype is not None else 2  # a string is its length and its bytes
        data = list(range(first + step - 1, first + step * n, step))
        return _HEAD + size, [raw_itype, alen, *parts], data, [GGUFValueType.ARRAY, itype]


def _scalars(buf: Any, start: int, n: int, dtype: np.dtype) -> tuple[int, list[np.ndarray]]:
    """n scalars at ``start``: one view per element of one copy."""
    size = n * dtype.itemsize
    values = np.array(buf[start:start + size]).view(dtype)
    return size, [values[i:i + 1] for i in range(n)]


def _strings(buf: Any, start: int, n: int) -> tuple[int, list[np.ndarray]]:
    """n length-prefixed strings at ``start``: [len_0, bytes_0, len_1, bytes_1, ...] as views."""
    mem = memoryview(buf)
    offsets, pos = [], start
    for _ in range(n):
        length = int.from_bytes(mem[pos:pos + 8], "little")
        offsets.append((pos, length))
        pos += 8 + length
    blob = np.array(buf[start:pos])
    parts: list[np.ndarray] = []
    for p, length in offsets:
        at = p - start
        parts.append(blob[at:at + 8].view(np.uint64))
        parts.append(blob[at + 8:at + 8 + length])
    return pos - start, parts
