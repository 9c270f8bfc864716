// The Metal side of the CPU emulator: what MLX's utils preamble gives a kernel body
// (metal_stdlib with `using namespace metal;`, bfloat16_t/float16_t), as plain C++17.
//
// Only what plain, C++-compatible MSL needs: address-space qualifiers, half/bfloat with
// round-to-nearest-even conversion, small vectors with 32-bit uint3 fields, metal:: /
// fast:: / precise:: math, threadgroup memory, barriers, SIMD-group collectives and
// relaxed atomics. Barriers and collectives switch fibers: runtime.h (included after the
// kernel) runs each threadgroup's threads as cooperative fibers.
//
// Limits (kept on purpose, so an unsupported construct fails to compile here instead of
// silently meaning something else): `threadgroup` is only for array declarations in the
// kernel body (it expands to a function-local static, which the runner poisons before
// every threadgroup); no swizzles beyond .x/.y/.z/.w; no textures, no quadgroup
// collectives. Address spaces are erased: passing a `constant` pointer where Metal wants
// a `device` one compiles here and not on Metal (keep such pointers out of the bodies).
// No libc math headers: names such as exp, abs and max resolve to metal:: only.
#pragma once

#include <float.h>
#include <stddef.h>
#include <stdint.h>

#include <limits>
#include <type_traits>

#define device
#define constant
#define thread
// one static per kernel instance; runner.py finds them in the library's symbol table
// (`<kernel>::name`) and poisons them before every threadgroup
#define threadgroup static __attribute__((aligned(16)))

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#define MAXFLOAT FLT_MAX
#define HUGE_VALF (__builtin_huge_valf())

namespace mlxemu {

template <class To, class From>
inline To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  __builtin_memcpy(&out, &v, sizeof(To));
  return out;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest even, IEEE binary16
  uint32_t x = bit_cast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  if (exp == 0xffu) return uint16_t(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
  int e = int(exp) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {  // subnormal half (or zero)
    if (e < -10) return uint16_t(sign);
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t half_man = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1u))) half_man++;
    return uint16_t(sign | half_man);
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  // may carry into the exponent: correct
  return uint16_t(h);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    float v = float(man) * 5.9604644775390625e-08f;  // 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return bit_cast<float>(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x = bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bit_cast<float>(uint32_t(b) << 16); }

}  // namespace mlxemu

// half and bfloat: 16-bit storage; each operation computes in float and rounds once,
// which is exact for + - * / (float has more than 2p+2 bits for both formats).
#define MLXEMU_FLOAT16(NAME, TO, FROM)                                                       \
  struct NAME {                                                                              \
    uint16_t bits;                                                                           \
    NAME() = default;                                                                        \
    NAME(float f) : bits(mlxemu::TO(f)) {}                                                   \
    NAME(double d) : bits(mlxemu::TO(float(d))) {}                                           \
    template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                \
    NAME(I v) : bits(mlxemu::TO(float(v))) {}                                                \
    operator float() const { return mlxemu::FROM(bits); }                                    \
    NAME operator-() const { return NAME(-float(*this)); }                                   \
    NAME operator+() const { return *this; }                                                 \
  };

MLXEMU_FLOAT16(half, f32_to_f16, f16_to_f32)
MLXEMU_FLOAT16(bfloat, f32_to_bf16, bf16_to_f32)

