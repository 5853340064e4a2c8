"""One table of weight types (kernels/weight_types.py) for Python, Triton and C++: the C++ ops'
copy (csrc/blocks.h, through _C.weight_type_traits) equal to it field by field, the Triton
kernels and ops.blocks reading it, and all of it ggml's layouts as the `gguf` package has them."""
import dataclasses

import pytest

from specengine import _C
from specengine.kernels.weight_types import BY_ID, WEIGHT_TYPES, WeightTypeLayout
from specengine.ops import blocks as ops_blocks

gguf = pytest.importorskip("gguf")

FIELDS = [f.name for f in dataclasses.fields(WeightTypeLayout)]


def mismatches(python: tuple[WeightTypeLayout, ...], cpp: list[dict]) -> list[str]:
    """Every difference between the Python table and the C++ one, in words ([] when equal)."""
    found = []
    if [t.name for t in python] != [t["name"] for t in cpp]:
        found.append(f"types: Python {[t.name for t in python]}, C++ {[t['name'] for t in cpp]}")
    cpp_by_name = {t["name"]: t for t in cpp}
    for t in python:
        other = cpp_by_name.get(t.name)
        if other is None:
            continue
        if set(other) != set(FIELDS):
            found.append(f"{t.name}: C++ fields {sorted(other)}, Python {sorted(FIELDS)}")
        for field in FIELDS:
            if other.get(field) != getattr(t, field):
                found.append(f"{t.name}.{field}: Python {getattr(t, field)!r}, C++ {other.get(field)!r}")
    return found


def test_the_cpp_table_is_the_python_table():
    assert mismatches(WEIGHT_TYPES, _C.weight_type_traits()) == []


def test_a_planted_difference_is_caught():
    cpp = _C.weight_type_traits()
    planted = tuple(dataclasses.replace(t, qs=t.qs + 2) if t.name == "Q5_1" else t for t in WEIGHT_TYPES)
    assert mismatches(planted, cpp) == ["Q5_1.qs: Python 10, C++ 8"]
    assert mismatches(WEIGHT_TYPES, [t for t in cpp if t["name"] != "Q6_K"])[0].startswith("types:")
    assert mismatches(WEIGHT_TYPES, [dict(t, block_bytes=t["block_bytes"] + 1) if t["name"] == "BF16" else t
                                     for t in cpp]) == ["BF16.block_bytes: Python 2, C++ 3"]


def test_the_table_is_ggmls():
    for t in WEIGHT_TYPES:
        qtype = gguf.GGMLQuantizationType[t.name]
        assert int(qtype) == t.type_id, t.name
        assert gguf.GGML_QUANT_SIZES[qtype] == (t.block_size, t.block_bytes), t.name


def field_sizes(t: WeightTypeLayout) -> dict[str, int]:
    """Bytes of each field of a block type (ggml's block structs): float16 d and m, the sub-block
    scales, 1 (Q5_0 ... Q5_K) or 2 (Q6_K) high bits per weight, 4 (8: Q8_0) low bits per weight."""
    high_bits = 2 if t.name == "Q6_K" else 1
    low_bits = 8 if t.name == "Q8_0" else 4
    return dict(d=2, m=2, scales={"Q4_K": 12, "Q5_K": 12, "Q6_K": 16}.get(t.name, 0),
                qh=t.block_size * high_bits // 8, qs=t.block_size * low_bits // 8)


@pytest.mark.parametrize("t", [t for t in WEIGHT_TYPES if not t.is_float], ids=lambda t: t.name)
def test_a_blocks_fields_cover_it_once(t):
    """The fields the table places are the block's bytes, each byte in one field."""
    sizes = field_sizes(t)
    owner = [None] * t.block_bytes
    for field in ("d", "m", "scales", "qh", "qs"):
        offset = getattr(t, field)
        if offset < 0:
            continue
        for byte in range(offset, offset + sizes[field]):
            assert byte < t.block_bytes and owner[byte] is None, (t.name, field, byte, owner[byte] if byte < t.block_bytes else None)
            owner[byte] = field
    assert None not in owner, (t.name, owner.index(None))


def test_ops_and_triton_read_the_table():
    assert {int(w): w.name for w in ops_blocks.WeightType} == {t.type_id: t.name for t in WEIGHT_TYPES}
    assert all(ops_blocks.LAYOUTS[w] is BY_ID[int(w)] for w in ops_blocks.WeightType)
    pytest.importorskip("triton")
    from specengine.kernels import blocks as kernels

    for t in WEIGHT_TYPES:
        assert getattr(kernels, t.name).value == t.type_id
        assert kernels.LAYOUT[t.type_id] == (t.block_size, t.block_bytes)
        # What a kernel reads while it compiles (host calls of its constexpr functions).
        fields = ("block_bytes", "d", "m", "scales", "qh", "qs")
        assert [kernels._layout(t.type_id, f) for f in fields] == [getattr(t, f) for f in fields]
    assert set(kernels.FLOAT_TYPES) == {t.type_id for t in WEIGHT_TYPES if t.is_float}
