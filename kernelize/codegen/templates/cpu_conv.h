// ---- convolutions over NHWC f32 (kernelize/codegen/cpu_conv.py) ------------------------------------------
// Two drivers, each passing every output value through the kernel's generated epilogue (an object with
// `epi(value, pixel, channel)` and, where every op of the chain has one, a vector form `epi.vec`):
//   kz_conv_dense:     groups of `cig` input and `cog` output channels (1x1, kxk, strided, dilated) as an
//                      implicit GEMM: a tile of KZ_MR output pixels x KZ_NR output channels accumulates in
//                      registers over taps x input channels, reading the input rows through per-tap row
//                      pointers (a zero row where a tap falls into the padding: no padded copy);
//   kz_conv_depthwise: one input channel per output channel (or per `m` of them: a channel multiplier, where
//                      output channel o reads input channel o / m), vectorised over output channels,
//                      KZ_DW_RUN output pixels of a row at a time.
// Weights come packed (cpu_conv.py pack_weight): dense [g][panel][kh][kw][cig][KZ_NR] with each group's
// output channels zero-padded to whole panels; depthwise [kh][kw][c padded to a multiple of KZ_NR].
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 / AVX2 forms below; elsewhere (aarch64) the GCC vector form
#endif

// KZ_NR: output channels per panel (cpu_conv.panel(), the packer's width, reads the same macros). A tile is
// KZ_MR pixels x KZ_NR channels: MR x NV accumulators, NV weight vectors and one broadcast in registers
#if defined(__AVX512F__)
typedef __m512 kz_vec;
#define KZ_VW 16
#define KZ_NR 32
#define KZ_MR 12  // 12 x 2 accumulators + 2 weight vectors + 1 broadcast of the 32 zmm registers
KZ_INLINE kz_vec kz_vzero() { return _mm512_setzero_ps(); }
KZ_INLINE kz_vec kz_vload(const float* p) { return _mm512_loadu_ps(p); }
KZ_INLINE kz_vec kz_vload_n(const float* p, int n) {  // the first n < KZ_VW lanes, the rest 0
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
KZ_INLINE kz_vec kz_vbcast(float s) { return _mm512_set1_ps(s); }
KZ_INLINE kz_vec kz_vfma(kz_vec a, kz_vec b, kz_vec c) { return _mm512_fmadd_ps(a, b, c); }
KZ_INLINE void kz_vstore(float* p, kz_vec v) { _mm512_storeu_ps(p, v); }
KZ_INLINE void kz_vstore_n(float* p, kz_vec v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), v); }
// clamp with a NaN x staying NaN: max / min return their second operand when either is NaN
KZ_INLINE kz_vec kz_vclamp(kz_vec x, float lo, float hi) {
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 kz_vec;
#define KZ_VW 8
// (perf) 6 x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of the 16 ymm registers. The 3 x 32 tile
// this replaced needed 17, so gcc read every weight vector from memory once per pixel (15 loads per 12
// FMAs); on Zen 3 a 1x1 conv ran at 37 GFLOPS that way and 60-80 with this tile
#define KZ_NR 16
#define KZ_MR 6
KZ_INLINE kz_vec kz_vzero() { return _mm256_setzero_ps(); }
KZ_INLINE kz_vec kz_vload(const float* p) { return _mm256_loadu_ps(p); }
KZ_INLINE kz_vec kz_vload_n(const float* p, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
KZ_INLINE kz_vec kz_vbcast(float s) { return _mm256_set1_ps(s); }
KZ_INLINE kz_vec kz_vfma(kz_vec a, kz_vec b, kz_vec c) { return _mm256_fmadd_ps(a, b, c); }
KZ_INLINE void kz_vstore(float* p, kz_vec v) { _mm256_storeu_ps(p, v); }
KZ_INLINE void kz_vstore_n(float* p, kz_vec v, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), v);
}
KZ_INLINE kz_vec kz_vclamp(kz_vec x, float lo, float hi) {
    return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x));
}
#else
typedef float kz_vec __attribute__((vector_size(16)));
#define KZ_VW 4
#define KZ_NR 32
#define KZ_MR 2
KZ_INLINE kz_vec kz_vzero() { return (kz_vec){0, 0, 0, 0}; }
KZ_INLINE kz_vec kz_vload(const float* p) { kz_vec v; memcpy(&v, p, sizeof v); return v; }
KZ_INLINE kz_vec kz_vload_n(const float* p, int n) { kz_vec v = kz_vzero(); memcpy(&v, p, 4 * n); return v; }
KZ_INLINE kz_vec kz_vbcast(float s) { return (kz_vec){s, s, s, s}; }
KZ_INLINE kz_vec kz_vfma(kz_vec a, kz_vec b, kz_vec c) { return a * b + c; }
KZ_INLINE void kz_vstore(float* p, kz_vec v) { memcpy(p, &v, sizeof v); }
KZ_INLINE void kz_vstore_n(float* p, kz_vec v, int n) { memcpy(p, &v, 4 * n); }
KZ_INLINE kz_vec kz_vclamp(kz_vec x, float lo, float hi) {
    for (int i = 0; i < KZ_VW; ++i) x[i] = kz_clamp(x[i], lo, hi);
    return x;
}
#endif
// kz_exp_normal and kz_sigmoid of cpu_prelude.h on a vector, in GCC vector arithmetic: the same shift
// rounding, reduction and polynomial (its constants), so a lane gives what the scalar form gives
typedef int32_t kz_vint __attribute__((vector_size(sizeof(kz_vec))));
KZ_INLINE kz_vec kz_vexp_normal(kz_vec x) {
    const kz_vec t = kz_vfma(x, kz_vbcast(KZ_LOG2E), kz_vbcast(KZ_EXP_SHIFT + 127.0f));
    const kz_vec k = t - kz_vbcast(KZ_EXP_SHIFT + 127.0f);
    kz_vec r = kz_vfma(k, kz_vbcast(-KZ_LN2_HI), x);
    r = kz_vfma(k, kz_vbcast(-KZ_LN2_LO), r);
    kz_vec p = kz_vfma(kz_vbcast(KZ_EXP_C0), r, kz_vbcast(KZ_EXP_C1));
    p = kz_vfma(p, r, kz_vbcast(KZ_EXP_C2));
    p = kz_vfma(p, r, kz_vbcast(KZ_EXP_C3));
    p = kz_vfma(p, r, kz_vbcast(KZ_EXP_C4));
    p = kz_vfma(kz_vfma(p, r, kz_vbcast(1.0f)), r, kz_vbcast(1.0f));
    return p * (kz_vec)((kz_vint)t << 23);
}
KZ_INLINE kz_vec kz_vsigmoid(kz_vec x) {
    const kz_vec nax = (kz_vec)((kz_vint)x | (kz_vint)kz_vbcast(-0.0f));  // -|x|: exp never overflows
    const kz_vec e = nax < kz_vbcast(-87.3f) ? kz_vzero() : kz_vexp_normal(nax);
    const kz_vec r = kz_vbcast(1.0f) / (kz_vbcast(1.0f) + e);
    return x < kz_vzero() ? e * r : r;
}

