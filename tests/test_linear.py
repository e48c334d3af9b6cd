"""linear(x, weight) straight from GGUF blocks: every format, decode and prefill sizes, every
backend, against float64 products of the numpy reference's weights."""

import importlib
import threading

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

from muser_mlx import cpu_ext, formats, gguf, kernels, ops, testing
from muser_mlx.ops import dequantize as dequantize_module
from muser_mlx.ops import pacer as pacer_module
from muser_mlx.settings import Settings
from tests.conftest import relative_error

FORMATS = [
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
    GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.F16, GGMLType.BF16, GGMLType.F32,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS,
]
# float32 accumulation in another order: ~1e-6; the GPU prefill path rounds weights and x to
# float16 for the matmul units (relative rounding 2^-11 each).
BOUND = {"gpu_dequant_matmul": 3e-3}
DEFAULT_BOUND = 2e-5


def generate_module():
    return importlib.import_module("muser_mlx.generate")  # the package exports the function


def weight_file(tmp_path, rng, ggml_type, in_features, out_features, name="w.gguf"):
    raw = testing.random_blocks(rng, ggml_type, out_features, in_features)
    path = testing.write_gguf(tmp_path / name, {}, {"w": (ggml_type, (in_features, out_features), raw)})
    reference = formats.dequantize(raw, ggml_type, [in_features, out_features]).astype(np.float64)
    return path, reference


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 512])
def test_linear_matches_reference(backend, rng, tmp_path, ggml_type, tokens):
    block = formats.FORMATS[ggml_type].block_size
    in_features = max(block, 256) * int(rng.integers(1, 3))
    out_features = int(rng.integers(1, 40)) * 3 + 1  # rarely a multiple of 8 rows per threadgroup
    path, reference = weight_file(tmp_path, rng, ggml_type, in_features, out_features)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    with gguf.read(path) as model, kernels.poisoned_outputs():
        out = ops.linear(mx.array(x), model.tensors["w"])
        mx.eval(out)
    out = np.array(out)
    expected = x.astype(np.float64) @ reference.T
    path_name = ops.linear_path(ggml_type, tokens)
    assert out.shape == (tokens, out_features)
    assert np.isfinite(out).all(), f"{path_name} left an output unwritten"
    assert relative_error(out, expected) <= BOUND.get(path_name, DEFAULT_BOUND), path_name


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_generic_matvec_takes_long_rows(backend, rng, tmp_path, ggml_type, tokens):
    # Rows of 9-80 super-blocks (2,304-20,480 values): each lane of a row's SIMD group strides
    # over many elements; a threadgroup's last rows may lie past OUT.
    in_features = 256 * int(rng.integers(9, 81))
    out_features = int(rng.integers(2, 30)) * 4 + int(rng.integers(1, 4))
    path, reference = weight_file(tmp_path, rng, ggml_type, in_features, out_features)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    with gguf.read(path) as model, kernels.poisoned_outputs():
        out = np.array(ops.linear(mx.array(x), model.tensors["w"]))
    assert np.isfinite(out).all(), "an output left unwritten"
    assert relative_error(out, x.astype(np.float64) @ reference.T) <= DEFAULT_BOUND


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_dequantize_weight_matches_reference(backend, rng, tmp_path, ggml_type):
    # The prefill path's whole-matrix decode (kernel dequant_rows on a GPU). Rows of 32-value
    # blocks and float rows need not fill their last 256-value span.
    block = formats.FORMATS[ggml_type].block_size
    in_features = block * int(rng.integers(1, 40)) if block > 1 else int(rng.integers(1, 600))
    out_features = int(rng.integers(1, 50))
    path, reference = weight_file(tmp_path, rng, ggml_type, in_features, out_features)
    with gguf.read(path) as model, kernels.poisoned_outputs():
        tensor = model.tensors["w"]
        values = ops.dequantize_weight(tensor.data, ggml_type, in_features, out_features)
        halves = ops.dequantize_weight(tensor.data, ggml_type, in_features, out_features, mx.float16)
        values, halves = np.array(values), np.array(halves.astype(mx.float32))
    assert values.shape == halves.shape == (out_features, in_features)
    assert np.isfinite(values).all(), "a value left unwritten"
    assert relative_error(values, reference) <= 1e-6
    assert relative_error(halves, reference) <= 2**-11  # one float16 rounding


