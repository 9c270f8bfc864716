// MoE router: softmax over E expert logits, top-K, renormalized. The renormalized
// weights equal a softmax over the K selected logits, which is what is computed.
// Selection order: largest logit first; equal logits go to the lower expert index
// (a stable descending sort). logits [T, E]; ids int32 [T, K]; weights F32 [T, K].
// Non-finite logits: NaN ranks as -inf, so a slot with only -inf left takes the lowest
// expert not yet taken (the tie rule) and ids stay distinct and in [0, E). A selected
// logit equal to the largest one weighs exp(0) = 1 even when both are +inf or -inf:
// +inf logits share the weight and an all -inf selection is uniform.
// Template: E, K, TG (threads per row). grid (TG, T, 1), threadgroup (TG, 1, 1).
constexpr int PER_THREAD = (E + TG - 1) / TG;
// winners of each SIMD group, double-buffered by round so one barrier per round suffices
threadgroup float best_value[2][32];
threadgroup int best_index[2][32];

uint row = threadgroup_position_in_grid.y;
uint tid = thread_position_in_threadgroup.x;
uint lane = thread_index_in_simdgroup;
uint sg = simdgroup_index_in_threadgroup;
float vals[PER_THREAD];
for (int p = 0; p < PER_THREAD; ++p) {
  int e = int(tid) + p * TG;
  float v = e < E ? float(logits[size_t(row) * E + e]) : 0.0f;
  vals[p] = isnan(v) ? -INFINITY : v;
}
uint taken = 0u;
float top[K];
int top_id[K];
for (int k = 0; k < K; ++k) {
  // this thread's best remaining expert
  float bv = -INFINITY;
  int bi = E;
  for (int p = 0; p < PER_THREAD; ++p) {
    int e = int(tid) + p * TG;
    if (e < E && ((taken >> p) & 1u) == 0u && (bi == E || vals[p] > bv)) {
      bv = vals[p];
      bi = e;
    }
  }
  float m = simd_max(bi < E ? bv : -INFINITY);
  int cand = (bi < E && bv == m) ? bi : E;
  int mi = simd_min(cand);
  int buf = k & 1;
  if (lane == 0u) {
    best_value[buf][sg] = m;
    best_index[buf][sg] = mi;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float fv = -INFINITY;
  int fi = E;
  for (uint s = 0; s < simdgroups_per_threadgroup; ++s) {
    float v = best_value[buf][s];
    int i = best_index[buf][s];
    if (i < E && (fi == E || v > fv || (v == fv && i < fi))) {
      fv = v;
      fi = i;
    }
  }
  if (fi % TG == int(tid)) {
    taken |= 1u << (fi / TG);
  }
  top[k] = fv;
  top_id[k] = fi;
}
if (tid == 0u) {
  float largest = top[0];
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    top[k] = top[k] == largest ? 1.0f : exp(top[k] - largest);
    sum += top[k];
  }
  for (int k = 0; k < K; ++k) {
    ids[size_t(row) * K + k] = top_id[k];
    weights[size_t(row) * K + k] = top[k] / sum;
  }
}