// the first n lanes at p (the rest 0) without reading past them
KZ_INLINE kz_vec kz_vld(const float* p, int n) { return n >= KZ_VW ? kz_vload(p) : kz_vload_n(p, n); }
// A depthwise conv with channel multiplier m reads, for output channels [c0, c0 + nc), the `n` input
// channels from c0 / m, lane i taking input lane idx[i] = (c0 % m + i) / m: one load and one permute.
struct kz_dw_rep {
    int n;
    kz_vint idx;
};
KZ_INLINE kz_dw_rep kz_dw_rep_of(int64_t m, int64_t c0, int nc) {
    kz_dw_rep r;
    const int64_t first = c0 % m;
    for (int i = 0; i < KZ_VW; ++i) r.idx[i] = (int32_t)((first + (i < nc ? i : nc - 1)) / m);
    r.n = (int)((first + nc - 1) / m + 1);
    return r;
}
KZ_INLINE kz_vec kz_vexpand(const float* p, const kz_dw_rep& r) {
    const kz_vec v = kz_vld(p, r.n);
#if defined(__AVX512F__)
    return _mm512_permutexvar_ps((__m512i)r.idx, v);
#elif defined(__AVX2__) && defined(__FMA__)
    return _mm256_permutevar8x32_ps(v, (__m256i)r.idx);
#else
    kz_vec out;
    for (int i = 0; i < KZ_VW; ++i) out[i] = v[r.idx[i]];
    return out;
#endif
}
// a depthwise conv's input lanes for output channels [c0, c0 + nc) at p (input channel c0 / m)
template <bool REP> KZ_INLINE kz_vec kz_dw_load(const float* p, int nc, const kz_dw_rep& r) {
    return REP ? kz_vexpand(p, r) : kz_vld(p, nc);
}
#define KZ_NV (KZ_NR / KZ_VW)             // vectors per panel row
#define KZ_DW_RUN 8                       // output pixels per depthwise step
#define KZ_MAX_TAPS 128                   // row pointers of a tile live on the stack (cpu_conv checks)
#define KZ_ZERO_ROW 8192                  // the most input channels per group (cpu_conv checks)

// sizes as the launcher passes them (one int64 array, in this order)
struct kz_conv_dims {
    int64_t n, h, w, c, oh, ow, co, kh, kw, sh, sw, pt, pl, dh, dw, g;
    int64_t nr;  // the panel width the weights were packed with: KZ_NR, else the call is refused
    int64_t ly;  // floats from one output pixel to the next: co, or more when the output is a channel slice
                 // of a wider NHWC buffer (a concat's, written in place: kernelize/runtime/buffers.py)
    int64_t nchw;  // 1: the input is NCHW (a graph's image, read as it comes: kz_conv_nchw_tiles), 0: NHWC
};

// the bytes a conv of these sizes moves at least: its input, output and weights once (the team's grain)
KZ_INLINE int64_t kz_conv_bytes(const kz_conv_dims& d) {
    return 4 * (d.n * (d.h * d.w * d.c + d.oh * d.ow * d.co) + d.co * (d.c / (d.g ? d.g : 1)) * d.kh * d.kw);
}

// what taps that fall into the padding read
static const float kz_zero_row[KZ_ZERO_ROW] = {0};

// acc[i][v] += sum over taps and input channels of a[tap * MR + i][k] * b[tap][k][v * KZ_VW ...], for the
// first NV vectors of each panel row
// (`shift`: floats every row pointer is read from further on: a group's channels in rows made for channel 0)
template <int MR, int NV>
KZ_INLINE void kz_conv_micro(int64_t taps, int64_t cig, const float* const* a, const float* b, kz_vec acc[MR][NV],
                             int64_t shift = 0) {
    for (int64_t t = 0; t < taps; ++t, a += MR) {
        // (perf) one running pointer and MR - 1 fixed byte offsets from it, as a GEMM over a strided matrix
        // would address its rows: with MR pointers and a running index gcc ran out of registers and
        // reloaded one every step (the 1x1 conv 4608 -> 512 ran at 100 instead of 112 GFLOPS)
        const char* base = (const char*)a[0];
        intptr_t off[MR];
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i) off[i] = (intptr_t)a[i] - (intptr_t)base;
        base += shift * sizeof(float);
        const float* end = b + cig * KZ_NR;
        for (; b != end; b += KZ_NR, base += sizeof(float)) {
            kz_vec w[NV];
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) w[v] = kz_vload(b + v * KZ_VW);
#pragma GCC unroll 32
            for (int i = 0; i < MR; ++i) {
                const kz_vec x = kz_vbcast(*(const float*)(base + off[i]));
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) acc[i][v] = kz_vfma(x, w[v], acc[i][v]);
            }
        }
    }
}

// rows[t * MR + i]: the input row (from channel `cofs`) under output pixel p0 + i for tap t, or the zero row
// where the tap falls into the padding or the pixel is past the end
template <int MR>
KZ_INLINE void kz_conv_rows(const kz_conv_dims& d, const float* x, int64_t p0, int64_t cofs, const float** rows) {
    // (perf) the pixel's coordinates step along the tile: three 64-bit divisions per pixel cost more than
    // the multiply-adds of a 1x1 conv over 16 input channels
    int64_t ox = p0 % d.ow, oy = (p0 / d.ow) % d.oh, n = p0 / (d.ow * d.oh);
    for (int i = 0; i < MR; ++i) {
        for (int64_t ky = 0; ky < d.kh; ++ky) {
            const int64_t iy = oy * d.sh - d.pt + ky * d.dh;
            for (int64_t kx = 0; kx < d.kw; ++kx) {
                const int64_t ix = ox * d.sw - d.pl + kx * d.dw;
                const bool in = n < d.n && iy >= 0 && iy < d.h && ix >= 0 && ix < d.w;
                rows[(ky * d.kw + kx) * MR + i] = in ? x + ((n * d.h + iy) * d.w + ix) * d.c + cofs : kz_zero_row;
            }
        }
        if (++ox == d.ow) {
            ox = 0;
            if (++oy == d.oh) oy = 0, ++n;
        }
    }
}

