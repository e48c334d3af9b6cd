"""`muser inspect`: the tensor table and the embedding's byte accounting; clear errors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import cli, testing


def test_inspect_shows_tensors_and_embedding_accounting(tmp_path, capsys, rng):
    hidden, vocab = 512, 77
    table = testing.random_blocks(rng, GGMLType.Q4_K, vocab, hidden)
    path = testing.write_gguf(
        tmp_path / "m.gguf",
        {"general.architecture": "muse-glimmer", "tokenizer.ggml.tokens": [str(i) for i in range(vocab)]},
        {"token_embd.weight": (GGMLType.Q4_K, (hidden, vocab), table)},
    )
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "architecture: muse-glimmer" in out
    assert "tokenizer.ggml.tokens = [77 items]" in out
    assert "token_embd.weight" in out and "Q4_K" in out and "[512, 77]" in out
    assert "row_bytes = (512 / 256) x 144 = 288 B" in out
    assert f"table bytes = 77 x 288 = {77 * 288:,} B" in out
    assert "per token: read 288 B (row) + 4 B (id), write 2,048 B" in out


def test_inspect_reports_a_bad_file_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes(3))
    assert cli.main(["inspect", str(path)]) == 1
    assert "muser:" in capsys.readouterr().err


@pytest.mark.model
def test_inspect_defaults_to_the_packaged_model(capsys, smollm2_path):
    assert cli.main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "architecture: llama" in out and "Q8_0" in out
    assert "row_bytes = (576 / 32) x 34 = 612 B" in out
