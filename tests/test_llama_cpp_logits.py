"""Every architecture against llama.cpp itself: the tiny models of testing.LLAMA_CPP_CASES (one
per architecture and RoPE scaling, F32 weights) and the logits llama.cpp 0.3.36 (llama-cpp-python,
its CPU float path: F32 weights, f32 KV cache, no flash attention) gave for a 16-token prompt and
16 greedy steps, recorded in tests/data/llama_cpp_logits.npz by
tests/data/record_llama_cpp_logits.py. llama.cpp is not needed here.

Bounds. CPU: the general step and the CPU decode step compute in float32 what llama.cpp computes
in float32, in another order: measured 3e-7 to 1.1e-6 (‖ours − llama.cpp‖ / ‖llama.cpp‖ over the
32 rows; OLMo 2 1.1e-6), and 6e-5 for Gemma 2, whose GELU llama.cpp's CPU reads from a float16 table (its input
and output rounded to float16; ours and the reference compute it); LLAMA_CPP_BOUND is the
issue's 1e-4. GPU: a prefill chunk of more than 8 rows
multiplies in float16 (test_models' TOLERANCE["gpu"], 5e-3). The greedy tokens must be
llama.cpp's own.
"""

from __future__ import annotations

import dataclasses
import hashlib

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import cpu_ext, gguf
from muser_mlx.models import build_model
from muser_mlx.models.config import ModelConfigError
from muser_mlx.reference import Reference
from muser_mlx.testing import LLAMA_CPP_CASES, LLAMA_CPP_PROMPT, llama_cpp_case
from tests.conftest import relative_error
from tests.data.record_llama_cpp_logits import OUT as RECORDED

LLAMA_CPP_BOUND = {"cpu": 1e-4, "gpu": 5e-3}
RECORDING = dict(np.load(RECORDED)) if RECORDED.exists() else {}
CASES = sorted({key.split("/")[0] for key in RECORDING})


def load_case(tmp_path, name):
    """(GGUFFile, model, llama.cpp's tokens [32], its logits [32, vocab]) of a recorded case, the
    file rebuilt here and checked to be the one llama.cpp read."""
    try:
        path = llama_cpp_case(tmp_path / f"{name}.gguf", name)
    except ModelConfigError as error:
        pytest.fail(f"case {name}: {error}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == str(RECORDING[f"{name}/sha256"]), (
        f"case {name}'s tiny model is no longer the file llama.cpp read: re-record it "
        f"(tests/data/record_llama_cpp_logits.py {name})")
    file = gguf.read(path)
    return file, build_model(file), RECORDING[f"{name}/tokens"], RECORDING[f"{name}/logits"]


def test_every_case_is_recorded():
    assert CASES and set(CASES) == set(LLAMA_CPP_CASES), (
        f"recorded {CASES}, cases {sorted(LLAMA_CPP_CASES)}: run tests/data/record_llama_cpp_logits.py")


def general_logits(model, tokens) -> np.ndarray:
    """The prompt as one chunk, then llama.cpp's greedy tokens one step each: [32, vocab]."""
    cache = model.make_cache()
    rows = [np.array(model(tokens[None, :LLAMA_CPP_PROMPT], cache))[0]]
    rows += [np.array(model(tokens[None, t : t + 1], cache))[0] for t in range(LLAMA_CPP_PROMPT, tokens.size)]
    return np.concatenate(rows)


def assert_greedy_is_llama_cpps(logits, tokens):
    """Each greedy step's token (the argmax of the row before it) is the one llama.cpp chose."""
    np.testing.assert_array_equal(np.argmax(logits[LLAMA_CPP_PROMPT - 1 : -1], axis=-1), tokens[LLAMA_CPP_PROMPT:])


@pytest.mark.parametrize("name", CASES)
def test_the_general_step_gives_llama_cpps_logits(tmp_path, backend, name):
    _, model, tokens, expected = load_case(tmp_path, name)
    logits = general_logits(model, tokens)
    assert relative_error(logits, expected) <= LLAMA_CPP_BOUND[backend]
    assert_greedy_is_llama_cpps(logits, tokens)


@pytest.mark.parametrize("name", CASES)
def test_the_reference_gives_llama_cpps_logits(tmp_path, name):
    file, model, tokens, expected = load_case(tmp_path, name)
    logits = Reference(model.config, file.tensors).forward(tokens)
    assert relative_error(logits, expected) <= LLAMA_CPP_BOUND["cpu"]
    assert_greedy_is_llama_cpps(logits, tokens)


@pytest.mark.parametrize("rounded", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_the_cpu_decode_step_gives_llama_cpps_logits(tmp_path, name, rounded):
    """The CPU decode step (models/cpu_decode.py), every token one step. Exact (the prompt's
    last token's step): within LLAMA_CPP_BOUND, llama.cpp's greedy tokens. Rounded (generate()'s
    other steps: every product's input rounded to int8 blocks, as llama.cpp's quantized
    products do): within tests/test_cpu_decode.py's ROUNDED_BOUND, its derivation's."""
    if not cpu_ext.available():
        pytest.skip(f"the CPU extension is not built here: {cpu_ext.unavailable()}")
    from tests.test_cpu_decode import ROUNDED_BOUND

    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        _, model, tokens, expected = load_case(tmp_path, name)
        step = model.cpu_step if rounded else model.cpu_prompt_step
        assert step.rounded == rounded
        cache = model.make_cache()
        logits = np.stack([np.array(step(mx.array([[int(t)]], dtype=mx.int32), cache)) for t in tokens])
    finally:
        mx.set_default_device(previous)
    if rounded:
        assert relative_error(logits, expected) <= ROUNDED_BOUND
    else:
        assert relative_error(logits, expected) <= LLAMA_CPP_BOUND["cpu"]
        assert_greedy_is_llama_cpps(logits, tokens)


@pytest.mark.parametrize("name", [n for n in CASES if LLAMA_CPP_CASES[n][3] or "rope.scaling" in str(LLAMA_CPP_CASES[n][2])])
def test_the_comparison_sees_the_rope_scaling(tmp_path, name):
    """The recorded logits tell scaled RoPE from plain: without its frequencies (and its
    mscale) the same model is far outside the bound."""
    file, model, tokens, expected = load_case(tmp_path, name)
    plain = dataclasses.replace(model.config, rope_freqs=None, attention_scale=model.config.head_dim**-0.5)
    assert relative_error(Reference(plain, file.tensors).forward(tokens), expected) > 100 * LLAMA_CPP_BOUND["cpu"]


def test_the_recording_is_small():
    assert RECORDED.stat().st_size < 400_000