// the row-segment form of kz_conv_rows, for kernels whose taps along a row are adjacent (no column
// dilation, one group): rows[ky * MR + i] points at the kw * c contiguous inputs under kernel row ky of pixel
// p0 + i (weights are packed [ky][kx][ci], so kernel row ky is one run of kw * cig weights), and the product
// has kh taps of kw * cig channels instead of kh * kw taps of cig: a third of the pointers and loop trips for
// a 3x3 kernel, a ninth of them per input channel of an RGB stem (stem conv 660 -> 390 us). A pixel whose
// segment the left or right padding cuts reads a copy of it with zeros in the padding (`pad`: up to
// KZ_SEG_WINDOWS segments of KZ_SEG_FLOATS; with those tiles per tap, an RGB stem 3 -> 32 at 112 x 112
// outputs took 0.375 ms, with the copies 0.34-0.36). False (nothing usable written) when the copies do not
// fit; that tile goes per tap.
#define KZ_SEG_WINDOWS 64
#define KZ_SEG_FLOATS 64
template <int MR>
KZ_INLINE bool kz_conv_segments(const kz_conv_dims& d, const float* x, int64_t p0, int64_t cofs, const float** rows,
                                float* pad) {
    int64_t ox = p0 % d.ow, oy = (p0 / d.ow) % d.oh, n = p0 / (d.ow * d.oh);
    const int64_t cig = d.c / d.g, seg = d.kw * cig;
    int used = 0;
    for (int i = 0; i < MR; ++i) {
        const int64_t ix = ox * d.sw - d.pl;
        const bool cut = n < d.n && (ix < 0 || ix + d.kw > d.w);
        if (cut && seg > KZ_SEG_FLOATS) return false;
        for (int64_t ky = 0; ky < d.kh; ++ky) {
            const int64_t iy = oy * d.sh - d.pt + ky * d.dh;
            const bool in = n < d.n && iy >= 0 && iy < d.h;
            const float* row = x + (n * d.h + iy) * d.w * d.c + cofs;
            if (!in) {
                rows[ky * MR + i] = kz_zero_row;
            } else if (!cut) {
                rows[ky * MR + i] = row + ix * d.c;
            } else {
                if (used == KZ_SEG_WINDOWS) return false;
                float* w = pad + (used++) * KZ_SEG_FLOATS;
                for (int64_t kx = 0; kx < d.kw; ++kx) {
                    const int64_t col = ix + kx;
                    if (col >= 0 && col < d.w) memcpy(w + kx * cig, row + col * d.c, 4 * cig);
                    else memset(w + kx * cig, 0, 4 * cig);
                }
                rows[ky * MR + i] = w;
            }
        }
        if (++ox == d.ow) {
            ox = 0;
            if (++oy == d.oh) oy = 0, ++n;
        }
    }
    return true;
}

// one output pixel's values acc[0 .. NV) (channels c0 .. c0 + nc, nc <= NV * KZ_VW) through the epilogue into
// y. A kernel whose epilogue has a vector form (Epi::vector) applies it to the registers; otherwise the
// values go through a small buffer and a simd loop of the scalar form
template <int NV, class Epi>
KZ_INLINE void kz_conv_put(const kz_vec* acc, float* y, int64_t p, int64_t c0, int nc, const Epi& epi) {
    if constexpr (Epi::vector) {
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
            const int n = nc - v * KZ_VW;
            if (n >= KZ_VW)
                kz_vstore(y + v * KZ_VW, epi.vec(acc[v], p, c0 + v * KZ_VW, KZ_VW));
            else if (n > 0)
                kz_vstore_n(y + v * KZ_VW, epi.vec(acc[v], p, c0 + v * KZ_VW, n), n);
        }
    } else {
        float out[NV * KZ_VW];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) kz_vstore(out + v * KZ_VW, acc[v]);
        if (nc == NV * KZ_VW) {
#pragma omp simd
            for (int j = 0; j < NV * KZ_VW; ++j) y[j] = epi(out[j], p, c0 + j);
        } else {
#pragma omp simd
            for (int j = 0; j < nc; ++j) y[j] = epi(out[j], p, c0 + j);
        }
    }
}

// a dense tile's `rows` pixels through the epilogue into y (row stride ld). The scalar form buffers the whole
// tile first: one simd loop per pixel right after its own stores ran ~15% slower on a 1x1 conv with swish. An
// epilogue with a tile pass (Epi::tile_pass: one chosen at run time, cpu_gemm.cpp) then goes over the stored
// tile, still in L1, outside the registers' code (a run-time choice among inlined forms there cost the
// tiles 3-8%); only the tile drivers call it (the depthwise ones assert it is absent)
template <int MR, int NV, class Epi>
KZ_INLINE void kz_conv_tile_put(kz_vec acc[MR][NV], float* y, int64_t ld, int64_t p0, int64_t c0, int rows, int nc,
                                const Epi& epi) {
    if constexpr (Epi::vector) {
        // (perf) only constant indices into `acc` (a whole tile's loop unrolled, a partial one's over a copy),
        // so gcc keeps the accumulators in registers; indexed by a variable anywhere, it kept them on the stack
        // from the start and stored and loaded them around the multiply-adds
        if (rows == MR) {
#pragma GCC unroll 32
            for (int i = 0; i < MR; ++i) kz_conv_put<NV>(acc[i], y + i * ld, p0 + i, c0, nc, epi);
        } else {
            kz_vec part[MR][NV];
#pragma GCC unroll 32
            for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) part[i][v] = acc[i][v];
            for (int i = 0; i < rows; ++i) kz_conv_put<NV>(part[i], y + i * ld, p0 + i, c0, nc, epi);
        }
    } else {
        constexpr int W = NV * KZ_VW;
        float out[MR * W];
#pragma GCC unroll 32
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) kz_vstore(out + i * W + v * KZ_VW, acc[i][v]);
        for (int i = 0; i < rows; ++i) {
            if (nc == W) {
#pragma omp simd
                for (int j = 0; j < W; ++j) y[i * ld + j] = epi(out[i * W + j], p0 + i, c0 + j);
            } else {
#pragma omp simd
                for (int j = 0; j < nc; ++j) y[i * ld + j] = epi(out[i * W + j], p0 + i, c0 + j);
            }
        }
    }
    if constexpr (Epi::tile_pass) epi.tile(y, ld, p0, c0, rows, nc);
}

// acc starts at the channel bias when the epilogue's first op adds it (epi.bias_first), else at 0
template <int NV, class Epi>
KZ_INLINE void kz_conv_acc_init(kz_vec* acc, int64_t c0, int nc, const Epi& epi) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
        const int n = nc - v * KZ_VW;
        acc[v] = epi.bias_first && n > 0 ? kz_vld(epi.kz_b + c0 + v * KZ_VW, n) : kz_vzero();
    }
}

// a tile's accumulators: every pixel's start where kz_conv_acc_init starts one (unrolled: no variable index
// into `acc`, which would keep it on the stack)
template <int MR, int NV, class Epi>
KZ_INLINE void kz_conv_tile_init(kz_vec acc[MR][NV], int64_t c0, int nc, const Epi& epi) {
    kz_conv_acc_init<NV>(acc[0], c0, nc, epi);
#pragma GCC unroll 32
    for (int i = 1; i < MR; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] = acc[0][v];
}

// what one thread keeps between the tiles it computes: the row pointers of its last (tile, group)
struct kz_conv_rows_cache {
    const float* rows[KZ_MAX_TAPS * KZ_MR * 2];
    int64_t of = -1;  // (first pixel, group, tile height) the pointers are for
    bool seg = false; // and whether they are row segments
    float pad[KZ_SEG_WINDOWS * KZ_SEG_FLOATS];  // segments cut by the padding, as copies (kz_conv_segments)
};

