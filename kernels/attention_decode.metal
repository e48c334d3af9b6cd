// kernel: attention_decode
// inputs: y q_weight k_weight bias inv_freq state k_cache v_cache params after
// outputs: partial
//
// One decode token's attention, first pass (flash-decoding), fused with what precedes it: the
// norm and RoPE of q and k (kernel qk_norm_rope's work) and the KV-cache write; for one
// sequence, or for each of a batch's rows (grid y: row r; below, y, state, the caches and
// partial are row r's; the rows' positions and lengths differ).
//   y: the q/k/v projections' output f32 [ROWS, Y_WIDTH]: q at Q_OFF (HEADS * HEAD_DIM), k at K_OFF
//      and v at V_OFF (KV_HEADS * HEAD_DIM each) of a row; bias: q, k, v biases concatenated (BIAS 1);
//      q_weight, k_weight: the norm weights, [HEAD_DIM] for a norm per head (QK_NORM 1), or
//      [HEADS * HEAD_DIM], [KV_HEADS * HEAD_DIM] for a norm over each whole projection
//      (QK_NORM 2, OLMo 2's: every SIMD group sums the squares of q's whole projection itself,
//      and of k's where it writes the key); inv_freq [ROTARY / 2]; state int32 [ROWS] (or
//      longer): each row's token's position p; params f32 [3]: eps, the attention scale (folded into q), the
//      softcap c (SOFTCAP 1, Gemma 2's: each score s becomes c * tanh(s / c)).
//   k_cache, v_cache: f16 [ROWS or more, KV_HEADS, CAPACITY, HEAD_DIM]. A row's key and value are
//      written IN PLACE at slot w = p % CAPACITY (MLX knows these arrays only as inputs: the
//      caller keeps them alive and orders every later reader after this launch through the
//      outputs; `after`, an output of the last step that wrote them, unread here, is an input
//      so that MLX orders this launch after that step: MLX sees no write of the caches).
//      Slots 0 .. n-1, n = min(p + 1, CAPACITY), are the keys p may see: a full
//      cache holds position s at slot s (CAPACITY > p); a sliding-window ring of CAPACITY =
//      window keys holds position s at slot s % window, so slot w held p - window, which p
//      no longer sees. Slot w is read from the new key, never from the cache.
// Each SIMD group takes one kv head j, HEAD_GROUP of its GROUP = HEADS / KV_HEADS query heads
// and one split: slots [s * SPLIT, (s + 1) * SPLIT) (SPLITS = ceil(CAPACITY / SPLIT); SPLIT the
// least power-of-two multiple of 32 for which SPLITS <= MAX_SPLITS, as ops.attention sizes the
// grid). It
// prepares its q heads (and, if its split holds slot w, the new key and value) in threadgroup
// memory, then walks its slots 32 at a time: lane l scores slot base + l against every q head
// (the key row read as 16-byte loads), an online softmax keeps each head's max m and sum l,
// and for the values the lanes switch roles: lane l accumulates channels 2l, 2l+1, 2l+64, ...
// of every head, the probabilities broadcast by simd_shuffle. A block's key and value rows are
// all loaded before any is used, the first block's before q is prepared: at a short context
// the SIMD group waits for memory about once.
// partial f32 [ROWS, HEADS * SPLITS * (HEAD_DIM + 2)]: a row's holds two arrays (one output: each array of a
// launch is host work at every step):
//   partial_o [HEADS, SPLITS, HEAD_DIM]: sum_slots e^(score - m) v (not yet divided);
//   partial_stats [HEADS, SPLITS, 2] after it: (m, l); an empty split writes (-3e38, 0) and
//   no o (attention_combine reads o only of the splits that hold keys: the first ones).
// Kernel attention_combine merges the splits.
// Grid: KV_HEADS * (GROUP / HEAD_GROUP) * SPLITS SIMD groups along x, up to 4 per threadgroup,
// each on its own (no threadgroup barrier); ROWS along y.
// Bytes per call and row: n * KV_HEADS * HEAD_DIM * 4 read (f16 keys and values), y and weights,
// HEADS * SPLITS * (HEAD_DIM + 2) * 4 written; QK_NORM 2: each SIMD group reads q's whole
// projection once more (HEADS * HEAD_DIM * 4 bytes, from L2), and k's where it writes the key.
// Bounds: SIMD groups past the last (the last threadgroup's surplus) return whole; lanes past
// slot n score nothing.
// CAPACITY is the caches' third dimension, read at run time (a growing cache does not make a
// new kernel), and so is SPLIT, which follows it (as a template constant it made a kernel for
// each power of two a full cache crossed: 1.8-3.2 s to compile on the H200).
// Template constants: HEADS, KV_HEADS, HEAD_DIM (a multiple of 64), ROTARY, TRADITIONAL,
// QK_NORM (0 none, 1 per head, 2 whole projection), SOFTCAP, BIAS, MAX_SPLITS, HEAD_GROUP,
// Q_OFF, K_OFF, V_OFF.
// A block's value rows are loaded with its keys (216 registers a thread at HEAD_GROUP 2: 2
// threadgroups an SM, but one wait on memory a block); blocks of 32 stored slots without w take
// a path without per-slot clamps and tests.
#include "lib/base.metal"
#include "lib/attention.metal"
const int GROUP = HEADS / KV_HEADS;
const int HEAD_GROUPS = GROUP / HEAD_GROUP;
const int CHANNELS = HEAD_DIM / 32;  // value channels per lane
const int KEY_CHUNKS = HEAD_DIM / 8;  // 16-byte loads per key row
const uint CAPACITY = uint(k_cache_shape[2]);
uint SPLIT = 32u;
while (SPLIT * uint(MAX_SPLITS) < CAPACITY) {
  SPLIT *= 2u;
}
const uint SPLITS = (CAPACITY + SPLIT - 1u) / SPLIT;
// Row r of a batch (grid y): its projections, position, caches' row and partial results.
const uint row = threadgroup_position_in_grid.y;
const device float* y_row = y + size_t(row) * uint(y_shape[1]);
const size_t CACHE_ROW = size_t(KV_HEADS) * CAPACITY * size_t(HEAD_DIM);
device float* partial_o = partial + size_t(row) * size_t(HEADS) * SPLITS * size_t(HEAD_DIM + 2);
device float* partial_stats = partial_o + size_t(HEADS) * SPLITS * size_t(HEAD_DIM);
threadgroup float4 q_tiles[4 * HEAD_GROUP * HEAD_DIM / 4];
threadgroup float kv_tiles[4 * 2 * HEAD_DIM];
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
uint index = threadgroup_position_in_grid.x * (threads_per_threadgroup.x / 32u) + warp;
if (index >= uint(KV_HEADS * HEAD_GROUPS) * SPLITS) {
  return;
}
uint split = index % SPLITS;
uint head_group = (index / SPLITS) % uint(HEAD_GROUPS);
uint kv_head = index / SPLITS / uint(HEAD_GROUPS);
uint first_head = kv_head * uint(GROUP) + head_group * uint(HEAD_GROUP);
threadgroup float4* q_tile = q_tiles + warp * uint(HEAD_GROUP * HEAD_DIM / 4);
threadgroup float* k_tile = kv_tiles + warp * uint(2 * HEAD_DIM);
threadgroup float* v_tile = k_tile + HEAD_DIM;
int position = state[row];
uint count = min(uint(position) + 1u, CAPACITY);
uint write_slot = uint(position) % CAPACITY;
uint first = split * SPLIT;
uint last = min(first + SPLIT, count);
bool holds_new = first <= write_slot && write_slot < last;
if (first >= last) {  // an empty split (a short context): its statistics say so, its o is never read
  if (lane == 0u) {
    for (int i = 0; i < HEAD_GROUP; ++i) {
      size_t slot = size_t(first_head + uint(i)) * SPLITS + split;
      partial_stats[2u * slot] = -3.0e38f;
      partial_stats[2u * slot + 1u] = 0.0f;
    }
  }
  return;
}
float m[HEAD_GROUP];
float l[HEAD_GROUP];
float acc[HEAD_GROUP * CHANNELS];
for (int i = 0; i < HEAD_GROUP; ++i) {
  m[i] = -3.0e38f;
  l[i] = 0.0f;
  for (int c = 0; c < CHANNELS; ++c) {
    acc[i * CHANNELS + c] = 0.0f;
  }
}
const device half* keys = k_cache + size_t(row) * CACHE_ROW + size_t(kv_head) * CAPACITY * HEAD_DIM;
const device half* values = v_cache + size_t(row) * CACHE_ROW + size_t(kv_head) * CAPACITY * HEAD_DIM;
// A block of 32 slots at a time: lane l's key row (slot base + l, 16-byte loads) and, for the
// value pass, lane l's channels 2l, 2l+1, 2l+64, ... of all 32 slots, all loaded before any is
// used. The first block's loads are issued before q's preparation (they do not depend on q),
// so at a short context the whole pass waits for memory about once. A slot without a stored
// row (past the split, or slot w) reads slot `first` and ignores it.
uint4 key_rows[KEY_CHUNKS];
uint value_rows[32 * (CHANNELS / 2)];
{
  uint slot = first + lane;
  bool stored = slot < last && slot != write_slot;
  const device uint4* key = (const device uint4*)(keys + size_t(stored ? slot : first) * HEAD_DIM);
  for (int chunk = 0; chunk < KEY_CHUNKS; ++chunk) {
    key_rows[chunk] = key[chunk];
  }
  muser_load_value_rows<HEAD_DIM>(values, first, last, lane, value_rows);
}
float eps = params[0];
float softcap = params[2];
// The new key's head and value (the split holding slot w), loaded before q's preparation waits.
float new_value[CHANNELS];
for (int c = 0; c < CHANNELS; ++c) {
  uint e = lane + 32u * uint(c);
  uint k_bias = uint(HEADS * HEAD_DIM) + kv_head * uint(HEAD_DIM);
  new_value[c] = holds_new ? y_row[V_OFF + kv_head * uint(HEAD_DIM) + e] +
                                 (BIAS ? bias[k_bias + uint(KV_HEADS * HEAD_DIM) + e] : 0.0f)
                           : 0.0f;
}
float q_whole = QK_NORM == 2 ? muser_projection_inverse_rms<HEADS * HEAD_DIM, BIAS>(y_row + Q_OFF, bias, eps, lane)
                             : 1.0f;