def test_linear_keeps_leading_dimensions_and_accepts_half_inputs(backend, rng, tmp_path):
    path, reference = weight_file(tmp_path, rng, GGMLType.Q4_K, 256, 9)
    x = rng.standard_normal((2, 3, 256)).astype(np.float16)
    with gguf.read(path) as model:
        out = np.array(ops.linear(mx.array(x), model.tensors["w"]))
    assert out.shape == (2, 3, 9)
    expected = x.astype(np.float64) @ reference.T
    assert relative_error(out, expected) <= 1e-5


def test_linear_refuses_a_mismatched_input(rng, tmp_path):
    path, _ = weight_file(tmp_path, rng, GGMLType.Q8_0, 64, 5)
    with gguf.read(path) as model:
        with pytest.raises(ValueError, match=r"x of shape \[1, 32\] does not fit weight 'w'.*needs 64"):
            ops.linear(mx.zeros((1, 32)), model.tensors["w"])


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_rounded_products_round_what_the_cpu_extension_serves(rng, tmp_path, ggml_type):
    # Inside ops.rounded_products() (generate()'s prompt chunks on the CPU) a product the compiled
    # extension serves is linear(..., rounded=True)'s, bit for bit (40 rows: integer panels);
    # any other path keeps x as given; after the context nothing rounds.
    in_features = max(formats.FORMATS[ggml_type].block_size, 256)
    path, _ = weight_file(tmp_path, rng, ggml_type, in_features, 21)
    x = mx.array(rng.standard_normal((40, in_features)).astype(np.float32))
    with mx.stream(mx.cpu), gguf.read(path) as model:
        weight = model.tensors["w"]
        exact = np.array(ops.linear(x, weight))
        with ops.rounded_products():
            inside = np.array(ops.linear(x, weight))
        after = np.array(ops.linear(x, weight))
        serves = ops.linear_path(ggml_type, 40) == "cpu_gguf_linear"
        expected = np.array(ops.linear(x, weight, rounded=True)) if serves else exact
    np.testing.assert_array_equal(inside, expected)
    np.testing.assert_array_equal(after, exact)
    if serves:
        assert relative_error(inside, exact) > 1e-4  # the rounding shows: ~0.5 % of the output


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 64])
def test_cpu_products_split_into_pieces_on_two_streams_match_reference(rng, tmp_path, monkeypatch,
                                                                        ggml_type, tokens):
    in_features = max(formats.FORMATS[ggml_type].block_size, 256)
    out_features = int(rng.integers(20, 40))
    # Pieces of about 6 rows: several on each stream, the last one shorter.
    monkeypatch.setattr(ops.cpu_products, "CPU_PIECE", 6 * in_features)
    path, reference = weight_file(tmp_path, rng, ggml_type, in_features, out_features)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    with mx.stream(mx.cpu), gguf.read(path) as model:  # the CPU's path, on any machine
        assert ops.linear_path(ggml_type, tokens).startswith("cpu_")
        out = np.array(ops.linear(mx.array(x), model.tensors["w"]))
    assert out.shape == (tokens, out_features)
    assert relative_error(out, x.astype(np.float64) @ reference.T) <= DEFAULT_BOUND


