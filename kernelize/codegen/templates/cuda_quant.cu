// kernelize packed-weight matmul: $KERNEL$
// out[m, n] = sum_k x[m, k] W[n, k] + bias[n] against a packed $FORMAT$ weight (kernelize.quant.formats): w is
// the weight's raw bytes, uint8 [N, RB] with RB = K / 32 * KZ_BPB; s: int8's f32 row scales (unread by the
// GGUF formats, whose f16 scale leads each block). The weight is dequantized in registers, 8 elements (a
// chunk) at a time, never copied to memory as floats. f32 accumulation; the output in x's dtype.
//   $NAME$_gemv: up to KZ_MT rows (decode); a warp per output column, its lanes over the row's chunks (a
//                warp step reads 8 consecutive blocks of the row), then a butterfly sum across the warp.
//   $NAME$_mm:   KZ_BM x KZ_BN output tiles (prefill), shared-memory tiles of KZ_BK along K, the weight tile
//                filled by one chunk per thread; thread (tx, ty) owns column tx of rows ty, ty + 8, ...
// Every output element has one writer (no atomics).
$PRELUDE$
#define KZ_BPB $BPB$
#define KZ_THREADS 256
#define KZ_WARPS (KZ_THREADS / 32)
#define KZ_MT 8
#define KZ_BM 32
#define KZ_BN 32
#define KZ_BK 64
#define KZ_RPT (KZ_BM * KZ_BN / KZ_THREADS)  // rows per thread in _mm
typedef $T$ kz_t;  // x and out storage

// the little-endian f16 at p (any alignment), as f32
KZ float kz_f16_at(const uint8_t* p) { return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8)))); }

// elements 8c .. 8c + 7 of row n, dequantized into v
KZ void kz_chunk(const uint8_t* __restrict__ w, const float* __restrict__ s, int64_t n, int64_t rb, int64_t c,
                 float v[8]) {
$CHUNK$
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_gemv(
    const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = (int64_t)blockIdx.x * KZ_WARPS + warp, m0 = (int64_t)blockIdx.y * KZ_MT;
  const int64_t rb = K / 32 * KZ_BPB, chunks = K / 8;
  float acc[KZ_MT];
  for (int r = 0; r < KZ_MT; ++r) acc[r] = 0.0f;
  if (n < N) {
    for (int64_t c = lane; c < chunks; c += 32) {
      float v[8];
      kz_chunk(w, s, n, rb, c, v);
      for (int r = 0; r < KZ_MT; ++r) {
        if (m0 + r >= M) break;
        const kz_t* xr = x + (m0 + r) * K + c * 8;
        float t = 0.0f;
        for (int j = 0; j < 8; ++j) t += kz_ld(xr[j]) * v[j];
        acc[r] += t;
      }
    }
  }
  for (int r = 0; r < KZ_MT; ++r)  // every lane of every warp takes part (no early return above)
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  if (n >= N || lane != 0) return;
  const float b = bias ? bias[n] : 0.0f;
  for (int r = 0; r < KZ_MT; ++r)
    if (m0 + r < M) out[(m0 + r) * N + n] = kz_cvt<kz_t>(acc[r] + b);
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_mm(
    const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  __shared__ float xs[KZ_BM][KZ_BK + 1];  // +1: the column reads of a warp fall in distinct banks
  __shared__ float ws[KZ_BK][KZ_BN + 1];
  const int tid = threadIdx.x, tx = tid % KZ_BN, ty = tid / KZ_BN;
  const int64_t m0 = (int64_t)blockIdx.y * KZ_BM, n0 = (int64_t)blockIdx.x * KZ_BN;
  const int64_t rb = K / 32 * KZ_BPB, chunks = K / 8;
  float acc[KZ_RPT];
  for (int j = 0; j < KZ_RPT; ++j) acc[j] = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += KZ_BK) {
    for (int l = tid; l < KZ_BM * KZ_BK; l += KZ_THREADS) {  // rows m0.. of x, K fastest
      const int r = l / KZ_BK, kk = l % KZ_BK;
      xs[r][kk] = m0 + r < M && k0 + kk < K ? kz_ld(x[(m0 + r) * K + k0 + kk]) : 0.0f;
    }
    for (int l = tid; l < KZ_BN * (KZ_BK / 8); l += KZ_THREADS) {  // one chunk of one weight row per thread
      const int col = l / (KZ_BK / 8), ch = l % (KZ_BK / 8);
      const int64_t n = n0 + col, c = k0 / 8 + ch;
      float v[8];
      if (n < N && c < chunks) {
        kz_chunk(w, s, n, rb, c, v);
      } else {
        for (int j = 0; j < 8; ++j) v[j] = 0.0f;
      }
      for (int j = 0; j < 8; ++j) ws[ch * 8 + j][col] = v[j];
    }
    __syncthreads();
    for (int kk = 0; kk < KZ_BK; ++kk) {
      const float wv = ws[kk][tx];
      for (int j = 0; j < KZ_RPT; ++j) acc[j] += xs[ty + j * (KZ_THREADS / KZ_BN)][kk] * wv;
    }
    __syncthreads();
  }
  const int64_t n = n0 + tx;
  if (n >= N) return;
  const float b = bias ? bias[n] : 0.0f;
  for (int j = 0; j < KZ_RPT; ++j) {
    const int64_t m = m0 + ty + j * (KZ_THREADS / KZ_BN);
    if (m < M) out[m * N + n] = kz_cvt<kz_t>(acc[j] + b);
  }
}
