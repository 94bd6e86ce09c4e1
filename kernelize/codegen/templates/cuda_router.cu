$PRELUDE$
// $NAME$: a mixture-of-experts router (kernelize/ir/router.py), one warp per row of $E$ logits (rows
// grid-strided over blocks): lane l holds experts l, l + 32, ...; score ($SCORE$, f32) with warp-wide max and
// sum, the choice key = score + bias, K picks each a warp-wide first-best (the lowest index wins a tie, NaN
// is the largest), the K chosen scores renormalised ($RENORM$) and scaled, weights and int64 indices stored.
#define KZ_E $E$
#define KZ_K $K$
#define KZ_PER ((KZ_E + 31) / 32)
#define KZ_SCORE $SCORE_CODE$
#define KZ_RENORM $RENORM_CODE$
#define KZ_HAS_B $HAS_B$
#define KZ_HAS_W $HAS_W$
#define KZ_HAS_I $HAS_I$
typedef $TX$ kz_tx;
typedef $TB$ kz_tb;
typedef $TW$ kz_tw;

// whether (v, i) beats (bv, bi): a valid index first, NaN largest, then the value, then the lower index
KZ bool kz_route_better(float v, int i, float bv, int bi) {
    if (i < 0 || bi < 0) return bi < 0 && i >= 0;
    bool vn = v != v, bn = bv != bv;
    if (vn != bn) return vn;
    if (!vn && v != bv) return v > bv;
    return i < bi;
}

extern "C" __global__ void __launch_bounds__(32) $NAME$(const kz_tx* __restrict__ x, const kz_tb* __restrict__ b,
        kz_tw* __restrict__ w, int64_t* __restrict__ ix, int64_t rows) {
    const int lane = threadIdx.x;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float s[KZ_PER], c[KZ_PER];
        bool taken[KZ_PER];
        for (int j = 0; j < KZ_PER; ++j) {
            const int e = lane + 32 * j;
            s[j] = e < KZ_E ? kz_ld(x[r * KZ_E + e]) : 0.0f;
            taken[j] = e >= KZ_E;
        }
#if KZ_SCORE == 0
        float m = -INFINITY;
        for (int j = 0; j < KZ_PER; ++j) m = taken[j] ? m : fmaxf(m, s[j]);
        m = kz_warp_max(m);
        float total = 0.0f;
        for (int j = 0; j < KZ_PER; ++j) total += (s[j] = taken[j] ? 0.0f : expf(s[j] - m));
        total = kz_warp_sum(total);
        for (int j = 0; j < KZ_PER; ++j) s[j] = s[j] / total;
#elif KZ_SCORE == 1
        for (int j = 0; j < KZ_PER; ++j) s[j] = 1.0f / (1.0f + expf(-s[j]));
#endif
        for (int j = 0; j < KZ_PER; ++j) {
            const int e = lane + 32 * j;
            c[j] = KZ_HAS_B && e < KZ_E ? s[j] + kz_ld(b[e]) : s[j];
        }
        float kw[KZ_K];
        int ki[KZ_K];
        for (int k = 0; k < KZ_K; ++k) {
            float bv = 0.0f, sv = 0.0f;
            int bi = -1;
            for (int j = 0; j < KZ_PER; ++j)
                if (!taken[j] && kz_route_better(c[j], lane + 32 * j, bv, bi)) bv = c[j], bi = lane + 32 * j, sv = s[j];
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o), os = __shfl_xor_sync(0xffffffffu, sv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (kz_route_better(ov, oi, bv, bi)) bv = ov, bi = oi, sv = os;
            }
            if (bi % 32 == lane) taken[bi / 32] = true;
            kw[k] = sv;
            ki[k] = bi;
        }
#if KZ_RENORM == 1
        float sum = 0.0f;
        for (int k = 0; k < KZ_K; ++k) sum += kw[k];
        for (int k = 0; k < KZ_K; ++k) kw[k] = kw[k] / (sum + $EPS$);
#elif KZ_RENORM == 2
        float wm = kw[0];
        for (int k = 1; k < KZ_K; ++k) wm = kw[k] > wm || kw[k] != kw[k] ? kw[k] : wm;
        float ws = 0.0f;
        for (int k = 0; k < KZ_K; ++k) ws += (kw[k] = expf(kw[k] - wm));
        for (int k = 0; k < KZ_K; ++k) kw[k] = kw[k] / ws;
#endif
        for (int k = 0; k < KZ_K; ++k) {
            if (k % 32 != lane) continue;
            if (KZ_HAS_W) w[r * KZ_K + k] = kz_cvt<kz_tw>(kw[k] * $SCALE$);
            if (KZ_HAS_I) ix[r * KZ_K + k] = ki[k];
        }
    }
}
