// kernelize CUDA prelude: the kz_* helpers the shared render table calls, 16-bit load/store conversions
// and the row accumulators with their block-level reduction. Semantics follow kernelize/ir/reference.py:
// 16-bit floats compute in f32; MIN/MAX propagate NaN; integer MOD is floor-mod, float MOD is fmod.
// The same text compiles with NVRTC for the device and with g++ under cuda_host_emu.h for the host.
#ifndef KZ_HOST_EMU
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#endif

#define KZ __device__ __forceinline__

// -- 16-bit storage: load widens to f32, store rounds once (round to nearest even) ----------------------
KZ float kz_ld(__half x) { return __half2float(x); }
KZ float kz_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> KZ T kz_ld(T x) { return x; }

template <class D> struct KzCvt { template <class S> static KZ D to(S v) { return (D)v; } };
template <> struct KzCvt<bool> { template <class S> static KZ bool to(S v) { return v != 0; } };
template <> struct KzCvt<__half> { template <class S> static KZ __half to(S v) { return __float2half_rn((float)v); } };
template <> struct KzCvt<__nv_bfloat16> {
  template <class S> static KZ __nv_bfloat16 to(S v) { return __float2bfloat16_rn((float)v); }
};
template <class D, class S> KZ D kz_cvt(S v) { return KzCvt<D>::to(v); }
// a value rounded through a 16-bit type (CAST to f16/bf16 inside a kernel)
KZ float kz_round_f16(float x) { return __half2float(__float2half_rn(x)); }
KZ float kz_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// -- elementwise helpers ---------------------------------------------------------------------------------
KZ float kz_abs(float x) { return fabsf(x); }
KZ double kz_abs(double x) { return fabs(x); }
template <class T> KZ T kz_abs(T x) { return x < 0 ? (T)-x : x; }
KZ float kz_exp(float x) { return expf(x); }
KZ double kz_exp(double x) { return exp(x); }
KZ float kz_log(float x) { return logf(x); }
KZ double kz_log(double x) { return log(x); }
KZ float kz_sqrt(float x) { return sqrtf(x); }
KZ double kz_sqrt(double x) { return sqrt(x); }
KZ float kz_rsqrt(float x) { return 1.0f / sqrtf(x); }  // correctly rounded, unlike rsqrtf's 2 ulp
KZ double kz_rsqrt(double x) { return 1.0 / sqrt(x); }
KZ float kz_sin(float x) { return sinf(x); }
KZ double kz_sin(double x) { return sin(x); }
KZ float kz_cos(float x) { return cosf(x); }
KZ double kz_cos(double x) { return cos(x); }
KZ float kz_tanh(float x) { return tanhf(x); }
KZ double kz_tanh(double x) { return tanh(x); }
KZ float kz_erf(float x) { return erff(x); }
KZ double kz_erf(double x) { return erf(x); }
KZ float kz_floor(float x) { return floorf(x); }
KZ double kz_floor(double x) { return floor(x); }
KZ float kz_ceil(float x) { return ceilf(x); }
KZ double kz_ceil(double x) { return ceil(x); }
KZ float kz_round(float x) { return rintf(x); }  // half to even, like torch.round
KZ double kz_round(double x) { return rint(x); }
template <class T> KZ T kz_sigmoid(T x) { return (T)1 / ((T)1 + kz_exp(-x)); }
// torch softplus (beta=1, threshold=20): x above the threshold passes through
template <class T> KZ T kz_softplus(T x) { return x > (T)20 ? x : (T)log1p((double)kz_exp(x)); }
KZ float kz_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
template <class T> KZ T kz_gelu(T x) { return (T)0.5 * x * ((T)1 + kz_erf(x * (T)0.7071067811865476)); }
template <class T> KZ T kz_gelu_tanh(T x) {
  return (T)0.5 * x * ((T)1 + kz_tanh((T)0.7978845608028654 * (x + (T)0.044715 * x * x * x)));
}
template <class T> KZ T kz_sign(T x) { return (T)((x > (T)0) - (x < (T)0)); }  // sign(nan) = 0 like torch
template <class T> KZ T kz_min(T a, T b) { return a != a ? a : b != b ? b : (b < a ? b : a); }
template <class T> KZ T kz_max(T a, T b) { return a != a ? a : b != b ? b : (b > a ? b : a); }
template <class T> KZ T kz_clamp(T x, T lo, T hi) { return kz_min(kz_max(x, lo), hi); }
template <class T> KZ T kz_idiv(T a, T b) { return a / b; }  // C division truncates, like the reference
template <class T> KZ T kz_imod(T a, T b) {
  T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
KZ float kz_fmod(float a, float b) { return fmodf(a, b); }
KZ double kz_fmod(double a, double b) { return fmod(a, b); }
KZ float kz_pow(float a, float b) { return powf(a, b); }
KZ double kz_pow(double a, double b) { return pow(a, b); }
template <class T> KZ T kz_pow(T a, T b) {  // integers: exact repeated squaring
  T r = 1;
  for (; b > 0; b >>= 1, a *= a)
    if (b & 1) r *= a;
  return r;
}
// gather: a negative index wraps once; one still out of range reads element 0 (never outside the table)
// and sets the kernel's error flag, which the launcher asserts is 0 afterwards (as the CPU kernels raise)
template <class T> KZ long long kz_wrap(T i, long long size, int* err) {
  const long long j = i < 0 ? (long long)i + size : (long long)i;
  if (j >= 0 && j < size) return j;
  *err = 1;
  return 0;
}

// -- row accumulators: init / add / combine / shfl, reduced across a block by kz_block_reduce ---------------
// All are plain aggregates so they can live in __shared__ memory; shfl(o) is the state of lane (lane ^ o).
KZ float kz_shfl(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
KZ double kz_shfl(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
KZ long long kz_shfl(long long v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
template <class T> KZ T kz_shfl(T v, int o) { return (T)__shfl_xor_sync(0xffffffffu, (int)v, o); }
template <class T> struct KzSum {
  T v;
  static KZ KzSum init() { return {(T)0}; }
  KZ KzSum add(T x) const { return {(T)(v + x)}; }
  static KZ KzSum combine(KzSum a, KzSum b) { return {(T)(a.v + b.v)}; }
  KZ KzSum shfl(int o) const { return {kz_shfl(v, o)}; }
};
template <class T> struct KzProd {
  T v;
  static KZ KzProd init() { return {(T)1}; }
  KZ KzProd add(T x) const { return {(T)(v * x)}; }
  static KZ KzProd combine(KzProd a, KzProd b) { return {(T)(a.v * b.v)}; }
  KZ KzProd shfl(int o) const { return {kz_shfl(v, o)}; }
};
template <class T, bool MAX> struct KzExt {  // max / min with NaN propagation; `any` marks a non-empty state
  T v;
  bool any;
  static KZ KzExt init() { return {(T)0, false}; }
  KZ KzExt add(T x) const { return combine(*this, {x, true}); }
  static KZ KzExt combine(KzExt a, KzExt b) {
    if (!a.any) return b;
    if (!b.any) return a;
    return {MAX ? kz_max(a.v, b.v) : kz_min(a.v, b.v), true};
  }
  KZ KzExt shfl(int o) const { return {kz_shfl(v, o), kz_shfl(any, o)}; }
};
template <class T, bool MAX> struct KzArg {  // argmax / argmin: first index of the extreme (NaN counts as extreme)
  T v;
  long long i;
  static KZ KzArg init() { return {(T)0, -1}; }
  KZ KzArg add(T x, long long j) const { return combine(*this, {x, j}); }
  static KZ KzArg combine(KzArg a, KzArg b) {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    bool an = a.v != a.v, bn = b.v != b.v;
    if (an || bn) return (bn && (!an || b.i < a.i)) ? b : a;
    bool better = MAX ? b.v > a.v : b.v < a.v;
    return (better || (b.v == a.v && b.i < a.i)) ? b : a;
  }
  KZ KzArg shfl(int o) const { return {kz_shfl(v, o), kz_shfl(i, o)}; }
};
// online softmax: running max m and sum s of exp(x - m), merged by rescaling (one pass over the row)
template <class T> struct KzSoftmax {
  T m, s;
  static KZ KzSoftmax init() { return {(T)-INFINITY, (T)0}; }
  KZ KzSoftmax add(T x) const { return combine(*this, {x, (T)1}); }
  static KZ KzSoftmax combine(KzSoftmax a, KzSoftmax b) {
    T m = kz_max(a.m, b.m);
    if (m == (T)-INFINITY) return {m, a.s + b.s};
    return {m, a.s * kz_exp(a.m - m) + b.s * kz_exp(b.m - m)};
  }
  KZ KzSoftmax shfl(int o) const { return {kz_shfl(m, o), kz_shfl(s, o)}; }
};
// Welford mean / M2 with Chan's merge (layernorm statistics in one pass, no cancellation)
template <class T> struct KzWelford {
  T n, mean, m2;
  static KZ KzWelford init() { return {(T)0, (T)0, (T)0}; }
  KZ KzWelford add(T x) const {
    T n1 = n + (T)1, d = x - mean, mean1 = mean + d / n1;
    return {n1, mean1, m2 + d * (x - mean1)};
  }
  static KZ KzWelford combine(KzWelford a, KzWelford b) {
    if (b.n == (T)0) return a;
    if (a.n == (T)0) return b;
    T n = a.n + b.n, d = b.mean - a.mean;
    return {n, a.mean + d * (b.n / n), a.m2 + b.m2 + d * d * (a.n * b.n / n)};
  }
  KZ KzWelford shfl(int o) const { return {kz_shfl(n, o), kz_shfl(mean, o), kz_shfl(m2, o)}; }
};

// Block reduction: butterfly shuffles inside each warp, one partial per warp through shared memory, then
// every warp reduces the partials again so every thread gets the total. blockDim.x is a multiple of 32
// (<= KZ_BLOCK <= 1024) and every thread of the block must call it.
template <class A> KZ A kz_warp_reduce(A a) {
  for (int o = 16; o > 0; o >>= 1) a = A::combine(a, a.shfl(o));
  return a;
}
template <class A> KZ A kz_block_reduce(A a) {
  __shared__ A kz_warps[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  a = kz_warp_reduce(a);
  if (lane == 0) kz_warps[warp] = a;
  __syncthreads();
  a = kz_warp_reduce(lane < (blockDim.x >> 5) ? kz_warps[lane] : A::init());
  __syncthreads();  // kz_warps is reused by the next reduction
  return a;
}

// one warp's max / sum of a float, every lane gets it (attention's online softmax, the router's row)
KZ float kz_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

KZ float kz_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
