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
    # The batched GPU step's products (models/batch_decode.py) are tile products (kernel
    # product_tiles, tensor-core MMA) from this many sequences on, kernel product's and
    # product_glu's grouped form (8 rows a threadgroup, dot4 on the CUDA cores) below. Both
    # forms pad the step's rows to 8, so from 2 sequences to 8 each does 8 rows' work: at 8 the
    # tiles took 13.5 ms a step (H100) where the grouped form had taken 24.9 (H200)
    # (bench/history/session-47.md). One sequence alone runs generate()'s step (BatchGenerator).
    batch_tiles_from: int = 2
    # The batched GPU step's attention (kernel attention_decode over its rows): 0, the splits of
    # a cache attention_splits aims for, at every count of rows; N, N / (the rows of x a tile
    # product's threadgroup takes: 8, 16, 32, 64; ops.TileProduct.tokens), at least 1, so that
    # the step's SIMD groups stay near one row's at N splits. At 64 rows of Muse Glimmer (16
    # SIMD groups a split; 256-slot stores: 8 splits) attention_decode's 2,048 threadgroups,
    # 2 an SM by registers, ran in 7.8 waves; 128 makes 2 splits (1.9 waves). Untimed
    # (bench/history/session-50.md).
    batch_attention_splits: int = 0
    # The tile products' launch shape (kernel product_tiles): 16-row weight tiles a threadgroup
    # (one a SIMD group, sharing the threadgroup's copy of x), and the threadgroups a launch aims
    # for, products of few rows splitting their input into chunks to reach them (ops.tile_chunks).
    # A threadgroup takes 8, 16, 32 or 64 rows of x, the least that holds the step's.
    # 4 SIMD groups beat 2 and 8 (bench/history/session-47.md).
    tile_warps: int = 4
    tile_threadgroups: int = 512
    # The tile products run in f16 (mma m16n8k16, float sums) from this many rows of x on (the
    # step's sequences rounded up to 8), int8 below: the f16 form takes the weights' values
    # (scales and Q4_K's minimum applied, once for all the token tiles) and x's (code times
    # scale over the token's largest scale, once a threadgroup, as the stage is written) and
    # adds the products into the float sums directly; the int8 form scales each block's integer
    # dot for each token tile (~1 PTX instruction a weight byte at 64 rows against the f16
    # form's ~0.5: bench/history/session-46.md). H100, ms a step int8 / f16: B = 8 13.5 / 16.2,
    # 16 18.1 / 17.9, 24 23.2 / 21.3, 32 26.0 / 21.8, 48 35.8 / 42.3, 64 42.0 / 38.9
    # (bench/history/session-47.md). The weights' values must lie in f16's range (those of real
    # models do: |w| < 65,504).
    tile_half_from: int = 17
    # A gated tile product (gate and up, kernel product_tiles GLU 1) holds two tiles' sums a
    # lane: in the f16 form at 64 rows ptxas took 174 registers a thread, so an SM held 2
    # threadgroups of 4 SIMD groups, and Muse Glimmer's 312 threadgroups ran in 1.18 waves at
    # 11 % occupancy (H100, ncu: 16.9 of a 64-row step's 39.0 ms; bench/history/session-48.md).
    # On CUDA its 64-row threadgroups are launched bounded to hold at least this many SIMD
    # groups an SM (__launch_bounds__: 12 = 3 of 4, at most 168 registers, a few bytes spilled);
    # 0: the compiler's count.
    tile_glu_min_warps: int = 12
    # The same bound for 64-row launches whose lanes hold one tile's sums (0: none). ptxas gave
    # q+gate|k+v 135 registers (3 threadgroups an SM: its 544 threadgroups in 1.37 waves; 79.3
    # us, 2.3 us a MB where down Q4_K, 4 an SM in 0.98 waves, took 1.4: session-48.md); 16
    # caps it at 128 (24 bytes spilled, 4 an SM) and leaves down and the o-projection as they are.
    # Untimed (bench/history/session-50.md).
    tile_min_warps: int = 0
    # The f16 stage written by SIMD groups, one token's whole span a load instruction (2 cache
    # lines), against the items form's 8 tokens' 8 bytes (8 lines): L1 bound the 64-row step's
    # ungated products at 72-80 % (H100, ncu). Untimed since its loads were made unconditional
    # (its first form took them one after another and lost: bench/history/session-48.md). The
    # next round times it against the items form; the loser goes.
    tile_stage_by_token: bool = False
    # From this many rows of x on (0: never), a gated tile product runs split: its input in
    # chunks like an ungated product's (the fused form's 312 threadgroups at 64 rows ran in 1.18
    # waves), its halves summed, activated and quantized by kernel quantize_rows (GLU 1): chunks x
    # 2 x rows x FF x 4 bytes written and read again (10 MB a chunk and layer at 64 rows of Muse
    # Glimmer) and a launch. With tile_glu_split_pairs a SIMD group takes the same rows of gate
    # and up, as the fused form (product_tiles GLU 2: each x tile read from the stage once for
    # 32 weight rows, the bound of tile_glu_min_warps); without, gate and up are one ungated
    # product (GLU 0: a lane's sums for one tile, no bound). Untimed (bench/history/session-49.md).
    tile_glu_split_from: int = 0
    tile_glu_split_pairs: bool = True
    # From this many rows of x on (0: never), an ungated f16 tile product of one weight whose
    # rows split in two halves of whole 16-row tiles (Muse Glimmer's o-projection, down and head)
    # runs in pairs: a SIMD group takes tile i of the first half and tile i of the second, the
    # halves as A and B of kernel product_tiles' GLU 2 (views of the weight, no copy), so each x
    # tile is read from the stage once for 32 weight rows, not 16 (the stage's reads were ~1,024
    # of a 64-row threadgroup-span's ~2,600 L1 wavefronts: bench/history/session-48.md), with
    # the bound of tile_glu_min_warps. Untimed (bench/history/session-50.md).
    tile_pairs_from: int = 0

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
        if self.batch_attention_splits < 0:
            raise ValueError(f"batch_attention_splits must be at least 0 (0: attention_splits at every count of "
                             f"rows), got {self.batch_attention_splits}")
        if self.batch_tiles_from < 1:
            raise ValueError(f"batch_tiles_from must be at least 1 (sequences), got {self.batch_tiles_from}")
        if not 1 <= self.tile_warps <= 8:
            raise ValueError(f"tile_warps must be 1..8 (SIMD groups of a threadgroup), got {self.tile_warps}")
        if self.tile_half_from < 1:
            raise ValueError(f"tile_half_from must be at least 1 (rows of x), got {self.tile_half_from}")
        if self.tile_glu_min_warps < 0:
            raise ValueError(f"tile_glu_min_warps must be at least 0 (SIMD groups an SM), "
                             f"got {self.tile_glu_min_warps}")
        if self.tile_min_warps < 0:
            raise ValueError(f"tile_min_warps must be at least 0 (SIMD groups an SM), got {self.tile_min_warps}")
        if self.tile_glu_split_from < 0:
            raise ValueError(f"tile_glu_split_from must be at least 0 (rows of x; 0: never), "
                             f"got {self.tile_glu_split_from}")
        if self.tile_pairs_from < 0:
            raise ValueError(f"tile_pairs_from must be at least 0 (rows of x; 0: never), got {self.tile_pairs_from}")
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
