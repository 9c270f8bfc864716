// NVFP4 embedding gather: out[t, :] = E2M1 codes * E4M3 group scale * tensor_scale[row],
// row = tokens[t]. The pack stores a row as uint32 words [H/8] (eight E2M1 codes, the
// first in the lowest nibble), E4M3 scale bytes [H/16] (one per 16 values) and an F32
// (or compute-dtype) tensor scale per row.
// Template: T (output dtype), WORDS (= H/8). grid (WORDS, tokens, 1): one thread per word.
uint w = thread_position_in_grid.x;
uint t = thread_position_in_grid.y;
if (w >= uint(WORDS)) {
  return;
}
size_t row = size_t(tokens[t]);
uint word = words[row * WORDS + w];
uint sbits = uint(scales[row * (WORDS / 2) + w / 2]);
uint se = (sbits >> 3) & 0xFu;
uint sm = sbits & 0x7u;
// E4M3: bias 7, subnormal when the exponent field is 0
float scale = se == 0u ? float(sm) * 0.001953125f : as_type<float>(((se + 120u) << 23) | (sm << 20));
if ((sbits & 0x80u) != 0u) {
  scale = -scale;
}
float row_scale = float(tensor_scale[row]);
size_t out_base = size_t(t) * (WORDS * 8) + size_t(w) * 8;
for (uint j = 0; j < 8u; ++j) {
  uint code = (word >> (4u * j)) & 0xFu;
  uint mag = code & 0x7u;
  // E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6
  float v = mag < 2u ? 0.5f * float(mag) : float(2u + (mag & 1u)) * float(1u << (mag >> 1)) * 0.25f;
  if ((code & 0x8u) != 0u) {
    v = -v;
  }
  // (code * scale) is exact; one rounding for the tensor scale, as in the reference
  out[out_base + j] = static_cast<T>((v * scale) * row_scale);
}
