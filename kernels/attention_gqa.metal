// kernel: attention_gqa
// inputs: y q_weight k_weight bias inv_freq state k_cache v_cache params after
// outputs: partial_o partial_stats oq od os
//
// One decode token's attention for grouped query heads: kernel attention_decode's work (per-head
// norm and RoPE of q and k, the KV-cache write in place, split attention) with one threadgroup
// per (kv head, split), whose SIMD groups share the kv head's GROUP = HEADS / KV_HEADS query
// heads in threadgroup memory and split the split's key blocks between them. A key row is read
// by GROUP / HEAD_GROUP SIMD groups of one threadgroup (attention_decode: by that many
// threadgroups), and q is prepared once per threadgroup. With FINAL 1 (one split covers the
// cache), the threadgroup also does attention_combine's work: normalise, gate, write q8x.
//   y: the q/k/v projections' output f32 [Y_WIDTH]: q at Q_OFF (HEADS * HEAD_DIM), k at K_OFF
//      and v at V_OFF (KV_HEADS * HEAD_DIM each), the gate's sigmoid input at G_OFF (GATE 1);
//      bias: q, k, v biases concatenated (BIAS 1); q_weight, k_weight [HEAD_DIM]: the per-head
//      norm weights (QK_NORM 1); inv_freq [ROTARY / 2]; state int32 [1]: the token's position
//      p; params f32 [2]: eps, the attention scale (folded into q).
//   k_cache, v_cache: f16 [1, KV_HEADS, CAPACITY, HEAD_DIM], written IN PLACE at slot
//      w = p % CAPACITY; slots 0 .. n-1, n = min(p + 1, CAPACITY), are attended (the contract
//      of kernel attention_decode, whose `after` input this one shares). Slot w is read from
//      the new key and value in threadgroup memory, never from the cache.
// Threadgroup (kv head j, split s): slots [s * SPLIT, min((s + 1) * SPLIT, n)); WARPS =
// HEAD_WARPS * KEY_WARPS SIMD groups, HEAD_WARPS = GROUP / HEAD_GROUP. SIMD group g takes query
// heads HEAD_GROUP * (g % HEAD_WARPS) .. + HEAD_GROUP - 1 of the group and the split's blocks of
// 32 slots g / HEAD_WARPS, + KEY_WARPS, ...: lane l scores slot base + l against each of its
// heads (the key row as 16-byte loads, q broadcast from threadgroup memory), an online softmax
// keeps each head's max m and sum l, and for the values lane l accumulates channels 2l, 2l+1,
// 2l+64, ... of each head (probabilities by simd_shuffle). A block's key and value rows are all
// loaded before any is used; the first block's before q is prepared. Then the KEY_WARPS SIMD
// groups of each head merge through threadgroup memory (q's, no longer read), in KEY_WARPS
// rounds, each weighting its sums by e^(m - M), M the heads' max over the SIMD groups.
//   FINAL 0: partial_o f32 [HEADS, SPLITS, HEAD_DIM] (sum e^(score - M) v, not divided) and
//            partial_stats f32 [HEADS, SPLITS, 2] (M, L) for attention_combine; an empty
//            split writes (-3e38, 0) and no o. oq, od, os unused.
//   FINAL 1: (SPLITS must be 1) o = sum / L, times sigmoid(gate) when GATE, as q8x: oq int8
//            [HEADS * HEAD_DIM], od [HEADS * HEAD_DIM / 32], os [HEADS * HEAD_DIM / 8].
//            partial_o, partial_stats unused.
// Grid: KV_HEADS * SPLITS threadgroups of 32 * WARPS threads (the host sizes both).
// Bytes per call: n * KV_HEADS * HEAD_DIM * 4 read (f16 keys and values), y and weights,
// HEADS * SPLITS * (HEAD_DIM + 2) * 4 written (FINAL 0).
// Bounds: threadgroups past KV_HEADS * SPLITS return whole; lanes past slot n score nothing; a
// SIMD group without blocks (a short context) merges m = -3e38, l = 0.
// CAPACITY is the caches' third dimension, read at run time.
// Threadgroup memory: 4 * (GROUP * HEAD_DIM + 2 * HEAD_DIM + 2 * KEY_WARPS * GROUP) bytes.
// Template constants: HEADS, KV_HEADS, HEAD_DIM (a multiple of 64), ROTARY, TRADITIONAL,
// QK_NORM, BIAS, Q_OFF, K_OFF, V_OFF, SPLIT (a multiple of 32 * KEY_WARPS), HEAD_GROUP (a
// divisor of GROUP), KEY_WARPS, FINAL, GATE, G_OFF.
const int GROUP = HEADS / KV_HEADS;
const int HEAD_WARPS = GROUP / HEAD_GROUP;
const int WARPS = HEAD_WARPS * KEY_WARPS;
const int CHANNELS = HEAD_DIM / 32;  // value channels per lane
const int KEY_CHUNKS = HEAD_DIM / 8;  // 16-byte loads per key row
const uint CAPACITY = uint(k_cache_shape[2]);
const uint SPLITS = (CAPACITY + uint(SPLIT) - 1u) / uint(SPLIT);
threadgroup float4 q_tiles[GROUP * HEAD_DIM / 4];  // q of the group's heads, then the merged sums
threadgroup float kv_new[2 * HEAD_DIM];  // the new key and value, as the cache will hold them
threadgroup float stats[2 * KEY_WARPS * GROUP];  // (m, l) of each SIMD group's heads
uint lane = thread_index_in_simdgroup;
uint warp = simdgroup_index_in_threadgroup;
uint kv_head = threadgroup_position_in_grid.x / SPLITS;
uint split = threadgroup_position_in_grid.x % SPLITS;
if (kv_head >= uint(KV_HEADS)) {
  return;
}
uint head_warp = warp % uint(HEAD_WARPS);
uint key_warp = warp / uint(HEAD_WARPS);
uint first_head = head_warp * uint(HEAD_GROUP);  // within the group
int position = state[0];
uint count = min(uint(position) + 1u, CAPACITY);
uint write_slot = uint(position) % CAPACITY;
uint first = split * uint(SPLIT);
uint last = min(first + uint(SPLIT), count);
bool holds_new = first <= write_slot && write_slot < last;
if (first >= last) {  // an empty split (a short context; never with FINAL): its statistics say so
  for (uint h = warp; h < uint(GROUP); h += uint(WARPS)) {
    if (lane == 0u) {
      size_t slot = size_t(kv_head * uint(GROUP) + h) * SPLITS + split;
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
const device half* keys = k_cache + size_t(kv_head) * CAPACITY * HEAD_DIM;
const device half* values = v_cache + size_t(kv_head) * CAPACITY * HEAD_DIM;
// The SIMD group's first block's key and value rows, loaded before q's preparation waits (a
// slot without a stored row, past the split or slot w, reads slot `first` and is ignored).
uint start = first + 32u * key_warp;
uint4 key_rows[KEY_CHUNKS];
uint value_rows[32 * (CHANNELS / 2)];
{
  uint slot = start + lane;
  bool stored = slot < last && slot != write_slot;
  const device uint4* key = (const device uint4*)(keys + size_t(stored ? slot : first) * HEAD_DIM);
  for (int chunk = 0; chunk < KEY_CHUNKS; ++chunk) {
    key_rows[chunk] = key[chunk];
  }
  muser_load_value_rows<HEAD_DIM>(values, min(start, last - 1u), last, lane, value_rows);
}
float eps = params[0];
// q of the group's heads, shared by the threadgroup: SIMD group g prepares heads g, g + WARPS, ...
for (uint h = warp; h < uint(GROUP); h += uint(WARPS)) {
  uint head = kv_head * uint(GROUP) + h;
  muser_heads_prepare<1, HEAD_DIM, ROTARY, TRADITIONAL, QK_NORM, BIAS>(
      y + Q_OFF + head * uint(HEAD_DIM), bias + head * uint(HEAD_DIM), q_weight, inv_freq, float(position), eps,
      params[1], lane, (threadgroup float*)q_tiles + h * uint(HEAD_DIM));
}
// The new key and value (the split holding slot w): SIMD group WARPS - 1 prepares them and
// writes them to the cache.
if (holds_new && warp == uint(WARPS - 1)) {
  uint k_bias = uint(HEADS * HEAD_DIM) + kv_head * uint(HEAD_DIM);
  muser_heads_prepare<1, HEAD_DIM, ROTARY, TRADITIONAL, QK_NORM, BIAS>(
      y + K_OFF + kv_head * uint(HEAD_DIM), bias + k_bias, k_weight, inv_freq, float(position), eps,
      1.0f, lane, kv_new);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // the key's channels come from other lanes
  device half* k_store = (device half*)k_cache + (size_t(kv_head) * CAPACITY + write_slot) * HEAD_DIM;
  device half* v_store = (device half*)v_cache + (size_t(kv_head) * CAPACITY + write_slot) * HEAD_DIM;
  for (int c = 0; c < CHANNELS; ++c) {
    uint e = lane + 32u * uint(c);
    half v = half(y[V_OFF + kv_head * uint(HEAD_DIM) + e] + (BIAS ? bias[k_bias + uint(KV_HEADS * HEAD_DIM) + e] : 0.0f));
    kv_new[HEAD_DIM + int(e)] = float(v);
    k_store[e] = half(kv_new[e]);
    v_store[e] = v;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
threadgroup float4* q_tile = q_tiles + first_head * uint(HEAD_DIM / 4);
for (uint base = start; base < last; base += 32u * uint(KEY_WARPS)) {
  uint slot = base + lane;
  bool valid = slot < last;
  bool stored = valid && slot != write_slot;
  // A full block: 32 stored slots, none of them w (the same for every lane).
  bool full = base + 32u <= last && write_slot - base >= 32u;
  if (base != start) {
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
#pragma unroll
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
  if (write_slot - base < 32u) {  // this block holds slot w: the new key's score by the whole
    // SIMD group (lane l: channels l, l + 32, ...), for the lane of slot w
    for (int i = 0; i < HEAD_GROUP; ++i) {
      float part = 0.0f;
      for (int c = 0; c < CHANNELS; ++c) {
        uint e = lane + 32u * uint(c);
        part += ((threadgroup float*)q_tile)[i * HEAD_DIM + int(e)] * float(half(kv_new[e]));
      }
      float total = simd_sum(part);
      score[i] = slot == write_slot ? total : score[i];
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
#pragma unroll  // as every loop over a register array here: its indices must be constants
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
#pragma unroll
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
      uint packed = value_rows[k * (CHANNELS / 2) + c];
      float v0 = key_slot == write_slot ? kv_new[HEAD_DIM + int(e)] : muser_half_low(packed);
      float v1 = key_slot == write_slot ? kv_new[HEAD_DIM + int(e) + 1] : muser_half_high(packed);
      for (int i = 0; i < HEAD_GROUP; ++i) {
        acc[i * CHANNELS + 2 * c] += p[i] * v0;
        acc[i * CHANNELS + 2 * c + 1] += p[i] * v1;
      }
    }
  }
}
// The SIMD groups of each head merged: their (m, l) first, then KEY_WARPS rounds in which the
// SIMD groups of key_warp r add their sums, weighted by e^(m - M), into q's memory.
if (lane == 0u) {
  for (int i = 0; i < HEAD_GROUP; ++i) {
    uint at = 2u * (key_warp * uint(GROUP) + first_head + uint(i));
    stats[at] = m[i];
    stats[at + 1u] = l[i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD group is done with q too
threadgroup float* merged = (threadgroup float*)q_tiles;
for (int round = 0; round < KEY_WARPS; ++round) {
  if (key_warp == uint(round)) {
    for (int i = 0; i < HEAD_GROUP; ++i) {
      uint h = first_head + uint(i);
      float top = -3.0e38f;
      for (int r = 0; r < KEY_WARPS; ++r) {
        top = max(top, stats[2u * (uint(r) * uint(GROUP) + h)]);
      }
      float weight = exp(m[i] - top);
      for (int c = 0; c < CHANNELS / 2; ++c) {
        uint e = h * uint(HEAD_DIM) + 2u * lane + 64u * uint(c);
        merged[e] = (round == 0 ? 0.0f : merged[e]) + weight * acc[i * CHANNELS + 2 * c];
        merged[e + 1u] = (round == 0 ? 0.0f : merged[e + 1u]) + weight * acc[i * CHANNELS + 2 * c + 1];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
// Each head's M and L (over the SIMD groups) and its merged sums, 32 channels a SIMD group at a
// time: lane l takes channel l of blocks warp, warp + WARPS, ... of the group's heads.
for (uint block = warp; block < uint(GROUP * HEAD_DIM / 32); block += uint(WARPS)) {
  uint h = block / uint(HEAD_DIM / 32);
  uint channel = 32u * (block % uint(HEAD_DIM / 32)) + lane;
  float top = -3.0e38f;
  for (int r = 0; r < KEY_WARPS; ++r) {
    top = max(top, stats[2u * (uint(r) * uint(GROUP) + h)]);
  }
  float total = 0.0f;
  for (int r = 0; r < KEY_WARPS; ++r) {
    uint at = 2u * (uint(r) * uint(GROUP) + h);
    total += stats[at + 1u] * exp(stats[at] - top);
  }
  uint head = kv_head * uint(GROUP) + h;
  float o = merged[h * uint(HEAD_DIM) + channel];
  if (FINAL) {
    o /= total;
    if (GATE) {
      o /= 1.0f + exp(-y[G_OFF + head * uint(HEAD_DIM) + channel]);
    }
    muser_quantize_block(o, lane, oq, od, os, kv_head * uint(GROUP * HEAD_DIM / 32) + block);
  } else {
    size_t slot = size_t(head) * SPLITS + split;
    partial_o[slot * HEAD_DIM + channel] = o;
    if (lane == 0u && channel == 0u) {
      partial_stats[2u * slot] = top;
      partial_stats[2u * slot + 1u] = total;
    }
  }
}
