$PRELUDE$
// kernelize CPU few-row matmul over packed weights (kernelize/quant/kernels.py fills $FORMAT$):
//     y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),  W stored as q8_0 / q4_0 blocks, q4_k / q6_k
// super-blocks or int8 rows, the llama.cpp way. Decode is bound by the weight bytes, so the weights are
// never widened in memory: the few rows of x are quantized once per call into blocks of int8 values with an
// f32 scale (round to nearest even, d = max|x| / 127), blocks of 32, or of 256 for the k-quants (llama.cpp's
// q8_K), and each block of W meets them in an integer dot product (|w| times x with w's sign: AVX512-VNNI /
// AVX-VNNI vpdpbusd, else AVX2 vpmaddubsw to i16 pairs and vpmaddwd to i32, `kz_dot4`). A block of 32 converts
// its sums to f32 and scales them by the product of the two blocks' scales; a k-quant super-block is read as 8
// sub-blocks of 32 whose i16 pair sums meet the sub-blocks' integer scales in vpmaddwd, summed as i32 over the
// super-block and scaled once (`kz_qdot_k`), q4_k's mins entering as dmin * d_x * (mins . x's sums per 32).
// Threads split the output columns N; each reads its weight rows once, NB rows side by side, every row of x
// against each block while it is in registers.
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
// KZ_QUANT_PORTABLE: the scalar code even where AVX2 is there (tests build it to check the fallback)
#if defined(__AVX2__) && !defined(KZ_QUANT_PORTABLE)
#define KZ_QAVX2 1
#else
#define KZ_QAVX2 0
#endif

// kz_dot4: the integer dot product of 32 unsigned and 32 signed bytes in four-byte groups, as 8 i32 lanes:
// one vpdpbusd where the CPU has AVX512-VNNI (with VL) or AVX-VNNI, else vpmaddubsw to i16 pairs and vpmaddwd.
// The sums are the same: the i16 pairs cannot saturate (|w| <= 128 and |x| <= 127: 2 * 128 * 127 < 32767).
// Measured (8192 x 4096 weights, 7 of them read round robin, 2 threads, an AVX-512 EPYC with AVX512-VNNI,
// GB/s of packed weight, VNNI vs AVX2 in one run): 4 rows q8_0 14.3 -> 15.4, q4_0 7.5 -> 8.0, q4_k 7.4 -> 8.2;
// 1 row q4_k 22.8 -> 24.1, q6_k 16.2 -> 18.0; q4_0 and q8_0 at 1 row read at the memory's rate either way.
// (KZ_QUANT_NO_VNNI: the AVX2 code even where VNNI is there; tests build it to check both agree bit for bit)
#if KZ_QAVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(KZ_QUANT_NO_VNNI)
#define KZ_QVNNI 1
KZ_INLINE __m256i kz_dot4_acc(__m256i a, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(a, u, s); }
KZ_INLINE __m256i kz_dot4(__m256i u, __m256i s) { return kz_dot4_acc(_mm256_setzero_si256(), u, s); }
#elif KZ_QAVX2 && defined(__AVXVNNI__) && !defined(KZ_QUANT_NO_VNNI)
#define KZ_QVNNI 1
KZ_INLINE __m256i kz_dot4_acc(__m256i a, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(a, u, s); }
KZ_INLINE __m256i kz_dot4(__m256i u, __m256i s) { return kz_dot4_acc(_mm256_setzero_si256(), u, s); }
#else
#define KZ_QVNNI 0
#if KZ_QAVX2
KZ_INLINE __m256i kz_dot4(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
#endif
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

// ---- the formats: a block's bytes, its scales, its values as int8 --------------------------------------
// A block holds QK elements (32, or a k-quant's super-block of 256) read as QK / 32 sub-blocks of 32, with
// one f32 scale per SG elements and (MIN) one min per sub-block: the value is sc * q - mn.
// scales(b, sc, mn): a block's scales and mins as f32; values(b, q): its QK values q as int8;
// load(b, s): the AVX2 load of sub-block s. UNSIGNED: the load returns the stored unsigned values u and the
// value is u - OFFSET (q4_0: 8), so the dot product is u . x - OFFSET * sum(x): vpmaddubsw takes u as it
// is, no sign fix-ups per column. Signed loads (q8_0, int8) take |w| and x with w's sign instead.
// int8's per-row scales are applied to the finished dot products (its block scale is 1).
struct kz_q8_0 {
    static constexpr int QK = KZ_QK, SG = KZ_QK, OFFSET = 0;
    static constexpr bool UNSIGNED = false, MIN = false;
    static constexpr int64_t BYTES = 2 + KZ_QK;
    KZ_INLINE void scales(const uint8_t* b, float* sc, float*) { sc[0] = kz_h2f(b); }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) { memcpy(q, b + 2, KZ_QK); }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b, int) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
#endif
};
struct kz_q4_0 {
    static constexpr int QK = KZ_QK, SG = KZ_QK, OFFSET = 8;
    static constexpr bool UNSIGNED = true, MIN = false;
    static constexpr int64_t BYTES = 2 + KZ_QK / 2;
    KZ_INLINE void scales(const uint8_t* b, float* sc, float*) { sc[0] = kz_h2f(b); }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) {
        for (int i = 0; i < KZ_QK / 2; ++i) {
            q[i] = (int8_t)((b[2 + i] & 15) - 8);
            q[i + KZ_QK / 2] = (int8_t)((b[2 + i] >> 4) - 8);
        }
    }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b, int) {  // low nibbles are elements 0..15, high nibbles 16..31
        const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 2));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        return _mm256_and_si256(both, _mm256_set1_epi8(15));  // unsigned: OFFSET is subtracted in the dot
    }
