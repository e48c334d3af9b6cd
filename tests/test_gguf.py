"""The GGUF reader: round trips, every validation error, and real files against gguf-py."""

import struct

import gguf as gguf_py
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import gguf, testing


def small_file(rng):
    hidden, vocab = 256, 11
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny é ✓",
        "llama.embedding_length": ("u32", hidden),
        "llama.rope.freq_base": 10000.0,
        "flag": True,
        "big": ("u64", 2**40 + 3),
        "negative": ("i64", -(2**40)),
        "tokenizer.ggml.tokens": ["a", "b", "é", ""],
        "tokenizer.ggml.scores": [0.5, -1.25],
        "ids": [1, 2, 3],
        "nested": [[1, 2], [3]],
    }
    table = testing.random_blocks(rng, GGMLType.Q4_K, vocab, hidden)
    norm = rng.standard_normal(hidden).astype(np.float32)
    tensors = {
        "token_embd.weight": (GGMLType.Q4_K, (hidden, vocab), table),
        "output_norm.weight": (GGMLType.F32, (hidden,), norm.view(np.uint8)),
    }
    return metadata, tensors


def write(tmp_path, raw: bytes):
    path = tmp_path / "model.gguf"
    path.write_bytes(raw)
    return path


def test_round_trip_metadata_and_tensor_bytes(tmp_path, rng):
    metadata, tensors = small_file(rng)
    path = testing.write_gguf(tmp_path / "m.gguf", metadata, tensors)
    with gguf.read(path) as model:
        assert model.metadata["general.name"] == "tiny é ✓"
        assert model.metadata["llama.embedding_length"] == 256
        assert model.metadata["big"] == 2**40 + 3
        assert model.metadata["negative"] == -(2**40)
        assert model.metadata["flag"] is True
        assert model.metadata["tokenizer.ggml.tokens"] == ["a", "b", "é", ""]
        assert model.metadata["tokenizer.ggml.scores"] == [0.5, -1.25]
        assert model.metadata["nested"] == [[1, 2], [3]]
        table = model.tensors["token_embd.weight"]
        assert table.ggml_type == GGMLType.Q4_K and table.shape == (256, 11)
        assert table.row_bytes == 144 and table.nbytes == 11 * 144
        assert table.data.shape == (11, 144)  # [rows, row_bytes]
        np.testing.assert_array_equal(np.array(table.data), tensors["token_embd.weight"][2].reshape(11, 144))
        assert str(table.data.dtype) == "mlx.core.uint8"
        assert model.bytes_by_type() == {"Q4_K": 11 * 144, "F32": 256 * 4}


def test_tensor_bytes_are_read_only_when_asked(tmp_path, rng):
    metadata, tensors = small_file(rng)
    path = testing.write_gguf(tmp_path / "m.gguf", metadata, tensors)
    model = gguf.read(path)
    assert all(t._data is None for t in model.tensors.values())
    model.close()
    with pytest.raises(gguf.GGUFError, match="closed"):
        model.tensors["output_norm.weight"].data


def test_bad_magic(tmp_path, rng):
    raw = testing.gguf_bytes(*small_file(rng))
    with pytest.raises(gguf.BadMagicError, match="not a GGUF file"):
        gguf.read(write(tmp_path, b"GGML" + raw[4:]))


def test_unsupported_version(tmp_path, rng):
    raw = bytearray(testing.gguf_bytes(*small_file(rng)))
    raw[4:8] = struct.pack("<I", 1)
    with pytest.raises(gguf.UnsupportedVersionError, match="version 1"):
        gguf.read(write(tmp_path, bytes(raw)))


def test_empty_file(tmp_path):
    with pytest.raises(gguf.TruncatedFileError, match="empty"):
        gguf.read(write(tmp_path, b""))


def test_truncation_anywhere_is_a_named_error(tmp_path, rng):
    raw = testing.gguf_bytes(*small_file(rng))
    cuts = sorted(set(rng.integers(1, len(raw), size=40).tolist()) | {3, 8, 20, 24, len(raw) - 1})
    for cut in cuts:
        with pytest.raises(gguf.GGUFError) as error:
            gguf.read(write(tmp_path, raw[:cut]))
        assert isinstance(error.value, (gguf.TruncatedFileError, gguf.TensorLayoutError, gguf.BadMagicError)), cut


