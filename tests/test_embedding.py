"""The embedding lookup on every backend, every table format, several batch sizes."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import formats, gguf, kernels, ops, testing
from tests.conftest import relative_error

# The kernels and the MLX-ops path compute each element with the reference's float32
# operations; only fused multiply-adds may differ, so the bound is float32 rounding.
TOLERANCE = 1e-6
FORMATS = list(formats.FORMATS)


def random_table(rng, ggml_type, vocab):
    fmt = formats.FORMATS[ggml_type]
    hidden = fmt.block_size * int(rng.integers(1, 4)) if fmt.block_size > 1 else int(rng.integers(1, 300))
    raw = testing.random_blocks(rng, ggml_type, vocab, hidden)
    return hidden, raw


def write_table(tmp_path, ggml_type, hidden, vocab, raw):
    path = tmp_path / f"embd_{ggml_type.name}.gguf"
    return testing.write_gguf(path, {}, {"token_embd.weight": (ggml_type, (hidden, vocab), raw)})


def run(fn):
    with kernels.poisoned_outputs():
        out = fn()
        mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 7, 64, 513])
def test_embedding_matches_reference(backend, rng, tmp_path, ggml_type, tokens):
    vocab = int(rng.integers(50, 400))
    hidden, raw = random_table(rng, ggml_type, vocab)
    ids = rng.integers(0, vocab, size=tokens)
    ids[0], ids[-1] = 0, vocab - 1  # both ends of the table
    with gguf.read(write_table(tmp_path, ggml_type, hidden, vocab, raw)) as model:
        out = run(lambda: ops.embedding(model.tensors["token_embd.weight"], ids.tolist()))
    reference = formats.dequantize(raw, ggml_type, [hidden, vocab])[ids]
    assert out.shape == (tokens, hidden)
    assert np.isfinite(out).all(), "an output element was never written"
    assert relative_error(out, reference) <= TOLERANCE


def test_embedding_of_a_batch_keeps_its_shape(backend, rng, tmp_path):
    vocab = 97
    hidden, raw = random_table(rng, GGMLType.Q4_K, vocab)
    ids = rng.integers(0, vocab, size=(3, 5))
    with gguf.read(write_table(tmp_path, GGMLType.Q4_K, hidden, vocab, raw)) as model:
        out = run(lambda: ops.embedding(model.tensors["token_embd.weight"], mx.array(ids)))
    reference = formats.dequantize(raw, GGMLType.Q4_K, [hidden, vocab])[ids]
    assert out.shape == (3, 5, hidden)
    assert relative_error(out, reference) <= TOLERANCE


@pytest.mark.parametrize(
    "ids, message",
    [
        ([5, -1], r"token id -1 at position \[1\] is outside the vocabulary \(size 40"),
        ([40], r"token id 40 at position \[0\] is outside the vocabulary \(size 40: valid ids are 0..39"),
        ([[1, 2], [3, 10**9]], r"token id 1000000000 at position \[1, 1\]"),
        ([1.0, 2.0], "token ids must be integers, got float64"),
        (mx.array([1.5]), "token ids must be integers, got an mx.array of mlx.core.float32"),
        (np.zeros((1, 1, 2), np.int32), r"shaped \[T\] or \[B, T\], got shape \[1, 1, 2\]"),
        (7, r"got shape \[\]"),
        ([], "no token ids"),
    ],
)
def test_bad_token_ids_are_refused_before_any_kernel(rng, tmp_path, ids, message):
    hidden, raw = random_table(rng, GGMLType.Q8_0, 40)
    with gguf.read(write_table(tmp_path, GGMLType.Q8_0, hidden, 40, raw)) as model:
        with pytest.raises(ValueError, match=message):
            ops.embedding(model.tensors["token_embd.weight"], ids)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.F16], ids=lambda t: t.name)
def test_kernel_clamp_reads_the_last_row_when_validation_is_bypassed(backend, rng, ggml_type):
    vocab = 30
    hidden, raw = random_table(rng, ggml_type, vocab)
    ids = mx.array(np.array([vocab, 10**6, -1, 3], dtype=np.int32))
    out = run(lambda: ops.embedding_unchecked(mx.array(raw.reshape(-1)), ids, ggml_type, hidden, vocab))
    table = formats.dequantize(raw, ggml_type, [hidden, vocab])
    np.testing.assert_array_equal(out[:3], np.broadcast_to(table[vocab - 1], (3, hidden)))
    assert relative_error(out[3], table[3]) <= TOLERANCE


@pytest.mark.model
def test_real_q8_0_table_of_smollm2(backend, rng, smollm2_path):
    with gguf.read(smollm2_path) as model:
        table = model.tensors["token_embd.weight"]
        hidden, vocab = table.shape
        ids = rng.integers(0, vocab, size=16)
        out = run(lambda: ops.embedding(table, ids))
        rows = table.numpy().reshape(vocab, -1)[ids]
        reference = formats.dequantize(rows, table.ggml_type, [hidden, len(ids)])
    assert relative_error(out, reference) <= TOLERANCE