#endif
};
#if KZ_QAVX2
// 16 in byte j where bit j of `bits` is set, else 0 (llama.cpp's bytes_from_bits_32: byte j takes byte j / 8
// of the word, then or-ing every bit but bit j % 8 leaves all ones only where that bit is set)
KZ_INLINE __m256i kz_bit4(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
#endif
// q5_0 (block_q5_0, 22 bytes): f16 d, 4 bytes qh (bit j: bit 4 of element j), 16 bytes of nibbles as q4_0's;
// value d (q - 16)
struct kz_q5_0 {
    static constexpr int QK = KZ_QK, SG = KZ_QK, OFFSET = 16;
    static constexpr bool UNSIGNED = true, MIN = false;
    static constexpr int64_t BYTES = 2 + 4 + KZ_QK / 2;
    KZ_INLINE void scales(const uint8_t* b, float* sc, float*) { sc[0] = kz_h2f(b); }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        for (int i = 0; i < KZ_QK / 2; ++i) {
            q[i] = (int8_t)(((b[6 + i] & 15) | ((qh >> i) & 1) << 4) - 16);
            q[i + KZ_QK / 2] = (int8_t)(((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
        }
    }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b, int) {  // unsigned: OFFSET is subtracted in the dot
        const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 6));
        const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        return _mm256_or_si256(lo, kz_bit4(qh));
    }
#endif
};
// q4_k (block_q4_K, 144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales / mins per 32, 128 bytes of
// nibbles (byte 32 c + l: element 64 c + l low, 64 c + 32 + l high); value d sc_j q - dmin m_j
struct kz_q4_k {
    static constexpr int QK = 256, SG = KZ_QK, OFFSET = 0;
    static constexpr bool UNSIGNED = true, MIN = true;
    static constexpr int64_t BYTES = 144;
    // llama.cpp's unpacking of get_scale_min_k4 in 32-bit words (little-endian): bytes 0..7 of u become the
    // 8 six-bit scales, bytes 8..15 the 8 mins
    KZ_INLINE void unpack(const uint8_t* b, uint32_t* u) {
        memcpy(u, b + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t low_mins = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = low_mins;
        u[0] &= 0x3f3f3f3fu;
    }
    KZ_INLINE void scales(const uint8_t* b, float* sc, float* mn) {
        uint32_t u[4];
        unpack(b, u);
        const float d = kz_h2f(b), dmin = kz_h2f(b + 2);
#if KZ_QAVX2  // as a scalar loop this took half the kernel's time (measured 4.1 against 2.1 ms)
        const __m128i q = _mm_loadu_si128((const __m128i*)u);
        const __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
        const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
        _mm256_storeu_ps(sc, _mm256_mul_ps(fs, _mm256_set1_ps(d)));
        _mm256_storeu_ps(mn, _mm256_mul_ps(fm, _mm256_set1_ps(dmin)));
#else
        uint8_t q[16];
        memcpy(q, u, 16);
        for (int j = 0; j < 8; ++j) {
            sc[j] = d * (float)q[j];
            mn[j] = dmin * (float)q[8 + j];
        }
#endif
    }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) {
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                q[64 * c + l] = (int8_t)(b[16 + 32 * c + l] & 15);
                q[64 * c + 32 + l] = (int8_t)(b[16 + 32 * c + l] >> 4);
            }
    }
#if KZ_QAVX2
    // the super-block's integer scales as i16 lanes (the 8 scales, then the 8 mins), its d and dmin: unpack's
    // bit moves on the 12 bytes s[0..11] in one vector (scale j < 4: s[j] & 63, min: s[j + 4] & 63; j >= 4:
    // the low / high nibble of s[j + 4] and the top two bits of s[j - 4] / s[j])
    KZ_INLINE __m256i iscales(const uint8_t* b, float& d, float& dmin) {
        const __m128i v = _mm_loadu_si128((const __m128i*)(b + 4));  // 12 bytes and 4 of the nibbles
        const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        const __m128i a = _mm_and_si128(lo, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0));
        const __m128i c = _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
        const __m128i t = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int*)b));  // (unaligned: x86 loads allow it)
        d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        return _mm256_cvtepu8_epi16(_mm_or_si128(_mm_or_si128(a, c), t));
    }
    KZ_INLINE __m256i load(const uint8_t* b, int s) {  // sub-block s: chunk s / 2, nibble s % 2
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (s >> 1)));
        return _mm256_and_si256(s & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
    }
#endif
};
// q6_k (block_q6_K, 210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] per 16, f16 d;
// in half h of 128: element 32 i + l (i < 4) is ql[64 h + 32 (i & 1) + l] >> 4 (i >> 1) | qh[32 h + l] >> 2 i
// (2 bits) << 4; value d scales_g (u - 32)
struct kz_q6_k {
    static constexpr int QK = 256, SG = 16, OFFSET = 32;
    static constexpr bool UNSIGNED = true, MIN = false;
    static constexpr int64_t BYTES = 210;
    KZ_INLINE void scales(const uint8_t* b, float* sc, float*) {
        const float d = kz_h2f(b + 208);
        for (int g = 0; g < 16; ++g) sc[g] = d * (float)(int8_t)b[192 + g];
    }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) {
        for (int h = 0; h < 2; ++h)
            for (int i = 0; i < 4; ++i)
                for (int l = 0; l < 32; ++l) {
                    const int lo = (b[64 * h + 32 * (i & 1) + l] >> (4 * (i >> 1))) & 15;
                    const int hi = (b[128 + 32 * h + l] >> (2 * i)) & 3;
                    q[128 * h + 32 * i + l] = (int8_t)((lo | (hi << 4)) - 32);
                }
    }
#if KZ_QAVX2
    KZ_INLINE __m256i iscales(const uint8_t* b, float& d, float& dmin) {  // the 16 scales as i16 lanes
        d = kz_h2f(b + 208), dmin = 0.0f;
        return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
    }
    KZ_INLINE __m256i load(const uint8_t* b, int s) {
        const int h = s >> 2, i = s & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (i & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (i >> 1))), _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
#endif
};
struct kz_int8 {  // per-row scales: a "block" is 32 int8 values and its scale is 1
    static constexpr int QK = KZ_QK, SG = KZ_QK, OFFSET = 0;
    static constexpr bool UNSIGNED = false, MIN = false;
    static constexpr int64_t BYTES = KZ_QK;
    KZ_INLINE void scales(const uint8_t*, float* sc, float*) { sc[0] = 1.0f; }
    KZ_INLINE void values(const uint8_t* b, int8_t* q) { memcpy(q, b, KZ_QK); }
#if KZ_QAVX2
    KZ_INLINE __m256i load(const uint8_t* b, int) { return _mm256_loadu_si256((const __m256i*)b); }
#endif
};
typedef $FORMAT$ kz_fmt;
#define KZ_NSUB (kz_fmt::QK / KZ_QK)  // sub-blocks of 32 per block
#define KZ_NSG (kz_fmt::QK / kz_fmt::SG)  // scales per block
static_assert(!kz_fmt::MIN || KZ_NSUB == 8, "the AVX2 kernel takes a block's mins as the 8 i16 lanes of a vector");

