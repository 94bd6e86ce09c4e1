$PRELUDE$
// kernelize CPU few-row matmul over packed weights (kernelize/quant/kernels.py fills $FORMAT$):
//     y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),  W stored as q8_0 / q4_0 blocks or int8 rows
// the llama.cpp way. Decode is bound by the weight bytes, so the weights are never widened in memory: the
// few rows of x are quantized once per call into blocks of 32 int8 values with an f32 scale (round to
// nearest even, d = max|x| / 127), and each block of W meets them in an integer dot product (AVX2: |w| times
// x with w's sign, vpmaddubsw to i16 pairs, vpmaddwd to i32), converted to f32 and scaled by the product of
// the two blocks' scales. Threads split the output columns N; each reads its weight rows once, NB rows side
// by side, every row of x against each block while it is in registers.
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
// KZ_QUANT_PORTABLE: the scalar code even where AVX2 is there (tests build it to check the fallback)
#if defined(__AVX2__) && !defined(KZ_QUANT_PORTABLE)
#define KZ_QAVX2 1
#else
#define KZ_QAVX2 0
#endif

#define KZ_QK 32
KZ_INLINE float kz_h2f(const uint8_t* p) {  // an unaligned f16 scale
    kz_f16 h;
    memcpy(&h.u, p, 2);
#if defined(__F16C__)  // one instruction; the bit-trick conversion cost ~40% of a q8_0 block's time
    return _cvtsh_ss(h.u);
#else
    return kz_f16_to_f32(h);
#endif
}

// ---- the formats: a block's bytes, its scale, its 32 values as int8 ------------------------------------
// (row_bytes: a stored row of K elements; row_scale: the per-row factor, 1 when the scales are per block)
// OFFSET: the AVX2 load returns the stored unsigned values u and the value is u - OFFSET (q4_0: 8), so the
// dot product is u . x - OFFSET * sum(x): vpmaddubsw takes u as it is, no sign fix-ups per column
struct kz_q8_0 {
    static constexpr int64_t BYTES = 2 + KZ_QK;
    static constexpr int OFFSET = 0;
    KZ_INLINE float scale(const uint8_t* b) { return kz_h2f(b); }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) { memcpy(q, b + 2, KZ_QK); }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
#endif
};
struct kz_q4_0 {
    static constexpr int64_t BYTES = 2 + KZ_QK / 2;
    static constexpr int OFFSET = 8;
    KZ_INLINE float scale(const uint8_t* b) { return kz_h2f(b); }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) {
        for (int i = 0; i < KZ_QK / 2; ++i) {
            q[i] = (int8_t)((b[2 + i] & 15) - 8);
            q[i + KZ_QK / 2] = (int8_t)((b[2 + i] >> 4) - 8);
        }
    }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b) {  // low nibbles are elements 0..15, high nibbles 16..31
        const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 2));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_and_si256(both, _mm256_set1_epi8(15));  // unsigned: OFFSET is subtracted in the dot
    }
#endif
};
struct kz_int8 {  // per-row scales: a "block" is 32 int8 values and its scale is 1
    static constexpr int64_t BYTES = KZ_QK;
    static constexpr int OFFSET = 0;
    KZ_INLINE float scale(const uint8_t*) { return 1.0f; }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) { memcpy(q, b, KZ_QK); }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)b); }
#endif
};
typedef $FORMAT$ kz_fmt;

// ---- the activations: rows of x as int8 blocks and f32 scales ------------------------------------------
template <class XT>
static void kz_quantize_rows(const XT* x, int64_t m, int64_t k, int8_t* xq, float* xd) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < k / KZ_QK; ++b) {
            const XT* src = x + r * k + b * KZ_QK;
            float v[KZ_QK], amax = 0.0f;
            for (int i = 0; i < KZ_QK; ++i) {
                v[i] = kz_ld(src, i);
                const float a = fabsf(v[i]);  // not fmaxf: aarch64 gcc 12's vectoriser crashes on it here
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int i = 0; i < KZ_QK; ++i) xq[r * k + b * KZ_QK + i] = (int8_t)rintf(v[i] * id);
            xd[r * (k / KZ_QK) + b] = d;
        }
}