// one tile: MR output pixels from p0 x the NV vectors of panel `unit` (a group's panel), epilogue included
// (pixels from `limit` on are computed but not stored: a chain's row ends there). Out of line: inlined into
// the chain's row loop, gcc kept the tile's row offsets in vector registers and on the stack (the chain's
// 32 -> 16 projection ran 2x slower than the same tiles in the conv's own driver)
template <int MR, int NV, class Epi>
static __attribute__((noinline)) void kz_conv_tile(const kz_conv_dims& d, const float* x, const float* wp, float* y, int64_t p0,
                            int64_t unit, bool segments, kz_conv_rows_cache& rc, const Epi& epi, int64_t limit) {
    // (perf) no divisions where there is one group: a 64-bit one costs ~20-40 cycles, what a 16-channel 1x1
    // tile's multiply-adds take in all
    const int64_t cig = d.g == 1 ? d.c : d.c / d.g, cog = d.g == 1 ? d.co : d.co / d.g, taps = d.kh * d.kw;
    const int64_t panels = (cog + KZ_NR - 1) / KZ_NR, gi = d.g == 1 ? 0 : unit / panels;
    const int64_t panel = d.g == 1 ? unit : unit % panels;
    // (perf) a tile's row pointers differ between groups only by the group's channel offset: made once per
    // tile from channel 0 and read `shift` floats on (zero rows too: the zero row covers every channel).
    // RegNet's convs of 8 channels per group computed 72 pointers per 72 multiply-add steps, once per group
    const bool shared = !segments && d.g > 1 && d.c <= KZ_ZERO_ROW;
    const int64_t key = (shared ? p0 * 64 : (p0 * d.g + gi) * 64) + MR, shift = shared ? gi * cig : 0;
    if (key != rc.of) {
        // (perf) a pointwise conv (1x1, stride 1, no padding) reads pixel p's channels at p * c: the rows
        // without the pixel coordinates' divisions (MobileNet's 16 -> 32 1x1 at 112 x 112 spent more time
        // making the pointers than multiplying)
        if (d.kh == 1 && d.kw == 1 && d.sh == 1 && d.sw == 1 && d.pt == 0 && d.pl == 0 && d.oh == d.h && d.ow == d.w) {
            const int64_t end = d.n * d.h * d.w, cofs = shared ? 0 : gi * cig;
            for (int i = 0; i < MR; ++i) rc.rows[i] = p0 + i < end ? x + (p0 + i) * d.c + cofs : kz_zero_row;
            rc.seg = false;
        } else {
            rc.seg = segments && kz_conv_segments<MR>(d, x, p0, gi * cig, rc.rows, rc.pad);
            if (!rc.seg) kz_conv_rows<MR>(d, x, p0, shared ? 0 : gi * cig, rc.rows);
        }
        rc.of = key;
    }
    const int64_t c0 = gi * cog + panel * KZ_NR;
    const int nc = (int)(cog - panel * KZ_NR < KZ_NR ? cog - panel * KZ_NR : KZ_NR);
    kz_vec acc[MR][NV];
    kz_conv_tile_init<MR, NV>(acc, c0, nc, epi);
    const float* b = wp + unit * taps * cig * KZ_NR;
    if (rc.seg)
        kz_conv_micro<MR, NV>(d.kh, d.kw * cig, rc.rows, b, acc);
    else
        kz_conv_micro<MR, NV>(taps, cig, rc.rows, b, acc, shift);
    kz_conv_tile_put<MR, NV>(acc, y + p0 * d.ly + c0, d.ly, p0, c0, limit - p0 < MR ? (int)(limit - p0) : MR, nc,
                             epi);
}

// tiles of MR output pixels x NV vectors of output channels (see kz_conv_dense); the pixels left after the
// whole tiles go in one tile of MR / 3 or 2 MR / 3 rows when they fit: a 7 x 7 output (49 pixels) in
// tiles of 12 computed 60 rows, 18% of ResNet-50's last stage spent on padding
template <int MR, int NV, class Epi>
static int kz_conv_dense_tiles(const kz_conv_dims& d, const float* x, const float* wp, float* y, int nthreads,
                               const Epi& epi) {
    const int64_t cig = d.c / d.g, cog = d.co / d.g, taps = d.kh * d.kw, panels = (cog + KZ_NR - 1) / KZ_NR;
    const int64_t units = d.g * panels;
    const int64_t pixels = d.n * d.oh * d.ow, whole = pixels / MR, rest = pixels - whole * MR;
    const int64_t tiles = whole + (rest > 0);
    constexpr int SMALL = MR / 3 > 0 ? MR / 3 : 1, MEDIUM = 2 * MR / 3 > 0 ? 2 * MR / 3 : 1;
    // a kernel row's inputs are contiguous when the row has no dilation and one group (cig == c)
    const bool segments = d.kw > 1 && d.dw == 1 && d.g == 1 && d.kw * cig <= KZ_ZERO_ROW;
    // (perf) panels go in blocks of ~256 KiB of weights, which stay in L2 while every tile of pixels
    // streams past; inside a block each thread takes a run of (tile, panel) items, tile-major, so a tile's
    // row pointers are computed once per group and its input rows stay in L1 across the panels it meets
    const int64_t panel_bytes = taps * cig * KZ_NR * 4;
    const int64_t per_block = panel_bytes >= (256 << 10) ? 1 : (256 << 10) / panel_bytes;
    const kz_team_t team = kz_team_work(nthreads, 2 * pixels * d.co * taps * cig, kz_conv_bytes(d));
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        kz_conv_rows_cache rc;
        for (int64_t u0 = 0; u0 < units; u0 += per_block) {
            const int64_t nu = units - u0 < per_block ? units - u0 : per_block;
            int64_t lo, hi;
            kz_range(tiles * nu, t, tn, lo, hi);
            for (int64_t item = lo; item < hi; ++item) {
                const int64_t tile = item / nu, unit = u0 + item % nu, p0 = tile * MR;
                // (perf) a group's last panel holding at most half a panel of channels (ShuffleNet's groups
                // of 20: 16 + 4) multiplies half the vectors
                if (NV >= 2 && cog - (unit % panels) * KZ_NR <= KZ_NR / 2 && (tile < whole || rest > MEDIUM))
                    kz_conv_tile<MR, (NV >= 2 ? NV / 2 : 1)>(d, x, wp, y, p0, unit, segments, rc, epi, pixels);
                else if (tile < whole || rest > MEDIUM)
                    kz_conv_tile<MR, NV>(d, x, wp, y, p0, unit, segments, rc, epi, pixels);
                else if (rest > SMALL)
                    kz_conv_tile<MEDIUM, NV>(d, x, wp, y, p0, unit, segments, rc, epi, pixels);
                else
                    kz_conv_tile<SMALL, NV>(d, x, wp, y, p0, unit, segments, rc, epi, pixels);
            }
        }
        return 0;
    });
}

// ---- convs over an NCHW input: a network's stem reading the caller's image ----------------------------------
// A conv over few input channels (an RGB stem: kh * kw * c of 27-363 products per output) has too little work
// per tap for the NHWC tiles: per tile, the row pointers (or row segments) of MR pixels cost about what its
// multiply-adds do, and the image must first be copied NHWC. A 3 x 3 stem ran at 15-25 GFLOP/s, a 7 x 7 one
// at 50-70 (Zen 3, 1 thread; ~90 is the core's peak), plus 0.26-0.37 ms for the copy. Here each output row
// first copies the input rows under it (c x kh rows of the NCHW image) into a window with the padding as
// zeros, and a tile of MR pixels then reads the window in place, as MLAS's NCHW conv kernel reads the image:
// per tap, the MR inputs sit SW floats apart from one running pointer (compile-time offsets for strides 1, 2
// and 4). Packing the taps of the border tiles instead ([tap][pixel], scalar) took a quarter of a 7 x 7
// stem's time for its 5% of pixels. The taps go (ky, kx, c), the order pack_weight lays a panel's weights in.
#define KZ_NCHW_MAX_K 512  // the most taps x channels (cpu_conv.MAX_NCHW_K)