#define MLXEMU_F16_OPS(T)                                                                    \
  inline T operator+(T a, T b) { return T(float(a) + float(b)); }                            \
  inline T operator-(T a, T b) { return T(float(a) - float(b)); }                            \
  inline T operator*(T a, T b) { return T(float(a) * float(b)); }                            \
  inline T operator/(T a, T b) { return T(float(a) / float(b)); }                            \
  inline float operator+(T a, float b) { return float(a) + b; }                              \
  inline float operator-(T a, float b) { return float(a) - b; }                              \
  inline float operator*(T a, float b) { return float(a) * b; }                              \
  inline float operator/(T a, float b) { return float(a) / b; }                              \
  inline float operator+(float a, T b) { return a + float(b); }                              \
  inline float operator-(float a, T b) { return a - float(b); }                              \
  inline float operator*(float a, T b) { return a * float(b); }                              \
  inline float operator/(float a, T b) { return a / float(b); }                              \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator+(T a, I b) { return a + T(b); }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator-(T a, I b) { return a - T(b); }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator*(T a, I b) { return a * T(b); }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator/(T a, I b) { return a / T(b); }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator+(I a, T b) { return T(a) + b; }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator-(I a, T b) { return T(a) - b; }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator*(I a, T b) { return T(a) * b; }                                          \
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>                  \
  inline T operator/(I a, T b) { return T(a) / b; }                                          \
  inline T& operator+=(T& a, T b) { return a = a + b; }                                      \
  inline T& operator-=(T& a, T b) { return a = a - b; }                                      \
  inline T& operator*=(T& a, T b) { return a = a * b; }                                      \
  inline T& operator/=(T& a, T b) { return a = a / b; }                                      \
  inline T& operator+=(T& a, float b) { return a = T(float(a) + b); }                        \
  inline T& operator-=(T& a, float b) { return a = T(float(a) - b); }                        \
  inline T& operator*=(T& a, float b) { return a = T(float(a) * b); }                        \
  inline T& operator/=(T& a, float b) { return a = T(float(a) / b); }                        \
  inline bool operator<(T a, T b) { return float(a) < float(b); }                            \
  inline bool operator>(T a, T b) { return float(a) > float(b); }                            \
  inline bool operator<=(T a, T b) { return float(a) <= float(b); }                          \
  inline bool operator>=(T a, T b) { return float(a) >= float(b); }                          \
  inline bool operator==(T a, T b) { return float(a) == float(b); }                          \
  inline bool operator!=(T a, T b) { return float(a) != float(b); }                          \
  inline bool operator<(T a, float b) { return float(a) < b; }                               \
  inline bool operator>(T a, float b) { return float(a) > b; }                               \
  inline bool operator<=(T a, float b) { return float(a) <= b; }                             \
  inline bool operator>=(T a, float b) { return float(a) >= b; }                             \
  inline bool operator==(T a, float b) { return float(a) == b; }                             \
  inline bool operator!=(T a, float b) { return float(a) != b; }                             \
  inline bool operator<(float a, T b) { return a < float(b); }                               \
  inline bool operator>(float a, T b) { return a > float(b); }                               \
  inline bool operator<=(float a, T b) { return a <= float(b); }                             \
  inline bool operator>=(float a, T b) { return a >= float(b); }                             \
  inline bool operator==(float a, T b) { return a == float(b); }                             \
  inline bool operator!=(float a, T b) { return a != float(b); }

MLXEMU_F16_OPS(half)
MLXEMU_F16_OPS(bfloat)

typedef half float16_t;
typedef bfloat bfloat16_t;

// ------------------------------------------------------------------ vectors
template <class T, int N>
struct vec;

#define MLXEMU_VEC_COMMON(N)                                                                 \
  T& operator[](int i) { return (&x)[i]; }                                                   \
  const T& operator[](int i) const { return (&x)[i]; }

template <class T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  template <class U>
  explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  MLXEMU_VEC_COMMON(2)
};

template <class T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <class U>
  explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  MLXEMU_VEC_COMMON(3)
};

template <class T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <class U>
  explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  MLXEMU_VEC_COMMON(4)
};