// ---- the activations: rows of x as int8 blocks and f32 scales ------------------------------------------
// x's blocks are the weight's: 32 elements, or a k-quant's super-block of 256 (llama.cpp's q8_K), so that a
// super-block's products sum as integers under one scale. xs (formats with mins, else null): the sums of
// the int8 values of each 32, what a sub-block's min multiplies.
#define KZ_XQK kz_fmt::QK
template <class XT>
static void kz_quantize_rows(const XT* x, int64_t m, int64_t k, int8_t* xq, float* xd, int16_t* xs) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < k / KZ_XQK; ++b) {
            const XT* src = x + r * k + b * KZ_XQK;
            float v[KZ_XQK], amax = 0.0f;
            for (int i = 0; i < KZ_XQK; ++i) {
                v[i] = kz_ld(src, i);
                const float a = fabsf(v[i]);  // not fmaxf: aarch64 gcc 12's vectoriser crashes on it here
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t* q = xq + r * k + b * KZ_XQK;
            for (int i = 0; i < KZ_XQK; ++i) q[i] = (int8_t)rintf(v[i] * id);
            xd[r * (k / KZ_XQK) + b] = d;
            for (int s = 0; xs && s < KZ_NSUB; ++s) {
                int32_t sum = 0;
                for (int i = 0; i < KZ_QK; ++i) sum += q[KZ_QK * s + i];
                xs[r * (k / KZ_QK) + b * KZ_NSUB + s] = (int16_t)sum;  // |sum| <= 32 * 127
            }
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
// What the format's offset takes off a block's products with x's block xv: OFFSET * (the sum of each four x,
// VNNI; of each pair, AVX2), or nothing for formats without an offset.
KZ_INLINE __m256i kz_qoffset(__m256i xv) {
    if constexpr (kz_fmt::OFFSET == 0) return _mm256_setzero_si256();
#if KZ_QVNNI
    return kz_dot4(_mm256_set1_epi8(kz_fmt::OFFSET), xv);
#else
    return _mm256_maddubs_epi16(_mm256_set1_epi8(kz_fmt::OFFSET), xv);
#endif
}
// The 8 i32 sums of a weight sub-block wv (|w| in wa for signed formats) times x's block xv, less the offset's
// share xo (kz_qoffset).
KZ_INLINE __m256i kz_qprod(__m256i wa, __m256i wv, __m256i xv, __m256i xo) {
    if constexpr (!kz_fmt::UNSIGNED) return kz_dot4(wa, _mm256_sign_epi8(xv, wv));
#if KZ_QVNNI
    else if constexpr (kz_fmt::OFFSET != 0) return _mm256_sub_epi32(kz_dot4(wv, xv), xo);
#else  // the offset comes off the i16 pairs, before vpmaddwd (one subtraction of 16 lanes)
    else if constexpr (kz_fmt::OFFSET != 0)
        return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(wv, xv), xo), _mm256_set1_epi16(1));
#endif
    else return kz_dot4(wv, xv);
}
// block b of the next column block's NB rows (pf, null past a thread's range), prefetched while this one's
// are read
template <int NB> KZ_INLINE void kz_prefetch_next(const char* pf, int64_t b) {
    if (pf)
        for (int64_t o = 0; o < NB * kz_fmt::BYTES; o += 64) __builtin_prefetch(pf + b * NB * kz_fmt::BYTES + o, 0, 2);
}
template <int MB, int NB> KZ_INLINE void kz_zero(__m256 (&acc)[MB][NB]) {
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
}
// blocks of 32 (q8_0, q4_0, int8): each block's i32 sums convert to f32 and meet the two scales in an fma
template <int MB, int NB>
KZ_INLINE void kz_qdot32(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, int64_t k,
                         float* out, int64_t ldo, const char* pf) {
    kz_fmt f;
    const int64_t nx = k / KZ_QK;  // x's blocks per row
    __m256 acc[MB][NB];
    kz_zero(acc);
    for (int64_t b = 0; b < nb; ++b) {
        kz_prefetch_next<NB>(pf, b);
        float ws[NB][1], wm[NB][1];
        __m256i wv[NB], wa[NB];
        for (int j = 0; j < NB; ++j) {
            f.scales(w[j] + b * kz_fmt::BYTES, ws[j], wm[j]);
            wv[j] = f.load(w[j] + b * kz_fmt::BYTES, 0);
            wa[j] = kz_fmt::UNSIGNED ? wv[j] : _mm256_sign_epi8(wv[j], wv[j]);  // |w|: the dot product's unsigned operand
        }
        for (int m = 0; m < MB; ++m) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * k + b * KZ_QK));
            const float dx = xd[m * nx + b];
            const __m256i xo = kz_qoffset(xv);
            for (int j = 0; j < NB; ++j) {
                const __m256 p = _mm256_cvtepi32_ps(kz_qprod(wa[j], wv[j], xv, xo));
                acc[m][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(ws[j][0] * dx), acc[m][j]);
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) out[m * ldo + j] = kz_hsum8(acc[m][j]);
}
// k-quant super-blocks of 256 against x's blocks of 256 (one scale each), as llama.cpp's AVX2 q4_K / q6_K dot
// products: a sub-block's i16 pair sums (less q6_k's offset) meet its integer scales in vpmaddwd, the i32
// sums of the super-block convert to f32 once and meet d * d_x in one fma; q4_k's mins enter as
// dmin * d_x * (the mins . x's sums per 32), one more vpmaddwd. The i16 pairs cannot saturate: q4_k
// 2 * 15 * 127, q6_k 2 * 63 * 127 before and 2 * 32 * 127 after the offset. (The float form, one convert
// and fma per sub-block, read q4_k at 0.79x q4_0's GB/s in decode.)
// sub-block s's scales as i16 lanes (lanes 0..7 multiply the pair sums of elements 0..15, lanes 8..15 those
// of 16..31) from a super-block's (iscales), by a byte shuffle: (2 t, 2 t + 1) picks i16 lane t of a half
KZ_INLINE __m256i kz_sub_scales(__m256i v, int s) {
    if constexpr (kz_fmt::SG == KZ_QK) {  // scale s everywhere
        const __m256i lo = _mm256_permute2x128_si256(v, v, 0x00);
        return _mm256_shuffle_epi8(lo, _mm256_set1_epi16((short)(0x0100 + 0x0202 * s)));
    } else {  // scale 2 s in the low half, 2 s + 1 in the high half (both in v's half s / 4)
        const __m256i h = s < 4 ? _mm256_permute2x128_si256(v, v, 0x00) : _mm256_permute2x128_si256(v, v, 0x11);
        const short a = (short)(0x0100 + 0x0202 * (2 * s % 8)), c = (short)(0x0100 + 0x0202 * ((2 * s + 1) % 8));
        return _mm256_shuffle_epi8(h, _mm256_set_m128i(_mm_set1_epi16(c), _mm_set1_epi16(a)));
    }
}
template <int MB, int NB, class F>  // F: kz_fmt (a template argument: q8_0 / q4_0 have no iscales)
KZ_INLINE void kz_qdot_k(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, const int16_t* xs,
                         int64_t k, float* out, int64_t ldo, const char* pf) {
    F f;
    const int64_t ns = k / KZ_QK;  // x's sums per row
    __m256 acc[MB][NB];
    kz_zero(acc);
    for (int64_t b = 0; b < nb; ++b) {
        kz_prefetch_next<NB>(pf, b);
        __m256i sc[NB];
        float d[NB], dmin[NB];
        for (int j = 0; j < NB; ++j) sc[j] = f.iscales(w[j] + b * kz_fmt::BYTES, d[j], dmin[j]);
        __m256i isum[MB][NB];
        for (int m = 0; m < MB; ++m)
            for (int j = 0; j < NB; ++j) isum[m][j] = _mm256_setzero_si256();
#pragma GCC unroll 8  // constant sub-block offsets, shift counts and shuffles; q4_k's two loads of one chunk merge
        for (int s = 0; s < KZ_NSUB; ++s) {
            __m256i wv[NB], sv[NB];
            for (int j = 0; j < NB; ++j) {
                wv[j] = f.load(w[j] + b * kz_fmt::BYTES, s);
                sv[j] = kz_sub_scales(sc[j], s);
            }
            for (int m = 0; m < MB; ++m) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * k + b * KZ_XQK + s * KZ_QK));
                const __m256i xo = _mm256_maddubs_epi16(_mm256_set1_epi8(kz_fmt::OFFSET), xv);
                for (int j = 0; j < NB; ++j) {
                    __m256i p16 = _mm256_maddubs_epi16(wv[j], xv);
                    if constexpr (kz_fmt::OFFSET != 0) p16 = _mm256_sub_epi16(p16, xo);
                    isum[m][j] = _mm256_add_epi32(isum[m][j], _mm256_madd_epi16(p16, sv[j]));
                }
            }
        }
        for (int m = 0; m < MB; ++m) {
            const float dx = xd[m * (k / KZ_XQK) + b];
            for (int j = 0; j < NB; ++j) {
                acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][j]), _mm256_set1_ps(d[j] * dx), acc[m][j]);
                if constexpr (kz_fmt::MIN) {
                    const __m128i bs = _mm_loadu_si128((const __m128i*)(xs + m * ns + b * KZ_NSUB));
                    const __m128i mi = _mm_madd_epi16(_mm256_extracti128_si256(sc[j], 1), bs);
                    acc[m][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_zextsi128_si256(mi)),
                                                 _mm256_set1_ps(dmin[j] * dx), acc[m][j]);
                }
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) out[m * ldo + j] = kz_hsum8(acc[m][j]);
}
template <int MB, int NB>
KZ_INLINE void kz_qdot(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, const int16_t* xs,
                       int64_t k, float* out, int64_t ldo, const char* pf) {
    if constexpr (kz_fmt::QK == KZ_QK) kz_qdot32<MB, NB>(w, nb, xq, xd, k, out, ldo, pf);
    else if constexpr (NB > 2) {  // two passes over x: the super-block's sums and scales of 4 rows spill
        kz_qdot<MB, NB / 2>(w, nb, xq, xd, xs, k, out, ldo, pf);
        kz_qdot<MB, NB / 2>(w + NB / 2, nb, xq, xd, xs, k, out + NB / 2, ldo, pf ? pf + NB / 2 * nb * kz_fmt::BYTES : 0);
    } else if constexpr (MB > 2) {
        kz_qdot<MB / 2, NB>(w, nb, xq, xd, xs, k, out, ldo, pf);
        kz_qdot<MB - MB / 2, NB>(w, nb, xq + MB / 2 * k, xd + MB / 2 * (k / KZ_XQK), xs ? xs + MB / 2 * (k / KZ_QK) : 0, k, out + MB / 2 * ldo, ldo, 0);
    } else kz_qdot_k<MB, NB, kz_fmt>(w, nb, xq, xd, xs, k, out, ldo, pf);
}
// ---- one row of x against 8 weight rows (decode, q4_0 / q8_0): the rows as the lanes ----------------------
// The 4-row kernel above pays per row and block for a scalar f16 scale (convert, multiply, broadcast) and
// one f32 convert + fma of 8 lanes; llama.cpp's AVX2 q4_0 gemv instead repacks 8 rows so that one vector
// op serves several rows. Here the GGUF rows stay as they are and each op still serves two rows: the 8
// rows' f16 scales are gathered through integer registers into one vector (one convert and multiply per 8
// rows), and a q4_0 block of row 2p and one of row 2p+1 share a vector (low half, high half), so the
// nibble unpack, the integer dot product and the f32 fma run once per two rows. Each pair's accumulator
// keeps 4 partial lanes per row, added up once at the end of the row.
KZ_INLINE uint64_t kz_ld16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}
// the f16 scales at byte `off` of rows w[0..7] as f32 lanes [s0 s2 s4 s6 | s1 s3 s5 s7]: pair p's
// [s_2p x4 | s_2p+1 x4] is then one in-lane shuffle
KZ_INLINE __m256 kz_scales8(const uint8_t* const* w, int64_t off) {
    // (perf) one vpinsrw from memory per row: the shifts and ors of two 64-bit words took ~2x the ops
    // (q4_0 decode, interleaved A/B on the 300 M layout's shapes: +2-4% GB/s at 1 and 2 threads, q8_0 even)
    __m128i h = _mm_cvtsi32_si128((int)kz_ld16(w[0] + off));
    h = _mm_insert_epi16(h, (short)kz_ld16(w[2] + off), 1);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[4] + off), 2);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[6] + off), 3);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[1] + off), 4);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[3] + off), 5);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[5] + off), 6);
    h = _mm_insert_epi16(h, (short)kz_ld16(w[7] + off), 7);
    return _mm256_cvtph_ps(h);
}
#define KZ_PAIR_SCALE(S, p) _mm256_shuffle_ps(S, S, (p) * 0x55)
// q4_0 / q5_0: pair p's vector holds row 2p's 16 bytes of nibbles in the low half, row 2p+1's in the high
// half; q5_0 ors in bit 4 from the two rows' qh words (their low halves for elements 0..15, high for 16..31)
template <class F>
KZ_INLINE void kz_row8_nibbles(const uint8_t* const* w, int64_t off, const int8_t* xb, __m256 S, __m256* acc) {
    constexpr int64_t QS = F::BYTES - KZ_QK / 2;  // where the nibbles start
    const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xb));
    const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + 16)));
    const __m256i eight = _mm256_set1_epi8(F::OFFSET), m4 = _mm256_set1_epi8(15);  // (the offset: 8 or 16)
