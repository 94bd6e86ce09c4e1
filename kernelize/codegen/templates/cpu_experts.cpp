$PRELUDE$
$GEMV_LIB$

// $NAME$: routed mixture-of-experts MLPs and their weighted combine (kernelize.ir.experts):
//   out[t] = sum_k w[t, k] * (down[e] @ glu(gate[e] @ x[t] + bg, up[e] @ x[t] + bu) + bd),  e = index[t, k]
// with the gate and up rows of `up` one after the other (or interleaved, GS = 2), the biases optional and
// glu(g, u) = act(g) * u, or the clamped forms of kernelize.ir.ops.ExpertsArgs.
// 1. the (token, slot) pairs are sorted by expert (a counting sort) and the rows of x they read are packed
//    once, as f32, in that order: each expert's rows are contiguous;
// 2. stage one: a work item is (expert, block of CB intermediate columns); it reads those columns of the
//    expert's gate and up rows once for all of the expert's rows (cpu_gemv.h's dot blocks) and writes
//    h = act(gate) * up in f32;
// 3. stage two: a work item is a block of CB output columns; for each selected expert in turn it reads the
//    block's rows of `down` once and adds w * (h @ down^T) into the tokens' f32 sums, so a token's sum takes
//    its experts in one order whatever the thread count; the block is then stored.
// Only the selected experts' weights are read, each once per call: decode reads K of E experts' bytes.
// Past a GEMM panel of pairs per expert (prefill), the caller passes the GEMM library's `gemm`
// (templates/cpu_gemm.cpp) and kz_many runs instead: each selected expert on one thread, its products
// transposed, h^T = up_e x_e^T and y^T = down_e g^T, with the expert's weight rows as the GEMM's left operand
// as they are stored (never packed or copied in f32; 16-bit rows widened) and its tokens' rows packed per
// call into the GEMM's column panels. The tiles then hold many weight rows against 16 tokens: a product of
// 64 tokens, 1536 x 1024 (Zen 3, 2 threads) ran at 125 GFLOP/s against 105 for torch.mm of x_e up_e^T;
// one Qwen3-MoE layer's experts at 512 tokens in 73-85 ms against 92-134 for grouped_mm and 96 for the dot
// blocks. An expert per thread, not each product split over the threads: 1 -> 2 threads 1.56x -> 1.8x.
#ifdef __clang__
#pragma clang fp contract(fast)
#else
#pragma GCC optimize("fp-contract=fast")
#endif

namespace {
typedef $T$ kz_t;    // x, up, down and out storage
typedef $TI$ kz_ti;  // index storage
typedef $TW$ kz_tw;  // routing weight storage
constexpr int64_t H = $H$, I = $I$, E = $E$, K = $K$;
constexpr int64_t NU = $GATED$ ? 2 * I : I;  // rows of an expert's up weight
constexpr bool GATED = $GATED$;
constexpr bool BIAS = $BIAS$;
constexpr int64_t GS = $INTERLEAVED$ ? 2 : 1, UOFF = $INTERLEAVED$ ? 1 : I;  // gate row j: GS*j; up: UOFF+GS*j
constexpr bool PAIRS = $PAIRS$;  // 16-bit weights read as bf16 pairs, the f32 rows packed to match
constexpr int64_t CB = 4 * KZ_NB;  // columns per work item
KZ_INLINE float kz_act(float v) { return $ACT$; }
KZ_INLINE float kz_glu(float g, float u) { $GLU$ }

// rows [s0, s0 + nr) of the packed rows `xs` (ldx apart) against columns [j, j + KZ_NB) of the K-contiguous
// rows of `wt` (`ldw` apart, `n` of them: a column past the end reads the last row, its result unused).
// `next`: the first row of the block this thread reads after this one (null: none). Packed weights
// (ldw == k) prefetch it while this block is read: a row of 4 KiB or less sits in one page, where the
// hardware prefetcher never gets ahead of the block's rows read side by side (cpu_gemv.h), and a work
// item's first block, cold, waited on memory (a quarter of the blocks with 4-block items).
KZ_INLINE void kz_cols(const float* xs, int64_t ldx, int nr, const kz_t* wt, int64_t ldw, int64_t j, int64_t n,
                       int64_t k, float* part, const kz_t* next) {
    const kz_t* cols[KZ_NB];
    for (int c = 0; c < KZ_NB; ++c) cols[c] = wt + (j + c < n ? j + c : n - 1) * ldw;
    kz_dot_cols<PAIRS>(xs, ldx, nr, cols, true, 0, k, part, ldw == k ? (const char*)next : nullptr);
}
// the block of `KZ_NB` rows from row `j` of `wt` (`n` rows), when it is whole (a prefetch target), else null
KZ_INLINE const kz_t* kz_block(const kz_t* wt, int64_t ldw, int64_t j, int64_t n) {
    return j + KZ_NB <= n ? wt + j * ldw : nullptr;
}

// the GEMM library's entry (templates/cpu_gemm.cpp: y[m, n] = x[m, k] @ w, w packed in panels of NR columns)
typedef int (*kz_gemm_fn)(const float*, const float*, const float*, const float*, float*, const int64_t*, int);
constexpr int64_t NR = $PANEL$;  // the GEMM's panel width (cpu_conv.panel)

// y[m, n] = a[m, k] @ p (p: k x n packed in panels), by the library on this thread (cpu_conv.gemm_dims' sizes)
KZ_INLINE int kz_gemm_call(kz_gemm_fn gemm, const float* a, int64_t m, int64_t k, const float* p, int64_t n, float* y) {
    const int64_t dims[19] = {1, 1, m, k, 1, m, n, 1, 1, 1, 1, 0, 0, 1, 1, 1, NR, n, 0};
    return gemm(a, p, nullptr, nullptr, y, dims, 1) ? 3 : 0;
}

// the expert's `rows` weight rows (`ld` apart, `n` long) as f32 for the GEMM: themselves in f32 (dense: the
// caller checks), else widened into `buf`
KZ_INLINE const float* kz_rows_f32(const kz_t* w, int64_t rows, int64_t ld, int64_t n, float* buf) {
    if constexpr (sizeof(kz_t) == sizeof(float)) return (const float*)w;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) buf[r * n + i] = kz_ld(w, r * ld + i);
    return buf;
}

