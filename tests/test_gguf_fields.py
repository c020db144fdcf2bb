"""specserve.models.gguf_fields: the one-pass array reader gives the gguf package's own fields,
part for part, on a real GGUF and on a written one with every kind of array."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specserve.models.gguf_fields import GGUFArrayReader


def same_fields(path) -> None:
    ref, fast = gguf.GGUFReader(str(path)), GGUFArrayReader(str(path))
    assert list(ref.fields) == list(fast.fields)
    for key, a in ref.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), key
        assert [(p.dtype, p.tobytes()) for p in a.parts] == [(p.dtype, p.tobytes()) for p in b.parts], key
        assert a.contents() == b.contents(), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors]


def test_every_kind_of_array_reads_as_the_package_reads_it(tmp_path):
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.after", "still aligned")
    w.add_uint32("t.scalar", 9)
    w.add_tensor("w", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    same_fields(path)
    assert GGUFArrayReader(str(path)).fields["t.strings"].contents() == ["a", "", "ünï", "x" * 300]


@pytest.mark.slow
def test_a_real_tokenizer_reads_as_the_package_reads_it():
    from specserve.models.catalog import resolve_model

    same_fields(resolve_model("smollm2-135m").path)
