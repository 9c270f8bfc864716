// Gated DeltaNet pre-mixer for T rows: conv window, causal depthwise conv (K taps) + SiLU,
// split into q/k/v heads, q/k l2-norm (q also scaled by DK^-0.5), gates beta and gamma.
// proj [1, T, W] holds per row: conv channels C = 2*HK*DK + HV*DV (all q heads, all k
// heads, all v heads) | z [HV*DV] | b [HV] | a [HV]. conv_state [1, K-1, C] F32 holds the
// last K-1 pre-conv rows, conv_weight [C, K] F32 (tap K-1 multiplies the current row).
// Outputs (F32): q, k [1, T, HK, DK]; v [1, T, HV, DV]; gamma, beta [1, T, HV];
// window [1, K-1+T, C] = conv_state rows then the T new pre-conv rows.
// One threadgroup per (head slot, row): grid (TG, 2*HK + HV, T), threadgroup (TG, 1, 1);
// slots [0, HK) are q heads, [HK, 2*HK) k heads, [2*HK, 2*HK+HV) v heads.
constexpr int C = 2 * HK * DK + HV * DV;
constexpr int W = C + HV * DV + 2 * HV;
constexpr int PER_THREAD = 8;
threadgroup float partial[32];

uint slot = threadgroup_position_in_grid.y;
uint t = threadgroup_position_in_grid.z;
uint tid = thread_position_in_threadgroup.x;
uint nthreads = threads_per_threadgroup.x;
bool is_key = slot < uint(2 * HK);
int dim = is_key ? DK : DV;
int ch0 = is_key ? int(slot) * DK : 2 * HK * DK + (int(slot) - 2 * HK) * DV;
size_t row = size_t(t) * W;

float vals[PER_THREAD];
float sumsq = 0.0f;
int n = 0;
for (int d = int(tid); d < dim; d += int(nthreads), ++n) {
  int ch = ch0 + d;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) {
    int r = int(t) + j;  // window row
    float x = r < K - 1 ? conv_state[r * C + ch] : float(proj[size_t(r - (K - 1)) * W + ch]);
    acc += conv_weight[ch * K + j] * x;
  }
  float c = acc * (1.0f / (1.0f + exp(-acc)));
  vals[n] = c;
  sumsq += c * c;
  window[(size_t(K - 1) + t) * C + ch] = float(proj[row + ch]);
  if (t == 0u) {
    for (int r = 0; r < K - 1; ++r) {
      window[r * C + ch] = conv_state[r * C + ch];
    }
  }
}

if (is_key) {
  // l2 norm over the head: SIMD sums, then the threadgroup's partial sums
  float s = simd_sum(sumsq);
  if (thread_index_in_simdgroup == 0u) {
    partial[simdgroup_index_in_threadgroup] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < simdgroups_per_threadgroup; ++i) {
    total += partial[i];
  }
  bool is_q = slot < uint(HK);
  float inv = rsqrt(total + 1e-6f) * (is_q ? rsqrt(float(DK)) : 1.0f);
  int head = is_q ? int(slot) : int(slot) - HK;
  device float* dst = is_q ? q : k;
  size_t base = (size_t(t) * HK + head) * DK;
  n = 0;
  for (int d = int(tid); d < DK; d += int(nthreads), ++n) {
    dst[base + d] = vals[n] * inv;
  }
} else {
  int head = int(slot) - 2 * HK;
  size_t base = (size_t(t) * HV + head) * DV;
  n = 0;
  for (int d = int(tid); d < DV; d += int(nthreads), ++n) {
    v[base + d] = vals[n];
  }
  if (tid == 0u) {
    // beta = sigmoid(b); gamma = exp(-exp(A_log) * softplus(a + dt_bias))
    float b = float(proj[row + C + HV * DV + head]);
    float a = float(proj[row + C + HV * DV + HV + head]) + dt_bias[head];
    float e = exp(-fabs(a));
    float u = 1.0f + e;
    float log1p_e = u == 1.0f ? e : log(u) * (e / (u - 1.0f));
    float softplus = max(a, 0.0f) + log1p_e;
    beta[t * HV + head] = 1.0f / (1.0f + exp(-b));
    gamma[t * HV + head] = exp(neg_decay[head] * softplus);
  }
}