// one expert's pairs [c0, c0 + n) on this thread: x_e^T packed in panels, h^T = up_e @ x_e^T, g = glu(h)
// packed as the next product's panels, y^T = down_e @ g^T; ys[s] = y + bias for each sorted pair s
static int kz_one_expert(kz_gemm_fn gemm, const kz_t* x, const kz_t* up, const kz_t* down, const kz_t* ubias,
                         const kz_t* dbias, const int64_t* st, int64_t e, int64_t c0, int64_t n, const int64_t* tok,
                         float* ys) {
    const int64_t np = (n + NR - 1) / NR * NR, rows = NU > H ? NU : H;
    const int64_t wide = sizeof(kz_t) == sizeof(float) ? 0 : (NU * H > H * I ? NU * H : H * I);
    float* px = kz_scratch<float>(0, (H + I) * np + 1);  // x_e^T in panels, then g^T's
    float* pg = px + H * np;
    float* ph = kz_scratch<float>(1, rows * n + wide + 1);  // h^T, then y^T; 16-bit weights widened
    float* wf = ph + rows * n;
    if (!px || !ph) return 1;
    for (int64_t c = 0; c < np; ++c) {
        float* dst = px + (c / NR) * H * NR + c % NR;
        const int64_t t = c < n ? tok[c0 + c] : -1;
        for (int64_t h = 0; h < H; ++h) dst[h * NR] = t < 0 ? 0.0f : kz_ld(x, t * st[0] + h * st[1]);
    }
    if (kz_gemm_call(gemm, kz_rows_f32(up + e * st[6], NU, st[7], H, wf), NU, H, px, n, ph)) return 3;
    for (int64_t j = 0; j < I; ++j) {
        const int64_t bg = e * st[10] + GS * j * st[11];
        const float bgv = BIAS ? kz_ld(ubias, bg) : 0.0f, buv = BIAS && GATED ? kz_ld(ubias, bg + UOFF * st[11]) : 0.0f;
        const float *hg = ph + GS * j * n, *hu = ph + (UOFF + GS * j) * n;
        for (int64_t c = 0; c < np; ++c)
            pg[(c / NR) * I * NR + j * NR + c % NR] =
                c >= n ? 0.0f : (GATED ? kz_glu(hg[c] + bgv, hu[c] + buv) : kz_act(hg[c] + bgv));
    }
    if (kz_gemm_call(gemm, kz_rows_f32(down + e * st[8], H, st[9], I, wf), H, I, pg, n, ph)) return 3;
    for (int64_t c = 0; c < n; ++c)  // (perf) rows of ys in turn: its rows 4 KiB apart share L1 sets
        for (int64_t h = 0; h < H; ++h)
            ys[(c0 + c) * H + h] = ph[h * n + c] + (BIAS ? kz_ld(dbias, e * st[12] + h * st[13]) : 0.0f);
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && !defined(KZ_NO_AMX)
#define KZ_AMX 1
}  // namespace
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
namespace {
// AMX (Xeon from Sapphire Rapids on), bf16 weights whose sizes are multiples of 32: kz_one_expert's products
// as tile dot products. The weight rows are the A tiles as stored (16 rows x 32 values), the tokens' rows
// the B tiles (32 values x 16 tokens, as bf16 pairs: pair r of token c at row r, column c), 2 x 2 tiles of
// 16 x 16 f32 sums; g = glu(h) is rounded to bf16 for the second product, as the model's bf16 forward
// rounds it. Nothing is widened or packed but the tokens' rows: one Qwen3-MoE layer's experts, 2 threads,
// 512 tokens 14.6 against 26.2 ms for grouped_mm (oneDNN's AMX GEMMs per expert), 128 tokens 8.9 against
// 15.7, 24 tokens 7.8 against 12.9 (10.1 for the dot blocks); a software prefetch of the weight rows: level.
constexpr bool AMX_FITS = PAIRS && H % 32 == 0 && I % 32 == 0;
struct kz_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// the process's permission to use the tile data (Linux grants it on request, once per process)
KZ_INLINE bool kz_amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// value pairs (j, j + 1) of rows as B tiles: b[(tb * KB + kb) * 256 + r * 16 + c] = pair kb * 16 + r of row
// tb * 16 + c, for np rows (zeros past n); `pair(c, j)` returns the bf16 bits of values j and j + 1 of row c
template <int64_t KB, class F> KZ_INLINE void kz_amx_pack(uint32_t* b, int64_t n, int64_t np, F pair) {
    for (int64_t c = 0; c < np; ++c)
        for (int64_t q = 0; q < KB * 16; ++q)
            b[((c / 16) * KB + q / 16) * 256 + (q % 16) * 16 + c % 16] = c < n ? pair(c, 2 * q) : 0u;
}

// y[r, c] = w[r, :] . b's row c, for rows [0, R) of w (ld values apart, KB * 32 long) and np (a multiple of
// 32) rows of b packed by kz_amx_pack; y: R x np f32
template <int64_t KB> static void kz_amx_product(const kz_t* w, int64_t R, int64_t ld, const uint32_t* b, int64_t np, float* y) {
    for (int64_t r = 0; r < R; r += 32)
        for (int64_t c = 0; c < np; c += 32) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            const uint32_t *b0 = b + (c / 16) * KB * 256, *b1 = b0 + KB * 256;
            for (int64_t kb = 0; kb < KB; ++kb) {
                _tile_loadd(4, w + r * ld + kb * 32, ld * 2);
                _tile_loadd(5, w + (r + 16) * ld + kb * 32, ld * 2);
                _tile_loadd(6, b0 + kb * 256, 64);
                _tile_loadd(7, b1 + kb * 256, 64);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, y + r * np + c, np * 4); _tile_stored(1, y + r * np + c + 16, np * 4);
            _tile_stored(2, y + (r + 16) * np + c, np * 4); _tile_stored(3, y + (r + 16) * np + c + 16, np * 4);
        }
}

