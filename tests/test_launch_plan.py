"""The GPU launches of whole model steps, checked on any machine: the host side of every kernel
call (template constants, inputs, grid, threadgroup) as the model makes it, with the kernels
replaced by a recorder. CI has no GPU; this is where a launch that could not compile or that
leaves threads without work is caught before the GPU machine sees it."""

from __future__ import annotations

import collections
import contextlib
import io
import re

import mlx.core as mx
import numpy as np
import pytest

from muser_mlx import kernels, ops
from muser_mlx.generate import load
from muser_mlx.ops.products import MATVEC_SIMD_GROUPS
from muser_mlx.settings import Settings
from muser_mlx.testing import recorded_launches, tiny_model

# The fused step's launches one by one (untraced), as a recorder can count them.
UNTRACED = Settings(compile_decode=False)


def declared_constants(name: str) -> set[str]:
    """The names on the kernel file's '// Template constants:' lines (to the header's end)."""
    text = (kernels.kernel_dir() / f"{name}.metal").read_text()
    lines = re.search(r"//\s*Template constants:((?:.*\n)(?://.*\n)*)", text).group(1)
    return set(re.findall(r"\b([A-Z][A-Z_0-9]*[A-Z])\b(?![^(]*\))", lines.replace("//", " ")))


@pytest.fixture
def recorded():
    with recorded_launches() as launches:
        yield launches


# ff 9216: FFN down rows of 288 units, more than a threadgroup's 256 threads (one architecture
# pays for the larger file).
@pytest.mark.parametrize("architecture, ff", [("muse-glimmer", 9216), ("llama", 1024), ("gemma3", 1024),
                                              ("qwen2", 1024)])