#if KZ_QVNNI  // -8 * (the sum of each four x): what the offset takes off, where every pair's sums start
    // (the dot products accumulate onto it: two vpdpbusd a pair, no add or subtract; q4_0 decode read 3-12%
    // more GB/s at 2 threads, 6% at 1, in an interleaved A/B on the 300 M layout's shapes, same sums)
    const __m256i nxo = _mm256_sub_epi32(_mm256_setzero_si256(), kz_dot4_acc(kz_dot4(eight, xl), eight, xh));
#else
    const __m256i xo = _mm256_add_epi16(_mm256_maddubs_epi16(eight, xl), _mm256_maddubs_epi16(eight, xh));
#endif
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu2_m128i((const __m128i*)(w[2 * p + 1] + off + QS), (const __m128i*)(w[2 * p] + off + QS));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (F::OFFSET == 16) {  // q5_0 (its sums stay within i16: 2 * 2 * 31 * 127)
            uint32_t a, b;
            memcpy(&a, w[2 * p] + off + 2, 4);
            memcpy(&b, w[2 * p + 1] + off + 2, 4);
            lo = _mm256_or_si256(lo, kz_bit4((a & 0xffffu) | (b << 16)));
            hi = _mm256_or_si256(hi, kz_bit4((a >> 16) | (b & 0xffff0000u)));
        }
#if KZ_QVNNI
        const __m256 d = _mm256_cvtepi32_ps(kz_dot4_acc(kz_dot4_acc(nxo, lo, xl), hi, xh));
