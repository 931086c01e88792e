"""The GGUF parser (``loading/gguf_file.py``) against ``gguf.GGUFReader``: every metadata value
type, nested arrays, the tensor table and every tensor's dequantized values, on a file written with
``gguf.GGUFWriter`` (custom alignment, float, legacy and K-quant types)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from fastdecode.errors import CheckpointError  # noqa: E402
from fastdecode.loading.gguf_file import LAZY_STRINGS, GGUFFile, StringArray  # noqa: E402


METADATA = [  # (key, value, value type, array item type)
    ("test.u8", 250, GGUFValueType.UINT8, None),
    ("test.i8", -120, GGUFValueType.INT8, None),
    ("test.u16", 65000, GGUFValueType.UINT16, None),
    ("test.i16", -32000, GGUFValueType.INT16, None),
    ("test.u32", 4_000_000_000, GGUFValueType.UINT32, None),
    ("test.i32", -2_000_000_000, GGUFValueType.INT32, None),
    ("test.u64", 2**64 - 3, GGUFValueType.UINT64, None),
    ("test.i64", -(2**62) - 7, GGUFValueType.INT64, None),
    ("test.f32", 0.1, GGUFValueType.FLOAT32, None),
    ("test.f64", 0.1, GGUFValueType.FLOAT64, None),
    ("test.true", True, GGUFValueType.BOOL, None),
    ("test.false", False, GGUFValueType.BOOL, None),
    ("test.string", "héllo wörld ✓ 🤗", GGUFValueType.STRING, None),
    ("test.u8s", [0, 7, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    ("test.i16s", [-5, 0, 5], GGUFValueType.ARRAY, GGUFValueType.INT16),
    ("test.i32s", [1, -2, 2**31 - 1], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("test.u64s", [0, 2**64 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    ("test.i64s", [-(2**63), 2**63 - 1], GGUFValueType.ARRAY, GGUFValueType.INT64),
    ("test.f32s", [0.1, -2.5, 1e30], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("test.f64s", [0.1, -2.5, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    ("test.bools", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    ("test.strings", ["a", "", "ünï", "<|im_end|>"], GGUFValueType.ARRAY, GGUFValueType.STRING),
]
# (name, type, [rows, columns]); K-quants cannot be quantized by gguf-py: random blocks instead.
TENSORS = [("t.f32", QT.F32, [3, 64]), ("t.f16", QT.F16, [3, 64]), ("t.bf16", QT.BF16, [3, 64]),
           ("t.q8_0", QT.Q8_0, [5, 96]), ("t.q4_0", QT.Q4_0, [5, 64]), ("t.q4_1", QT.Q4_1, [2, 32]),
           ("t.q5_0", QT.Q5_0, [3, 64]), ("t.q5_1", QT.Q5_1, [3, 64]),
           ("t.q4_k", QT.Q4_K, [2, 256]), ("t.q6_k", QT.Q6_K, [3, 512])]


@pytest.fixture(scope="module")
def everything_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("meta") / "everything.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)  # general.alignment: data is not at the default 32
    for key, value, vtype, sub_type in METADATA:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, qtype, shape in TENSORS:
        if qtype in (QT.Q4_K, QT.Q6_K):
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(rng.standard_normal(shape, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.add_tensor("t.f32_1d", rng.standard_normal(7, dtype=np.float32))
    writer.add_tensor("t.f32_3d", rng.standard_normal((2, 3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_equals_gguf_reader(everything_file):
    reader = GGUFReader(everything_file)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    ours = GGUFFile(everything_file).metadata
    assert ours == expected
    assert ours["general.alignment"] == 64 and ours["general.architecture"] == "llama"
    for key, value, vtype, _ in METADATA:  # and the values written, exactly (f32 rounded)
        if vtype == GGUFValueType.FLOAT32:
            assert ours[key] == float(np.float32(value)), key
        elif key == "test.f32s":
            assert ours[key] == np.asarray(value, np.float32).tolist()
        else:
            assert ours[key] == value and type(ours[key]) is type(value), key


def test_nested_array_metadata(tmp_path):
    """Arrays of arrays (GGUFReader flattens them, so compare with the written value)."""
    path = tmp_path / "nested.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_key_value("test.nested", [[1, 2], [3], ["x", "y"]], GGUFValueType.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).metadata["test.nested"] == [[1, 2], [3], ["x", "y"]]


def test_tensor_table_and_dequantized_values_equal_gguf_reader(everything_file):
    ours = GGUFFile(everything_file)
    reader_tensors = {t.name: t for t in GGUFReader(everything_file).tensors}
    assert set(ours.tensors) == set(reader_tensors)
    for name, theirs in reader_tensors.items():
        info = ours.tensors[name]
        assert info.ggml_type == theirs.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(theirs.shape.tolist())), name
        assert info.offset == theirs.data_offset and info.nbytes == theirs.n_bytes, name
        assert info.offset % 64 == 0, name
        expected = dequantize(theirs.data, theirs.tensor_type).reshape(info.shape)
        values = ours.dequantized(name)
        assert values.dtype == np.float32 and values.shape == info.shape, name
        np.testing.assert_array_equal(values, expected, err_msg=name)  # NaN == NaN (random K blocks)


def _string_array_file(path: Path, strings: list[str]) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_key_value("test.vocabulary", strings, GGUFValueType.ARRAY)
    writer.add_key_value("test.after", 7, GGUFValueType.UINT32)  # read past the array: its end was found
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_long_string_arrays_are_decoded_when_read(tmp_path):
    """A vocabulary-size string array stays in the map (StringArray) and reads like the list it encodes."""
    strings = [f"tok{i}·" * (i % 5) for i in range(LAZY_STRINGS + 3)]
    parsed = GGUFFile(_string_array_file(tmp_path / "vocabulary.gguf", strings)).metadata
    array = parsed["test.vocabulary"]
    assert isinstance(array, StringArray) and parsed["test.after"] == 7
    assert len(array) == len(strings) and array[5] == strings[5] and array[-1] == strings[-1]
    assert array[10:20] == strings[10:20] and array == strings and list(array) == strings
    with pytest.raises(IndexError):
        array[len(strings)]


def test_a_string_that_is_not_utf8_is_named_when_read(tmp_path):
    strings = [f"t{i}" for i in range(LAZY_STRINGS)]
    path = _string_array_file(tmp_path / "bad.gguf", strings)
    data = bytearray(path.read_bytes())
    at = data.index((4).to_bytes(8, "little") + b"t123") + 8  # string 123: its length (4 bytes), then "t123"
    data[at] = 0xFF  # "t123" -> b"\xff123": not UTF-8
    path.write_bytes(bytes(data))
    array = GGUFFile(path).metadata["test.vocabulary"]
    assert array[122] == "t122"  # the other strings read as written
    for read in (lambda: array[123], lambda: list(array)):
        with pytest.raises(CheckpointError, match="string 123 of an array is not UTF-8"):
            read()