def test_cpu_pieces_run_from_a_thread_of_their_own(rng, tmp_path, monkeypatch):
    # MLX streams belong to the thread that made them: each thread needs its own pair.
    monkeypatch.setattr(ops.cpu_products, "CPU_PIECE", 6 * 256)
    path, reference = weight_file(tmp_path, rng, GGMLType.Q4_K, 256, 31)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    results = []

    def run():
        with mx.stream(mx.cpu), gguf.read(path) as model:
            results.append(np.array(ops.linear(mx.array(x), model.tensors["w"])))

    for _ in range(2):  # this thread's streams exist already the second time
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    run()
    assert len(results) == 3
    for out in results:
        assert relative_error(out, x.astype(np.float64) @ reference.T) <= DEFAULT_BOUND


def test_cpu_pieces_do_not_unpack_later_layers_ahead_of_their_input(rng, tmp_path, monkeypatch):
    # A weight's unpacking needs nothing but the weight: unless it waits for x, the second
    # stream runs ahead through later layers' weights and holds all their temporaries (an
    # 8-layer 203 MB model peaked 444 MB above its weights in one step before this held;
    # a layer held ahead is its weights as floats, ~7 layers' worth of their Q4_K bytes).
    # Bound: 3 layers' worth. What a step holds above its start moves in steps of ~0.3 of a
    # layer (131 KB: one 256 x 128 float32 buffer), with how MLX's CPU stream thread and
    # the host race to free buffers: 0.7-1.49 layers' worth in 48 runs without the shared
    # prefill masks (26ae366), 0.7-2.08 in 64 runs with them (a bound of 2 failed one CI run).
    layers = 12
    path = testing.tiny_model(tmp_path / "m.gguf", "llama", rng, weights="Q4_K", layers=layers,
                              hidden=256, heads=4, kv_heads=2, head_dim=64, ff=768)
    monkeypatch.setattr(ops.cpu_products, "CPU_PIECE", 256 * 16)
    with mx.stream(mx.cpu):
        model, _ = generate_module().load(path)
        for tensor in model.file.tensors.values():
            mx.eval(tensor.data)
        layer_bytes = model.weight_bytes() / layers
        for _ in range(2):
            active = mx.get_active_memory()
            mx.reset_peak_memory()
            mx.eval(model(mx.array([[1, 2, 3]])))
            above = mx.get_peak_memory() - active
            assert above <= 3 * layer_bytes, f"{above / layer_bytes:.1f} layers' worth of bytes in flight"


def test_path_choice():
    # A few rows of float x on a GPU: the generic matvec, any format (the fused decode step's
    # q8x products are ops.Product, chosen by the model at load).
    assert ops.linear_path(GGMLType.Q4_K, 1, "cuda") == "matvec"
    assert ops.linear_path(GGMLType.Q6_K, 8, "metal") == "matvec"
    assert ops.linear_path(GGMLType.Q5_K, 1, "cuda") == "matvec"
    assert ops.linear_path(GGMLType.Q6_K, 9, "cuda") == "gpu_dequant_matmul"
    # The compiled products (cpu_ext) where the install built them (make test requires that:
    # tests/test_cpu_ext.py); MLX's ops elsewhere (a checkout run without installing, the GPU machine).
    compiled = cpu_ext.available()
    assert ops.linear_path(GGMLType.Q4_1, 1, "cpu") == ("cpu_gguf_linear" if compiled else "cpu_affine_qmm")
    assert ops.linear_path(GGMLType.Q6_K, 512, "cpu") == ("cpu_gguf_linear" if compiled else "cpu_dequant_matmul")
    assert ops.linear_path(GGMLType.Q3_K, 1, "cpu") == "cpu_dequant_matmul"  # 16-value scales
    assert ops.linear_path(GGMLType.F16, 64, "cpu") == "cpu_dequant_matmul"