#else
        const __m256i p16 = _mm256_sub_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), xo);
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
        acc[p] = _mm256_fmadd_ps(d, KZ_PAIR_SCALE(S, p), acc[p]);
    }
}
KZ_INLINE void kz_row8_block(kz_q4_0, const uint8_t* const* w, int64_t off, const int8_t* xb, __m256 S, __m256* acc) {
    kz_row8_nibbles<kz_q4_0>(w, off, xb, S, acc);
}
KZ_INLINE void kz_row8_block(kz_q5_0, const uint8_t* const* w, int64_t off, const int8_t* xb, __m256 S, __m256* acc) {
    kz_row8_nibbles<kz_q5_0>(w, off, xb, S, acc);
}
// q8_0: a row's block fills a vector; the pairs share the scale shuffle and (added as i32) the convert + fma
KZ_INLINE void kz_row8_block(kz_q8_0, const uint8_t* const* w, int64_t off, const int8_t* xb, __m256 S, __m256* acc) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)xb);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
        __m256i d32[2];
        for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w[2 * p + h] + off + 2));
            d32[h] = kz_dot4(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
        }
        // [row 2p lanes 0-3 + 4-7 | row 2p+1 lanes 0-3 + 4-7]: the halves' sums in the pair's lane order
        const __m256i lo = _mm256_permute2x128_si256(d32[0], d32[1], 0x20), hi = _mm256_permute2x128_si256(d32[0], d32[1], 0x31);
        acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), KZ_PAIR_SCALE(S, p), acc[p]);
    }
}
template <class F> struct kz_has_row8 { static constexpr bool value = false; };
template <> struct kz_has_row8<kz_q4_0> { static constexpr bool value = true; };
template <> struct kz_has_row8<kz_q5_0> { static constexpr bool value = true; };
template <> struct kz_has_row8<kz_q8_0> { static constexpr bool value = true; };
// out[j] = row j of the 8 rows from w (rb bytes apart) . x; pf: the next 8 rows' bytes (or null)
template <class F>
static void kz_row8(const uint8_t* w, int64_t rb, int64_t nb, const int8_t* xq, const float* xd, float* out, const char* pf) {
    const uint8_t* wr[8];
    for (int j = 0; j < 8; ++j) wr[j] = w + j * rb;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
        kz_prefetch_next<8>(pf, b);
        const __m256 S = _mm256_mul_ps(kz_scales8(wr, b * kz_fmt::BYTES), _mm256_set1_ps(xd[b]));
        kz_row8_block(F(), wr, b * kz_fmt::BYTES, xq + b * KZ_QK, S, acc);
    }
    for (int p = 0; p < 4; ++p) {  // row 2p: lanes 0-3, row 2p+1: lanes 4-7
        const __m128 lo = _mm256_castps256_ps128(acc[p]), hi = _mm256_extractf128_ps(acc[p], 1);
        const __m128 s = _mm_hadd_ps(_mm_hadd_ps(lo, hi), _mm_setzero_ps());  // [row 2p, row 2p+1, 0, 0]
        out[2 * p] = _mm_cvtss_f32(s);
        out[2 * p + 1] = _mm_cvtss_f32(_mm_movehdup_ps(s));
    }
}
#else
template <int MB, int NB>
KZ_INLINE void kz_qdot(const uint8_t* const* w, int64_t nb, const int8_t* xq, const float* xd, const int16_t* xs,
                       int64_t k, float* out, int64_t ldo, const char*) {
    kz_fmt f;
    float acc[MB][NB] = {};
    int8_t q[kz_fmt::QK];
    float ws[KZ_NSG], wm[KZ_NSUB];
    for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < NB; ++j) {
            const uint8_t* blk = w[j] + b * kz_fmt::BYTES;
            f.values(blk, q);
            f.scales(blk, ws, wm);
            for (int m = 0; m < MB; ++m) {
                const int8_t* xr = xq + m * k + b * kz_fmt::QK;
                const float dx = xd[m * (k / KZ_XQK) + b];  // x's block is the weight's
                for (int g = 0; g < KZ_NSG; ++g) {
                    int32_t s = 0;
                    for (int i = g * kz_fmt::SG; i < (g + 1) * kz_fmt::SG; ++i) s += (int32_t)q[i] * xr[i];
                    acc[m][j] += (float)s * (ws[g] * dx);
                }
                if constexpr (kz_fmt::MIN)
                    for (int sb = 0; sb < KZ_NSUB; ++sb)
                        acc[m][j] -= wm[sb] * dx * (float)xs[m * (k / KZ_QK) + b * KZ_NSUB + sb];
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
                     const int8_t* xq, const float* xd, const int16_t* xs, int64_t k, float* out, const char* pf) {
    const uint8_t* wr[KZ_QNB];
    for (int j = 0; j < KZ_QNB; ++j) wr[j] = w + (c0 + (j < cn ? j : cn - 1)) * rb;
    const int64_t nx = k / KZ_XQK, ns = k / KZ_QK;  // x's blocks and sums per row
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {  // 4 rows x 2 columns: 8 accumulators, as 2 x 4 (the second reads cache)
        kz_qdot<4, 2>(wr, nb, xq + r * k, xd + r * nx, xs ? xs + r * ns : 0, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
        kz_qdot<4, 2>(wr + 2, nb, xq + r * k, xd + r * nx, xs ? xs + r * ns : 0, k, out + r * KZ_QNB + 2, KZ_QNB, r || !pf ? 0 : pf + KZ_QNB / 2 * rb);
    }
    for (; r + 2 <= m; r += 2)
        kz_qdot<2, KZ_QNB>(wr, nb, xq + r * k, xd + r * nx, xs ? xs + r * ns : 0, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
    for (; r < m; ++r) kz_qdot<1, KZ_QNB>(wr, nb, xq + r * k, xd + r * nx, xs ? xs + r * ns : 0, k, out + r * KZ_QNB, KZ_QNB, r ? 0 : pf);
}

// columns [c0, c0 + cn) of a column block of qnb (8: one row of x by kz_row8, where the format has it)
static void kz_qblock(const uint8_t* w, int64_t rb, int64_t c0, int64_t cn, int64_t qnb, int64_t nb, int64_t m,
                      const int8_t* xq, const float* xd, const int16_t* xs, int64_t k, float* out, const char* pf) {
#if KZ_QAVX2
    if constexpr (kz_has_row8<kz_fmt>::value) {
        if (qnb == 8 && cn == 8) return kz_row8<kz_fmt>(w + c0 * rb, rb, nb, xq, xd, out, pf);
    }
#endif
    for (int64_t j = 0; j < cn; j += KZ_QNB)  // qnb 8 (m = 1) at the end of the columns: two blocks of 4
        kz_qcols(w, rb, c0 + j, cn - j < KZ_QNB ? cn - j : KZ_QNB, nb, m, xq, xd, xs, k, out + j, j ? 0 : pf);
}
// 8 columns side by side for one row of x where the format has kz_row8, else KZ_QNB
KZ_INLINE int64_t kz_qnb(int64_t m) {
#if KZ_QAVX2
    if (m == 1 && kz_has_row8<kz_fmt>::value) return 8;
#endif
    return KZ_QNB;
}

// the gated activations of the fused gate|up epilogue (ACT's values: kernels.py's GLU_ACTS)
enum { KZ_SILU = 0, KZ_GELU = 1, KZ_GELU_TANH = 2 };
KZ_INLINE float kz_glu_act(float g, int act) {
    if (act == KZ_SILU) return g / (1.0f + expf(-g));
    if (act == KZ_GELU) return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f));
    return 0.5f * g * (1.0f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
}

// y = x W^T, or (up > 0: W's rows [0, n) are gate, [up, up + n) up) y = act(x Wg^T) * (x Wu^T): a merged
// gate|up weight read once per column block, both halves' rows side by side, the product in the epilogue
template <class OT>
static int kz_qgemv(const int8_t* xq, const float* xd, const int16_t* xs, int64_t m, int64_t k, const uint8_t* w,
                    const float* wscale, int64_t n, const float* bias, OT* y, int nthreads, int64_t up, int act) {
    const int64_t nb = k / kz_fmt::QK, rb = nb * kz_fmt::BYTES, qnb = kz_qnb(m), nblk = (n + qnb - 1) / qnb;
    const kz_team_t tm = kz_team_open(nthreads, m * n * k * (up ? 2 : 1) >= 32768);
    return kz_parallel_for(tm, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(nblk, t, tn, lo, hi);
        float blk[8 * KZ_QNB], blu[8 * KZ_QNB];
        for (int64_t c = lo; c < hi; ++c) {
            const int64_t c0 = c * qnb, cn = n - c0 < qnb ? n - c0 : qnb;
            for (int64_t r0 = 0; r0 < m; r0 += 8) {
                const int64_t mr = m - r0 < 8 ? m - r0 : 8;
                const bool first = r0 == 0 && c + 1 < hi && KZ_PREFETCH;
                const int64_t x0 = r0 * (k / KZ_XQK), s0 = r0 * (k / KZ_QK);
                const char* pf = first ? (const char*)(w + (c0 + qnb) * rb) : 0;
                kz_qblock(w, rb, c0, cn, qnb, nb, mr, xq + r0 * k, xd + x0, xs ? xs + s0 : 0, k, blk, pf);
                if (up) {
                    const char* pu = first ? (const char*)(w + (up + c0 + qnb) * rb) : 0;
                    kz_qblock(w, rb, up + c0, cn, qnb, nb, mr, xq + r0 * k, xd + x0, xs ? xs + s0 : 0, k, blu, pu);
                }
                for (int64_t r = 0; r < mr; ++r)
                    for (int64_t j = 0; j < cn; ++j) {
                        float v = blk[r * qnb + j];
                        if (wscale) v *= wscale[c0 + j];
                        if (bias) v += bias[c0 + j];
                        if (up) {
                            float u = blu[r * qnb + j];
                            if (wscale) u *= wscale[up + c0 + j];
                            if (bias) u += bias[up + c0 + j];
                            v = kz_glu_act(v, act) * u;
                        }
                        kz_st(y, (r0 + r) * n + c0 + j, v);
                    }
            }
        }
        return 0;
    });
}

// x [m, k] (XT) times the packed W [n, k]^T into y [m, n] (OT); wscale: int8's row scales, else null.
// up > 0: W holds gate rows [0, n) and up rows [up, up + n), y = act(gate) * up (see kz_qgemv)
#define KZ_QGEMV_ENTRY(XN, XT, ON, OT)                                                                      \
    extern "C" int $NAME$_##XN##_##ON(const XT* x, int64_t m, int64_t k, const uint8_t* w,                  \
                                      const float* wscale, int64_t n, const float* bias, OT* y, int nthreads, \
                                      int64_t up, int act) {                                                \
        int8_t* xq = kz_scratch<int8_t>(0, m * k);                                                         \
        float* xd = kz_scratch<float>(1, m * (k / KZ_XQK));                                                \
        int16_t* xs = kz_fmt::MIN ? kz_scratch<int16_t>(2, m * (k / KZ_QK)) : 0;                           \
        kz_quantize_rows(x, m, k, xq, xd, xs);                                                             \
        return kz_qgemv(xq, xd, xs, m, k, w, wscale, n, bias, y, nthreads, up, act);                       \
    }