def test_every_launch_of_prefill_and_decode_is_well_formed(tmp_path, rng, recorded, architecture, ff):
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q4_K_M", hidden=512, ff=ff,
                      layers=2)
    with mx.stream(mx.cpu):
        model, _ = load(path)
        ids = rng.integers(0, model.config.vocab, size=30)
        cache = model.make_cache()
        for a, b in [(0, 20), (20, 21), (21, 26), (26, 30)]:  # prefill, decode, 5 and 4 rows
            mx.eval(model(ids[None, a:b], cache))
    names = {launch[0] for launch in recorded}
    assert {"embedding", "dequant_spans", "matvec"} <= names
    for name, inputs, template, grid, threadgroup, output_shapes in recorded:
        source = kernels.source(name)
        where = f"{name} {template}"
        assert len(inputs) == len(source.inputs) and len(output_shapes) == len(source.outputs), where
        assert set(template) == declared_constants(name), where
        assert threadgroup[0] % 32 == 0 and threadgroup[0] <= 1024 and grid[0] <= ops.MAX_GRID, where
        if name == "matvec":
            # Whole threadgroups of MATVEC_SIMD_GROUPS SIMD groups, one an output row, covering
            # every row; x comes as float32 rows of IN values.
            x = inputs[1]
            assert threadgroup[0] == 32 * MATVEC_SIMD_GROUPS and grid[0] % threadgroup[0] == 0, where
            assert grid[0] // threadgroup[0] == -(-template["OUT"] // MATVEC_SIMD_GROUPS), where
            assert x.dtype == mx.float32 and x.shape[-1] == template["IN"], where
            assert int(np.prod(x.shape[:-1])) == template["TOKENS"] <= ops.MATVEC_MAX_TOKENS, where
            assert output_shapes[0] == (*x.shape[:-1], template["OUT"]), where
        if name in ("dequant_rows", "dequant_spans"):  # a SIMD group per 256 values of a row
            assert grid[0] >= 32 * template["OUT"] * -(-template["IN"] // 256), where
            assert output_shapes[0] == (template["OUT"], template["IN"]), where
        if name == "qk_norm_rope":  # q's and k's heads inside their rows; a SIMD group a head
            batch, tokens, width = inputs[0].shape
            assert width == template["Q_STRIDE"] >= template["Q_OFF"] + template["HEADS"] * template["HEAD_DIM"], where
            assert inputs[1].shape[-1] == template["K_STRIDE"] >= template["K_OFF"] + template["KV_HEADS"] * template["HEAD_DIM"], where
            assert inputs[0].dtype == inputs[1].dtype and output_shapes[0][2] == tokens, where
            assert grid[0] == 32 * batch * tokens * (template["HEADS"] + template["KV_HEADS"]), where


# Kernels a fused decode step launches once per step, outside the layers.
STEP_KERNELS = {"embedding": 1, "residual_norm_quant": 1, "product": 1, "argmax": 1}
LAUNCHES_PER_LAYER = 8  # ARCHITECTURE.md's decode budget
# Arrays a layer's launches write and read: each costs MLX host time at every launch (bench/
# launch.py on the H200: ~2 us an output, ~0.4 us an input), so attention's partial results
# are one array, and a product writes one (the LM head's maxima after its logits).
OUTPUTS_PER_LAYER = 18
INPUTS_PER_LAYER = 45


@pytest.mark.parametrize("architecture", ["muse-glimmer", "llama"])
def test_prefill_chunks_of_any_length_launch_the_same_kernels(tmp_path, rng, recorded, architecture):
    """A GPU prefill chunk's kernels, each a (name, template constants) pair that compiles on
    its first use, are the same for chunks of every row count. One template constant that
    followed the rows (dequant_into's count of x's values, once) made every prompt
    length a process had not seen compile its products' kernels again: ~13 s a prompt on
    full-scale Muse Glimmer on the H200 (bench/prompt_lengths.py)."""
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q4_K_M", hidden=512, ff=1024, layers=2)
    kernels_of = {}
    with mx.stream(mx.cpu):
        model, _ = load(path)
        ids = rng.integers(0, model.config.vocab, size=40)
        for tokens in (20, 23, 37):
            recorded.clear()
            mx.eval(model.hidden(ids[None, :tokens], model.make_cache()))
            kernels_of[tokens] = {(name, tuple(sorted(template.items()))) for name, _, template, *_ in recorded}
    assert "dequant_spans" in {name for name, _ in kernels_of[20]}
    assert kernels_of[20] == kernels_of[23] == kernels_of[37], {
        tokens: sorted(found - kernels_of[20]) for tokens, found in kernels_of.items()}


@pytest.mark.parametrize("architecture", ["muse-glimmer", "llama", "gemma3", "qwen2", "gemma2", "olmo2"])
def test_a_fused_decode_step_launches_at_most_8_kernels_a_layer(tmp_path, rng, recorded, architecture):
    layers = 3
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q4_K_M", layers=layers)
    with mx.stream(mx.cpu):
        model, _ = load(path, settings=UNTRACED)
        assert model.fused
        cache = model.make_cache()
        for token in (5, 9):
            recorded.clear()
            mx.eval(model.decode_step(mx.array([[token]], dtype=mx.int32), cache))
            per_layer = (len(recorded) - sum(STEP_KERNELS.values())) / layers
            assert per_layer <= LAUNCHES_PER_LAYER, [launch[0] for launch in recorded]
            layer_launches = recorded[2:-2]  # embedding and its seam first; the head and argmax last
            assert [launch[0] for launch in recorded[:2]] == ["embedding", "residual_norm_quant"]
            outputs = sum(len(launch[5]) for launch in layer_launches) / layers
            inputs = sum(len(launch[1]) for launch in layer_launches) / layers
            assert outputs <= OUTPUTS_PER_LAYER and inputs <= INPUTS_PER_LAYER, (outputs, inputs)
    names = [launch[0] for launch in recorded]
    assert names[0] == "embedding" and names[-2:] == ["product", "argmax"]
    for name, inputs, template, grid, threadgroup, output_shapes in recorded:
        where = f"{name} {template}"
        assert set(template) == declared_constants(name), where
        assert threadgroup[0] % 32 == 0 and threadgroup[0] <= 1024 and grid[0] <= ops.MAX_GRID, where
        if name == "product":  # whole SIMD groups of ROWS rows; q8x x of IN values
            rows = -(-template["OUT_A"] // template["ROWS"]) - (-template["OUT_B"] // template["ROWS"])
            assert grid[0] >= 32 * rows and grid[0] % threadgroup[0] == 0, where
            assert inputs[2].dtype == mx.int8 and inputs[2].shape[-1] == template["IN"], where
        if name == "attention_decode":
            assert inputs[6].dtype == mx.float16 and template["MAX_SPLITS"] == model.settings.attention_splits, where


def test_decode_steps_at_every_cache_capacity_launch_the_same_kernels(tmp_path, rng, recorded):
    """A fused decode step's kernels are the same whatever its caches' capacity. attention_decode
    once took its split (keys per SIMD group, which grows with the capacity) as a template
    constant: each power of two a full cache crossed compiled a kernel mid-generation (1.8-3.2 s
    on the H200). Two splits at most here, so that capacities of 256 and 1,024 slots take splits
    of 128 and 512 keys."""
    path = tiny_model(tmp_path / "m.gguf", "llama", rng, weights="Q4_K_M", layers=2, context=2048)  # full layers
    kernels_of, grids = {}, {}
    with mx.stream(mx.cpu):
        model, _ = load(path, settings=UNTRACED.replace(attention_splits=2))
        for capacity in (256, 1024):
            cache = model.make_cache()
            for layer_cache in cache:
                layer_cache.reserve(1, model.config.kv_heads, model.config.head_dim, capacity)
            recorded.clear()
            mx.eval(model.decode_step(mx.array([[5]], dtype=mx.int32), cache))
            kernels_of[capacity] = {(name, tuple(sorted(template.items()))) for name, _, template, *_ in recorded}
            grids[capacity] = [grid for name, _, _, grid, *_ in recorded if name == "attention_decode"]
    assert kernels_of[256] == kernels_of[1024], sorted(kernels_of[256] ^ kernels_of[1024])
    assert grids[256] and grids[256] == grids[1024]  # two splits of each full cache either way


def mlx_residual_norm(residual, branch, branch_weight, next_weight, branch_eps, next_eps):
    """ops.residual_norm as MLX's ops (a recorded kernel's output would cut the graph)."""
    branch = branch.astype(mx.float32)
    if branch_weight is not None:
        branch = mx.fast.rms_norm(branch, branch_weight, branch_eps)
    total = residual + branch
    return total, mx.fast.rms_norm(total, next_weight, next_eps)


@pytest.mark.parametrize("architecture", ["muse-glimmer", "gemma3"])
def test_a_prefill_layer_converts_its_float16_products_inside_compiled_launches(tmp_path, rng, monkeypatch,
                                                                                 architecture):
    """A GPU prefill chunk keeps its products' float16 outputs where the next step converts them
    anyway: per layer, the FFN's activation (and Muse Glimmer's attention gate) is one compiled
    node that converts them itself, and the graph holds no standalone sigmoid of the gate. The
    graph of one 20-row chunk is read with kernels recorded, the products not paced (nothing
    evaluated before the graph is read) and the seams as MLX's ops."""
    layers = 2
    path = tiny_model(tmp_path / "m.gguf", architecture, rng, weights="Q4_K_M", hidden=512, ff=1024, layers=layers)
    monkeypatch.setattr(ops, "residual_norm", mlx_residual_norm)
    monkeypatch.setattr(ops, "paced_products", lambda settings: contextlib.nullcontext())
    with recorded_launches(), mx.stream(mx.cpu):
        model, _ = load(path)
        hidden = model.hidden(rng.integers(0, model.config.vocab, size=(1, 20)), model.make_cache())
        dot = io.StringIO()
        mx.export_to_dot(dot, hidden)
    nodes = collections.Counter(re.findall(r'label\s*=\s*"(\w+)"', dot.getvalue()))
    compiled = sum(n for name, n in nodes.items() if name.startswith("Compiled") and "AsType" in name)
    gates = layers if architecture == "muse-glimmer" else 0
    assert compiled == layers + gates, sorted(nodes.items())
    assert nodes["Sigmoid"] == 0, sorted(nodes.items())