// kz_one_expert on the tiles
static int kz_one_expert_amx(const kz_t* x, const kz_t* up, const kz_t* down, const kz_t* ubias, const kz_t* dbias,
                             const int64_t* st, int64_t e, int64_t c0, int64_t n, const int64_t* tok, float* ys) {
    const int64_t np = (n + 31) / 32 * 32, rows = NU > H ? NU : H;
    uint32_t* bx = kz_scratch<uint32_t>(0, (H + I) / 2 * np + 1);  // x_e's rows as B tiles, then g's
    uint32_t* bg = bx + H / 2 * np;
    float* ph = kz_scratch<float>(1, rows * np + 1);  // h^T, then y^T
    if (!bx || !ph) return 1;
    kz_tilecfg cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    const uint16_t* xb = (const uint16_t*)x;
    kz_amx_pack<H / 32>(bx, n, np, [&](int64_t c, int64_t j) {
        const int64_t at = tok[c0 + c] * st[0] + j * st[1];
        return (uint32_t)xb[at] | (uint32_t)xb[at + st[1]] << 16;
    });
    kz_amx_product<H / 32>(up + e * st[6], NU, st[7], bx, np, ph);
    kz_amx_pack<I / 32>(bg, n, np, [&](int64_t c, int64_t j) {
        uint32_t v = 0;
        for (int64_t d = 0; d < 2; ++d) {
            const int64_t bgi = e * st[10] + GS * (j + d) * st[11];
            const float bgv = BIAS ? kz_ld(ubias, bgi) : 0.0f, buv = BIAS && GATED ? kz_ld(ubias, bgi + UOFF * st[11]) : 0.0f;
            const float hg = ph[GS * (j + d) * np + c] + bgv, hu = ph[(UOFF + GS * (j + d)) * np + c] + buv;
            v |= (uint32_t)kz_f32_to_bf16_bits(GATED ? kz_glu(hg, hu) : kz_act(hg)) << (16 * d);
        }
        return v;
    });
    kz_amx_product<I / 32>(down + e * st[8], H, st[9], bg, np, ph);
    _tile_release();
    for (int64_t c = 0; c < n; ++c)
        for (int64_t h = 0; h < H; ++h)
            ys[(c0 + c) * H + h] = ph[h * np + c] + (BIAS ? kz_ld(dbias, e * st[12] + h * st[13]) : 0.0f);
    return 0;
}
#else
#define KZ_AMX 0
#endif