// one tile of MR pixels x NV vectors, epilogue included; pixel j's input under tap (ky, kx, ci) at
// x[ci * plane + ky * ld + kx * dw + j * SW] (SW 0: the conv's stride, at run time). CC: the input channels
// when they are 3 (an RGB image: the loop over them unrolled), else 0. Out of line: inlined into the driver's
// loop, gcc kept the accumulators in memory (3x slower)
template <int MR, int NV, int SW, int CC, class Epi>
static __attribute__((noinline)) void kz_conv_nchw_tile(const kz_conv_dims& d, const float* x, int64_t ld,
                                                        int64_t plane, const float* b, float* y, int64_t p,
                                                        int64_t c0, int rows, int nc, const Epi& epi) {
    kz_vec acc[MR][NV];
    kz_conv_tile_init<MR, NV>(acc, c0, nc, epi);
    const int64_t channels = CC ? CC : d.c, sw = SW ? SW : d.sw;
    for (int64_t ky = 0; ky < d.kh; ++ky)
        for (int64_t kx = 0; kx < d.kw; ++kx) {
            const float* xr = x + ky * ld + kx * d.dw;
#pragma GCC unroll 4
            for (int64_t c = 0; c < channels; ++c, xr += plane, b += KZ_NR) {
                kz_vec w[NV];
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) w[v] = kz_vload(b + v * KZ_VW);
#pragma GCC unroll 32
                for (int i = 0; i < MR; ++i) {
                    const kz_vec xv = kz_vbcast(xr[i * sw]);
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) acc[i][v] = kz_vfma(xv, w[v], acc[i][v]);
                }
            }
        }
    kz_conv_tile_put<MR, NV>(acc, y, d.ly, p, c0, rows, nc, epi);
}

// SW: the conv's column stride when it is 1, 2 or 4, else 0 (read at run time)
template <int MR, int NV, int SW, class Epi>
static int kz_conv_nchw_tiles(const kz_conv_dims& d, const float* x, const float* wp, float* y, int nthreads,
                              const Epi& epi) {
    const int64_t taps = d.kh * d.kw * d.c, panels = (d.co + KZ_NR - 1) / KZ_NR, rows = d.n * d.oh;
    if (d.g != 1 || taps > KZ_NCHW_MAX_K) return 1;
    // a row's window: the columns under its whole tiles (the last one's pixels past the row too), from the
    // first tap's column of pixel 0 (ix = -pl)
    const int64_t tiles = (d.ow + MR - 1) / MR, ld = (tiles * MR - 1) * d.sw + (d.kw - 1) * d.dw + 1;
    const int64_t plane = d.kh * ld, x0 = d.pl < ld ? d.pl : ld, x1 = d.w + d.pl < ld ? d.w + d.pl : ld;
    const kz_team_t team = kz_team_work(nthreads, 2 * rows * d.ow * d.co * taps, kz_conv_bytes(d));
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(rows, t, tn, lo, hi);
        if (lo >= hi) return 0;
        float* win = (float*)malloc(d.c * plane * sizeof(float));
        if (!win) return 1;
        for (int64_t row = lo; row < hi; ++row) {
            const int64_t n = row / d.oh, oy = row % d.oh;
            for (int64_t ci = 0; ci < d.c; ++ci)
                for (int64_t ky = 0; ky < d.kh; ++ky) {
                    const int64_t iy = oy * d.sh - d.pt + ky * d.dh;
                    float* dst = win + ci * plane + ky * ld;
                    if (iy < 0 || iy >= d.h) {
                        memset(dst, 0, ld * sizeof(float));
                        continue;
                    }
                    memset(dst, 0, x0 * sizeof(float));
                    if (x1 > x0) memcpy(dst + x0, x + ((n * d.c + ci) * d.h + iy) * d.w, (x1 - x0) * sizeof(float));
                    memset(dst + x1, 0, (ld - (x1 > x0 ? x1 : x0)) * sizeof(float));
                }
            for (int64_t ox = 0; ox < d.ow; ox += MR) {
                const int64_t p = row * d.ow + ox;
                const int cols = d.ow - ox < MR ? (int)(d.ow - ox) : MR;
                const float* xt = win + ox * d.sw;
                for (int64_t panel = 0; panel < panels; ++panel) {
                    const int64_t c0 = panel * KZ_NR;
                    const int nc = (int)(d.co - c0 < KZ_NR ? d.co - c0 : KZ_NR);
                    const float* b = wp + panel * taps * KZ_NR;
                    float* yt = y + p * d.ly + c0;
                    if (d.c == 3) kz_conv_nchw_tile<MR, NV, SW, 3>(d, xt, ld, plane, b, yt, p, c0, cols, nc, epi);
                    else kz_conv_nchw_tile<MR, NV, SW, 0>(d, xt, ld, plane, b, yt, p, c0, cols, nc, epi);
                }
            }
        }
        free(win);
        return 0;
    });
}

// NCHW: -1, or the function also takes an NCHW input (cpu_conv.reads_nchw: a stem) with this horizontal stride
// (1, 2, 4; 0 any other); HALF: groups of at most half a panel of output channels. Both are known when a kernel
// is rendered (cpu_conv.render), and each driver left out is compiled code saved: every variant in one
// function took 3.7 s to build cold, the NHWC full-panel one 1.7
template <int NCHW, bool HALF, class Epi>
static int kz_conv_dense(const kz_conv_dims& d, const float* x, const float* wp, float* y, int nthreads,
                         const Epi& epi) {
    if (d.nr != KZ_NR || d.ly < d.co || d.c / d.g > KZ_ZERO_ROW || d.kh * d.kw > KZ_MAX_TAPS) return 1;
    const int sw = d.sw == 1 || d.sw == 2 || d.sw == 4 ? (int)d.sw : 0;
    if ((d.nchw && sw != NCHW) || (HALF && d.co / d.g > KZ_NR / 2)) return 1;
    if (d.n * d.oh * d.ow == 0 || d.co == 0) return 0;
    // (perf) groups of at most half a panel of output channels (a 1x1 projection to 16 channels) use half
    // the vectors and twice the pixels per tile: the same registers, no multiply-adds on padding
    constexpr int MR = HALF ? 2 * KZ_MR : KZ_MR, NV = HALF ? KZ_NV / 2 : KZ_NV;
    if constexpr (NCHW >= 0)
        if (d.nchw) return kz_conv_nchw_tiles<MR, NV, NCHW>(d, x, wp, y, nthreads, epi);
    return kz_conv_dense_tiles<MR, NV>(d, x, wp, y, nthreads, epi);
}