#define MLXEMU_VEC_OP(OP)                                                                    \
  template <class T, int N>                                                                  \
  inline vec<T, N> operator OP(vec<T, N> a, const vec<T, N>& b) {                            \
    for (int i = 0; i < N; ++i) a[i] = a[i] OP b[i];                                         \
    return a;                                                                                \
  }                                                                                          \
  template <class T, int N>                                                                  \
  inline vec<T, N> operator OP(vec<T, N> a, T b) {                                           \
    for (int i = 0; i < N; ++i) a[i] = a[i] OP b;                                            \
    return a;                                                                                \
  }                                                                                          \
  template <class T, int N>                                                                  \
  inline vec<T, N> operator OP(T a, vec<T, N> b) {                                           \
    for (int i = 0; i < N; ++i) b[i] = a OP b[i];                                            \
    return b;                                                                                \
  }                                                                                          \
  template <class T, int N, class S>                                                         \
  inline vec<T, N>& operator OP##=(vec<T, N>& a, const S& b) {                               \
    return a = a OP b;                                                                       \
  }

MLXEMU_VEC_OP(+)
MLXEMU_VEC_OP(-)
MLXEMU_VEC_OP(*)
MLXEMU_VEC_OP(/)

#define MLXEMU_VEC_TYPES(S, T) \
  typedef vec<T, 2> S##2;      \
  typedef vec<T, 3> S##3;      \
  typedef vec<T, 4> S##4;

MLXEMU_VEC_TYPES(float, float)
MLXEMU_VEC_TYPES(half, half)
MLXEMU_VEC_TYPES(bfloat, bfloat)
MLXEMU_VEC_TYPES(int, int32_t)
MLXEMU_VEC_TYPES(uint, uint32_t)
MLXEMU_VEC_TYPES(short, int16_t)
MLXEMU_VEC_TYPES(ushort, uint16_t)
MLXEMU_VEC_TYPES(char, int8_t)
MLXEMU_VEC_TYPES(uchar, uint8_t)
MLXEMU_VEC_TYPES(bool, bool)

// ------------------------------------------------------------------ math
namespace metal {

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static half min() { return half(6.103515625e-05f); }
  static half max() { return half(65504.0f); }
  static half lowest() { return half(-65504.0f); }
  static half infinity() { return half(__builtin_inff()); }
  static half quiet_NaN() { return half(__builtin_nanf("")); }
  static half epsilon() { return half(0.0009765625f); }
};
template <>
struct numeric_limits<bfloat> {
  static bfloat min() { return bfloat(1.1754943508222875e-38f); }
  static bfloat max() { return bfloat(3.3895313892515355e+38f); }
  static bfloat lowest() { return bfloat(-3.3895313892515355e+38f); }
  static bfloat infinity() { return bfloat(__builtin_inff()); }
  static bfloat quiet_NaN() { return bfloat(__builtin_nanf("")); }
  static bfloat epsilon() { return bfloat(0.0078125f); }
};

#define MLXEMU_UNARY(NAME, EXPR)                                       \
  inline float NAME(float x) { return EXPR; }                          \
  inline half NAME(half x) { return half(NAME(float(x))); }            \
  inline bfloat NAME(bfloat x) { return bfloat(NAME(float(x))); }

MLXEMU_UNARY(exp, __builtin_expf(x))
MLXEMU_UNARY(exp2, __builtin_exp2f(x))
MLXEMU_UNARY(exp10, __builtin_powf(10.0f, x))
MLXEMU_UNARY(log, __builtin_logf(x))
MLXEMU_UNARY(log2, __builtin_log2f(x))
MLXEMU_UNARY(log10, __builtin_log10f(x))
MLXEMU_UNARY(sqrt, __builtin_sqrtf(x))
MLXEMU_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
MLXEMU_UNARY(sin, __builtin_sinf(x))
MLXEMU_UNARY(cos, __builtin_cosf(x))
MLXEMU_UNARY(tan, __builtin_tanf(x))
MLXEMU_UNARY(asin, __builtin_asinf(x))
MLXEMU_UNARY(acos, __builtin_acosf(x))
MLXEMU_UNARY(atan, __builtin_atanf(x))
MLXEMU_UNARY(sinh, __builtin_sinhf(x))
MLXEMU_UNARY(cosh, __builtin_coshf(x))
MLXEMU_UNARY(tanh, __builtin_tanhf(x))
MLXEMU_UNARY(fabs, __builtin_fabsf(x))
MLXEMU_UNARY(abs, __builtin_fabsf(x))
MLXEMU_UNARY(floor, __builtin_floorf(x))
MLXEMU_UNARY(ceil, __builtin_ceilf(x))
MLXEMU_UNARY(round, __builtin_roundf(x))
MLXEMU_UNARY(rint, __builtin_rintf(x))
MLXEMU_UNARY(trunc, __builtin_truncf(x))
MLXEMU_UNARY(saturate, x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x))
MLXEMU_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x))