muser_heads_prepare<HEAD_GROUP, HEAD_DIM, ROTARY, TRADITIONAL, QK_NORM, BIAS>(
    y_row + Q_OFF + first_head * uint(HEAD_DIM), bias + first_head * uint(HEAD_DIM),
    q_weight + (QK_NORM == 2 ? first_head * uint(HEAD_DIM) : 0u), inv_freq, float(position), eps, q_whole,
    params[1], lane, (threadgroup float*)q_tile);
if (holds_new) {
  uint k_bias = uint(HEADS * HEAD_DIM) + kv_head * uint(HEAD_DIM);
  float k_whole = QK_NORM == 2 ? muser_projection_inverse_rms<KV_HEADS * HEAD_DIM, BIAS>(
                                     y_row + K_OFF, bias + HEADS * HEAD_DIM, eps, lane)
                               : 1.0f;
  muser_heads_prepare<1, HEAD_DIM, ROTARY, TRADITIONAL, QK_NORM, BIAS>(
      y_row + K_OFF + kv_head * uint(HEAD_DIM), bias + k_bias,
      k_weight + (QK_NORM == 2 ? kv_head * uint(HEAD_DIM) : 0u), inv_freq, float(position), eps, k_whole,
      1.0f, lane, k_tile);
  for (int c = 0; c < CHANNELS; ++c) {
    v_tile[lane + 32u * uint(c)] = new_value[c];
  }
}
simdgroup_barrier(mem_flags::mem_threadgroup);
if (holds_new && head_group == 0u) {
  device half* k_store = (device half*)k_cache + size_t(row) * CACHE_ROW +
                        (size_t(kv_head) * CAPACITY + write_slot) * HEAD_DIM;
  device half* v_store = (device half*)v_cache + size_t(row) * CACHE_ROW +
                        (size_t(kv_head) * CAPACITY + write_slot) * HEAD_DIM;
  for (int c = 0; c < CHANNELS; ++c) {
    uint e = lane + 32u * uint(c);
    k_store[e] = half(k_tile[e]);
    v_store[e] = half(v_tile[e]);
  }
}
for (uint base = first; base < last; base += 32u) {
  uint slot = base + lane;
  bool valid = slot < last;
  bool stored = valid && slot != write_slot;
  // A full block: 32 stored slots, none of them w (the same for every lane). Its value rows
  // need no clamp and its value pass no test a slot.
  bool full = base + 32u <= last && write_slot - base >= 32u;
  if (base != first) {
    const device uint4* key = (const device uint4*)(keys + size_t(stored ? slot : first) * HEAD_DIM);
    for (int chunk = 0; chunk < KEY_CHUNKS; ++chunk) {
      key_rows[chunk] = key[chunk];
    }
    if (full) {
      muser_load_full_value_rows<HEAD_DIM>(values, base, lane, value_rows);
    } else {
      muser_load_value_rows<HEAD_DIM>(values, base, last, lane, value_rows);
    }
  }
  float score[HEAD_GROUP];
  for (int i = 0; i < HEAD_GROUP; ++i) {
    score[i] = 0.0f;
  }
  if (stored) {
    for (int chunk = 0; chunk < KEY_CHUNKS; ++chunk) {
      uint4 packed = key_rows[chunk];
      float4 low = float4(muser_half_low(packed.x), muser_half_high(packed.x), muser_half_low(packed.y),
                          muser_half_high(packed.y));
      float4 high = float4(muser_half_low(packed.z), muser_half_high(packed.z), muser_half_low(packed.w),
                           muser_half_high(packed.w));
      for (int i = 0; i < HEAD_GROUP; ++i) {
        float4 qa = q_tile[(i * HEAD_DIM + 8 * chunk) / 4];
        float4 qb = q_tile[(i * HEAD_DIM + 8 * chunk) / 4 + 1];
        score[i] += qa.x * low.x + qa.y * low.y + qa.z * low.z + qa.w * low.w +
                    qb.x * high.x + qb.y * high.y + qb.z * high.z + qb.w * high.w;
      }
    }
  }
  if (write_slot - base < 32u) {  // this block holds slot w (the same for every lane): the new
    // key's score, as the cache will hold it (f16), by the whole SIMD group (lane l: channels
    // l, l + 32, ...), for the lane of slot w
    for (int i = 0; i < HEAD_GROUP; ++i) {
      float part = 0.0f;
      for (int c = 0; c < CHANNELS; ++c) {
        uint e = lane + 32u * uint(c);
        part += ((threadgroup float*)q_tile)[i * HEAD_DIM + int(e)] * float(half(k_tile[e]));
      }
      float total = simd_sum(part);
      score[i] = slot == write_slot ? total : score[i];
    }
  }
  if (SOFTCAP) {  // the scores as Gemma 2 caps them (a lane past the split scores 0 and is not used)
    for (int i = 0; i < HEAD_GROUP; ++i) {
      score[i] = softcap * tanh(score[i] / softcap);
    }
  }
  for (int i = 0; i < HEAD_GROUP; ++i) {
    float top = max(m[i], simd_max(valid ? score[i] : -3.0e38f));
    float correction = exp(m[i] - top);
    score[i] = valid ? exp(score[i] - top) : 0.0f;
    l[i] = l[i] * correction + simd_sum(score[i]);
    m[i] = top;
    for (int c = 0; c < CHANNELS; ++c) {
      acc[i * CHANNELS + c] *= correction;
    }
  }
  // The values: each slot's probabilities broadcast from the lane that scored it; a slot past
  // the split's last adds 0 (its row, read from slot last - 1, is not used: that slot may be w,
  // whose stored row is stale); slot w's value is the new one, as the cache will hold it.
  for (int k = 0; full && k < 32; ++k) {
    float p[HEAD_GROUP];
    for (int i = 0; i < HEAD_GROUP; ++i) {
      p[i] = simd_shuffle(score[i], uint(k));
    }
    for (int c = 0; c < CHANNELS / 2; ++c) {
      uint packed = value_rows[k * (CHANNELS / 2) + c];
      float v0 = muser_half_low(packed);
      float v1 = muser_half_high(packed);
      for (int i = 0; i < HEAD_GROUP; ++i) {
        acc[i * CHANNELS + 2 * c] += p[i] * v0;
        acc[i * CHANNELS + 2 * c + 1] += p[i] * v1;
      }
    }
  }
  uint block_end = min(last - base, 32u);  // slots of this block attended (the same for every lane)
  for (int k = 0; !full && k < 32; ++k) {
    if (uint(k) >= block_end) {
      break;
    }
    uint key_slot = base + uint(k);
    float p[HEAD_GROUP];
    for (int i = 0; i < HEAD_GROUP; ++i) {
      p[i] = simd_shuffle(score[i], uint(k));
    }
    for (int c = 0; c < CHANNELS / 2; ++c) {
      uint e = 2u * lane + 64u * uint(c);
      bool stored_value = key_slot < last && key_slot != write_slot;
      uint packed = value_rows[k * (CHANNELS / 2) + c];
      float v0 = stored_value ? muser_half_low(packed) : 0.0f;
      float v1 = stored_value ? muser_half_high(packed) : 0.0f;
      if (key_slot == write_slot) {
        v0 = float(half(v_tile[e]));
        v1 = float(half(v_tile[e + 1u]));
      }
      for (int i = 0; i < HEAD_GROUP; ++i) {
        acc[i * CHANNELS + 2 * c] += p[i] * v0;
        acc[i * CHANNELS + 2 * c + 1] += p[i] * v1;
      }
    }
  }
}
for (int i = 0; i < HEAD_GROUP; ++i) {
  size_t slot = size_t(first_head + uint(i)) * SPLITS + split;
  for (int c = 0; c < CHANNELS / 2; ++c) {
    uint e = 2u * lane + 64u * uint(c);
    partial_o[slot * HEAD_DIM + e] = acc[i * CHANNELS + 2 * c];
    partial_o[slot * HEAD_DIM + e + 1u] = acc[i * CHANNELS + 2 * c + 1];
  }
  if (lane == 0u) {
    partial_stats[2u * slot] = m[i];
    partial_stats[2u * slot + 1u] = l[i];
  }
}
