// GDN state commit by tape replay: the state after exactly the first `rows` rows of a
// recorded verify pass (rows is a runtime value: one compiled kernel serves every
// accepted length), and the conv state = window rows [rows, rows + KM1).
// state [1, HV, DV, DK] F32 (MLX layout); k [1, T, HK, DK], v [1, T, HV, DV],
// gamma, beta [1, T, HV] (F32, the tape); window [1, KM1 + T, C] F32.
// Per row t: S = gamma*S; d = beta*(v - S k); S += d k^T (value head h reads key head
// h / (HV/HK)). Each SIMD group owns one state row (h, i): lane l holds DK/32 entries.
// Template: HK, DK, HV, DV, KM1 (K-1), PER_LANE (= ceil(DK/32)).
// grid (32, DV, HV), threadgroup (32, TGY, 1).
constexpr int C = 2 * HK * DK + HV * DV;
uint lane = thread_position_in_threadgroup.x;
uint i = thread_position_in_grid.y;
uint h = thread_position_in_grid.z;
uint kh = h / uint(HV / HK);
size_t srow = (size_t(h) * DV + i) * DK;

float s[PER_LANE];
for (int p = 0; p < PER_LANE; ++p) {
  int j = int(lane) + 32 * p;
  s[p] = j < DK ? state[srow + j] : 0.0f;
}
for (int t = 0; t < rows; ++t) {
  float g = gamma[size_t(t) * HV + h];
  float b = beta[size_t(t) * HV + h];
  size_t kbase = (size_t(t) * HK + kh) * DK;
  float part = 0.0f;
  for (int p = 0; p < PER_LANE; ++p) {
    int j = int(lane) + 32 * p;
    if (j < DK) {
      s[p] *= g;
      part += s[p] * k[kbase + j];
    }
  }
  float kv = simd_sum(part);
  float delta = (v[(size_t(t) * HV + h) * DV + i] - kv) * b;
  for (int p = 0; p < PER_LANE; ++p) {
    int j = int(lane) + 32 * p;
    if (j < DK) {
      s[p] += k[kbase + j] * delta;
    }
  }
}
for (int p = 0; p < PER_LANE; ++p) {
  int j = int(lane) + 32 * p;
  if (j < DK) {
    state_out[srow + j] = s[p];
  }
}
// conv state: every thread copies a strided share of the KM1 * C values
uint nthreads = threads_per_grid.x * threads_per_grid.y * threads_per_grid.z;
uint gid = (h * uint(DV) + i) * threads_per_grid.x + lane;
for (uint idx = gid; idx < uint(KM1 * C); idx += nthreads) {
  conv_out[idx] = window[size_t(rows) * C + idx];
}
