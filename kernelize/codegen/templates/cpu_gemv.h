// kernelize CPU few-row matmul helpers: out[r][j] = sum_k x[r][k] * W_j[k] for a handful of rows r, read
// through GCC vector extensions (AVX2 / AVX-512 / NEON from one source). Decode is bound by the bytes of
// the weights, so every weight element is read from memory once: rows are blocked two at a time over a
// block of NB weight columns (the block, NB * K elements, stays in L1/L2 while the next rows reuse it), and
// 16-bit weights are widened to f32 in registers. The activations x are packed once per call into f32 rows.
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>  // else cpu_prelude.h's one-thread stand-ins
#endif

#if defined(__AVX512F__)
#define KZ_VL 16
#else
#define KZ_VL 8
#endif
#define KZ_NB 4      // weight columns per block (dot form)
#define KZ_MAXR 16   // rows per pass over the weights
typedef float kz_vf __attribute__((vector_size(KZ_VL * 4)));
typedef float kz_vfu __attribute__((vector_size(KZ_VL * 4), aligned(4)));
typedef uint16_t kz_vhu __attribute__((vector_size(KZ_VL * 2), aligned(2)));
typedef uint32_t kz_vu __attribute__((vector_size(KZ_VL * 4)));

KZ_INLINE kz_vf kz_vld(const float* p) { return *(const kz_vfu*)p; }
KZ_INLINE kz_vf kz_vld(const kz_bf16* p) {  // bf16 -> f32: zero-extend to 32 bits, shift into the top half
#if defined(__AVX512F__) && KZ_VL == 16
    return (kz_vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(__AVX2__) && KZ_VL == 8
    return (kz_vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
    kz_vu u = __builtin_convertvector(*(const kz_vhu*)p, kz_vu) << 16;
    return (kz_vf)u;
#endif
}
KZ_INLINE kz_vf kz_vld(const kz_f16* p) {
#if defined(__F16C__) && KZ_VL == 8
    return (kz_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX512F__) && KZ_VL == 16
    return (kz_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
    kz_vf v;
    for (int i = 0; i < KZ_VL; ++i) v[i] = kz_f16_to_f32(p[i]);
    return v;
#endif
}
// bf16 pairs without shuffles: a 32-bit lane holds an even (low half) and an odd (high half) bf16 element;
// `<< 16` and `& 0xffff0000` make both f32 in two plain ALU ops (the widening load above costs a shuffle,
// which capped bf16 at ~half the f32 element rate on Zen 3). x is packed to match: in each chunk of
// 2 * KZ_VL elements, the even-indexed elements first, then the odd ones (kz_xpos).
typedef uint32_t kz_vuu __attribute__((vector_size(KZ_VL * 4), aligned(2)));
KZ_INLINE void kz_vld_pairs(const kz_bf16* p, kz_vf* even, kz_vf* odd) {
    const kz_vu u = *(const kz_vuu*)p;
    *even = (kz_vf)(u << 16);
    *odd = (kz_vf)(u & 0xffff0000u);
}
template <bool PAIRS> KZ_INLINE int64_t kz_xpos(int64_t k, int64_t kfull) {
    if (!PAIRS || k >= kfull) return k;
    const int64_t c = k & (2 * KZ_VL - 1);
    return k - c + ((c & 1) ? KZ_VL : 0) + (c >> 1);
}
KZ_INLINE float kz_hsum(kz_vf v) {
    float s = 0.0f;
    for (int i = 0; i < KZ_VL; ++i) s += v[i];
    return s;
}

// MB rows x NB columns, K-contiguous weights (w[j] points at column j's first element), k in [k0, k1):
// out[m * ldo + j] = dot (plus `add` times the old value: 0 overwrites, 1 accumulates)
// `pf` (may be null): the next block's weights, prefetched into L2 at the rate this block consumes its own.
// A block reads NB rows of W side by side; rows of 4 KiB or less (bf16 K <= 2048) each sit in one page and
// the hardware stream prefetcher, which stops at page boundaries, never gets ahead: measured 1.5-2x.
template <int MB, bool PAIRS, class W>
KZ_INLINE void kz_dot_block(const float* x, int64_t ldx, const W* const* w, int64_t k0, int64_t k1,
                            float* out, int64_t ldo, const char* pf) {
    kz_vf acc[MB][KZ_NB];
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < KZ_NB; ++j) acc[m][j] = (kz_vf){};
    int64_t k = k0;
    if constexpr (PAIRS) {
        for (; k + 2 * KZ_VL <= k1; k += 2 * KZ_VL) {
            if (pf) {
                const char* p = pf + (k - k0) * KZ_NB * (int64_t)sizeof(W);
                for (int64_t b = 0; b < 2 * KZ_VL * KZ_NB * (int64_t)sizeof(W); b += 64) __builtin_prefetch(p + b, 0, 2);
            }
            kz_vf we[KZ_NB], wo[KZ_NB];
            for (int j = 0; j < KZ_NB; ++j) kz_vld_pairs((const kz_bf16*)(w[j] + k), &we[j], &wo[j]);
            for (int m = 0; m < MB; ++m) {
                const kz_vf xe = kz_vld(x + m * ldx + k), xo = kz_vld(x + m * ldx + k + KZ_VL);
                for (int j = 0; j < KZ_NB; ++j) acc[m][j] += xe * we[j] + xo * wo[j];
            }
        }
    } else {
        for (; k + KZ_VL <= k1; k += KZ_VL) {
            if (pf) {
                const char* p = pf + (k - k0) * KZ_NB * (int64_t)sizeof(W);
                for (int64_t b = 0; b < KZ_VL * KZ_NB * (int64_t)sizeof(W); b += 64) __builtin_prefetch(p + b, 0, 2);
            }
            kz_vf wv[KZ_NB];
            for (int j = 0; j < KZ_NB; ++j) wv[j] = kz_vld(w[j] + k);
            for (int m = 0; m < MB; ++m) {
                const kz_vf xv = kz_vld(x + m * ldx + k);
                for (int j = 0; j < KZ_NB; ++j) acc[m][j] += xv * wv[j];
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < KZ_NB; ++j) {
            float s = kz_hsum(acc[m][j]);
            for (int64_t kk = k; kk < k1; ++kk) s += x[m * ldx + kk] * kz_ld(w[j], kk);
            out[m * ldo + j] = s;
        }
}

// every row of x (nr <= KZ_MAXR) against NB columns; rows share the weights when `shared`, else row r
// reads its own columns (w + r * KZ_NB), a batched matmul
template <bool PAIRS, class W>
static void kz_dot_cols(const float* x, int64_t ldx, int nr, const W* const* w, bool shared, int64_t k0,
                        int64_t k1, float* out, const char* pf) {
    int r = 0;
    if (shared)
        for (; r + 2 <= nr; r += 2)  // only the first pass over the block reads memory: it prefetches
            kz_dot_block<2, PAIRS>(x + r * ldx, ldx, w, k0, k1, out + r * KZ_NB, KZ_NB, r ? 0 : pf);
    for (; r < nr; ++r)
        kz_dot_block<1, PAIRS>(x + r * ldx, ldx, shared ? w : w + r * KZ_NB, k0, k1, out + r * KZ_NB, KZ_NB,
                               r || !shared ? 0 : pf);
}

// N-contiguous weights (w[k * ldk + j]): out[r][j] for j in [0, nb) of a column block, k in [k0, k1).
// Shared weights: k outer, so each row segment of the block is read once for every row of x; four weight
// rows per pass (one row per pass loads and stores `out` once per FMA: 7.4 against 14.0 GB/s on one Zen
// core, 1024 x 4096 f32), in wide blocks (AXPY_COLUMNS) of long contiguous runs per weight row.
template <class W>
static void kz_axpy_cols(const float* x, int64_t ldx, int nr, const W* const* w, bool shared, int64_t ldk,
                         int64_t nb, int64_t k0, int64_t k1, float* out, int64_t ldo) {
    if (shared) {
        for (int r = 0; r < nr; ++r)
            for (int64_t j = 0; j < nb; ++j) out[r * ldo + j] = 0.0f;
        int64_t k = k0;
        for (; k + 4 <= k1; k += 4) {  // four weight rows per pass: one load and store of out per 4 FMAs
            const W *w0 = w[0] + k * ldk, *w1 = w0 + ldk, *w2 = w1 + ldk, *w3 = w2 + ldk;
            for (int r = 0; r < nr; ++r) {
                const float* xr = x + r * ldx + k;
                const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
                float* o = out + r * ldo;
#pragma omp simd
                for (int64_t j = 0; j < nb; ++j)
                    o[j] += x0 * kz_ld(w0, j) + x1 * kz_ld(w1, j) + x2 * kz_ld(w2, j) + x3 * kz_ld(w3, j);
            }
        }
        for (; k < k1; ++k) {
            const W* row = w[0] + k * ldk;
            for (int r = 0; r < nr; ++r) {
                const float xv = x[r * ldx + k];
                float* o = out + r * ldo;
#pragma omp simd
                for (int64_t j = 0; j < nb; ++j) o[j] += xv * kz_ld(row, j);
            }
        }
        return;
    }
    for (int r = 0; r < nr; ++r) {
        const W* wr = w[shared ? 0 : r];
        float* o = out + r * ldo;
        for (int64_t j = 0; j < nb; ++j) o[j] = 0.0f;
        for (int64_t k = k0; k < k1; ++k) {
            const float xv = x[r * ldx + k];
            const W* row = wr + k * ldk;
#pragma omp simd
            for (int64_t j = 0; j < nb; ++j) o[j] += xv * kz_ld(row, j);
        }
    }
}

// any strides, any accumulator type (f64 matmuls): out[r][j] = sum_k x[r][k] * w[k * ks + j * ns]
template <class T, class W>
static void kz_generic_cols(const T* x, int64_t ldx, int nr, const W* const* w, bool shared, int64_t ks,
                            int64_t ns, int64_t nb, int64_t k0, int64_t k1, T* out, int64_t ldo) {
    for (int r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nb; ++j) {
            T s = 0;
            const W* wr = w[shared ? 0 : r] + j * ns;
            for (int64_t k = k0; k < k1; ++k) s += x[r * ldx + k] * (T)kz_ld(wr, k * ks);
            out[r * ldo + j] = s;
        }
}