def test_paced_products_keep_the_queued_temporaries_within_the_budget(monkeypatch):
    """A GPU prefill's products are queued as they are built; before each, the host waits for
    the oldest until the float16 weight temporaries queued at once fit the budget (one product
    is queued whatever its size)."""
    waited = []
    monkeypatch.setattr(pacer_module.mx, "eval", lambda *arrays: waited.extend(arrays))
    monkeypatch.setattr(pacer_module.mx, "async_eval", lambda *arrays: None)
    sizes = [300, 500, 100, 100, 900, 50]
    outs = [mx.full((2,), float(i)) for i in range(len(sizes))]
    with ops.paced_products(Settings(prefill_queued_bytes=800, prefill_headroom=None)):
        pacer = pacer_module.current()
        for out, nbytes in zip(outs, sizes):
            pacer.make_room(nbytes)
            assert sum(n for _, n in pacer.queued) + nbytes <= 800 or not pacer.queued
            pacer.queue(out, nbytes)
    # 300+500 fit; 100 waits for 300; 100 fits (700); 900 waits for all and is queued alone; 50 waits for it.
    assert [id(a) for a in waited] == [id(outs[i]) for i in (0, 1, 2, 3, 4)]
    assert pacer_module.current() is None


def test_paced_products_wait_while_active_memory_is_past_the_headroom(monkeypatch):
    """Besides the pieces' budget, the host waits for the oldest queued products while MLX's
    active memory, the pacer's slots left out, is more than `headroom` past what it was when the
    block began; with nothing queued it goes on."""
    active = [1000]  # MLX's active memory as the pacer sees it; each wait frees 300
    waited = []

    def wait(*arrays):
        waited.extend(arrays)
        active[0] -= 300

    monkeypatch.setattr(pacer_module.mx, "get_active_memory", lambda: active[0])
    monkeypatch.setattr(pacer_module.mx, "eval", wait)
    monkeypatch.setattr(pacer_module.mx, "async_eval", lambda *arrays: None)
    outs = [mx.full((2,), float(i)) for i in range(6)]
    with ops.paced_products(Settings(prefill_queued_bytes=1 << 40, prefill_slots=1, prefill_headroom=500)):
        pacer = pacer_module.current()
        assert pacer.start == 1000
        pacer.slots[0].values = mx.zeros((100,), dtype=mx.float16)  # 200 bytes, not counted
        steps = []
        for out, grown in zip(outs, (0, 550, 250, 0, 900, 2000)):
            active[0] += grown
            pacer.make_room(1)
            steps.append((len(waited), active[0]))
            pacer.queue(out, 1)
    # 1000 and 1550 (200 of it the slot: 1350 <= 1500) queue at once; 1800 waits for the oldest
    # (1500); 1500 goes on; 2400 waits for the three queued (1500); 3500 waits for the one
    # queued and, nothing left to wait for, goes on at 3200.
    assert steps == [(0, 1000), (0, 1550), (1, 1500), (1, 1500), (4, 1500), (5, 3200)]
    assert [id(a) for a in waited] == [id(outs[i]) for i in range(5)]


