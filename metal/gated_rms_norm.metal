// GDN output norm per head: out = rmsnorm(o) * weight * silu(z), F32 math, cast to T.
// o [..., H, D]; z_src [..., ZW] with z at columns [Z0, Z0 + H*D) (e.g. the fused
// in_proj output); weight [D] F32 (plain weight, not 1 + w); out [..., H*D].
// Template: T, H, D, ZW, Z0. grid (TG, H, rows), threadgroup (TG, 1, 1).
constexpr int PER_THREAD = 8;
threadgroup float partial[32];

uint h = threadgroup_position_in_grid.y;
uint r = threadgroup_position_in_grid.z;
uint tid = thread_position_in_threadgroup.x;
uint nthreads = threads_per_threadgroup.x;
size_t base = (size_t(r) * H + h) * D;
size_t zbase = size_t(r) * ZW + Z0 + size_t(h) * D;

float xs[PER_THREAD];
float sumsq = 0.0f;
int n = 0;
for (int d = int(tid); d < D; d += int(nthreads), ++n) {
  float x = float(o[base + d]);
  xs[n] = x;
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
n = 0;
for (int d = int(tid); d < D; d += int(nthreads), ++n) {
  float z = float(z_src[zbase + d]);
  float gate = z * (1.0f / (1.0f + exp(-z)));
  out[base + d] = static_cast<T>((xs[n] * inv * weight[d]) * gate);
}