// ---- MB rows of x against NB weight rows (w[j]: row j's first block), over all nb blocks -----------------
#if KZ_QAVX2
KZ_INLINE float kz_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
template <int MB, int NB>
KZ_INLINE void kz_qdot(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, int64_t k,
                       float* out, int64_t ldo, const char* pf) {
    kz_fmt f;
    __m256 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        if (pf)  // the next column block's bytes, as fast as this one's are read
            for (int64_t o = 0; o < NB * kz_fmt::BYTES; o += 64) __builtin_prefetch(pf + b * NB * kz_fmt::BYTES + o, 0, 2);
        __m256i wv[NB], wa[NB];
        float ws[NB];
        for (int j = 0; j < NB; ++j) {
            const uint8_t* blk = w[j] + b * kz_fmt::BYTES;
            wv[j] = f.load(blk);
            if constexpr (!kz_fmt::OFFSET) wa[j] = _mm256_sign_epi8(wv[j], wv[j]);  // |w|: vpmaddubsw's unsigned operand
            ws[j] = f.scale(blk);
        }
        for (int m = 0; m < MB; ++m) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * k + b * KZ_QK));
            const float s = xd[m * nb + b];
            __m256i xo;  // OFFSET * (x[2i] + x[2i+1]), what the offset takes off each pair
            if constexpr (kz_fmt::OFFSET) xo = _mm256_maddubs_epi16(_mm256_set1_epi8(kz_fmt::OFFSET), xv);
            for (int j = 0; j < NB; ++j) {
                const __m256i p16 = kz_fmt::OFFSET
                    ? _mm256_sub_epi16(_mm256_maddubs_epi16(wv[j], xv), xo)
                    : _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j]));
                const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[m][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(ws[j] * s), acc[m][j]);
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) out[m * ldo + j] = kz_hsum8(acc[m][j]);
}
#else
template <int MB, int NB>
KZ_INLINE void kz_qdot(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, int64_t k,
                       float* out, int64_t ldo, const char* pf) {
    kz_fmt f;
    float acc[MB][NB] = {};
    int8_t q[KZ_QK];
    for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < NB; ++j) {
            const uint8_t* blk = w[j] + b * kz_fmt::BYTES;
            f.values(blk, q);
            const float ws = f.scale(blk);
            for (int m = 0; m < MB; ++m) {
                const int8_t* xb = xq + m * k + b * KZ_QK;
                int32_t s = 0;
                for (int i = 0; i < KZ_QK; ++i) s += (int32_t)q[i] * xb[i];
                acc[m][j] += (float)s * (ws * xd[m * nb + b]);
            }
        }
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) out[m * ldo + j] = acc[m][j];
}
#endif

