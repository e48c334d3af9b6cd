// lib/attention.metal — attention_decode's helpers: its value-row loads, RoPE's channel
// pairs, and the preparation of q and k heads (bias, RMS norm per head or over the whole
// projection, RoPE, scale).
// Includes no other lib file.

// attention_decode's value rows of one block of 32 slots, base .. base + 31: lane l's channels
// 2l, 2l+1, 2l+64, ... of each slot as packed half pairs, rows[k * (HEAD_DIM / 64) + c]; a slot
// at or past `last` re-reads slot last - 1 (its probability is 0).
template <int HEAD_DIM>
inline void muser_load_value_rows(const device half* values, uint base, uint last, uint lane, thread uint* rows) {
  for (int k = 0; k < 32; ++k) {
    uint slot = min(base + uint(k), last - 1u);
    for (int c = 0; c < HEAD_DIM / 64; ++c) {
      rows[k * (HEAD_DIM / 64) + c] = *((const device uint*)(values + size_t(slot) * HEAD_DIM + 2u * lane + 64u * uint(c)));
    }
  }
}

// muser_load_value_rows for a block whose 32 slots are all stored: no clamp, one address.
template <int HEAD_DIM>
inline void muser_load_full_value_rows(const device half* values, uint base, uint lane, thread uint* rows) {
  const device uint* row = (const device uint*)(values + size_t(base) * HEAD_DIM + 2u * lane);
  for (int k = 0; k < 32; ++k) {
    for (int c = 0; c < HEAD_DIM / 64; ++c) {
      rows[k * (HEAD_DIM / 64) + c] = row[k * (HEAD_DIM / 2) + 32 * c];
    }
  }
}

// RoPE's pair i of a head: the channels (a, b) it rotates, (2i, 2i+1) when TRADITIONAL
// (llama.cpp's NORM), (i, i + ROTARY/2) otherwise (NEOX); pairs past the rotary width keep
// their channels and pass through (muser_rope_rotates says which).
template <int ROTARY, int TRADITIONAL>
inline uint2 muser_rope_pair(uint pair) {
  if (TRADITIONAL || pair >= uint(ROTARY / 2)) {
    uint a = TRADITIONAL ? 2u * pair : uint(ROTARY) + 2u * (pair - uint(ROTARY / 2));
    return uint2(a, a + 1u);
  }
  return uint2(pair, pair + uint(ROTARY / 2));
}

template <int ROTARY, int TRADITIONAL>
inline bool muser_rope_rotates(uint pair) {
  return TRADITIONAL ? 2u * pair < uint(ROTARY) : pair < uint(ROTARY / 2);
}

// 1 / rms of a whole projection, (source + bias) over WIDTH values, summed by one SIMD group
// (lane l: values l, l + 32, ...; every lane gets the result): muser_heads_prepare's
// whole_norm for QK_NORM 2.
template <int WIDTH, int BIAS>
inline float muser_projection_inverse_rms(const device float* source, const device float* bias, float eps,
                                          uint lane) {
  float squares = 0.0f;
  for (uint i = lane; i < uint(WIDTH); i += 32u) {
    float value = source[i] + (BIAS ? bias[i] : 0.0f);
    squares += value * value;
  }
  return 1.0f / sqrt(simd_sum(squares) / float(WIDTH) + eps);
}

// COUNT consecutive heads of a projection made ready for attention by one SIMD group:
// (source + bias), RMS-normed (QK_NORM 1: each head by its own rms, weights norm_weight
// [HEAD_DIM]; QK_NORM 2: times whole_norm, the whole projection's 1 / rms, weights
// norm_weight[i * HEAD_DIM ...] of head i, the first head's at norm_weight), rotated by RoPE at
// `position` (ROTARY 0: none), times `scale`, into out[COUNT * HEAD_DIM]. Lane l takes pairs
// l, l + 32, ... (HEAD_DIM / 64 each) of every head: all loads are issued before any use, and
// the angles' sines and cosines are computed once for all the heads.
template <int COUNT, int HEAD_DIM, int ROTARY, int TRADITIONAL, int QK_NORM, int BIAS>
inline void muser_heads_prepare(const device float* source, const device float* bias,
                                const device float* norm_weight, const device float* inv_freq,
                                float position, float eps, float whole_norm, float scale, uint lane,
                                threadgroup float* out) {
  const int PAIRS = HEAD_DIM / 64;
  const int WEIGHTS = QK_NORM == 2 ? COUNT : 1;  // heads with weights of their own
  float first[COUNT * PAIRS];
  float second[COUNT * PAIRS];
  float weight_first[WEIGHTS * PAIRS];
  float weight_second[WEIGHTS * PAIRS];
  float cosine[PAIRS];
  float sine[PAIRS];
  for (int k = 0; k < PAIRS; ++k) {
    uint pair = lane + 32u * uint(k);
    uint2 channels = muser_rope_pair<ROTARY, TRADITIONAL>(pair);
    for (int i = 0; i < COUNT; ++i) {
      first[i * PAIRS + k] = source[i * HEAD_DIM + int(channels.x)] + (BIAS ? bias[i * HEAD_DIM + int(channels.x)] : 0.0f);
      second[i * PAIRS + k] = source[i * HEAD_DIM + int(channels.y)] + (BIAS ? bias[i * HEAD_DIM + int(channels.y)] : 0.0f);
    }
    for (int i = 0; i < WEIGHTS; ++i) {
      weight_first[i * PAIRS + k] = QK_NORM ? norm_weight[i * HEAD_DIM + int(channels.x)] : 1.0f;
      weight_second[i * PAIRS + k] = QK_NORM ? norm_weight[i * HEAD_DIM + int(channels.y)] : 1.0f;
    }
    float angle = muser_rope_rotates<ROTARY, TRADITIONAL>(pair) ? position * inv_freq[pair] : 0.0f;
    cosine[k] = cos(angle);
    sine[k] = sin(angle);
  }
  for (int i = 0; i < COUNT; ++i) {
    float squares = 0.0f;
    for (int k = 0; k < PAIRS; ++k) {
      squares += first[i * PAIRS + k] * first[i * PAIRS + k] + second[i * PAIRS + k] * second[i * PAIRS + k];
    }
    float norm = QK_NORM == 1 ? 1.0f / sqrt(simd_sum(squares) / float(HEAD_DIM) + eps)
                 : QK_NORM == 2 ? whole_norm : 1.0f;
    int w = QK_NORM == 2 ? i : 0;
    for (int k = 0; k < PAIRS; ++k) {
      uint2 channels = muser_rope_pair<ROTARY, TRADITIONAL>(lane + 32u * uint(k));
      float x0 = first[i * PAIRS + k] * norm * weight_first[w * PAIRS + k];
      float x1 = second[i * PAIRS + k] * norm * weight_second[w * PAIRS + k];
      out[i * HEAD_DIM + int(channels.x)] = (x0 * cosine[k] - x1 * sine[k]) * scale;
      out[i * HEAD_DIM + int(channels.y)] = (x0 * sine[k] + x1 * cosine[k]) * scale;
    }
  }
}
