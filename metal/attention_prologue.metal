// Gated attention prologue for T rows at positions offset + t:
// qkv [1, T, (2*H + 2*KVH) * D] holds per row the fused q_proj rows (per head: query D
// then gate D), then k_proj (KVH heads), then v_proj (KVH heads).
// q, k: zero-centred RMSNorm with the stored (1 + w) F32 weights (rounded to T, as the
// reference does), then rotate-half RoPE on the first R dims (theta = pos *
// 2^(-j/(R/2) * log2(base)), j < R/2). Outputs (T): q [1, H, T, D], k and v [1, KVH, T, D]
// (the layout SDPA and the KV cache take), gate [1, T, H*D] = sigmoid(gate).
// Template: T, H, KVH, D, R, TG. grid (TG, H + 2*KVH, T), threadgroup (TG, 1, 1):
// slots [0, H) q heads, [H, H+KVH) k heads, [H+KVH, H+2*KVH) v heads.
constexpr int WIDTH = (2 * H + 2 * KVH) * D;
constexpr int PER_THREAD = (D + TG - 1) / TG;
constexpr int HALF = R / 2;
threadgroup float partial[32];
threadgroup float normed[D];

uint slot = threadgroup_position_in_grid.y;
uint t = threadgroup_position_in_grid.z;
uint rows = threadgroups_per_grid.z;
uint tid = thread_position_in_threadgroup.x;
size_t row = size_t(t) * WIDTH;
bool is_q = slot < uint(H);
bool is_v = slot >= uint(H + KVH);

size_t src;
device T* dst;
if (is_q) {
  src = row + size_t(slot) * 2 * D;
  dst = q + (size_t(slot) * rows + t) * D;
} else if (!is_v) {
  src = row + size_t(2 * H * D) + size_t(slot - H) * D;
  dst = k + (size_t(slot - H) * rows + t) * D;
} else {
  src = row + size_t((2 * H + KVH) * D) + size_t(slot - H - KVH) * D;
  dst = v + (size_t(slot - H - KVH) * rows + t) * D;
}

if (is_v) {
  for (int d = int(tid); d < D; d += TG) {
    dst[d] = static_cast<T>(qkv[src + d]);
  }
  return;
}

float xs[PER_THREAD];
float sumsq = 0.0f;
for (int p = 0; p < PER_THREAD; ++p) {
  int d = int(tid) + p * TG;
  float x = d < D ? float(qkv[src + d]) : 0.0f;
  xs[p] = x;
  sumsq += x * x;
}
float s = simd_sum(sumsq);
if (thread_index_in_simdgroup == 0u) {
  partial[simdgroup_index_in_threadgroup] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint i = 0; i < simdgroups_per_threadgroup; ++i) {
  total += partial[i];
}
float inv = rsqrt(total / float(D) + eps);
for (int p = 0; p < PER_THREAD; ++p) {
  int d = int(tid) + p * TG;
  if (d < D) {
    float w = is_q ? q_norm[d] : k_norm[d];
    normed[d] = float(static_cast<T>(xs[p] * inv * w));
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float pos = float(offset + int(t));
for (int d = int(tid); d < D; d += TG) {
  float y = normed[d];
  if (d < R) {
    int j = d < HALF ? d : d - HALF;
    float theta = pos * exp2(-(float(j) / float(HALF)) * log2_base);
    float c = cos(theta);
    float sn = sin(theta);
    y = d < HALF ? normed[d] * c - normed[d + HALF] * sn : normed[d - HALF] * sn + normed[d] * c;
  }
  dst[d] = static_cast<T>(y);
}
if (is_q) {
  size_t gsrc = src + D;
  size_t gdst = (size_t(t) * H + slot) * D;
  for (int d = int(tid); d < D; d += TG) {
    float g = float(qkv[gsrc + d]);
    gate[gdst + d] = static_cast<T>(1.0f / (1.0f + exp(-g)));
  }
}