// many pairs: each selected expert on one thread (kz_one_expert; the experts with the most rows first, taken
// as threads come free), then per token the weighted sum of its slots' rows in slot order (bitwise
// independent of the thread count). `inv`: pair -> sorted position, -1 for the sentinel expert E.
static int kz_many(kz_gemm_fn gemm, const kz_t* x, const kz_t* up, const kz_t* down, const kz_t* ubias,
                   const kz_t* dbias, kz_t* out, int64_t T, const int64_t* st, const int64_t* cnt, const int64_t* tok,
                   const int64_t* inv, const float* ws, int nthreads) {
    float* ys = kz_scratch<float>(3, cnt[E] * H + 1);
    int64_t* items = kz_scratch<int64_t>(1, E + 1);
    if (!ys || !items) return 1;
    int64_t active = 0;  // the experts with rows, by decreasing rows (insertion: E is small)
    for (int64_t e = 0; e < E; ++e) {
        if (cnt[e + 1] == cnt[e]) continue;
        int64_t i = active++;
        for (; i > 0 && cnt[items[i - 1] + 1] - cnt[items[i - 1]] < cnt[e + 1] - cnt[e]; --i) items[i] = items[i - 1];
        items[i] = e;
    }
    int64_t next = 0;
    int64_t* nx = &next;
    int err = kz_parallel_for(kz_team_open(nthreads, true), [=](int kz_tid, int kz_tn) KZ_BODY {
        int rc = 0;
        for (int64_t it = kz_next(nx); it < active && !rc; it = kz_next(nx)) {
            const int64_t e = items[it];
#if KZ_AMX
            if (AMX_FITS && kz_amx_ready()) {
                rc = kz_one_expert_amx(x, up, down, ubias, dbias, st, e, cnt[e], cnt[e + 1] - cnt[e], tok, ys);
                continue;
            }
#endif
            rc = kz_one_expert(gemm, x, up, down, ubias, dbias, st, e, cnt[e], cnt[e + 1] - cnt[e], tok, ys);
        }
        return rc;
    });
    if (err) return err;
    return kz_parallel_for(kz_team_open(nthreads, T * H * K >= $PARALLEL_MIN$), [=](int kz_tid, int kz_tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(T, kz_tid, kz_tn, lo, hi);
        for (int64_t t = lo; t < hi; ++t)
            for (int64_t h = 0; h < H; ++h) {
                float v = 0.0f;
                for (int64_t k = 0; k < K; ++k) {
                    const int64_t s = inv[t * K + k];
                    if (s >= 0) v += ws[s] * ys[s * H + h];
                }
                kz_st(out, t * H + h, v);
            }
        return 0;
    });
}
}  // namespace