KZ_QGEMV_ENTRY(f32, float, f32, float)
KZ_QGEMV_ENTRY(f32, float, bf16, kz_bf16)
KZ_QGEMV_ENTRY(bf16, kz_bf16, f32, float)
KZ_QGEMV_ENTRY(bf16, kz_bf16, bf16, kz_bf16)

// ---- routed experts (kernelize/quant/experts.py): out[t] = sum of w[t, k] * (down_e glu(gate_e x_t + bg_e,
// up_e x_t + bu_e) + bd_e) over t's slots k, e = index[t, k] (E itself: a sentinel, skipped), the biases
// optional and glu the gate form of kernelize.ir.experts.split_gate (kz_qglu). The E experts' gate|up weights
// are one packed [E * 2I, H] (expert e's gate rows from row 2I e, its up rows I after) and their down weights
// one [E * H, I]. The (token, slot) pairs are sorted by expert (a counting sort) and each pair's row of x is
// quantized once; stage one: an item is (expert, column block of I), reading the block's gate and up rows
// once for all the expert's pairs, h = act(gate) * up in f32; each pair's h is then quantized as a row of x
// is; stage two: an item is a column block of H, taking the selected experts in turn and reading each one's
// down rows once, w * (h . down) added into the tokens' f32 sums (a token's experts in expert order, so the
// sums do not depend on the thread count). Only the selected experts' bytes are read, each once per call.
#define KZ_QE_COLS 32  // columns of H per stage-two item
// the gate form (form: the activation's KZ_SILU.. code, alpha, the gate, activation and up limits, the up
// shift; a limit of +inf: none): split_gate's math, and as kernelize.codegen.cpu_experts.c_glu a NaN passes
// the clamps as it does torch's
KZ_INLINE float kz_qglu(float g, float u, const float* form) {
    g = g > form[2] ? form[2] : g;
    float a = form[1] != 1.0f ? g / (1.0f + expf(-form[1] * g)) : kz_glu_act(g, (int)form[0]);
    a = a > form[3] ? form[3] : a;
    u = u > form[4] ? form[4] : (u < -form[4] ? -form[4] : u);
    return a * (u + form[5]);
}
template <class XT>
static int kz_qexperts(const XT* x, const int64_t* index, const XT* wts, XT* out, const int64_t* sz,
                       const int64_t* wp, const float* form, int nthreads) {
    const int64_t T = sz[0], K = sz[1], E = sz[2], H = sz[3], I = sz[4], stages = sz[5];
    const uint8_t *wu = (const uint8_t*)wp[0], *wd = (const uint8_t*)wp[2];
    const float *su = (const float*)wp[1], *sd = (const float*)wp[3], *ub = (const float*)wp[4], *db = (const float*)wp[5];
    const int64_t S = T * K;
    int64_t* cnt = kz_scratch<int64_t>(0, 3 * (E + 2) + 2 * S);
    if (!cnt) return 1;
    int64_t *items = cnt + E + 2, *first = items + E + 2, *tok = first + E + 2, *slot = tok + S;
    for (int64_t e = 0; e < E + 2; ++e) cnt[e] = 0;
    for (int64_t p = 0; p < S; ++p) {
        if (index[p] < 0 || index[p] > E) return 2;
        ++cnt[index[p] + 1];
    }
    for (int64_t e = 0; e <= E; ++e) cnt[e + 1] += cnt[e];  // cnt[e]: expert e's first sorted position
    for (int64_t p = 0; p < S; ++p)
        if (index[p] < E) slot[cnt[index[p]]++] = p;
    for (int64_t e = E; e > 0; --e) cnt[e] = cnt[e - 1];
    cnt[0] = 0;
    const int64_t R = cnt[E];  // pairs routed to an expert of this call
    const int64_t nbh = H / kz_fmt::QK, rbh = nbh * kz_fmt::BYTES, nbi = I / kz_fmt::QK, rbi = nbi * kz_fmt::BYTES;
    const int64_t nxh = H / KZ_XQK, nxi = I / KZ_XQK, nsh = H / KZ_QK, nsi = I / KZ_QK;
    int8_t* xq = kz_scratch<int8_t>(1, R * (H + I) + 1);
    float* xd = kz_scratch<float>(2, R * (nxh + nxi + I + 1) + T * H + 1);
    int16_t* xs = kz_fmt::MIN ? kz_scratch<int16_t>(3, R * (nsh + nsi) + 1) : nullptr;
    if (!xq || !xd || (kz_fmt::MIN && !xs)) return 1;
    int8_t* hq = xq + R * H;
    float *hd = xd + R * nxh, *hs = hd + R * nxi, *ws = hs + R * I, *acc = ws + R;
    if (wp[6]) hs = (float*)wp[6];  // h between two calls (gate|up and down in other formats)
    int16_t* hsum = xs ? xs + R * nsh : nullptr;
    for (int64_t s = 0; s < R; ++s) {
        tok[s] = slot[s] / K;
        ws[s] = kz_ld(wts, slot[s]);
        if (stages & 1) kz_quantize_rows(x + tok[s] * H, 1, H, xq + s * H, xd + s * nxh, xs ? xs + s * nsh : nullptr);
    }
    int64_t active = 0, n1 = 0;  // the experts with pairs, in order; their stage-one items from first[a]
    for (int64_t e = 0; e < E; ++e)
        if (cnt[e + 1] > cnt[e]) {
            const int64_t q = kz_qnb(cnt[e + 1] - cnt[e]);
            items[active] = e, first[active++] = n1;
            n1 += (I + q - 1) / q;
        }
    first[active] = n1;
    const int64_t n2 = (H + KZ_QE_COLS - 1) / KZ_QE_COLS;
    const kz_team_t team = kz_team_open(nthreads, R * (2 * I * H + H * I) >= 32768);
    // (perf) each thread takes a contiguous range of items and prefetches the next item's rows while it reads
    // an item's: handed out one by one, two threads' items interleaved and each prefetched the other's next
    // block (q4_0, one token's 4 of 32 Qwen3-MoE experts, 5.3 MB, 2 threads: 0.44 -> 0.30 ms a call from
    // memory, 12 -> 18 GB/s; 0.21 -> 0.13 ms from cache)
    return kz_parallel_together(team, [=](int kz_tid, int kz_tn) KZ_BODY {
        float blk[8 * KZ_QNB], blu[8 * KZ_QNB];
        int64_t lo, hi, a = 0;  // the expert of item `it`: items come in increasing order
        kz_range(stages & 1 ? n1 : 0, kz_tid, kz_tn, lo, hi);
        for (int64_t it = lo; it < hi; ++it) {  // stage one
            while (first[a + 1] <= it) ++a;
            const int64_t e = items[a], r0 = cnt[e], r1 = cnt[e + 1], q = kz_qnb(r1 - r0);
            const int64_t c0 = (it - first[a]) * q, cn = I - c0 < q ? I - c0 : q;
            const uint8_t* we = wu + e * 2 * I * rbh;
            // the next item's gate rows: this expert's next block, or the next expert's first
            const uint8_t* ng = it + 1 >= hi || !KZ_PREFETCH ? nullptr
                              : c0 + q < I ? we + (c0 + q) * rbh : wu + items[a + 1] * 2 * I * rbh;
            for (int64_t r = r0; r < r1; r += 8) {
                const int64_t mr = r1 - r < 8 ? r1 - r : 8;
                const bool pf = r == r0 && ng;
                kz_qblock(we, rbh, c0, cn, q, nbh, mr, xq + r * H, xd + r * nxh, xs ? xs + r * nsh : 0, H, blk,
                          pf ? (const char*)ng : 0);
                kz_qblock(we, rbh, I + c0, cn, q, nbh, mr, xq + r * H, xd + r * nxh, xs ? xs + r * nsh : 0, H, blu,
                          pf ? (const char*)(ng + I * rbh) : 0);
                for (int64_t i = 0; i < mr; ++i)
                    for (int64_t j = 0; j < cn; ++j) {
                        const int64_t n = e * 2 * I + c0 + j;
                        const float g = blk[i * q + j] * (su ? su[n] : 1.0f) + (ub ? ub[n] : 0.0f);
                        const float u = blu[i * q + j] * (su ? su[n + I] : 1.0f) + (ub ? ub[n + I] : 0.0f);
                        hs[(r + i) * I + c0 + j] = kz_qglu(g, u, form);
                    }
            }
        }
        if (!(stages & 2)) return 0;
        if (stages & 1) kz_barrier(kz_tn);
        kz_range(R, kz_tid, kz_tn, lo, hi);  // each pair's h as int8 blocks
        kz_quantize_rows(hs + lo * I, hi - lo, I, hq + lo * I, hd + lo * nxi, hsum ? hsum + lo * nsi : nullptr);
        kz_barrier(kz_tn);
        kz_range(n2, kz_tid, kz_tn, lo, hi);
        for (int64_t it = lo; it < hi; ++it) {  // stage two
            const int64_t n0 = it * KZ_QE_COLS, nn = H - n0 < KZ_QE_COLS ? H - n0 : KZ_QE_COLS;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < nn; ++j) acc[t * H + n0 + j] = 0.0f;
            for (int64_t b = 0; b < active; ++b) {
                const int64_t e = items[b], r0 = cnt[e], r1 = cnt[e + 1], q = kz_qnb(r1 - r0);
                const uint8_t* de = wd + e * H * rbi;
                for (int64_t c0 = n0; c0 < n0 + nn; c0 += q) {
                    const int64_t cn = n0 + nn - c0 < q ? n0 + nn - c0 : q;
                    // the next rows read: this expert's next block, the next expert's first of this item, or
                    // the first expert's of the next item
                    const uint8_t* nx = c0 + q < n0 + nn ? de + (c0 + q) * rbi
                                      : b + 1 < active ? wd + (items[b + 1] * H + n0) * rbi
                                      : it + 1 < hi ? wd + (items[0] * H + n0 + KZ_QE_COLS) * rbi : nullptr;
                    for (int64_t r = r0; r < r1; r += 8) {
                        const int64_t mr = r1 - r < 8 ? r1 - r : 8;
                        kz_qblock(de, rbi, c0, cn, q, nbi, mr, hq + r * I, hd + r * nxi, hsum ? hsum + r * nsi : 0, I,
                                  blk, r == r0 && KZ_PREFETCH ? (const char*)nx : 0);
                        for (int64_t i = 0; i < mr; ++i)
                            for (int64_t j = 0; j < cn; ++j)
                                acc[tok[r + i] * H + c0 + j] +=
                                    ws[r + i] * (blk[i * q + j] * (sd ? sd[e * H + c0 + j] : 1.0f) + (db ? db[e * H + c0 + j] : 0.0f));
                    }
                }
            }
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < nn; ++j) kz_st(out, t * H + n0 + j, acc[t * H + n0 + j]);
        }
        return 0;
    });
}
// x [T, H], weights [T, K] and out [T, H] in XT; index [T, K] int64; sz: T, K, E, H, I and the stages to run
// (1: gate|up, writing h; 2: down, reading it; 3: both); wp: the addresses of the packed gate|up and its int8
// row scales, the packed down and its scales, the f32 gate|up bias [E * 2I] and down bias [E * H] (0: none),
// and h's f32 rows [T * K, I] in expert order (0: scratch; stage 1 and 2 in two calls: the libraries of
// two formats, each reading its own weight); form: kz_qglu's. Returns 1: out of memory, 2: an index outside [0, E].
#define KZ_QEXPERTS_ENTRY(XN, XT)                                                                             \
    extern "C" int $NAME$_experts_##XN(const XT* x, const int64_t* index, const XT* weights, XT* out,       \
                                       const int64_t* sz, const int64_t* wp, const float* form, int nthreads) { \
        return kz_qexperts(x, index, weights, out, sz, wp, form, nthreads);                                  \
    }