inline int abs(int x) { return x < 0 ? -x : x; }
inline float pow(float x, float y) { return __builtin_powf(x, y); }
inline float powr(float x, float y) { return __builtin_powf(x, y); }
inline float atan2(float y, float x) { return __builtin_atan2f(y, x); }
inline float fmod(float x, float y) { return __builtin_fmodf(x, y); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float copysign(float x, float y) { return __builtin_copysignf(x, y); }
inline float ldexp(float x, int k) { return __builtin_ldexpf(x, k); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isnan(bfloat x) { return __builtin_isnan(float(x)); }
inline bool isinf(bfloat x) { return __builtin_isinf(float(x)); }

// Metal's max/min on floats return the other operand for a NaN (fmax semantics).
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline half max(half a, half b) { return half(__builtin_fmaxf(a, b)); }
inline half min(half a, half b) { return half(__builtin_fminf(a, b)); }
inline bfloat max(bfloat a, bfloat b) { return bfloat(__builtin_fmaxf(a, b)); }
inline bfloat min(bfloat a, bfloat b) { return bfloat(__builtin_fminf(a, b)); }
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
inline I max(I a, I b) { return a > b ? a : b; }
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
inline I min(I a, I b) { return a < b ? a : b; }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T mix(T a, T b, T t) { return a + (b - a) * t; }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline float divide(float a, float b) { return a / b; }

template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = s + a[i] * b[i];
  return s;
}

template <class To, class From>
inline To as_type(const From& v) { return mlxemu::bit_cast<To>(v); }

// Metal's fast:: and precise:: variants: the same functions here (compare with a tolerance)
namespace fast {
using metal::cos; using metal::divide; using metal::exp; using metal::exp2; using metal::log;
using metal::log2; using metal::pow; using metal::powr; using metal::rsqrt; using metal::sin;
using metal::sqrt; using metal::tanh; using metal::max; using metal::min; using metal::fabs;
using metal::tan; using metal::exp10; using metal::log10; using metal::atan; using metal::atan2;
}  // namespace fast
namespace precise {
using metal::cos; using metal::divide; using metal::exp; using metal::exp2; using metal::log;
using metal::log2; using metal::pow; using metal::powr; using metal::rsqrt; using metal::sin;
using metal::sqrt; using metal::tanh; using metal::max; using metal::min; using metal::fabs;
using metal::tan; using metal::exp10; using metal::log10; using metal::atan; using metal::atan2;
}  // namespace precise

// ------------------------------------------------------------------ synchronisation
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

enum memory_order { memory_order_relaxed = 0 };

template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;

// threads never run in parallel here: a fiber only switches at barriers and collectives
template <class T, class U>
inline void atomic_store_explicit(device atomic<T>* a, U v, memory_order) { a->value = T(v); }
template <class T>
inline T atomic_load_explicit(const device atomic<T>* a, memory_order) { return a->value; }
template <class T, class U>
inline T atomic_fetch_add_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value; a->value = T(old + T(v)); return old;
}
template <class T, class U>
inline T atomic_fetch_sub_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value; a->value = T(old - T(v)); return old;
}
template <class T, class U>
inline T atomic_fetch_max_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value; if (T(v) > old) a->value = T(v); return old;
}
template <class T, class U>
inline T atomic_fetch_min_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value; if (T(v) < old) a->value = T(v); return old;
}
template <class T, class U>
inline T atomic_exchange_explicit(device atomic<T>* a, U v, memory_order) {
  T old = a->value; a->value = T(v); return old;
}

}  // namespace metal