def test_huge_declared_array_fails_fast_without_allocating(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    raw += struct.pack("<Q", 3) + b"key" + struct.pack("<IIQ", 9, 6, 2**60)
    with pytest.raises(gguf.TruncatedFileError, match=r"metadata 'key' \(1152921504606846976 items\)"):
        gguf.read(write(tmp_path, raw + bytes(64)))


def test_huge_counts_fail_fast(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62)
    with pytest.raises(gguf.TruncatedFileError, match="metadata entries"):
        gguf.read(write(tmp_path, raw))


def test_unknown_metadata_type(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77)
    with pytest.raises(gguf.BadMetadataError, match="'k' has unknown value type 77"):
        gguf.read(write(tmp_path, raw + bytes(16)))


def test_unknown_tensor_type_is_refused_before_reading(tmp_path, rng):
    metadata, tensors = small_file(rng)
    tensors["mystery"] = (GGMLType.F32, (4,), np.zeros(16, np.uint8))
    raw = bytearray(testing.gguf_bytes(metadata, tensors))
    type_at = bytes(raw).index(b"mystery") + len(b"mystery") + 4 + 8
    raw[type_at : type_at + 4] = struct.pack("<I", int(GGMLType.TQ1_0))
    with pytest.raises(gguf.UnknownTensorTypeError, match="'mystery'.*TQ1_0"):
        gguf.read(write(tmp_path, bytes(raw)))


def test_tensor_outside_the_file(tmp_path, rng):
    raw = testing.gguf_bytes(*small_file(rng))
    with pytest.raises(gguf.TensorLayoutError, match="'output_norm.weight'.*file ends"):
        gguf.read(write(tmp_path, raw[:-100]))


def patch_offset(raw: bytes, name: bytes, offset: int) -> bytes:
    at = raw.index(name) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    offset_at = at + 4 + 8 * n_dims + 4
    return raw[:offset_at] + struct.pack("<Q", offset) + raw[offset_at + 8 :]


def test_misaligned_tensor(tmp_path, rng):
    raw = patch_offset(testing.gguf_bytes(*small_file(rng)), b"output_norm.weight", 1601)
    with pytest.raises(gguf.TensorLayoutError, match="offset 1601 is not aligned to 32"):
        gguf.read(write(tmp_path, raw))


def test_row_not_whole_blocks(tmp_path):
    tensors = {"w": (GGMLType.Q4_K, (100, 2), np.zeros(2 * 144, np.uint8))}
    raw = testing.gguf_bytes({}, tensors)
    with pytest.raises(gguf.TensorLayoutError, match="rows of 100 elements"):
        gguf.read(write(tmp_path, raw))


def test_bad_alignment_value(tmp_path, rng):
    metadata, tensors = small_file(rng)
    metadata["general.alignment"] = ("u32", 24)
    with pytest.raises(gguf.BadMetadataError, match="general.alignment = 24"):
        gguf.read(write(tmp_path, testing.gguf_bytes(metadata, tensors)))


def test_custom_alignment_is_honoured(tmp_path, rng):
    metadata, tensors = small_file(rng)
    metadata["general.alignment"] = ("u32", 64)
    path = write(tmp_path, testing.gguf_bytes(metadata, tensors, alignment=64))
    with gguf.read(path) as model:
        assert model.alignment == 64 and model.data_offset % 64 == 0
        np.testing.assert_array_equal(
            np.array(model.tensors["output_norm.weight"].data).reshape(-1),
            tensors["output_norm.weight"][2].reshape(-1),
        )


def test_duplicate_key_and_tensor_name(tmp_path, rng):
    metadata, tensors = small_file(rng)
    raw = testing.gguf_bytes(metadata, tensors)
    raw = raw.replace(b"ids", b"big", 1)
    with pytest.raises(gguf.BadMetadataError, match="'big' appears twice"):
        gguf.read(write(tmp_path, raw))


@pytest.mark.model
def test_real_file_matches_gguf_py(smollm2_path):
    theirs = gguf_py.GGUFReader(smollm2_path)
    with gguf.read(smollm2_path) as ours:
        for key, field in theirs.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            if isinstance(value, float):
                assert ours.metadata[key] == pytest.approx(value, rel=1e-6), key
            else:
                assert ours.metadata[key] == value, key
        assert len(ours.tensors) == len(theirs.tensors)
        for tensor in theirs.tensors:
            mine = ours.tensors[tensor.name]
            assert (mine.offset, mine.nbytes) == (tensor.data_offset, tensor.n_bytes)
            assert list(mine.shape) == [int(n) for n in tensor.shape]
            assert mine.ggml_type == tensor.tensor_type


@pytest.mark.parametrize("read_first", [False, True])  # from the map, or from MLX copies
def test_stacked_rows_hold_each_tensor_once_as_views(tmp_path, rng, read_first):
    shapes = {"a": (GGMLType.Q4_K, 3), "b": (GGMLType.Q4_K, 5), "c": (GGMLType.Q8_0, 2)}
    tensors = {n: (kind, (256, rows), testing.random_blocks(rng, kind, rows, 256))
               for n, (kind, rows) in shapes.items()}
    path = testing.write_gguf(tmp_path / "s.gguf", {}, tensors)
    with gguf.read(path) as file:
        a, b, c = (file.tensors[n] for n in "abc")
        expected = [a.numpy().reshape(a.rows, -1).copy(), b.numpy().reshape(b.rows, -1).copy()]
        if read_first:
            a.data, b.data
        stacked = gguf.stack_rows([a, b])
        assert stacked.shape == (256, 8) and stacked.ggml_type == GGMLType.Q4_K
        assert np.array_equal(np.array(stacked.data), np.concatenate(expected))
        assert np.array_equal(np.array(a.data), expected[0]) and np.array_equal(np.array(b.data), expected[1])
        with pytest.raises(ValueError, match=r"cannot stack 'c' \(Q8_0 \[256, 2\]\) with 'a' \(Q4_K"):
            gguf.stack_rows([a, c])