#ifndef KZ_PREFETCH
#define KZ_PREFETCH 1
#endif
#define KZ_QNB 4  // weight rows read side by side
// columns [c0, c0 + cn) (cn <= KZ_QNB) for every row of x; a short block repeats its last column.
// The block's KZ_QNB rows are one contiguous run of bytes, and so is the next block's (`pf`, null at the
// end of a thread's range). A q4_0 row of K = 4096 is 2304 bytes: NB rows side by side are NB streams that
// each end before the hardware prefetcher gets ahead, so the first pass over a block prefetches the next
// one into L2 (measured: see benchmarks/quantized.py).
static void kz_qcols(const uint8_t* w, int64_t rb, int64_t c0, int64_t cn, int64_t nb, int64_t m,
                     const int8_t* xq, const float* xd, int64_t k, float* out, const char* pf) {
    const uint8_t* wr[KZ_QNB];
    for (int j = 0; j < KZ_QNB; ++j) wr[j] = w + (c0 + (j < cn ? j : cn - 1)) * rb;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {  // 4 rows x 2 columns: 8 accumulators, as 2 x 4 (the second reads cache)
        kz_qdot<4, 2>(wr, nb, xq + r * k, xd + r * nb, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
        kz_qdot<4, 2>(wr + 2, nb, xq + r * k, xd + r * nb, k, out + r * KZ_QNB + 2, KZ_QNB, r || !pf ? 0 : pf + KZ_QNB / 2 * rb);
    }
    for (; r + 2 <= m; r += 2)
        kz_qdot<2, KZ_QNB>(wr, nb, xq + r * k, xd + r * nb, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
    for (; r < m; ++r) kz_qdot<1, KZ_QNB>(wr, nb, xq + r * k, xd + r * nb, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
}

template <class OT>
static int kz_qgemv(const int8_t* xq, const float* xd, int64_t m, int64_t k, const uint8_t* w,
                    const float* wscale, int64_t n, const float* bias, OT* y, int nthreads) {
    const int64_t nb = k / KZ_QK, rb = nb * kz_fmt::BYTES, nblk = (n + KZ_QNB - 1) / KZ_QNB;
    const kz_team_t tm = kz_team_open(nthreads, m * n * k >= 32768);
    return kz_parallel_for(tm, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(nblk, t, tn, lo, hi);
        float blk[8 * KZ_QNB];
        for (int64_t c = lo; c < hi; ++c) {
            const int64_t c0 = c * KZ_QNB, cn = n - c0 < KZ_QNB ? n - c0 : KZ_QNB;
            for (int64_t r0 = 0; r0 < m; r0 += 8) {
                const int64_t mr = m - r0 < 8 ? m - r0 : 8;
                const char* pf = r0 == 0 && c + 1 < hi && KZ_PREFETCH ? (const char*)(w + (c0 + KZ_QNB) * rb) : 0;
                kz_qcols(w, rb, c0, cn, nb, mr, xq + r0 * k, xd + r0 * nb, k, blk, pf);
                for (int64_t r = 0; r < mr; ++r)
                    for (int64_t j = 0; j < cn; ++j) {
                        float v = blk[r * KZ_QNB + j];
                        if (wscale) v *= wscale[c0 + j];
                        if (bias) v += bias[c0 + j];
                        kz_st(y, (r0 + r) * n + c0 + j, v);
                    }
            }
        }
        return 0;
    });
}

// x [m, k] (XT) times the packed W [n, k]^T into y [m, n] (OT); wscale: int8's row scales, else null
#define KZ_QGEMV_ENTRY(XN, XT, ON, OT)                                                                      \
    extern "C" int $NAME$_##XN##_##ON(const XT* x, int64_t m, int64_t k, const uint8_t* w,                  \
                                      const float* wscale, int64_t n, const float* bias, OT* y, int nthreads) { \
        int8_t* xq = kz_scratch<int8_t>(0, m * k);                                                         \
        float* xd = kz_scratch<float>(1, m * (k / KZ_QK));                                                 \
        kz_quantize_rows(x, m, k, xq, xd);                                                                 \
        return kz_qgemv(xq, xd, m, k, w, wscale, n, bias, y, nthreads);                                    \
    }
KZ_QGEMV_ENTRY(f32, float, f32, float)
KZ_QGEMV_ENTRY(f32, float, bf16, kz_bf16)
KZ_QGEMV_ENTRY(bf16, kz_bf16, f32, float)
KZ_QGEMV_ENTRY(bf16, kz_bf16, bf16, kz_bf16)

// the quantized activations as the kernel sees them (for tests): xq [m, k] int8, xd [m, k / 32]
extern "C" void $NAME$_quantize_x(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd) {
    kz_quantize_rows(x, m, k, xq, xd);
}

// rows [n0, n1) of W as f32 into out [n1 - n0, k] (prefill: a panel of the weight for a library GEMM)
extern "C" int $NAME$_dequant(const uint8_t* w, const float* wscale, int64_t n0, int64_t n1, int64_t k,
                              float* out, int nthreads) {
    const int64_t nb = k / KZ_QK, rb = nb * kz_fmt::BYTES;
    return kz_parallel_for(kz_team_open(nthreads, (n1 - n0) * k >= 32768), [=](int t, int tn) KZ_BODY {
        kz_fmt f;
        int64_t lo, hi;
        kz_range(n1 - n0, t, tn, lo, hi);
        int8_t q[KZ_QK];
        for (int64_t r = lo; r < hi; ++r) {
            const float rs = wscale ? wscale[n0 + r] : 1.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = w + (n0 + r) * rb + b * kz_fmt::BYTES;
                f.values(blk, q);
                const float s = f.scale(blk) * rs;
                for (int i = 0; i < KZ_QK; ++i) out[r * k + b * KZ_QK + i] = (float)q[i] * s;
            }
        }
        return 0;
    });
}