// ------------------------------------------------------------------ fiber hooks
namespace mlxemu {

enum SyncKind { SYNC_BARRIER = 1, SYNC_SIMD = 2 };
enum SimdOp {
  OP_SUM = 1, OP_PRODUCT, OP_MAX, OP_MIN, OP_PREFIX_INCLUSIVE_SUM, OP_PREFIX_EXCLUSIVE_SUM,
  OP_PREFIX_INCLUSIVE_PRODUCT, OP_PREFIX_EXCLUSIVE_PRODUCT, OP_SHUFFLE, OP_SHUFFLE_DOWN,
  OP_SHUFFLE_UP, OP_SHUFFLE_XOR, OP_BROADCAST, OP_BROADCAST_FIRST, OP_ALL, OP_ANY, OP_AND,
  OP_OR, OP_XOR, OP_SIMDGROUP_BARRIER, OP_COUNT
};

constexpr int kSimdWidth = 32;
constexpr int kMaxSimdgroups = 32;  // 1024 threads per threadgroup
constexpr int kSlotBytes = 32;

struct ThreadState {
  unsigned lane;
  unsigned simdgroup;
  unsigned phase;  // collectives this thread has entered (double-buffers the lane slots)
};

static ThreadState* current;  // the running fiber's state
static unsigned char lane_values[kMaxSimdgroups][2][kSimdWidth][kSlotBytes];
static unsigned active_lanes[kMaxSimdgroups][2];  // lanes that took part, set on release

static void sync(int kind, int op);  // runtime.h: yield until the barrier/collective releases

template <class T>
inline unsigned enter(const T& x, int op) {
  static_assert(sizeof(T) <= kSlotBytes, "SIMD collective on a type larger than 32 bytes");
  unsigned ph = current->phase++ & 1u;
  __builtin_memcpy(lane_values[current->simdgroup][ph][current->lane], &x, sizeof(T));
  sync(SYNC_SIMD, op);
  return ph;
}

template <class T>
inline T lane_value(unsigned ph, unsigned lane) {
  T v;
  __builtin_memcpy(&v, lane_values[current->simdgroup][ph][lane], sizeof(T));
  return v;
}

inline bool lane_active(unsigned ph, unsigned lane) {
  return lane < unsigned(kSimdWidth) && ((active_lanes[current->simdgroup][ph] >> lane) & 1u);
}

template <class T, class F>
inline T reduce(const T& x, int op, F combine) {
  unsigned ph = enter(x, op);
  bool first = true;
  T acc = x;
  for (unsigned l = 0; l < unsigned(kSimdWidth); ++l) {
    if (!lane_active(ph, l)) continue;
    T v = lane_value<T>(ph, l);
    acc = first ? v : combine(acc, v);
    first = false;
  }
  return acc;
}

template <class T, class F>
inline T scan(const T& x, int op, bool inclusive, T identity, F combine) {
  unsigned ph = enter(x, op);
  T acc = identity;
  for (unsigned l = 0; l < current->lane; ++l)
    if (lane_active(ph, l)) acc = combine(acc, lane_value<T>(ph, l));
  return inclusive ? combine(acc, x) : acc;
}

template <class T>
inline T read_lane(const T& own, unsigned ph, long src) {
  if (src < 0 || src >= kSimdWidth || !lane_active(ph, unsigned(src))) {
    T poison;  // reading an inactive lane is undefined in Metal: hand back garbage
    __builtin_memset(&poison, 0xff, sizeof(T));
    return poison;
  }
  (void)own;
  return lane_value<T>(ph, unsigned(src));
}

}  // namespace mlxemu