KZ_QEXPERTS_ENTRY(f32, float)
KZ_QEXPERTS_ENTRY(bf16, kz_bf16)

// the quantized activations as the kernel sees them (for tests): xq [m, k] int8, xd [m, k / the block]
extern "C" void $NAME$_quantize_x(const float* x, int64_t m, int64_t k, int8_t* xq, float* xd) {
    kz_quantize_rows(x, m, k, xq, xd, (int16_t*)0);
}

// one row of W (nb blocks from `row`, its scale rs) as f32 into o_row. The values equal formats.dequantize's
// bit for bit: a k-quant's sc * q is exact in f32 (an f16 times a 6-bit scale times a 4-bit q, or a single
// product for q6_k), so a fused multiply-subtract rounds the same.
KZ_INLINE void kz_dequant_row(const uint8_t* row, float rs, int64_t nb, float* o_row) {
    kz_fmt f;
    int8_t q[kz_fmt::QK];
    float sc[KZ_NSG], mn[KZ_NSUB];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kz_fmt::BYTES;
        f.scales(blk, sc, mn);
        float* o = o_row + b * kz_fmt::QK;
#if KZ_QAVX2
        // (perf) the dot product's unpack, 8 values per vector: q4_0 1.4 -> 5.9 G values/s (2 threads); 16 with
        // AVX-512 (each scale covers 16 values or more; 12.6 M values, 2 threads, AMX Xeon, f32 / bf16 out, two
        // alternating runs: q4_0 7.2-8.2 / 8.4-9.6 -> 9.5 / 12.4 G values/s, q6_k 4.7-5.8 / 5.5-6.2 -> 8.6 / 8.8)
        (void)q;
        for (int sb = 0; sb < KZ_NSUB; ++sb) {
            alignas(32) uint8_t raw[KZ_QK];
            _mm256_store_si256((__m256i*)raw, f.load(blk, sb));
#if defined(__AVX512F__)
            static_assert(kz_fmt::SG % 16 == 0, "a scale covers 16 values or more");
            for (int g = 0; g < KZ_QK / 16; ++g) {
                const __m128i part = _mm_load_si128((const __m128i*)(raw + 16 * g));
                __m512i iv = kz_fmt::UNSIGNED ? _mm512_cvtepu8_epi32(part) : _mm512_cvtepi8_epi32(part);
                if (kz_fmt::OFFSET) iv = _mm512_sub_epi32(iv, _mm512_set1_epi32(kz_fmt::OFFSET));
                const float scale = sc[(KZ_QK * sb + 16 * g) / kz_fmt::SG] * rs;
                __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(scale));
                if (kz_fmt::MIN) v = _mm512_sub_ps(v, _mm512_set1_ps(mn[sb]));
                _mm512_storeu_ps(o + KZ_QK * sb + 16 * g, v);
            }
#else
            for (int g = 0; g < KZ_QK / 8; ++g) {
                const __m128i part = _mm_loadl_epi64((const __m128i*)(raw + 8 * g));
                __m256i iv = kz_fmt::UNSIGNED ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
                if (kz_fmt::OFFSET) iv = _mm256_sub_epi32(iv, _mm256_set1_epi32(kz_fmt::OFFSET));
                const float scale = sc[(KZ_QK * sb + 8 * g) / kz_fmt::SG] * rs;
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(iv), _mm256_set1_ps(scale));
                if (kz_fmt::MIN) v = _mm256_sub_ps(v, _mm256_set1_ps(mn[sb]));
                _mm256_storeu_ps(o + KZ_QK * sb + 8 * g, v);
            }