// strides (elements): x (token, hidden), index (token, slot), weights (token, slot), up (expert, row),
// down (expert, row), up bias (expert, row), down bias (expert, column); the weights' last axes are
// unit-stride. Returns 1: out of memory, 2: an index outside [0, E] (E itself: a sentinel, skipped).
extern "C" int $NAME$(const kz_t* x, const kz_ti* index, const kz_tw* weights, const kz_t* up, const kz_t* down,
                      const kz_t* ubias, const kz_t* dbias, kz_t* out, int64_t T, const int64_t* st,
                      kz_gemm_fn gemm, int kz_nthreads) {
    if (T <= 0) return 0;
    const int64_t S = T * K;
    int64_t* cnt = kz_scratch<int64_t>(0, E + 2 + 3 * S);
    if (!cnt) return 1;
    int64_t* pos = cnt + E + 2;  // sorted position -> pair
    int64_t* tok = pos + S;      // sorted position -> token
    int64_t* inv = tok + S;      // pair -> sorted position (the many-pair path)
    for (int64_t e = 0; e < E + 2; ++e) cnt[e] = 0;
    for (int64_t p = 0; p < S; ++p) {
        const int64_t e = (int64_t)kz_ld(index, (p / K) * st[2] + (p % K) * st[3]);
        if (e < 0 || e > E) return 2;
        ++cnt[e + 1];
    }
    for (int64_t e = 0; e <= E; ++e) cnt[e + 1] += cnt[e];  // cnt[e]: the first sorted position of expert e
    for (int64_t p = 0; p < S; ++p) {
        const int64_t e = (int64_t)kz_ld(index, (p / K) * st[2] + (p % K) * st[3]);
        if (e < E) pos[cnt[e]++] = p;
    }
    for (int64_t e = E; e > 0; --e) cnt[e] = cnt[e - 1];  // back to the first positions
    cnt[0] = 0;
    const int64_t R = cnt[E];  // pairs routed to an expert of this call
    if (gemm) {
        float* ws = kz_scratch<float>(2, R + 1);
        if (!ws) return 1;
        for (int64_t p = 0; p < S; ++p) inv[p] = -1;
        for (int64_t s = 0; s < R; ++s) {
            const int64_t p = pos[s];
            tok[s] = p / K;
            inv[p] = s;
            ws[s] = (float)kz_ld(weights, (p / K) * st[4] + (p % K) * st[5]);
        }
        return kz_many(gemm, x, up, down, ubias, dbias, out, T, st, cnt, tok, inv, ws, kz_nthreads);
    }
    const int64_t ldx = (H + 15) / 16 * 16 + 16, ldh = (I + 15) / 16 * 16 + 16;
    float* xs = kz_scratch<float>(0, R * ldx + 1);
    float* hs = kz_scratch<float>(1, R * ldh + 1);
    float* ws = kz_scratch<float>(2, R + 1);
    float* acc = kz_scratch<float>(3, T * H);
    int64_t* items = kz_scratch<int64_t>(1, E + 1);
    if (!xs || !hs || !ws || !acc || !items) return 1;
    int64_t active = 0;  // the experts with rows, in order
    for (int64_t e = 0; e < E; ++e)
        if (cnt[e + 1] > cnt[e]) items[active++] = e;
    const int64_t hfull = H / (2 * KZ_VL) * (2 * KZ_VL), ifull = I / (2 * KZ_VL) * (2 * KZ_VL);
    for (int64_t s = 0; s < R; ++s) {  // the pairs' rows of x, once, as f32
        const int64_t p = pos[s], t = p / K;
        tok[s] = t;
        ws[s] = (float)kz_ld(weights, t * st[4] + (p % K) * st[5]);
        for (int64_t h = 0; h < H; ++h) xs[s * ldx + kz_xpos<PAIRS>(h, hfull)] = kz_ld(x, t * st[0] + h * st[1]);
    }
    for (int64_t e = 0; e < T * H; ++e) acc[e] = 0.0f;
    const int64_t blocks1 = (I + CB - 1) / CB, blocks2 = (H + CB - 1) / CB;
    int64_t next1 = 0, next2 = 0;
    int64_t *n1 = &next1, *n2 = &next2;
    const kz_team_t team = kz_team_open(kz_nthreads, R * H * NU >= $PARALLEL_MIN$);
    return kz_parallel_together(team, [=](int kz_tid, int kz_tn) KZ_BODY {
        float part[KZ_MAXR * KZ_NB], gate[KZ_MAXR * KZ_NB];
        // each loop claims its next item before it runs the current one, so that the current item's last
        // block can prefetch the next item's first (dynamic scheduling, prefetch without a cold start)
        for (int64_t it = kz_next(n1), nx = it; it < active * blocks1; it = nx) {  // stage one
            nx = kz_next(n1);
            const int64_t e = items[it / blocks1], j0 = it % blocks1 * CB;
            const kz_t* wu = up + e * st[6];
            const kz_t* wn = nx < active * blocks1 ? up + items[nx / blocks1] * st[6] : nullptr;
            const int64_t jn = nx % blocks1 * CB;  // the next item's first column
            for (int64_t s0 = cnt[e]; s0 < cnt[e + 1]; s0 += KZ_MAXR) {
                const int nr = (int)(cnt[e + 1] - s0 < KZ_MAXR ? cnt[e + 1] - s0 : KZ_MAXR);
                const bool last_rows = s0 + KZ_MAXR >= cnt[e + 1];
                for (int64_t j = j0; j < j0 + CB && j < I; j += KZ_NB) {
                    const bool inside = j + KZ_NB < j0 + CB || !last_rows;  // the next block is this item's
                    const kz_t *wb = inside ? wu : wn, *pg = nullptr, *pu = nullptr;
                    const int64_t jb = !last_rows && j + KZ_NB >= j0 + CB ? j0 : (inside ? j + KZ_NB : jn);
                    if (wb) pg = kz_block(wb, GS * st[7], jb, I), pu = kz_block(wb + UOFF * st[7], GS * st[7], jb, I);
                    kz_cols(xs + s0 * ldx, ldx, nr, wu, GS * st[7], j, I, H, gate, pg);
                    if (GATED) kz_cols(xs + s0 * ldx, ldx, nr, wu + UOFF * st[7], GS * st[7], j, I, H, part, pu);
                    for (int r = 0; r < nr; ++r)
                        for (int c = 0; c < KZ_NB && j + c < I; ++c) {
                            const int64_t bg = e * st[10] + GS * (j + c) * st[11];
                            const float g = gate[r * KZ_NB + c] + (BIAS ? kz_ld(ubias, bg) : 0.0f);
                            const float u = GATED ? part[r * KZ_NB + c] + (BIAS ? kz_ld(ubias, bg + UOFF * st[11]) : 0.0f)
                                                  : 0.0f;
                            hs[(s0 + r) * ldh + kz_xpos<PAIRS>(j + c, ifull)] = GATED ? kz_glu(g, u) : kz_act(g);
                        }
                }
            }
        }
        kz_barrier(kz_tn);
        for (int64_t it = kz_next(n2), nx = it; it < blocks2; it = nx) {  // stage two
            nx = kz_next(n2);
            const int64_t n0 = it * CB;
            for (int64_t a = 0; a < active; ++a) {
                const int64_t e = items[a];
                const kz_t* wd = down + e * st[8];
                // after this expert's blocks: the next expert's first block of this item, or the next item's
                const kz_t* wn = a + 1 < active ? down + items[a + 1] * st[8] : (nx < blocks2 ? down + items[0] * st[8] : nullptr);
                const int64_t jn = a + 1 < active ? n0 : nx * CB;
                for (int64_t s0 = cnt[e]; s0 < cnt[e + 1]; s0 += KZ_MAXR) {
                    const int nr = (int)(cnt[e + 1] - s0 < KZ_MAXR ? cnt[e + 1] - s0 : KZ_MAXR);
                    const bool last_rows = s0 + KZ_MAXR >= cnt[e + 1];
                    for (int64_t j = n0; j < n0 + CB && j < H; j += KZ_NB) {
                        const bool inside = j + KZ_NB < n0 + CB || !last_rows;
                        const int64_t jb = !last_rows && j + KZ_NB >= n0 + CB ? n0 : (inside ? j + KZ_NB : jn);
                        const kz_t* wb = inside ? wd : wn;
                        kz_cols(hs + s0 * ldh, ldh, nr, wd, st[9], j, H, I, part, wb ? kz_block(wb, st[9], jb, H) : nullptr);
                        for (int r = 0; r < nr; ++r)
                            for (int c = 0; c < KZ_NB && j + c < H; ++c) {
                                const float b = BIAS ? kz_ld(dbias, e * st[12] + (j + c) * st[13]) : 0.0f;
                                acc[tok[s0 + r] * H + j + c] += ws[s0 + r] * (part[r * KZ_NB + c] + b);
                            }
                    }
                }
            }
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = n0; j < n0 + CB && j < H; ++j) kz_st(out, t * H + j, acc[t * H + j]);
        }
        return 0;
    });
}
