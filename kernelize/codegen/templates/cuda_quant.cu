// kernelize packed-weight matmul: $KERNEL$
// out[m, n] = sum_k x[m, k] W[n, k] + bias[n] against a packed $FORMAT$ weight (kernelize.quant.formats): w is
// the weight's raw bytes, uint8 [N, RB] with RB = K / 32 * KZ_BPB; s: int8's f32 row scales (unread by the
// GGUF formats, whose f16 scale leads each block). The weight is dequantized in registers, 8 elements (a
// chunk) at a time, never copied to memory as floats. f32 accumulation; the output in x's dtype.
//   $NAME$_gemv1 / _gemv4: KZ_MT rows a block (decode); a warp per 1 or 4 output columns, its lanes over the
//                rows' chunks (a warp step reads 8 consecutive blocks of a row), then a butterfly sum across
//                the warp. 4 columns reuse each x value loaded 4 times (more rows); 1 spreads over more warps.
//   $NAME$_mm:   KZ_BM x KZ_BN output tiles (prefill), shared-memory tiles of KZ_BK along K, the weight tile
//                filled by one chunk per thread; each thread owns a KZ_R x KZ_R register tile (f32 FMAs).
// Every output element has one writer (no atomics).
$PRELUDE$
#define KZ_BPB $BPB$
#define KZ_THREADS 256
#define KZ_WARPS (KZ_THREADS / 32)
#define KZ_MT 8
#define KZ_BM 64
#define KZ_BN 64
#define KZ_BK 32
#define KZ_TN 16  // _mm: a 16 x 16 grid of threads, each a KZ_R x KZ_R register tile
#define KZ_R 4
typedef $T$ kz_t;  // x and out storage

// the little-endian f16 at p (any alignment), as f32
KZ float kz_f16_at(const uint8_t* p) { return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8)))); }

// elements 8c .. 8c + 7 of row n, dequantized into v
KZ void kz_chunk(const uint8_t* __restrict__ w, const float* __restrict__ s, int64_t n, int64_t rb, int64_t c,
                 float v[8]) {
$CHUNK$
}

// COLS output columns a warp: the x values a lane loads serve COLS weight rows
template <int COLS>
KZ void kz_gemv(const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
                const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n0 = ((int64_t)blockIdx.x * KZ_WARPS + warp) * COLS, m0 = (int64_t)blockIdx.y * KZ_MT;
  const int64_t rb = K / 32 * KZ_BPB, chunks = K / 8;
  float acc[KZ_MT][COLS];
  for (int r = 0; r < KZ_MT; ++r)
    for (int j = 0; j < COLS; ++j) acc[r][j] = 0.0f;
  for (int64_t c = lane; c < chunks; c += 32) {
    float v[COLS][8];
    for (int j = 0; j < COLS; ++j) {
      if (n0 + j < N) {
        kz_chunk(w, s, n0 + j, rb, c, v[j]);
      } else {
        for (int i = 0; i < 8; ++i) v[j][i] = 0.0f;
      }
    }
    for (int r = 0; r < KZ_MT; ++r) {
      if (m0 + r >= M) break;
      float xv[8];
      for (int i = 0; i < 8; ++i) xv[i] = kz_ld(x[(m0 + r) * K + c * 8 + i]);
      for (int j = 0; j < COLS; ++j) {
        float t = 0.0f;
        for (int i = 0; i < 8; ++i) t += xv[i] * v[j][i];
        acc[r][j] += t;
      }
    }
  }
  for (int r = 0; r < KZ_MT; ++r) {  // every thread of the block takes the same branches (no early return)
    if (m0 + r >= M) break;
    for (int j = 0; j < COLS; ++j)
      for (int o = 16; o > 0; o >>= 1) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], o);
  }
  if (lane != 0) return;
  for (int j = 0; j < COLS; ++j) {
    const int64_t n = n0 + j;
    if (n >= N) break;
    const float b = bias ? bias[n] : 0.0f;
    for (int r = 0; r < KZ_MT; ++r)
      if (m0 + r < M) out[(m0 + r) * N + n] = kz_cvt<kz_t>(acc[r][j] + b);
  }
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_gemv1(
    const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  kz_gemv<1>(x, w, s, bias, out, M, N, K);
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_gemv4(
    const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  kz_gemv<4>(x, w, s, bias, out, M, N, K);
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_mm(
    const kz_t* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ s,
    const float* __restrict__ bias, kz_t* __restrict__ out, int64_t M, int64_t N, int64_t K) {
  __shared__ float xs[KZ_BM][KZ_BK + 1];  // +1: a warp's reads of one k fall in distinct banks
  __shared__ float ws[KZ_BK][KZ_BN + 1];
  const int tid = threadIdx.x, tx = tid % KZ_TN, ty = tid / KZ_TN;
  const int64_t m0 = (int64_t)blockIdx.y * KZ_BM, n0 = (int64_t)blockIdx.x * KZ_BN;
  const int64_t rb = K / 32 * KZ_BPB, chunks = K / 8;
  float acc[KZ_R][KZ_R];
  for (int i = 0; i < KZ_R; ++i)
    for (int j = 0; j < KZ_R; ++j) acc[i][j] = 0.0f;
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
    for (int kk = 0; kk < KZ_BK; ++kk) {  // a KZ_R x KZ_R register tile: rows ty + 16 i, columns tx + 16 j
      float a[KZ_R], b[KZ_R];
      for (int i = 0; i < KZ_R; ++i) a[i] = xs[ty + KZ_TN * i][kk];
      for (int j = 0; j < KZ_R; ++j) b[j] = ws[kk][tx + KZ_TN * j];
      for (int i = 0; i < KZ_R; ++i)
        for (int j = 0; j < KZ_R; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
  for (int j = 0; j < KZ_R; ++j) {
    const int64_t n = n0 + tx + KZ_TN * j;
    if (n >= N) continue;
    const float b = bias ? bias[n] : 0.0f;
    for (int i = 0; i < KZ_R; ++i) {
      const int64_t m = m0 + ty + KZ_TN * i;
      if (m < M) out[m * N + n] = kz_cvt<kz_t>(acc[i][j] + b);
    }
  }
}
