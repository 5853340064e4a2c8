"""models.gguf_file against the gguf package's GGUFReader: the same fields and the same tensors
(type, shape, offset, and data of the same dtype, shape and bytes) on every committed test file
and on SmolLM2's Q4_1 file; and bad files refused by name."""
import struct

import gguf
import numpy as np
import pytest

from gguf_util import GGUF_FILES_DIR
from specengine.models.gguf_file import GGUFError, GGUFFile
from specengine.shipped import smollm2_gguf

FILES = sorted(GGUF_FILES_DIR.glob("*.gguf"))


def assert_same_as_gguf_reader(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {name: f for name, f in theirs.fields.items() if not name.startswith("GGUF.")}  # its header, as fields
    assert list(ours.fields) == list(fields)
    for name, field in fields.items():
        mine = ours.fields[name]
        assert mine.value == field.contents(), name
        assert mine.value_type == field.types[0], name
        assert mine.item_type == (field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == t.tensor_type, t.name
        assert mine.shape == tuple(int(n) for n in t.shape), t.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (t.n_elements, t.n_bytes, t.data_offset), t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8)), t.name
        assert not mine.data.flags.writeable, t.name


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_the_committed_files_read_as_gguf_reads_them(path):
    assert_same_as_gguf_reader(path)


def test_smollm2s_file_reads_as_gguf_reads_it():
    # A tokenizer of 49,152 tokens and merges: string arrays, a chat template, scalars of several types.
    assert_same_as_gguf_reader(smollm2_gguf())


def write(path, fields=(), tensors=(), alignment=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value, value_type in fields:
        writer.add_key_value(name, value, value_type)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, data, raw_type in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_an_alignment_round_trip(tmp_path):
    V = gguf.GGUFValueType
    fields = [("a.u8", 200, V.UINT8), ("a.i8", -7, V.INT8), ("a.u16", 60000, V.UINT16), ("a.i16", -300, V.INT16),
              ("a.u32", 4_000_000_000, V.UINT32), ("a.i32", -5, V.INT32), ("a.f32", 0.5, V.FLOAT32),
              ("a.bool", True, V.BOOL), ("a.str", "héllo", V.STRING), ("a.u64", 2**63 + 5, V.UINT64),
              ("a.i64", -(2**40), V.INT64), ("a.f64", 0.1, V.FLOAT64), ("a.ints", [1, -2, 3], V.ARRAY),
              ("a.strs", ["x", "", "zz"], V.ARRAY)]
    tensors = [("t.f32", np.arange(6, dtype=np.float32).reshape(2, 3), gguf.GGMLQuantizationType.F32),
               ("t.q8", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                                             gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)]
    path = write(tmp_path / "v.gguf", fields, tensors, alignment=64)
    assert_same_as_gguf_reader(path)
    file = GGUFFile(path)
    assert file.get("a.f64") == 0.1 and file.get("a.strs") == ["x", "", "zz"] and file.get("nope", 3) == 3
    assert all(t.data_offset % 64 == 0 for t in file.tensors)


def header(version=3, tensors=0, fields=0, byte_order="<"):
    return b"GGUF" + struct.pack(f"{byte_order}IQQ", version, tensors, fields)


def string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize("data, message", [
    (b"GGML" + bytes(20), "is not a GGUF file"),
    (header(version=1), "GGUF version 1; readable: little-endian versions"),
    (header(byte_order=">"), "big-endian, which this engine does not read"),
    (header(fields=1) + string("a") + struct.pack("<I", 99), "is not a readable GGUF file"),
    (header(fields=1) + string("a") + struct.pack("<IQ", 8, 1000) + b"abc", "1000-byte string runs past its end"),
    (header(fields=1) + string("a") + struct.pack("<IIQ", 9, 4, 1000), "array of 1000 UINT32 runs past its end"),
    (header(fields=2) + (string("a") + struct.pack("<IB", 0, 1)) * 2, "field a appears twice"),
    (header(fields=1) + string("general.alignment") + struct.pack("<II", 4, 48), "alignment 48 is not a power of two"),
    (header(tensors=1) + string("w") + struct.pack("<IQIQ", 1, 32, 250, 0), "tensor w has type 250"),
    (header(tensors=1) + string("w") + struct.pack("<IQQIQ", 2, 33, 2, 8, 0), "tensor w of type Q8_0 has rows of 33"),
    (header(tensors=1) + string("w") + struct.pack("<IQIQ", 1, 1000, 0, 0), "truncated: tensor w ends at byte"),
    (header(tensors=2) + (string("w") + struct.pack("<IQIQ", 1, 1, 0, 0)) * 2 + bytes(64), "tensor w appears twice"),
], ids=["magic", "version", "big-endian", "value type", "string", "array", "field twice", "alignment",
        "tensor type", "row length", "tensor data", "tensor twice"])
def test_bad_files_are_refused_by_name(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=f"bad.gguf.*{message}"):
        GGUFFile(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("pad", range(0, 64, 8))
def test_tensor_data_starts_at_the_default_alignment(tmp_path, pad):
    # Headers of every length modulo 64 (in steps of 8): the data's start differs between
    # alignments for some of them.
    tensors = [("t", np.ones((2, 4), dtype=np.float32), gguf.GGMLQuantizationType.F32)]
    path = write(tmp_path / "a.gguf", [("pad", "x" * pad, gguf.GGUFValueType.STRING)], tensors)
    assert_same_as_gguf_reader(path)
