"""`muser inspect`: the tensor table and the embedding's byte accounting; clear errors."""

import argparse
import re

import mlx.core as mx
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


# --- generate / chat / perplexity -------------------------------------------------------------

@pytest.fixture(params=["muse-glimmer", "llama"])
def tiny_path(tmp_path, request):
    from muser_mlx.testing import tiny_model
    return tiny_model(tmp_path / "m.gguf", request.param, np.random.default_rng(), weights="Q8_0")


def prompt_tokens(path, text, chat=False, system=None):
    from muser_mlx.generate import load
    _, tokenizer = load(path)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return len(tokenizer.apply_chat_template(messages, tokenize=True))
    return len(tokenizer.encode(text))


def test_generate_streams_text_and_ends_with_speeds_and_memory(tiny_path, capsys):
    assert cli.main(["generate", "--model", str(tiny_path), "--prompt", "the fox", "--max-tokens", "5",
                 "--temp", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"Prompt: {prompt_tokens(tiny_path, 'the fox')} tokens" in out and "tokens-per-sec" in out and "Peak memory" in out


def test_generate_chat_uses_the_template(tiny_path, capsys):
    assert cli.main(["generate", "--model", str(tiny_path), "--prompt", "hi", "--chat", "--system", "be brief",
                 "--max-tokens", "3"]) == 0
    expected = prompt_tokens(tiny_path, "hi", chat=True, system="be brief")
    assert expected > prompt_tokens(tiny_path, "hi") + 5  # the template's tokens are there
    assert f"Prompt: {expected} tokens" in capsys.readouterr().out


def test_generate_reports_bad_settings_without_a_traceback(tiny_path, capsys):
    assert cli.main(["generate", "--model", str(tiny_path), "--prompt", "x", "--temp", "-1"]) == 1
    assert "temperature must be" in capsys.readouterr().err


def test_chat_keeps_the_cache_between_turns(tiny_path, capsys, monkeypatch):
    """The second turn continues the first turn's cache (a window model re-reads only when
    the re-rendered history differs from what it was fed)."""
    from muser_mlx import cli
    turns = iter(["hello there", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
    fed = []
    real = cli.stream_generate

    def spy(model, tokenizer, prompt, *args, cache=None, **kwargs):
        fed.append((len(prompt), cache[0].offset))
        return real(model, tokenizer, prompt, *args, cache=cache, **kwargs)

    monkeypatch.setattr(cli, "stream_generate", spy)
    assert cli.main(["chat", "--model", str(tiny_path), "--max-tokens", "4"]) == 0
    (first_fed, first_offset), (second_fed, second_offset) = fed
    assert first_offset == 0
    from muser_mlx.generate import load
    if load(tiny_path)[0].config.architecture == "llama":
        assert second_offset > 0  # full caches step back at most to the common prefix


def test_perplexity_prints_a_value_and_speed(tiny_path, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert cli.main(["perplexity", "--model", str(tiny_path), "--text-file", str(text),
                 "--context", "64", "--prefill-step", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("perplexity ") and "tokens/s" in out


@pytest.mark.parametrize("context", ["0", "1", "-5"])
def test_perplexity_refuses_a_context_below_two_tokens_without_a_traceback(tiny_path, tmp_path, capsys, context):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog")
    assert cli.main(["perplexity", "--model", str(tiny_path), "--text-file", str(text), "--context", context]) == 1
    assert "--context must be at least 2 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("1000", 1000), ("4KiB", 4096), ("2GB", 2 * 10**9), ("1.5 MiB", 3 * 2**19),
                                        ("512mib", 512 * 2**20)])
def test_byte_counts_read_units(text, size):
    assert cli.byte_count(text) == size


@pytest.mark.parametrize("text", ["", "GB", "4 parsecs", "-1", "nan"])
def test_byte_counts_refuse_what_is_not_a_size(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.byte_count(text)


def test_perplexity_matches_the_reference_forward(tiny_path):
    """Teacher forcing in prefill chunks scores what a one-shot float64 forward scores."""
    from muser_mlx import cli, gguf
    from muser_mlx.generate import load
    from muser_mlx.reference import Reference
    model, tokenizer = load(tiny_path)
    text = "the capital of france is paris. the quick brown fox."
    value, scored, _ = cli.perplexity(model, tokenizer, text, context=512, prefill_step=5)
    ids = tokenizer.encode(text)
    logits = Reference(model.config, gguf.read(tiny_path).tensors).forward(ids)
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = np.exp(-np.mean(logprobs[np.arange(len(ids) - 1), ids[1:]]))
    assert scored == len(ids) - 1
    # Compared as mean negative log-likelihood (log perplexity): 1e-4 relative on the CPU's
    # float32; a GPU multiplies prefill rows in float16.
    tolerance = 1e-4 if mx.default_device() == mx.cpu else 2e-3
    assert abs(np.log(value) - np.log(expected)) <= tolerance * abs(np.log(expected))


# --- progress on long work ------------------------------------------------------------------

def run_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run `python -m muser_mlx.cli argv` with stderr on a pseudo-terminal 100 columns wide;
    (exit code, what the terminal showed)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "muser_mlx.cli", *argv], stdout=subprocess.DEVNULL,
                               stderr=secondary)
    os.close(secondary)
    shown = b""
    while True:
        if select.select([primary], [], [], 0.1)[0]:
            try:
                data = os.read(primary, 65536)
            except OSError:  # the terminal's other end is closed: the process is gone
                data = b""
            if not data:
                break
            shown += data
        elif process.poll() is not None:
            break
    os.close(primary)
    return process.wait(timeout=60), shown.decode(errors="replace")


@pytest.fixture
def scoring_run(tmp_path, rng):
    from muser_mlx.testing import tiny_model
    path = tiny_model(tmp_path / "progress.gguf", "llama", rng, weights="Q8_0")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    return ["perplexity", "--model", str(path), "--text-file", str(text), "--context", "64",
            "--prefill-step", "16"]


def test_loading_and_perplexity_show_progress_bars_on_a_terminal(scoring_run):
    code, shown = run_on_a_terminal(scoring_run)
    assert code == 0, shown
    assert re.search(r"loading progress\.gguf: +\d+%\|", shown), shown
    assert re.search(r"scoring: +\d+%\|.*token", shown), shown


def test_loading_and_perplexity_stay_quiet_when_not_on_a_terminal(scoring_run, capsys):
    assert cli.main(scoring_run) == 0
    out, err = capsys.readouterr()
    assert out.startswith("perplexity ") and err == ""


def test_inspect_shows_the_architectures_fields_or_why_it_cannot_run(tmp_path, rng):
    from muser_mlx.cli import inspect
    from muser_mlx.testing import tiny_model

    phi3 = tiny_model(tmp_path / "phi3.gguf", "phi3", rng, extra_tensors={"rope_factors_short.weight": rng.uniform(1, 2, 32)})
    shown = inspect(phi3)
    assert "phi3 model:" in shown and "rope_traditional = False" in shown and "rope_freqs = 32 pairs" in shown
    olmo2 = inspect(tiny_model(tmp_path / "olmo2.gguf", "olmo2", rng))
    assert "olmo2 model:" in olmo2 and "qk_norm_whole = True" in olmo2 and "pre_norms = False" in olmo2
    unknown = tiny_model(tmp_path / "olmo2.gguf", "olmo2", rng, extra_metadata={"general.architecture": "olmo3"})
    assert "not supported: general.architecture is 'olmo3'" in inspect(unknown)
