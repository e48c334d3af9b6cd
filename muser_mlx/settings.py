"""What stays tunable, in one frozen object fixed at load: `load(path, settings=Settings(...))`.

The model hands these values to the operations it builds (a product's launch shape, the
attention's splits, the prefill's pacing), so a step never reads a module global that
something may have changed. Benches that compare settings pass a `Settings` explicitly; the
defaults are the ones measured best on the H200 (bench/RESULTS.md, bench/history/).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, NamedTuple

from muser_mlx.formats import GGMLType


class ProductConfig(NamedTuple):
    """The launch shape of kernel product (and product_glu) for one weight format: rows per
    SIMD group, SIMD groups per threadgroup, units per lane at a time (their loads issued
    together), wide units (Q4_K in 64-value units), x staged in threadgroup memory, integers
    made floats without conversion instructions, and LEAN's integer scaling (wide Q4_K and
    Q6_K). product_glu takes `rows`, `unroll` and `wide` (its threadgroups hold 32 rows)."""

    rows: int
    simd_groups: int
    unroll: int = 1
    wide: int = 0
    stage: int = 0
    int_floats: int = 0
    lean: int = 0


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(dict(mapping))


# Chosen by `bench/linear.py --products` and CUPTI in a real step (`bench/timeline.py`).
# Muse Glimmer's ffn_down Q4_K (19,968 wide) stages x: 22.85 against 24.04 us; Q6_K takes LEAN:
# ffn_down Q6_K 39.02 against 41.2 us.
_PRODUCTS = {GGMLType.Q4_K: ProductConfig(2, 8, 1, 1, 1), GGMLType.Q6_K: ProductConfig(2, 4, 1, 0, 0, 0, 1),
             GGMLType.Q8_0: ProductConfig(2, 4)}
# One (format, input width) of kernel product: q+gate and k+v (Q4_K, 6656 wide) in wide units,
# 2 SIMD groups (12.24 against 12.42 us); the o-projection (Q4_K, 4096 wide) both of a lane's
# wide units at once, integer floats and LEAN (5.94 us); the LM head (Q6_K, 6656 wide) integer
# floats without LEAN (310.6 against 315.9 us).
_PRODUCTS_BY_WIDTH = {(GGMLType.Q4_K, 6656): ProductConfig(2, 2, 1, 1),
                      (GGMLType.Q4_K, 4096): ProductConfig(2, 4, 2, 1, 0, 1, 1),
                      (GGMLType.Q6_K, 6656): ProductConfig(2, 4, 1, 0, 0, 1)}
# product_glu's, before the above: Muse Glimmer's gate/up (Q4_K, 6656 wide), four rows a SIMD
# group in wide units.
_GLU_BY_WIDTH = {(GGMLType.Q4_K, 6656): ProductConfig(4, 8, 1, 1)}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The engine's tunables; every field has the default measured best."""

    # -- The fused GPU decode step (models/gpu_decode.py) --
    # kernel product's shape: per format, per (format, input width), product_glu's per width.
    products: Mapping = dataclasses.field(default_factory=lambda: _frozen(_PRODUCTS))
    products_by_width: Mapping = dataclasses.field(default_factory=lambda: _frozen(_PRODUCTS_BY_WIDTH))
    glu_by_width: Mapping = dataclasses.field(default_factory=lambda: _frozen(_GLU_BY_WIDTH))
    # x staged in threadgroup memory (ProductConfig.stage) for rows of at least this many values
    # (it cost the 4,096- and 6,656-value rows, paid for 19,968) and at most this many bytes
    # (Metal gives a threadgroup 32 KiB).
    stage_min_in: int = 8192
    stage_bytes: int = 28 << 10
    # attention_decode: the splits of a cache it aims for (128 against 64: 36.5 + 6.5 against
    # 47.6 + 5.3 us a full layer at 8,192), and the query heads a SIMD group takes (2 beat 4 by
    # 0.3-0.4 ms a step).
    attention_splits: int = 128
    attention_head_group: int = 2
    # The step compiled with mx.compile (its Python runs once per cache shape, not every step).
    compile_decode: bool = True
    # The batched GPU step's products (models/batch_decode.py) are int8 tile products (kernel
    # product_tiles, tensor-core MMA) from this many sequences on, kernel product's and
    # product_glu's grouped form (8 rows a threadgroup, dot4 on the CUDA cores) below. H200,
    # c7f6d6e, ms a step grouped / tiles: B = 8 24.9 / 30.4, B = 32 73.1 / 33.5, B = 64 136.6 /
    # 53.7 (bench/RESULTS.md). 1: tiles at every B.
    batch_tiles_from: int = 9
    # The tile products' launch shape (kernel product_tiles): 16-row weight tiles a threadgroup
    # (one a SIMD group, sharing the threadgroup's copy of x), and the threadgroups a launch aims
    # for, products of few rows splitting their input into chunks to reach them (ops.tile_chunks).
    # 4 SIMD groups beat 2 and 8 (H200, B = 64: 53.7 against 55.3 and 57.9 ms a step).
    tile_warps: int = 4
    tile_threadgroups: int = 512
    # Two forms of the tile products not timed yet (bench/gpu_round.sh's header compares them in
    # one call; the loser goes): tile_prefetch, each SIMD group's loads of the next span's
    # weights go out before it multiplies this span's (the loads of a span in flight through the
    # products, the stage and its barriers; twice the weight registers); tile_fit_tokens, a
    # threadgroup takes 8, 16, 32 or 64 rows of x as the step has them, not always 64 (fewer
    # accumulators and a smaller stage below 64 rows). Why: at B = 8 the tile products read
    # their weights at 0.4-0.8 TB/s on the H200 (bench/RESULTS.md).
    tile_prefetch: bool = False
    tile_fit_tokens: bool = False
    # tile_split_glu: gate and up as one tile product of two weights, its input split into
    # chunks like the others (a gated launch takes whole sums: 312 threadgroups for Muse
    # Glimmer's 19,968 rows, ~2.4 an SM, each through all 26 spans), the activation after it.
    tile_split_glu: bool = False
    # tile_stage False: each SIMD group reads its x from device memory (L1) instead of the
    # threadgroup's stage: no barriers, so a SIMD group's loads wait for no other's.
    tile_stage: bool = True
    # tile_l2_ahead N > 0: each SIMD group asks L2 for its rows' weights N spans ahead of its
    # loads (a hint; no registers, nothing waits on it): the weight stream's bytes in flight
    # beyond what a SIMD group's registers hold. 0: no asks.
    tile_l2_ahead: int = 0
    # tile_half: the products in f16 on tensor cores (mma m16n8k16, float sums): the weights'
    # values (scales and Q4_K's minimum applied, once for all the token tiles) and x's (code
    # times scale over the token's largest scale, once a threadgroup, as the stage is written),
    # summed in the float accumulators directly. The int8 form scales each block's integer dot
    # for each token tile: ~31-36 PTX instructions an mma, ~1 a weight byte at 64 rows against
    # the f16 form's ~0.5 (counted, not timed: bench/history/session-46.md), at half the int8
    # tensor rate. Needs tile_stage. Weights' values must lie in f16's range.
    tile_half: bool = False
    # tile_pair (with tile_half): a SIMD group of a product that is not gated takes two 16-row
    # tiles of its weight and reads each x tile from the stage once for both (half the stage
    # reads and a threadgroup's stage shared by twice the rows, at ~180-210 registers a thread,
    # 2 threadgroups an SM); not for Q8_0 weights.
    tile_pair: bool = True

    # -- GPU prefill (models/transformer.py, ops/dequantize.py, ops/pacer.py) --
    # Attention inputs padded to multiples of these (keys, query rows) so that prompts of any
    # length share a few cuDNN graphs (38-62 ms to build each); 0: as they are.
    attention_key_bucket: int = 256
    attention_row_bucket: int = 128
    # A weight's float16 rows decoded at once, at most (bytes), in whole 64-row pieces: Muse
    # Glimmer's ffn weights whole, its LM head in ten pieces.
    prefill_piece_bytes: int = 280_000_000
    # Float16 weight pieces queued on the GPU at once, at most (bytes): unbounded, a chunk's
    # temporaries reached 2x the file.
    prefill_queued_bytes: int = 1_000_000_000
    # Float16 buffers the pieces are decoded into in turn (0: a fresh temporary a piece):
    # 7,083-7,121 tokens/s against 5,883-6,173.
    prefill_slots: int = 2
    # Memory a paced chunk may hold beyond what was active when it began, its slots not counted
    # (None: unbounded): 500 MB kept the peak at 1.087-1.089x the file (unbounded 1.101-1.118x).
    prefill_headroom: int | None = 500_000_000

    # -- The CPU decode step (models/cpu_decode.py) --
    # generate()'s one-token steps round every product's input to int8 and multiply in integers,
    # as llama.cpp's CPU does (at parity with it); False: the exact float products.
    cpu_rounded: bool = True

    def __post_init__(self):
        if not 1 <= self.attention_splits <= 128:
            raise ValueError(f"attention_splits must be 1..128 (attention_combine's lanes hold 4 each), "
                             f"got {self.attention_splits}")
        if self.batch_tiles_from < 1:
            raise ValueError(f"batch_tiles_from must be at least 1 (sequences), got {self.batch_tiles_from}")
        if not 1 <= self.tile_warps <= 8:
            raise ValueError(f"tile_warps must be 1..8 (SIMD groups of a threadgroup), got {self.tile_warps}")
        if self.tile_half and not self.tile_stage:
            raise ValueError("tile_half needs tile_stage (the f16 form reads x from the threadgroup's stage)")
        if not 0 <= self.tile_l2_ahead <= 8:
            raise ValueError(f"tile_l2_ahead must be 0..8 (spans), got {self.tile_l2_ahead}")
        if self.tile_threadgroups < 1:
            raise ValueError(f"tile_threadgroups must be at least 1, got {self.tile_threadgroups}")
        if self.attention_head_group < 1:
            raise ValueError(f"attention_head_group must be at least 1, got {self.attention_head_group}")
        for name in ("products", "products_by_width", "glu_by_width"):
            for key, config in getattr(self, name).items():
                _check_product_config(name, key, config)
        for name in ("attention_key_bucket", "attention_row_bucket", "prefill_slots", "stage_min_in", "stage_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_piece_bytes <= 0 or self.prefill_queued_bytes <= 0:
            raise ValueError("prefill_piece_bytes and prefill_queued_bytes must be positive")

    def replace(self, **changes) -> "Settings":
        """A copy with `changes` (dataclasses.replace); the mappings may be given as dicts."""
        for name in ("products", "products_by_width", "glu_by_width"):
            if name in changes:
                changes[name] = _frozen(changes[name])
        return dataclasses.replace(self, **changes)


def _check_product_config(table: str, key, config) -> None:
    if not isinstance(config, ProductConfig):
        raise TypeError(f"Settings.{table}[{key}] must be a ProductConfig, got {type(config).__name__}")
    if config.rows < 1 or config.simd_groups < 1:
        raise ValueError(f"Settings.{table}[{key}]: rows and simd_groups must be at least 1, got {config}")
    if config.unroll not in (1, 2, 4):
        raise ValueError(f"Settings.{table}[{key}]: unroll must be 1, 2 or 4, got {config.unroll}")
    for switch in ("wide", "stage", "int_floats", "lean"):
        if getattr(config, switch) not in (0, 1):
            raise ValueError(f"Settings.{table}[{key}]: {switch} must be 0 or 1, got {getattr(config, switch)}")


DEFAULT = Settings()
