// kernelize attention kernel: $KERNEL$
// out = softmax(scale * q @ k^T (+ mask)) @ v with an online softmax: one warp per (query row, batch x head,
// key split). Each step takes 32 keys: lane t computes the score of key t (q in shared memory), the warp
// reduces the step's max and sum with shuffles, and for p @ v lane t owns value columns t, t + 32, ...
// (coalesced reads of v). With several key splits (decode) each writes its (max, sum, accumulator) and
// $NAME$_combine merges them. f32 accumulation; a fully masked row gives zeros.
$PRELUDE$
#define KZ_D $D$
#define KZ_DV $DV$
#define KZ_CAUSAL $CAUSAL$
#define KZ_MASK $MASK$
#define KZ_MOD $HAS_MOD$
#define KZ_SINKS $SINKS$
#define KZ_COLS ((KZ_DV + 31) / 32)
typedef $T$ kz_t;
typedef $TM$ kz_tm;

// the score modification (kernelize.ir.score_mod) of a scaled score: query position (counted among the
// keys), key position, query head
KZ float kz_score_mod(float sm0, int64_t sm1, int64_t sm2, int64_t sm3) {
$SCORE_MOD$
}

extern "C" __global__ void __launch_bounds__(32) $NAME$(
    const kz_t* __restrict__ q, const kz_t* __restrict__ k, const kz_t* __restrict__ v, const kz_tm* __restrict__ m,
    kz_t* __restrict__ o, float* __restrict__ part, const float* __restrict__ sinks, int64_t HQ, int64_t LQ, int64_t LK, int64_t G, int64_t SPLIT_LEN,
    int64_t sqb, int64_t sqh, int64_t sql, int64_t sqd, int64_t skb, int64_t skh, int64_t skl, int64_t skd,
    int64_t svb, int64_t svh, int64_t svl, int64_t svd, int64_t smb, int64_t smh, int64_t sml, int64_t smk) {
  __shared__ float qs[KZ_D];
  __shared__ float ps[32];
  const int lane = threadIdx.x;
  const int64_t i = blockIdx.x, bh = blockIdx.y, sp = blockIdx.z, nsplit = gridDim.z;
  const int64_t b = bh / HQ, h = bh % HQ, hk = h / G;
  const float scale = $SCALE$;
  for (int d = lane; d < KZ_D; d += 32) qs[d] = kz_ld(q[b * sqb + h * sqh + i * sql + d * sqd]) * scale;
  __syncthreads();
  const int64_t lo = sp * SPLIT_LEN;
  int64_t hi = lo + SPLIT_LEN < LK ? lo + SPLIT_LEN : LK;
  if (KZ_CAUSAL) hi = hi < i + 1 ? hi : i + 1;  // top-left aligned: key j <= query i
  const kz_t* kb = k + b * skb + hk * skh;
  const kz_t* vb = v + b * svb + hk * svh;
  // with sinks, the first key split starts from the sink: a key of value zero, exp(sink - mx) = 1
  float mx = KZ_SINKS && sp == 0 ? sinks[h] : -INFINITY, l = KZ_SINKS && sp == 0 ? 1.0f : 0.0f, acc[KZ_COLS];
  for (int c = 0; c < KZ_COLS; ++c) acc[c] = 0.0f;
  for (int64_t j0 = lo; j0 < hi; j0 += 32) {
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j < hi) {
      const kz_t* kr = kb + j * skl;
      float dot = 0.0f;
      for (int d = 0; d < KZ_D; ++d) dot += qs[d] * kz_ld(kr[d * skd]);
      s = dot;
      if (KZ_MOD) s = kz_score_mod(s, i + LK - LQ, j, h);
      if (KZ_MASK == 1 && kz_ld(m[b * smb + h * smh + i * sml + j * smk]) == 0) s = -INFINITY;
      if (KZ_MASK == 2) s += kz_ld(m[b * smb + h * smh + i * sml + j * smk]);
    }
    const float mnew = fmaxf(mx, kz_warp_max(s));
    const float msafe = mnew == -INFINITY ? 0.0f : mnew;  // all masked so far: exp(-inf - 0) = 0
    const float alpha = expf(mx - msafe);
    const float p = expf(s - msafe);
    l = l * alpha + kz_warp_sum(p);
    mx = mnew;
    ps[lane] = p;
    __syncthreads();
    const int nb = hi - j0 < 32 ? (int)(hi - j0) : 32;
    for (int c = 0; c < KZ_COLS; ++c) {
      const int dv = lane + 32 * c;
      float a = acc[c] * alpha;
      if (dv < KZ_DV)
        for (int t = 0; t < nb; ++t) a += ps[t] * kz_ld(vb[(j0 + t) * svl + dv * svd]);
      acc[c] = a;
    }
    __syncthreads();
  }
  if (nsplit == 1) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = 0; c < KZ_COLS; ++c) {
      const int dv = lane + 32 * c;
      if (dv < KZ_DV) o[(bh * LQ + i) * KZ_DV + dv] = kz_cvt<kz_t>(acc[c] * inv);
    }
  } else {
    float* pr = part + ((bh * nsplit + sp) * LQ + i) * (KZ_DV + 2);
    if (lane == 0) pr[0] = mx, pr[1] = l;
    for (int c = 0; c < KZ_COLS; ++c) {
      const int dv = lane + 32 * c;
      if (dv < KZ_DV) pr[2 + dv] = acc[c];
    }
  }
}

// out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the key splits s (M: the largest m_s)
extern "C" __global__ void __launch_bounds__(32) $NAME$_combine(const float* __restrict__ part, kz_t* __restrict__ o,
                                                               int64_t LQ, int64_t NSPLIT) {
  const int lane = threadIdx.x;
  const int64_t i = blockIdx.x, bh = blockIdx.y;
  float mx = -INFINITY;
  for (int64_t s = 0; s < NSPLIT; ++s) mx = fmaxf(mx, part[((bh * NSPLIT + s) * LQ + i) * (KZ_DV + 2)]);
  const float msafe = mx == -INFINITY ? 0.0f : mx;
  float l = 0.0f;
  for (int64_t s = 0; s < NSPLIT; ++s) {
    const float* pr = part + ((bh * NSPLIT + s) * LQ + i) * (KZ_DV + 2);
    l += pr[1] * expf(pr[0] - msafe);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int dv = lane; dv < KZ_DV; dv += 32) {
    float a = 0.0f;
    for (int64_t s = 0; s < NSPLIT; ++s) {
      const float* pr = part + ((bh * NSPLIT + s) * LQ + i) * (KZ_DV + 2);
      a += pr[2 + dv] * expf(pr[0] - msafe);
    }
    o[(bh * LQ + i) * KZ_DV + dv] = kz_cvt<kz_t>(a * inv);
  }
}