// One output row (n, oy) of a depthwise conv, channels [c0, c0 + nch), in runs of R pixels, each run over
// every channel block before the next run, so the input a run reads (kernel rows x a few columns x the row's
// channels) is still in L1 for its next block (block by block over the whole row, a 32-channel stride-2
// conv at 112 x 112 took 0.13-0.16 ms, run by run 0.08-0.11; Zen 3, 1 thread, interleaved). Inside the
// row, full blocks multiply-add straight from memory (one instruction per tap and pixel; 5-12% faster than
// the columns held in registers, which left too few for accumulators); runs at the row's ends (padding),
// partial blocks and channel multipliers take the sliding-window form: the (R - 1) * SW + KW input columns
// under a run's kernel row loaded once into registers (the zero row in the padding, a multiplier's permute
// once per column). A run past the row's end computes pixels it does not store. `rows[t]` are the input
// rows of kernel rows [ky0, ky0 + nky) (column 0, the input channel of output channel c0); `w` the weights
// of kernel row ky0 from channel c0, `wrow` floats per kernel row; y the row's first output pixel p at c0.
// Kept out of line: inlined into the caller, gcc ran out of registers and re-read every column.
template <int KW, int SW, int R, class Epi, bool REP = false>
static __attribute__((noinline)) void kz_conv_dw_slide(const kz_conv_dims& d, const float* const* rows, int nky,
                                                       const float* w, int64_t wrow, int64_t cpad, float* y,
                                                       int64_t p, int64_t c0, int nch, const Epi& epi,
                                                       const kz_dw_rep& rp = kz_dw_rep()) {
    constexpr int NCOL = (R - 1) * SW + KW;
    for (int64_t ox = 0; ox < d.ow; ox += R) {
        const int64_t ix0 = ox * SW - d.pl;
        const bool inside = ix0 >= 0 && ix0 + NCOL <= d.w;
        const int run = d.ow - ox < R ? (int)(d.ow - ox) : R;
        for (int cb = 0; cb < nch; cb += KZ_VW) {
            const int nc = nch - cb < KZ_VW ? nch - cb : KZ_VW;
            kz_vec acc[R];
            kz_conv_acc_init<1>(&acc[0], c0 + cb, nc, epi);
#pragma GCC unroll 16
            for (int i = 1; i < R; ++i) acc[i] = acc[0];
            for (int ky = 0; ky < nky; ++ky) {
                const float* q = rows[ky] + (REP ? 0 : cb);  // (a multiplier's call has one block)
                if (!REP && inside && nc == KZ_VW) {
                    q += ix0 * d.c;
#pragma GCC unroll 8
                    for (int kx = 0; kx < KW; ++kx) {
                        const kz_vec wv = kz_vload(w + ky * wrow + kx * cpad + cb);
#pragma GCC unroll 16
                        for (int i = 0; i < R; ++i) acc[i] = kz_vfma(kz_vload(q + (i * SW + kx) * d.c), wv, acc[i]);
                    }
                    continue;
                }
                kz_vec in[NCOL];
#pragma GCC unroll 32
                for (int j = 0; j < NCOL; ++j) {
                    const int64_t ix = ix0 + j;
                    in[j] = kz_dw_load<REP>(ix >= 0 && ix < d.w ? q + ix * d.c : kz_zero_row, nc, rp);
                }
#pragma GCC unroll 8
                for (int kx = 0; kx < KW; ++kx) {
                    const kz_vec wv = kz_vload(w + ky * wrow + kx * cpad + cb);
#pragma GCC unroll 16
                    for (int i = 0; i < R; ++i) acc[i] = kz_vfma(in[i * SW + kx], wv, acc[i]);
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i)
                if (i < run) kz_conv_put<1>(&acc[i], y + (ox + i) * d.ly + cb, p + ox + i, c0 + cb, nc, epi);
        }
    }
}

// output pixels [ox0, ox0 + run) of row (n, oy), channels [c0, c0 + nc), kernel rows [ky0, ky1): any kernel
// (dilated, or a width / stride without a sliding-window form), taps in the padding reading the zero row
template <bool REP, class Epi>
KZ_INLINE void kz_conv_dw_any(const kz_conv_dims& d, const float* x, const float* wp, float* y, int64_t n,
                              int64_t oy, int64_t ox0, int run, int64_t c0, int nc, int64_t ky0, int64_t ky1,
                              const Epi& epi, const kz_dw_rep& rp) {
    const int64_t cpad = (d.co + KZ_NR - 1) / KZ_NR * KZ_NR;
    kz_vec acc[KZ_DW_RUN];
    kz_conv_acc_init<1>(&acc[0], c0, nc, epi);
    for (int i = 1; i < KZ_DW_RUN; ++i) acc[i] = acc[0];
    for (int64_t ky = ky0; ky < ky1; ++ky) {
        const float* xrow = x + (n * d.h + oy * d.sh - d.pt + ky * d.dh) * d.w * d.c + c0 * d.c / d.co;
        for (int64_t kx = 0; kx < d.kw; ++kx) {
            const kz_vec w = kz_vload(wp + (ky * d.kw + kx) * cpad + c0);
#pragma GCC unroll 16
            for (int i = 0; i < KZ_DW_RUN; ++i) {
                const int64_t ix = (ox0 + i) * d.sw - d.pl + kx * d.dw;
                const float* q = i < run && ix >= 0 && ix < d.w ? xrow + ix * d.c : kz_zero_row;
                acc[i] = kz_vfma(kz_dw_load<REP>(q, nc, rp), w, acc[i]);
            }
        }
    }
    const int64_t p = (n * d.oh + oy) * d.ow + ox0;
    for (int i = 0; i < run; ++i) kz_conv_put<1>(&acc[i], y + (p + i) * d.ly + c0, p + i, c0, nc, epi);
}

// output row (n, oy), channels [c0, c0 + nc): the sliding-window form when the kernel has one (KW > 0: the
// caller checked width, stride and dilation), else runs of the general form one channel block at a time
template <int KW, int SW, int R, bool REP, class Epi>
KZ_INLINE void kz_conv_dw_row(const kz_conv_dims& d, const float* x, const float* wp, float* y, int64_t n,
                              int64_t oy, int64_t c0, int nc, const Epi& epi) {
    const kz_dw_rep rp = REP ? kz_dw_rep_of(d.co / d.c, c0, nc) : kz_dw_rep();
    const int64_t ci = c0 * d.c / d.co;  // the input channel of output channel c0
    int64_t ky0 = 0, ky1 = d.kh;  // the kernel rows whose input row exists
    while (ky0 < ky1 && oy * d.sh - d.pt + ky0 * d.dh < 0) ++ky0;
    while (ky1 > ky0 && oy * d.sh - d.pt + (ky1 - 1) * d.dh >= d.h) --ky1;
    if (KW > 0) {
        const int64_t cpad = (d.co + KZ_NR - 1) / KZ_NR * KZ_NR, p = (n * d.oh + oy) * d.ow;
        const float* rows[16];
        for (int64_t ky = ky0; ky < ky1; ++ky) rows[ky - ky0] = x + (n * d.h + oy * d.sh - d.pt + ky * d.dh) * d.w * d.c + ci;
        kz_conv_dw_slide<KW, SW, R, Epi, REP>(d, rows, (int)(ky1 - ky0), wp + ky0 * KW * cpad + c0, KW * cpad, cpad,
                                              y + p * d.ly + c0, p, c0, nc, epi, rp);
        return;
    }
    for (int64_t cb = c0; cb < c0 + nc; cb += KZ_VW) {
        const int nb = c0 + nc - cb < KZ_VW ? (int)(c0 + nc - cb) : KZ_VW;
        for (int64_t ox = 0; ox < d.ow; ox += KZ_DW_RUN)
            kz_conv_dw_any<REP>(d, x, wp, y, n, oy, ox, (int)(d.ow - ox < KZ_DW_RUN ? d.ow - ox : KZ_DW_RUN), cb, nb,
                                ky0, ky1, epi, rp);
    }
}

// a thread's share of the (output row, channel group) items. A group is every channel block of the row
// unless the rows alone leave a thread of the team short (a 7 x 7 map: 7 rows), and one block under a
// channel multiplier (its permute pattern is per block)
template <int KW, int SW, int R, bool REP = false, class Epi>
static void kz_conv_dw_rows(const kz_conv_dims& d, const float* x, const float* wp, float* y, const Epi& epi, int t,
                            int tn) {
    const int64_t rows = d.n * d.oh, cblocks = (d.co + KZ_VW - 1) / KZ_VW;
    int64_t groups = REP ? cblocks : (4 * tn + rows - 1) / rows;
    groups = groups < cblocks ? groups : cblocks;
    const int64_t per = (cblocks + groups - 1) / groups * KZ_VW;
    int64_t lo, hi;
    kz_range(rows * groups, t, tn, lo, hi);
    for (int64_t item = lo; item < hi; ++item) {
        const int64_t r = item / groups, c0 = (item % groups) * per;
        if (c0 < d.co) kz_conv_dw_row<KW, SW, R, REP>(d, x, wp, y, r / d.oh, r % d.oh, c0, (int)(d.co - c0 < per ? d.co - c0 : per), epi);
    }
}

// REP: a channel multiplier (output channels a multiple of the input's; cpu_conv.render picks the driver)
// the sliding-window form a depthwise conv takes (kernel width x 10 + stride; 0: the generic rows): the
// kernel shapes of MobileNet / EfficientNet-style networks (its row pointers hold 16 kernel rows); with a
// multiplier, only the 3 x 3 stride-1 one
KZ_INLINE int kz_dw_form(const kz_conv_dims& d, bool rep) {
    const int form = d.dw != 1 || d.kh > 16 ? 0 : (int)(d.kw * 10 + d.sw);
    const bool known = form == 31 || (!rep && (form == 32 || form == 51 || form == 52 || form == 71));
    return known ? form : 0;
}

// FORM: the kz_dw_form the function is compiled for (cpu_conv.render knows the kernel's shape: one form
// compiled, not six), or -1 for every form
template <bool REP = false, int FORM = -1, class Epi>
static int kz_conv_depthwise(const kz_conv_dims& d, const float* x, const float* wp, float* y, int nthreads,
                             const Epi& epi) {
    static_assert(!Epi::tile_pass, "the depthwise driver applies no tile pass");
    const int64_t rows = d.n * d.oh;
    if (d.nr != KZ_NR || d.ly < d.co || d.c != d.g || d.c < 1 || d.co % d.c || (!REP && d.co != d.c) || d.nchw)
        return 1;
    const int form = kz_dw_form(d, REP);
    if (FORM >= 0 && form != FORM) return 1;
    if (rows * d.ow == 0 || d.co == 0) return 0;
    // (perf) counted 4x in the team's grain: a depthwise conv's multiply-adds run at ~16 flops / ns on a core
    // (each input loaded for kh x kw products of one channel), not a dense conv's ~64. Counted 1x, MobileNet's
    // 256-channel 14 x 14 ones (estimated 39 us, 44-65 measured) ran alone, and slower at 2 threads than at 1
    const kz_team_t team = kz_team_work(nthreads, 8 * rows * d.ow * d.co * d.kh * d.kw, kz_conv_bytes(d));
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        if constexpr (FORM < 0 || FORM == 31)
            if (form == 31) kz_conv_dw_rows<3, 1, 8, REP>(d, x, wp, y, epi, t, tn);
        if constexpr (!REP && (FORM < 0 || FORM == 32))
            if (form == 32) kz_conv_dw_rows<3, 2, 4>(d, x, wp, y, epi, t, tn);
        if constexpr (!REP && (FORM < 0 || FORM == 51))
            if (form == 51) kz_conv_dw_rows<5, 1, 8>(d, x, wp, y, epi, t, tn);
        if constexpr (!REP && (FORM < 0 || FORM == 52))
            if (form == 52) kz_conv_dw_rows<5, 2, 4>(d, x, wp, y, epi, t, tn);
        if constexpr (!REP && (FORM < 0 || FORM == 71))  // ConvNeXt
            if (form == 71) kz_conv_dw_rows<7, 1, 8>(d, x, wp, y, epi, t, tn);
        if constexpr (FORM <= 0)
            if (form == 0) kz_conv_dw_rows<0, 0, KZ_DW_RUN, REP>(d, x, wp, y, epi, t, tn);
        return 0;
    });
}

