// Residual add + zero-centred RMSNorm: h = x + y (rounded to T, as the reference adds in
// T), normed = rmsnorm(h) * weight in F32 with the stored (1 + w) F32 weight, cast to T.
// x, y [..., HID]; weight [HID] F32. Outputs h, normed [..., HID].
// Template: T, HID, TG. One threadgroup per row: grid (TG, rows, 1), threadgroup (TG, 1, 1).
constexpr int PER_THREAD = (HID + TG - 1) / TG;
threadgroup float partial[32];

uint r = threadgroup_position_in_grid.y;
uint tid = thread_position_in_threadgroup.x;
size_t base = size_t(r) * HID;
float hs[PER_THREAD];
float sumsq = 0.0f;
for (int p = 0; p < PER_THREAD; ++p) {
  int i = int(tid) + p * TG;
  float v = 0.0f;
  if (i < HID) {
    T sum = static_cast<T>(float(x[base + i]) + float(y[base + i]));
    h[base + i] = sum;
    v = float(sum);
  }
  hs[p] = v;
  sumsq += v * v;
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
float inv = rsqrt(total / float(HID) + eps);
for (int p = 0; p < PER_THREAD; ++p) {
  int i = int(tid) + p * TG;
  if (i < HID) {
    normed[base + i] = static_cast<T>(hs[p] * inv * weight[i]);
  }
}