namespace metal {

inline void threadgroup_barrier(mem_flags) { mlxemu::sync(mlxemu::SYNC_BARRIER, 0); }
inline void simdgroup_barrier(mem_flags) {
  mlxemu::enter(0, mlxemu::OP_SIMDGROUP_BARRIER);
}

template <class T>
inline T simd_sum(T x) { return mlxemu::reduce(x, mlxemu::OP_SUM, [](T a, T b) { return T(a + b); }); }
template <class T>
inline T simd_product(T x) { return mlxemu::reduce(x, mlxemu::OP_PRODUCT, [](T a, T b) { return T(a * b); }); }
template <class T>
inline T simd_max(T x) { return mlxemu::reduce(x, mlxemu::OP_MAX, [](T a, T b) { return max(a, b); }); }
template <class T>
inline T simd_min(T x) { return mlxemu::reduce(x, mlxemu::OP_MIN, [](T a, T b) { return min(a, b); }); }
template <class T>
inline T simd_and(T x) { return mlxemu::reduce(x, mlxemu::OP_AND, [](T a, T b) { return T(a & b); }); }
template <class T>
inline T simd_or(T x) { return mlxemu::reduce(x, mlxemu::OP_OR, [](T a, T b) { return T(a | b); }); }
template <class T>
inline T simd_xor(T x) { return mlxemu::reduce(x, mlxemu::OP_XOR, [](T a, T b) { return T(a ^ b); }); }
inline bool simd_all(bool x) { return mlxemu::reduce(x, mlxemu::OP_ALL, [](bool a, bool b) { return a && b; }); }
inline bool simd_any(bool x) { return mlxemu::reduce(x, mlxemu::OP_ANY, [](bool a, bool b) { return a || b; }); }

template <class T>
inline T simd_prefix_inclusive_sum(T x) {
  return mlxemu::scan(x, mlxemu::OP_PREFIX_INCLUSIVE_SUM, true, T(0), [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_prefix_exclusive_sum(T x) {
  return mlxemu::scan(x, mlxemu::OP_PREFIX_EXCLUSIVE_SUM, false, T(0), [](T a, T b) { return T(a + b); });
}
template <class T>
inline T simd_prefix_inclusive_product(T x) {
  return mlxemu::scan(x, mlxemu::OP_PREFIX_INCLUSIVE_PRODUCT, true, T(1), [](T a, T b) { return T(a * b); });
}
template <class T>
inline T simd_prefix_exclusive_product(T x) {
  return mlxemu::scan(x, mlxemu::OP_PREFIX_EXCLUSIVE_PRODUCT, false, T(1), [](T a, T b) { return T(a * b); });
}

template <class T>
inline T simd_shuffle(T x, ushort lane) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_SHUFFLE);
  return mlxemu::read_lane(x, ph, long(lane));
}
template <class T>
inline T simd_broadcast(T x, ushort lane) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_BROADCAST);
  return mlxemu::read_lane(x, ph, long(lane));
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_SHUFFLE_XOR);
  return mlxemu::read_lane(x, ph, long(mlxemu::current->lane ^ mask));
}
// lanes whose source lies outside the SIMD group keep their own value
template <class T>
inline T simd_shuffle_down(T x, ushort delta) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_SHUFFLE_DOWN);
  long src = long(mlxemu::current->lane) + long(delta);
  return src >= mlxemu::kSimdWidth ? x : mlxemu::read_lane(x, ph, src);
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_SHUFFLE_UP);
  long src = long(mlxemu::current->lane) - long(delta);
  return src < 0 ? x : mlxemu::read_lane(x, ph, src);
}
template <class T>
inline T simd_broadcast_first(T x) {
  unsigned ph = mlxemu::enter(x, mlxemu::OP_BROADCAST_FIRST);
  for (unsigned l = 0; l < unsigned(mlxemu::kSimdWidth); ++l)
    if (mlxemu::lane_active(ph, l)) return mlxemu::lane_value<T>(ph, l);
  return x;
}

}  // namespace metal

using namespace metal;