// ---- conv chains (kernelize/autokernel/conv.py conv_chains) ------------------------------------------------
// [1x1 expand A] -> depthwise B -> [1x1 project C] as one pass over groups of output rows: for a group of B's
// output rows, A computes the rows of its output their windows cover into a buffer (rows the previous group
// already computed are moved to its front, not computed again), B writes the group's rows into a second
// buffer and C turns that into the output rows. Only the chain's input and output touch memory. A group
// holds at least KZ_CHAIN_PIXELS output pixels, so the 1x1 stages are GEMMs of several row tiles (a 7 x 7
// output row by row wasted 5 of every 12 tile rows). The stages are the single convs' tile and
// sliding-window functions on those buffers, addressed through base pointers offset by the first pixel
// they hold (d[s]: each stage's sizes).
#define KZ_CHAIN_PIXELS 48

// A's output for image n, input rows [lo, hi), into buf (rows of w pixels x the expanded channels)
// (HALF: A's output channels fill at most half a panel, tiles of twice the pixels and half the vectors)
template <bool HALF, class E0>
KZ_INLINE void kz_conv_chain_expand(const kz_conv_dims& da, const float* x, const float* w, float* buf, int64_t n,
                                    int64_t lo, int64_t hi, int64_t buf_first, kz_conv_rows_cache& rc, const E0& e0) {
    const int64_t units = (da.co + KZ_NR - 1) / KZ_NR, p_end = (n * da.h + hi) * da.w;
    float* base = buf - (n * da.h + buf_first) * da.w * da.co;
    for (int64_t p0 = (n * da.h + lo) * da.w; p0 < p_end; p0 += KZ_MR)
        for (int64_t u = 0; u < units; ++u) {
            if constexpr (HALF)
                kz_conv_tile<2 * KZ_MR, KZ_NV / 2>(da, x, w, base, p0, u, false, rc, e0, p_end);
            else
                kz_conv_tile<KZ_MR, KZ_NV>(da, x, w, base, p0, u, false, rc, e0, p_end);
        }
}