@pytest.mark.parametrize("slots", [0, 2], ids=["temporaries", "slots"])
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gpu_prefill_products_in_pieces_match_the_whole(backend, rng, tmp_path, monkeypatch, ggml_type, slots):
    """A weight of 200 rows decoded and multiplied 64 rows at a time (the last piece 8 rows),
    paced (two pieces queued at once): the same result as at once, and the reference's. With 2
    slots the first two pieces are fresh arrays that become the slots, the next two are decoded
    into them in place (kernel dequant_into) after the matmuls that read them, all in one lazy
    graph: a write before such a read would change the first pieces' products. A second, wider
    weight's pieces outgrow the slots."""
    if backend == "cpu":
        pytest.skip("the GPU prefill path")
    products = dequantize_module
    in_features, out_features, tokens = 512, 200, 16
    path, reference = weight_file(tmp_path, rng, ggml_type, in_features, out_features)
    wide_path, wide_reference = weight_file(tmp_path, rng, ggml_type, 2 * in_features, 70, "wide.gguf")
    x = mx.array(rng.standard_normal((1, tokens, in_features)).astype(np.float32))
    x2 = mx.array(rng.standard_normal((1, tokens, 2 * in_features)).astype(np.float32))
    with gguf.read(path) as model, gguf.read(wide_path) as wide, kernels.poisoned_outputs():
        whole = np.array(ops.linear(x, model.tensors["w"]))
        whole2 = np.array(ops.linear(x2, wide.tensors["w"]))
        launches = []
        monkeypatch.setattr(products, "dequantize_weight",
                            lambda *args, **kwargs: launches.append(("fresh", args[3])) or ops.dequantize_weight(*args, **kwargs))
        real_into = products.dequantize_into
        monkeypatch.setattr(products, "dequantize_into",
                            lambda *args, **kwargs: launches.append(("into", args[3])) or real_into(*args, **kwargs))
        if slots:  # one lazy graph: only the launches' inputs order the in-place writes and the reads
            monkeypatch.setattr(products.mx, "async_eval", lambda *arrays: None)
        settings = Settings(prefill_piece_bytes=2 * in_features * 64, prefill_slots=slots,
                            prefill_queued_bytes=1 << 30 if slots else 2 * in_features * 130)
        with ops.paced_products(settings):
            pieces = ops.linear(x, model.tensors["w"])
            pieces2 = ops.linear(x2, wide.tensors["w"])
            pieces, pieces2 = np.array(pieces), np.array(pieces2)
    if slots:
        # The wide weight's pieces are 64 rows (PIECE_ROWS) of 1024 values: the first outgrows
        # slot 0 and replaces it; its last (6 rows) fits slot 1.
        assert launches == [("fresh", 64), ("fresh", 64), ("into", 64), ("into", 8), ("fresh", 64), ("into", 6)]
    else:
        assert launches == [("fresh", 64), ("fresh", 64), ("fresh", 64), ("fresh", 8), ("fresh", 64), ("fresh", 6)]
    for got, expected, x_, ref in ((pieces, whole, x, reference), (pieces2, whole2, x2, wide_reference)):
        assert got.shape == expected.shape and np.isfinite(got).all()
        # The same float16 operands; the matmul's float16 outputs may round apart (its algorithm
        # may differ with the width), by 2^-11 relative at most.
        assert relative_error(got, expected) <= 1e-3
        assert relative_error(got[0], np.array(x_[0]).astype(np.float64) @ ref.T) <= BOUND["gpu_dequant_matmul"]


def test_gpu_prefill_slots_grow_to_the_largest_piece(backend, rng, tmp_path, monkeypatch):
    """A piece larger than its slot is decoded fresh and becomes the slot."""
    if backend == "cpu":
        pytest.skip("the GPU prefill path")
    products = dequantize_module
    small_path, small_ref = weight_file(tmp_path, rng, GGMLType.Q8_0, 256, 24)
    big_path, big_ref = weight_file(tmp_path, rng, GGMLType.Q8_0, 256, 40, "big.gguf")
    x = rng.standard_normal((1, 9, 256)).astype(np.float32)
    kinds = []
    monkeypatch.setattr(products, "dequantize_weight",
                        lambda *args, **kwargs: kinds.append("fresh") or ops.dequantize_weight(*args, **kwargs))
    real_into = products.dequantize_into
    monkeypatch.setattr(products, "dequantize_into",
                        lambda *args, **kwargs: kinds.append("into") or real_into(*args, **kwargs))
    with gguf.read(small_path) as small, gguf.read(big_path) as big, kernels.poisoned_outputs():
        with ops.paced_products(Settings(prefill_slots=1)):
            outs = [ops.linear(mx.array(x), w.tensors["w"]) for w in (small, big, small, big)]
            outs = [np.array(o) for o in outs]
    assert kinds == ["fresh", "fresh", "into", "into"]
    for out, ref in zip(outs, (small_ref, big_ref, small_ref, big_ref)):
        assert relative_error(out[0], x[0].astype(np.float64) @ ref.T) <= BOUND["gpu_dequant_matmul"]
