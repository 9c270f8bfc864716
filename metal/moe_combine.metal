// MoE combine + the next RMSNorm: h = residual + sum_k weights[k] * expert_out[k] +
// sigmoid(shared_gate) * shared_out (F32, cast to T once), and normed = rmsnorm(h) *
// norm_weight (F32 math on the rounded h, stored (1 + w) F32 weight, cast to T): the next
// layer's input norm, or the final norm after the last layer.
// expert_out [T, K, HID]; weights [T, K] F32; shared_out [T, HID]; shared_gate [T, 1] (the
// logit); residual [T, HID]. Outputs h, normed [T, HID].
// Template: T, K, HID, TG. One threadgroup per row: grid (TG, T, 1), threadgroup (TG, 1, 1).
constexpr int PER_THREAD = (HID + TG - 1) / TG;
threadgroup float partial[32];

uint t = threadgroup_position_in_grid.y;
uint tid = thread_position_in_threadgroup.x;
size_t base = size_t(t) * HID;
float gate = 1.0f / (1.0f + exp(-float(shared_gate[t])));
float w[K];
for (int k = 0; k < K; ++k) {
  w[k] = weights[size_t(t) * K + k];
}
float hs[PER_THREAD];
float sumsq = 0.0f;
for (int p = 0; p < PER_THREAD; ++p) {
  int i = int(tid) + p * TG;
  float v = 0.0f;
  if (i < HID) {
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) {
      acc += w[k] * float(expert_out[(size_t(t) * K + k) * HID + i]);
    }
    acc += float(shared_out[base + i]) * gate;
    T out = static_cast<T>(acc + float(residual[base + i]));
    h[base + i] = out;
    v = float(out);
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
    normed[base + i] = static_cast<T>(hs[p] * inv * norm_weight[i]);
  }
}