// C's output for B's pixels [p, p_end), held in buf from pixel p
template <bool HALF, class E2>
KZ_INLINE void kz_conv_chain_project(const kz_conv_dims& dc, const float* buf, const float* w, float* y, int64_t p,
                                     int64_t p_end, kz_conv_rows_cache& rc, const E2& e2) {
    const int64_t units = (dc.co + KZ_NR - 1) / KZ_NR;
    const float* base = buf - p * dc.c;
    for (int64_t p0 = p; p0 < p_end; p0 += KZ_MR)
        for (int64_t u = 0; u < units; ++u) {
            if constexpr (HALF)
                kz_conv_tile<2 * KZ_MR, KZ_NV / 2>(dc, base, w, y, p0, u, false, rc, e2, p_end);
            else
                kz_conv_tile<KZ_MR, KZ_NV>(dc, base, w, y, p0, u, false, rc, e2, p_end);
        }
}

template <int KW, int SW, int R, bool A, bool C, bool HA, bool HC, class E0, class E1, class E2>
static void kz_conv_chain_rows(const kz_conv_dims* d, const float* x, const float* const* w, float* y,
                               int64_t r0, int64_t r1, int64_t group, float* t1, float* t2, const E0& e0,
                               const E1& e1, const E2& e2) {
    const kz_conv_dims &da = d[0], &db = d[1], &dc = d[2];
    const int64_t e = db.c, cpad = (e + KZ_NR - 1) / KZ_NR * KZ_NR, row_floats = db.w * e;
    int64_t held_n = -1, held_lo = 0, held_hi = 0;  // A's rows in t1: [held_lo, held_hi) of image held_n
    kz_conv_rows_cache rca, rcc;
    for (int64_t g0 = r0; g0 < r1;) {
        const int64_t n = g0 / db.oh, oy0 = g0 % db.oh;
        const int64_t g1 = g0 + group < r1 && oy0 + group < db.oh ? g0 + group : (r1 < (n + 1) * db.oh ? r1 : (n + 1) * db.oh);
        const int64_t oy1 = oy0 + (g1 - g0);
        int64_t lo = oy0 * db.sh - db.pt, hi = (oy1 - 1) * db.sh - db.pt + db.kh;
        lo = lo < 0 ? 0 : lo;
        hi = hi > db.h ? db.h : hi;
        if (A) {
            if (held_n == n && lo >= held_lo && lo < held_hi) {  // keep the rows the group shares with the last
                memmove(t1, t1 + (lo - held_lo) * row_floats, sizeof(float) * (held_hi - lo) * row_floats);
                kz_conv_chain_expand<HA>(da, x, w[0], t1, n, held_hi, hi, lo, rca, e0);
            } else {
                kz_conv_chain_expand<HA>(da, x, w[0], t1, n, lo, hi, lo, rca, e0);
            }
            held_n = n, held_lo = lo, held_hi = hi;
        }
        const float* in = A ? t1 - lo * row_floats : x + n * db.h * row_floats;  // row iy at in + iy * row_floats
        const int64_t p = g0 * db.ow;  // B's first output pixel of the group
        for (int64_t oy = oy0; oy < oy1; ++oy) {
            int64_t ky0 = 0, ky1 = db.kh;
            while (ky0 < ky1 && oy * db.sh - db.pt + ky0 < 0) ++ky0;
            while (ky1 > ky0 && oy * db.sh - db.pt + ky1 - 1 >= db.h) --ky1;
            const int64_t pr = (n * db.oh + oy) * db.ow;
            float* out = C ? t2 + (pr - p) * e : y + pr * db.ly;
            const float* rows[16];
            for (int64_t ky = ky0; ky < ky1; ++ky) rows[ky - ky0] = in + (oy * db.sh - db.pt + ky) * row_floats;
            kz_conv_dw_slide<KW, SW, R>(db, rows, (int)(ky1 - ky0), w[1] + ky0 * KW * cpad, KW * cpad, cpad, out, pr, 0,
                                        (int)e, e1);
        }
        if (C) kz_conv_chain_project<HC>(dc, t2, w[2], y, p, g1 * db.ow, rcc, e2);
        g0 = g1;
    }
}

// d: the three stages' sizes (d[1] the depthwise one; d[0] / d[2] unused without A / C); w: their packed
// weights; each thread takes a band of output rows, in groups of about KZ_CHAIN_PIXELS pixels. FORM: the
// depthwise stage's sliding form (kz_dw_form: 31, 32, 51 or 52), HA / HC: A's / C's outputs fill at most half
// a panel; cpu_conv.render_chain knows them from the kernel, so only those variants are compiled
template <bool A, bool C, int FORM, bool HA, bool HC, class E0, class E1, class E2>
static int kz_conv_chain(const kz_conv_dims* d, const float* x, const float* const* w, float* y, int nthreads,
                         const E0& e0, const E1& e1, const E2& e2) {
    const kz_conv_dims& db = d[1];
    const int64_t rows = db.n * db.oh, e = db.c;
    if (db.kh > 16 || db.nr != KZ_NR || (A && d[0].nr != KZ_NR) || (C && d[2].nr != KZ_NR) || d[0].nchw) return 1;
    if (db.dw != 1 || db.kw * 10 + db.sw != FORM || (A && (d[0].co <= KZ_NR / 2) != HA) ||
        (C && (d[2].co <= KZ_NR / 2) != HC))
        return 1;
    if (rows * db.ow == 0) return 0;
    const int64_t group = (KZ_CHAIN_PIXELS + db.ow - 1) / db.ow;
    const int64_t work = rows * db.ow * e * (db.kh * db.kw + (A ? d[0].c : 0) + (C ? d[2].co : 0));
    const int64_t bytes = kz_conv_bytes(d[A ? 0 : 1]) + kz_conv_bytes(d[C ? 2 : 1]);
    constexpr int KW = FORM / 10, SW = FORM % 10, R = SW == 1 ? 8 : 4;
    return kz_parallel_for(kz_team_work(nthreads, 2 * work, bytes), [=](int t, int tn) KZ_BODY {
        const int64_t r0 = rows * t / tn, r1 = rows * (t + 1) / tn;
        // A's rows for a group, B's rows for C, with KZ_MR pixels of slack: a tile of C computes past the
        // group's end. Zeroed: garbage there could be denormal floats, which x86 multiplies ~100x slower
        const int64_t t1_rows = (group - 1) * db.sh + db.kh;
        float* t1 = (float*)calloc(A ? (t1_rows * db.w + KZ_MR) * e : 1, sizeof(float));
        float* t2 = (float*)calloc(C ? (group * db.ow + 2 * KZ_MR) * e : 1, sizeof(float));
        kz_conv_chain_rows<KW, SW, R, A, C, HA, HC>(d, x, w, y, r0, r1, group, t1, t2, e0, e1, e2);
        free(t1);
        free(t2);
        return 0;
    });
}