#endif
        }
#else
        f.values(blk, q);
        for (int i = 0; i < kz_fmt::QK; ++i) {
            const float v = (float)q[i] * (sc[i / kz_fmt::SG] * rs);
            o[i] = kz_fmt::MIN ? v - mn[i / KZ_QK] : v;
        }
#endif
    }
}

// rows [n0, n1) of W into out [n1 - n0, k] (prefill: a panel of the weight for a library GEMM): as f32, or
// rounded to bf16 (kz_st_bf16_row: round to nearest even, as torch's conversion) for the CPU's native bf16
// GEMMs (quant.ops.native_panels), each row dequantized in an f32 row first: no f32 panel is written
template <class T> static int kz_dequant_rows(const uint8_t* w, const float* wscale, int64_t n0, int64_t n1, int64_t k,
                                              T* out, int nthreads) {
    const int64_t nb = k / kz_fmt::QK, rb = nb * kz_fmt::BYTES;
    return kz_parallel_for(kz_team_open(nthreads, (n1 - n0) * k >= 32768), [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(n1 - n0, t, tn, lo, hi);
        float* row = sizeof(T) == sizeof(float) ? nullptr : kz_scratch<float>(0, k);
        if (sizeof(T) != sizeof(float) && !row) return 1;
        for (int64_t r = lo; r < hi; ++r) {
            if constexpr (sizeof(T) == sizeof(float)) {
                kz_dequant_row(w + (n0 + r) * rb, wscale ? wscale[n0 + r] : 1.0f, nb, out + r * k);
            } else {
                kz_dequant_row(w + (n0 + r) * rb, wscale ? wscale[n0 + r] : 1.0f, nb, row);
#if KZ_BF16_ROWS
                kz_st_bf16_row(out + r * k, row, k);
#else
                for (int64_t i = 0; i < k; ++i) kz_st(out, r * k + i, row[i]);
#endif
            }
        }
        return 0;
    });
}
extern "C" int $NAME$_dequant(const uint8_t* w, const float* wscale, int64_t n0, int64_t n1, int64_t k, float* out,
                              int nthreads) {
    return kz_dequant_rows(w, wscale, n0, n1, k, out, nthreads);
}
extern "C" int $NAME$_dequant_bf16(const uint8_t* w, const float* wscale, int64_t n0, int64_t n1, int64_t k,
                                   kz_bf16* out, int nthreads) {
    return kz_dequant_rows(w, wscale, n0, n1, k, out, nthreads);
}
