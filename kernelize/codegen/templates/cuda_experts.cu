// kernelize grouped-expert kernels: $KERNEL$
// Routed mixture-of-experts MLPs (kernelize.ir.experts). The launcher sorts the (token, slot) pairs by
// expert and pads each expert's segment to whole blocks of KZ_BM rows (ids: the pair of each sorted row, S
// for padding; bexp: the expert of each block, E for a block without work). Two grouped GEMMs, a block per
// (KZ_BM sorted pairs, KZ_BN columns), shared-memory tiles over KZ_BK-long steps, f32 accumulation:
//   $NAME$_up:   h[row] = glu(x[tok] @ gate[e]^T + bg, x[tok] @ up[e]^T + bu)   (the token's row of x gathered)
//   $NAME$_down: y[pair] = w[pair] * (h[row] @ down[e]^T + bd)                 (per pair; the launcher sums over K)
// glu(g, u) = act(g) * u or a clamped form (kernelize.ir.ops.ExpertsArgs); gate row n of `up` is GS * n, up
// row n is UOFF + GS * n (concatenated or interleaved); the biases are optional (BIAS).
// Thread (tx, ty) of a block owns column tx of rows ty, ty + 8, ty + 16, ty + 24. Every output element has
// one writer (no atomics), so the result does not depend on the schedule.
$PRELUDE$
#define KZ_BM 32
#define KZ_BN 32
#define KZ_BK 32
#define KZ_THREADS 256
#define KZ_RPT (KZ_BM * KZ_BN / KZ_THREADS)  // rows per thread
typedef $T$ kz_t;    // x, up, down storage
typedef $TW$ kz_tw;  // routing weight storage
constexpr int64_t H = $H$, I = $I$, K = $K$, E = $E$;  // E itself: the sentinel expert
constexpr bool GATED = $GATED$, BIAS = $BIAS$;
constexpr int64_t GS = $INTERLEAVED$ ? 2 : 1, UOFF = $INTERLEAVED$ ? 1 : I;
KZ float kz_act(float v) { return $ACT$; }
KZ float kz_glu(float g, float u) { $GLU$ }

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_up(
    const kz_t* __restrict__ x, const kz_t* __restrict__ up, float* __restrict__ h, const int* __restrict__ ids,
    const int* __restrict__ bexp, const kz_t* __restrict__ ub, int64_t S, int64_t sxt, int64_t sxh, int64_t sue,
    int64_t sun, int64_t suh, int64_t sbe, int64_t sbn) {
  __shared__ float xs[KZ_BM][KZ_BK + 1];  // +1: the column reads of a warp fall in distinct banks
  __shared__ float gs[KZ_BK][KZ_BN + 1];
  __shared__ float us[KZ_BK][KZ_BN + 1];
  __shared__ int64_t toks[KZ_BM];
  const int tid = threadIdx.x, tx = tid % KZ_BN, ty = tid / KZ_BN;
  const int64_t e = bexp[blockIdx.x];
  if (e >= E) return;  // the whole block: past the real blocks, or the sentinel's
  const int64_t row0 = (int64_t)blockIdx.x * KZ_BM, n0 = (int64_t)blockIdx.y * KZ_BN;
  if (tid < KZ_BM) {
    const int64_t p = ids[row0 + tid];
    toks[tid] = p < S ? p / K : -1;
  }
  __syncthreads();
  const kz_t* w = up + e * sue;
  float ag[KZ_RPT], au[KZ_RPT];
  for (int j = 0; j < KZ_RPT; ++j) ag[j] = au[j] = 0.0f;
  for (int64_t k0 = 0; k0 < H; k0 += KZ_BK) {
    for (int l = tid; l < KZ_BM * KZ_BK; l += KZ_THREADS) {  // the pairs' rows of x, hidden index fastest
      const int r = l / KZ_BK, kk = l % KZ_BK;
      const int64_t t = toks[r];
      xs[r][kk] = t >= 0 && k0 + kk < H ? kz_ld(x[t * sxt + (k0 + kk) * sxh]) : 0.0f;
    }
    for (int l = tid; l < KZ_BN * KZ_BK; l += KZ_THREADS) {  // the gate (and up) rows n0.., coalesced along H
      const int c = l / KZ_BK, kk = l % KZ_BK;
      const int64_t n = n0 + c;
      const bool ok = n < I && k0 + kk < H;
      gs[kk][c] = ok ? kz_ld(w[GS * n * sun + (k0 + kk) * suh]) : 0.0f;
      if (GATED) us[kk][c] = ok ? kz_ld(w[(UOFF + GS * n) * sun + (k0 + kk) * suh]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < KZ_BK; ++kk) {
      const float g = gs[kk][tx], u = GATED ? us[kk][tx] : 0.0f;
      for (int j = 0; j < KZ_RPT; ++j) {
        const float a = xs[ty + j * (KZ_THREADS / KZ_BN)][kk];
        ag[j] += a * g;
        if (GATED) au[j] += a * u;
      }
    }
    __syncthreads();
  }
  const int64_t n = n0 + tx;
  if (n >= I) return;
  for (int j = 0; j < KZ_RPT; ++j) {
    const int r = ty + j * (KZ_THREADS / KZ_BN);
    if (toks[r] < 0) continue;
    const float g = ag[j] + (BIAS ? kz_ld(ub[e * sbe + GS * n * sbn]) : 0.0f);
    const float u = au[j] + (BIAS && GATED ? kz_ld(ub[e * sbe + (UOFF + GS * n) * sbn]) : 0.0f);
    h[(row0 + r) * I + n] = GATED ? kz_glu(g, u) : kz_act(g);
  }
}

extern "C" __global__ void __launch_bounds__(KZ_THREADS) $NAME$_down(
    const float* __restrict__ h, const kz_t* __restrict__ down, const kz_tw* __restrict__ wt, float* __restrict__ y,
    const int* __restrict__ ids, const int* __restrict__ bexp, const kz_t* __restrict__ db, int64_t S, int64_t swt,
    int64_t swk, int64_t sde, int64_t sdn, int64_t sdi, int64_t sbe, int64_t sbn) {
  __shared__ float hs[KZ_BM][KZ_BK + 1];
  __shared__ float ds[KZ_BK][KZ_BN + 1];
  __shared__ int64_t pairs[KZ_BM];
  const int tid = threadIdx.x, tx = tid % KZ_BN, ty = tid / KZ_BN;
  const int64_t e = bexp[blockIdx.x];
  if (e >= E) return;
  const int64_t row0 = (int64_t)blockIdx.x * KZ_BM, n0 = (int64_t)blockIdx.y * KZ_BN;
  if (tid < KZ_BM) {
    const int64_t p = ids[row0 + tid];
    pairs[tid] = p < S ? p : -1;
  }
  __syncthreads();
  const kz_t* w = down + e * sde;
  float acc[KZ_RPT];
  for (int j = 0; j < KZ_RPT; ++j) acc[j] = 0.0f;
  for (int64_t k0 = 0; k0 < I; k0 += KZ_BK) {
    for (int l = tid; l < KZ_BM * KZ_BK; l += KZ_THREADS) {
      const int r = l / KZ_BK, kk = l % KZ_BK;
      hs[r][kk] = pairs[r] >= 0 && k0 + kk < I ? h[(row0 + r) * I + k0 + kk] : 0.0f;
    }
    for (int l = tid; l < KZ_BN * KZ_BK; l += KZ_THREADS) {  // rows n0.. of down, coalesced along I
      const int c = l / KZ_BK, kk = l % KZ_BK;
      const int64_t n = n0 + c;
      ds[kk][c] = n < H && k0 + kk < I ? kz_ld(w[n * sdn + (k0 + kk) * sdi]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < KZ_BK; ++kk) {
      const float d = ds[kk][tx];
      for (int j = 0; j < KZ_RPT; ++j) acc[j] += hs[ty + j * (KZ_THREADS / KZ_BN)][kk] * d;
    }
    __syncthreads();
  }
  const int64_t n = n0 + tx;
  if (n >= H) return;
  for (int j = 0; j < KZ_RPT; ++j) {  // the routing weight, in the epilogue
    const int64_t p = pairs[ty + j * (KZ_THREADS / KZ_BN)];
    const float b = BIAS ? kz_ld(db[e * sbe + n * sbn]) : 0.0f;
    if (p >= 0) y[p * H + n] = (float)kz_ld(wt[(p / K) * swt + (p % K) * swk]) * (acc[j] + b);
  }
}
