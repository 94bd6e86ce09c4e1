$PRELUDE$
// $NAME$: fused attention, out = softmax(scale * q @ k^T (+ mask)) @ v with an online softmax: the scores
// are computed one key block at a time and never stored beyond that block.
//
// The query rows of one batch entry and one key/value head (the `groups` query heads sharing that key head,
// times the query positions) form one axis of rows `r = g * LQ + i`. Two shapes:
//  * prefill (many rows): a work item is a block of BQ rows; scores of a key block are kept transposed,
//    St[key][row], so every step vectorises over rows: q @ k^T broadcasts one key element against BQ
//    transposed query values, the softmax statistics are per-row vectors, and p @ v broadcasts one value
//    element against BQ probabilities into a transposed accumulator. k and v are read in place (f32) or
//    converted one block at a time (16-bit); key blocks past a causal diagonal are skipped;
//  * decode (a few rows, long keys): work items split the keys of a (batch, key head) across threads; each
//    row's scores come from dot products over the head dim, p @ v vectorises over the value dim, and the
//    partial (max, sum, accumulator) of every split are combined at the end.
// Accumulation is f32 for every storage type. A row with every key masked gives zeros (torch's kernels).
// Several attention kernels can share a translation unit (with other kernels): each in a namespace of its
// own ($NS$, named after its source), fp-contract fast only within it (GCC; clang keeps it to the unit's end).
#ifdef __clang__
#pragma clang fp contract(fast)
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif
#include <math.h>

namespace $NS$ {
typedef $T$ kz_t;    // q, k, v and out storage
typedef $TM$ kz_tm;  // mask storage
constexpr int D = $D$, DV = $DV$;
constexpr int CAUSAL = $CAUSAL$, MASK = $MASK$;  // MASK: 0 none, 1 bool (keep where true), 2 additive
constexpr bool MOD = $HAS_MOD$;                  // a score modification (kz_score_mod) is applied
constexpr bool SINKS = $SINKS$;                  // a logit per query head joins every softmax (value zero)
constexpr bool F32 = $F32$;                      // k and v are read in place when they are f32
constexpr int VL = 8;                            // decode's vectors (head dims of 8s)
// prefill's micro tiles vectorise over query rows, PVL of them a vector: the machine's widest. With 8 lanes
// on AVX-512 each FMA did half its work: ViT-base's attention (12 heads x 197 x 64), 1 thread, Xeon, 1.97 ->
// 1.40 ms with the skip of empty row tiles below (60 -> 85 GFLOP/s; DeiT-small's 12 layers in the ONNX model
// 17.9 -> 11.0 ms, thread CPU time). RG keeps a block at 64 rows (its q, scores and accumulator in ~48 KiB)
#if defined(__AVX512F__)
constexpr int PVL = 16;
#else
constexpr int PVL = 8;
#endif
constexpr int RV = 2, RG = $ROW_GROUPS$ * 8 / PVL;  // a micro tile has RV vectors of PVL rows; a block RG tiles
constexpr int BQ = RG * RV * PVL;                // rows per block: k and v blocks are reused by all of them
constexpr int BK = 60, NK = 6, NV = 6;           // keys per block; keys / value columns per micro tile
constexpr int DECODE_ROWS = $DECODE_ROWS$;       // at most this many rows per key head: the decode shape
constexpr float NEG_INF = -INFINITY;
// the compiler keeps a vector of this type in one register; arrays of floats indexed in loops it keeps in
// memory, which makes the micro tiles store-bound
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float pvf __attribute__((vector_size(PVL * 4)));

struct Args {
    const kz_t *q, *k, *v;
    const kz_tm* m;
    const float* sinks;
    kz_t* o;
    int64_t B, HQ, HKV, LQ, LK, G;
    int64_t sq[4], sk[4], sv[4], sm[4];  // element strides over (batch, head, position, dim / key)
    float scale;
};

KZ_INLINE vf vload(const float* p) { vf x; memcpy(&x, p, sizeof x); return x; }
KZ_INLINE void vstore(float* p, vf x) { memcpy(p, &x, sizeof x); }
// keeps a loaded vector in a register: otherwise gcc folds it into every FMA as a memory operand, and the
// micro tiles become bound by loads instead of FMAs
#if defined(__x86_64__) && !defined(__clang__)
#define KZ_REG(x) __asm__("" : "+x"(x))
#else
#define KZ_REG(x) (void)0
#endif
KZ_INLINE vf vsplat(float a) { return vf{a, a, a, a, a, a, a, a}; }  // (vf){} + a adds a -0 check
KZ_INLINE pvf pvload(const float* p) { pvf x; memcpy(&x, p, sizeof x); return x; }
KZ_INLINE void pvstore(float* p, pvf x) { memcpy(p, &x, sizeof x); }
#if defined(__AVX512F__)
KZ_INLINE pvf pvsplat(float a) { return pvf{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }
#else
KZ_INLINE pvf pvsplat(float a) { return vsplat(a); }
#endif

// the head and position of row r of key head hkv
KZ_INLINE void row_pos(const Args& a, int64_t hkv, int64_t r, int64_t* h, int64_t* i) {
    *h = hkv * a.G + r / a.LQ;
    *i = r % a.LQ;
}

// the score modification (kernelize.ir.score_mod) of a scaled score: query position q (counted among the
// keys: i + LK - LQ), key position k, query head h
KZ_INLINE float kz_score_mod(float sm0, int64_t sm1, int64_t sm2, int64_t sm3) {
    (void)sm1, (void)sm2, (void)sm3;
$SCORE_MOD$
}

// the score of query row (head h, position i) against key j after the modification, the causal cut and
// the mask
KZ_INLINE float mask_score(const Args& a, const kz_tm* mrow, int64_t h, int64_t i, int64_t j, float s) {
    if (MOD) s = kz_score_mod(s, i + a.LK - a.LQ, j, h);
    if (CAUSAL && j > i) return NEG_INF;
    if (MASK == 1) return kz_ld(mrow, j * a.sm[3]) ? s : NEG_INF;
    if (MASK == 2) return s + (float)kz_ld(mrow, j * a.sm[3]);
    return s;
}

// ---- prefill: one block of BQ rows against all (unmasked) key blocks ------------------------------------
struct Block {
    alignas(64) float qt[D][BQ];    // scaled queries, transposed
    alignas(64) float st[BK][BQ];   // scores, then probabilities, of one key block, transposed
    alignas(64) float acc[DV][BQ];  // output accumulator, transposed
    alignas(64) float mx[BQ], l[BQ], alpha[BQ];
    alignas(64) float kb[F32 ? 1 : BK * D], vb[F32 ? 1 : BK * DV];  // 16-bit k and v as f32
    int64_t head[BQ], pos[BQ];
};

// st[j][0:BQ] = qt^T k_j for keys j in [0, nb), NK keys at a time (2 * NK accumulators in registers), for
// the first ng micro tiles of rows (the rest of a block's last rows hold no query)
KZ_INLINE void block_scores(Block& w, const float* const* krow, int nb, int ng) {
    for (int j = 0; j < nb; j += NK) {
        const float* kr[NK];
        for (int t = 0; t < NK; ++t) kr[t] = krow[j + t < nb ? j + t : nb - 1];
        for (int g = 0; g < ng; ++g) {
        pvf s[NK][RV] = {};
        for (int d = 0; d < D; ++d) {
            pvf qv[RV];
            for (int u = 0; u < RV; ++u) {
                qv[u] = pvload(&w.qt[d][(g * RV + u) * PVL]);
                KZ_REG(qv[u]);
            }
            for (int t = 0; t < NK; ++t) {
                pvf kv = pvsplat(kr[t][d]);
                for (int u = 0; u < RV; ++u) s[t][u] += kv * qv[u];
            }
        }
        for (int t = 0; t < NK && j + t < nb; ++t)
            for (int u = 0; u < RV; ++u) pvstore(&w.st[j + t][(g * RV + u) * PVL], s[t][u]);
        }
    }
}

// acc[dv:dv+NT][0:BQ] = alpha * acc + sum_j p[j] v_j[dv:dv+NT]: NT x RV accumulators in registers
template <int NT>
KZ_INLINE void pv_tile(Block& w, const float* const* vrow, int nb, int dv, const pvf* al, int g) {
    pvf c[NT][RV];
    for (int t = 0; t < NT; ++t)
        for (int u = 0; u < RV; ++u) c[t][u] = pvload(&w.acc[dv + t][(g * RV + u) * PVL]) * al[u];
    for (int j = 0; j < nb; ++j) {
        pvf p[RV];
        for (int u = 0; u < RV; ++u) {
            p[u] = pvload(&w.st[j][(g * RV + u) * PVL]);
            KZ_REG(p[u]);
        }
        const float* vr = vrow[j] + dv;
        for (int t = 0; t < NT; ++t) {
            pvf vv = pvsplat(vr[t]);
            for (int u = 0; u < RV; ++u) c[t][u] += vv * p[u];
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int u = 0; u < RV; ++u) pvstore(&w.acc[dv + t][(g * RV + u) * PVL], c[t][u]);
}

KZ_INLINE void block_pv(Block& w, const float* const* vrow, int nb, int ng) {
    for (int g = 0; g < ng; ++g) {
        pvf al[RV];
        for (int u = 0; u < RV; ++u) al[u] = pvload(&w.alpha[(g * RV + u) * PVL]);
        int dv = 0;
        for (; dv + NV <= DV; dv += NV) pv_tile<NV>(w, vrow, nb, dv, al, g);
        if constexpr (DV % NV != 0) pv_tile<DV % NV>(w, vrow, nb, dv, al, g);
    }
}

// online softmax over one key block (the first `rows` rows: the micro tiles holding queries): new row maxima,
// rescale factors, probabilities, row sums
KZ_INLINE void block_softmax(Block& w, int nb, int rows) {
    float mnew[BQ], msafe[BQ];
#pragma omp simd
    for (int r = 0; r < rows; ++r) mnew[r] = w.mx[r];
    for (int j = 0; j < nb; ++j) {
#pragma omp simd
        for (int r = 0; r < rows; ++r) mnew[r] = w.st[j][r] > mnew[r] ? w.st[j][r] : mnew[r];
    }
#pragma omp simd
    for (int r = 0; r < rows; ++r) {
        msafe[r] = mnew[r] == NEG_INF ? 0.0f : mnew[r];  // all masked so far: exp(-inf - 0) = 0
        w.alpha[r] = kz_exp_neg(w.mx[r] - msafe[r]);
        w.mx[r] = mnew[r];
    }
    float sum[BQ] = {};
    for (int j = 0; j < nb; ++j) {
#pragma omp simd
        for (int r = 0; r < rows; ++r) {
            float p = kz_exp_neg(w.st[j][r] - msafe[r]);
            w.st[j][r] = p;
            sum[r] += p;
        }
    }
#pragma omp simd
    for (int r = 0; r < rows; ++r) w.l[r] = w.l[r] * w.alpha[r] + sum[r];
}

void prefill_block(const Args& a, Block& w, int64_t b, int64_t hkv, int64_t r0, int64_t nr) {
    int64_t imin = INT64_MAX, imax = -1;
    for (int r = 0; r < BQ; ++r) {
        int64_t h = 0, i = 0;
        if (r < nr) row_pos(a, hkv, r0 + r, &h, &i);
        w.head[r] = h;
        w.pos[r] = i;
        if (r < nr) imin = i < imin ? i : imin, imax = i > imax ? i : imax;
        const kz_t* qr = a.q + b * a.sq[0] + h * a.sq[1] + i * a.sq[2];
        for (int d = 0; d < D; ++d) w.qt[d][r] = r < nr ? kz_ld(qr, d * a.sq[3]) * a.scale : 0.0f;
        w.mx[r] = SINKS ? a.sinks[h] : NEG_INF;  // the sink: a key of value zero, exp(sink - mx) = 1
        w.l[r] = SINKS ? 1.0f : 0.0f;
        for (int dv = 0; dv < DV; ++dv) w.acc[dv][r] = 0.0f;
    }
    const int ng = (int)((nr + RV * PVL - 1) / (RV * PVL));  // micro tiles of rows holding queries
    const int64_t kend = CAUSAL ? (imax + 1 < a.LK ? imax + 1 : a.LK) : a.LK;
    const kz_t* kbase = a.k + b * a.sk[0] + hkv * a.sk[1];
    const kz_t* vbase = a.v + b * a.sv[0] + hkv * a.sv[1];
    const float* krow[BK];
    const float* vrow[BK];
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int nb = (int)(kend - j0 < BK ? kend - j0 : BK);
        for (int j = 0; j < nb; ++j) {
            const kz_t* kp = kbase + (j0 + j) * a.sk[2];
            const kz_t* vp = vbase + (j0 + j) * a.sv[2];
            if (F32) {
                krow[j] = (const float*)kp;
                vrow[j] = (const float*)vp;
            } else {
#pragma omp simd
                for (int d = 0; d < D; ++d) w.kb[j * D + d] = kz_ld(kp, d);
#pragma omp simd
                for (int d = 0; d < DV; ++d) w.vb[j * DV + d] = kz_ld(vp, d);
                krow[j] = &w.kb[j * D];
                vrow[j] = &w.vb[j * DV];
            }
        }
        block_scores(w, krow, nb, ng);
        if (MASK || MOD || (CAUSAL && j0 + nb - 1 > imin)) {
            for (int r = 0; r < nr; ++r) {
                const kz_tm* mrow = MASK ? a.m + b * a.sm[0] + w.head[r] * a.sm[1] + w.pos[r] * a.sm[2] : 0;
                for (int j = 0; j < nb; ++j) w.st[j][r] = mask_score(a, mrow, w.head[r], w.pos[r], j0 + j, w.st[j][r]);
            }
        }
        block_softmax(w, nb, ng * RV * PVL);
        block_pv(w, vrow, nb, ng);
    }
    for (int r = 0; r < nr; ++r) {
        kz_t* orow = a.o + ((b * a.HQ + w.head[r]) * a.LQ + w.pos[r]) * DV;
        float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
        for (int dv = 0; dv < DV; ++dv) kz_st(orow, dv, w.acc[dv][r] * inv);
    }
}

// s[j] = q . k_j for j in [0, nb): VL keys at a time, each with its own accumulator over the head dim, then
// one transposing reduction (a single accumulator would chain every FMA of a key on the previous one)
KZ_INLINE void decode_scores(const float* q, const float* const* krow, int nb, float* s) {
    if constexpr (D % VL == 0) {
        int j = 0;
        for (; j + VL <= nb; j += VL) {
            vf acc[VL] = {};
            for (int d = 0; d < D; d += VL) {
                vf qv = vload(q + d);
                KZ_REG(qv);
                for (int t = 0; t < VL; ++t) acc[t] += vload(krow[j + t] + d) * qv;
            }
            alignas(32) float tmp[VL][VL];
            for (int t = 0; t < VL; ++t) vstore(tmp[t], acc[t]);
            float out[VL] = {};
            for (int l = 0; l < VL; ++l) {
#pragma omp simd
                for (int t = 0; t < VL; ++t) out[t] += tmp[t][l];
            }
            for (int t = 0; t < VL; ++t) s[j + t] = out[t];
        }
        for (; j < nb; ++j) {
            vf acc = {};
            for (int d = 0; d < D; d += VL) acc += vload(krow[j] + d) * vload(q + d);
            float sum = 0.0f;
            for (int l = 0; l < VL; ++l) sum += acc[l];
            s[j] = sum;
        }
    } else {
        for (int j = 0; j < nb; ++j) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < D; ++d) acc += q[d] * krow[j][d];
            s[j] = acc;
        }
    }
}

// acc[0:DV] = alpha * acc + sum_j p[j] v_j, the accumulator held in registers across the keys
KZ_INLINE void decode_pv(float* acc, float alpha, const float* p, const float* const* vrow, int nb) {
    if constexpr (DV % VL == 0) {
        constexpr int NC = DV / VL < 8 ? DV / VL : 8;  // columns per pass: at most 8 vector registers
        for (int c0 = 0; c0 < DV; c0 += NC * VL) {
            vf c[NC];
            for (int u = 0; u < NC; ++u) c[u] = c0 + u * VL < DV ? vload(acc + c0 + u * VL) * vsplat(alpha) : vf{};
            for (int j = 0; j < nb; ++j) {
                vf pj = vsplat(p[j]);
                for (int u = 0; u < NC; ++u)
                    if (c0 + u * VL < DV) c[u] += vload(vrow[j] + c0 + u * VL) * pj;
            }
            for (int u = 0; u < NC; ++u)
                if (c0 + u * VL < DV) vstore(acc + c0 + u * VL, c[u]);
        }
    } else {
#pragma omp simd
        for (int dv = 0; dv < DV; ++dv) acc[dv] *= alpha;
        for (int j = 0; j < nb; ++j) {
            const float pj = p[j];
            const float* vr = vrow[j];
#pragma omp simd
            for (int dv = 0; dv < DV; ++dv) acc[dv] += pj * vr[dv];
        }
    }
}

// ---- decode: rows of one key head against keys [j0, j1), partial results per split ---------------------
// part: for each row, [max, sum, acc[DV]]
void decode_split(const Args& a, int64_t b, int64_t hkv, int64_t nrows, int64_t j0, int64_t j1, float* part) {
    alignas(32) float qs[DECODE_ROWS][D];
    alignas(32) float s[BK];
    alignas(32) float kb[F32 ? 1 : BK * D], vb[F32 ? 1 : BK * DV];
    int64_t head[DECODE_ROWS], pos[DECODE_ROWS];
    for (int r = 0; r < nrows; ++r) {
        row_pos(a, hkv, r, &head[r], &pos[r]);
        const kz_t* qr = a.q + b * a.sq[0] + head[r] * a.sq[1] + pos[r] * a.sq[2];
        for (int d = 0; d < D; ++d) qs[r][d] = kz_ld(qr, d * a.sq[3]) * a.scale;
        float* pr = part + r * (DV + 2);
        pr[0] = NEG_INF;
        pr[1] = 0.0f;
        for (int dv = 0; dv < DV; ++dv) pr[2 + dv] = 0.0f;
    }
    const kz_t* kbase = a.k + b * a.sk[0] + hkv * a.sk[1];
    const kz_t* vbase = a.v + b * a.sv[0] + hkv * a.sv[1];
    const float* krow[BK];
    const float* vrow[BK];
    for (int64_t k0 = j0; k0 < j1; k0 += BK) {
        const int nb = (int)(j1 - k0 < BK ? j1 - k0 : BK);
        for (int j = 0; j < nb; ++j) {
            const kz_t* kp = kbase + (k0 + j) * a.sk[2];
            const kz_t* vp = vbase + (k0 + j) * a.sv[2];
            if (F32) {
                krow[j] = (const float*)kp;
                vrow[j] = (const float*)vp;
            } else {
#pragma omp simd
                for (int d = 0; d < D; ++d) kb[j * D + d] = kz_ld(kp, d);
#pragma omp simd
                for (int d = 0; d < DV; ++d) vb[j * DV + d] = kz_ld(vp, d);
                krow[j] = &kb[j * D];
                vrow[j] = &vb[j * DV];
            }
        }
        for (int r = 0; r < nrows; ++r) {
            const kz_tm* mrow = MASK ? a.m + b * a.sm[0] + head[r] * a.sm[1] + pos[r] * a.sm[2] : 0;
            float mx = NEG_INF;
            decode_scores(qs[r], krow, nb, s);
            for (int j = 0; j < nb; ++j) {
                s[j] = mask_score(a, mrow, head[r], pos[r], k0 + j, s[j]);
                mx = s[j] > mx ? s[j] : mx;
            }
            float* pr = part + r * (DV + 2);
            float mnew = pr[0] > mx ? pr[0] : mx;
            float msafe = mnew == NEG_INF ? 0.0f : mnew;
            float alpha = kz_exp_neg(pr[0] - msafe), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < nb; ++j) {
                s[j] = kz_exp_neg(s[j] - msafe);
                sum += s[j];
            }
            pr[0] = mnew;
            pr[1] = pr[1] * alpha + sum;
            decode_pv(pr + 2, alpha, s, vrow, nb);
        }
    }
}

// out rows of (b, hkv) from the partials of nsplit splits
void decode_combine(const Args& a, int64_t b, int64_t hkv, int64_t nrows, int64_t nsplit, const float* part) {
    const int64_t stride = nrows * (DV + 2);
    for (int r = 0; r < nrows; ++r) {
        int64_t h, i;
        row_pos(a, hkv, r, &h, &i);
        float m = SINKS ? a.sinks[h] : NEG_INF;
        for (int64_t s = 0; s < nsplit; ++s) m = part[s * stride + r * (DV + 2)] > m ? part[s * stride + r * (DV + 2)] : m;
        const float msafe = m == NEG_INF ? 0.0f : m;
        float l = SINKS ? kz_exp_neg(a.sinks[h] - msafe) : 0.0f, acc[DV] = {};
        for (int64_t s = 0; s < nsplit; ++s) {
            const float* pr = part + s * stride + r * (DV + 2);
            const float f = kz_exp_neg(pr[0] - msafe);
            l += pr[1] * f;
#pragma omp simd
            for (int dv = 0; dv < DV; ++dv) acc[dv] += pr[2 + dv] * f;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        kz_t* orow = a.o + ((b * a.HQ + h) * a.LQ + i) * DV;
        for (int dv = 0; dv < DV; ++dv) kz_st(orow, dv, acc[dv] * inv);
    }
}

int decode(const Args& a, int nthreads) {
    const int64_t rows = a.G * a.LQ, heads = a.B * a.HKV;
    // enough splits to give every thread work, none shorter than two key blocks
    int64_t nsplit = (2 * nthreads + heads - 1) / heads;
    const int64_t maxsplit = (a.LK + 2 * BK - 1) / (2 * BK);
    nsplit = nsplit < maxsplit ? nsplit : maxsplit;
    nsplit = nsplit < 1 ? 1 : nsplit;
    const int64_t chunk = (a.LK + nsplit - 1) / nsplit;
    float* part = (float*)malloc(sizeof(float) * (size_t)(heads * nsplit * rows * (DV + 2)));
    if (!part) return 2;
    const bool par = heads * nsplit > 1 && heads * a.LK * rows * (D + DV) >= $PARALLEL_MIN$;
    kz_parallel_together(kz_team_open(nthreads, par), [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(heads * nsplit, t, tn, lo, hi);
        for (int64_t it = lo; it < hi; ++it) {
            const int64_t bh = it / nsplit, s = it % nsplit;
            const int64_t j0 = s * chunk, j1 = j0 + chunk < a.LK ? j0 + chunk : a.LK;
            float* pr = part + (bh * nsplit + s) * rows * (DV + 2);
            int64_t jend = j1;
            if (CAUSAL) {  // rows see keys up to their position: the largest is LQ - 1
                jend = j1 < a.LQ ? j1 : a.LQ;
                jend = jend > j0 ? jend : j0;
            }
            decode_split(a, bh / a.HKV, bh % a.HKV, rows, j0, jend, pr);
        }
        kz_barrier(tn);  // every split is in
        kz_range(heads, t, tn, lo, hi);
        for (int64_t bh = lo; bh < hi; ++bh)
            decode_combine(a, bh / a.HKV, bh % a.HKV, rows, nsplit, part + bh * nsplit * rows * (DV + 2));
        return 0;
    });
    free(part);
    return 0;
}

int prefill(const Args& a, int nthreads) {
    const int64_t rows = a.G * a.LQ, nblk = (rows + BQ - 1) / BQ, heads = a.B * a.HKV;
    const int64_t items = heads * nblk;
    const bool par = items > 1 && heads * rows * a.LK * (D + DV) >= $PARALLEL_MIN$;
    int64_t next = 0;  // the next item to hand out
    kz_parallel_for(kz_team_open(nthreads, par), [=, &next](int, int) KZ_BODY {
        Block* w = (Block*)aligned_alloc(64, (sizeof(Block) + 63) / 64 * 64);
        // the last row blocks see the most keys under a causal mask: hand them out first
        for (int64_t it = kz_next(&next); it < items; it = kz_next(&next)) {
            const int64_t blk = nblk - 1 - it / heads, bh = it % heads;
            const int64_t r0 = blk * BQ, nr = rows - r0 < BQ ? rows - r0 : BQ;
            prefill_block(a, *w, bh / a.HKV, bh % a.HKV, r0, nr);
        }
        free(w);
        return 0;
    });
    return 0;
}
extern "C" int $NAME$(const kz_t* q, const kz_t* k, const kz_t* v, const kz_tm* m, const float* sinks, kz_t* o,
                      const int64_t* sizes, const int64_t* strides, int64_t scale_bits, int kz_nthreads) {
    // the scale comes as its f32 bits in an integer argument: every argument is integer-class, so a replay
    // program (kernelize/runtime/replay.py) calls this as it calls the other kernels
    const uint32_t sb = (uint32_t)scale_bits;
    float scale;
    memcpy(&scale, &sb, sizeof scale);
    Args a;
    a.q = q, a.k = k, a.v = v, a.m = m, a.sinks = sinks, a.o = o;
    a.B = sizes[0], a.HQ = sizes[1], a.HKV = sizes[2], a.LQ = sizes[3], a.LK = sizes[4];
    a.G = a.HQ / a.HKV;
    for (int t = 0; t < 4; ++t) {
        a.sq[t] = strides[t], a.sk[t] = strides[4 + t], a.sv[t] = strides[8 + t], a.sm[t] = strides[12 + t];
    }
    a.scale = scale;
    if (a.B * a.HQ * a.LQ == 0) return 0;
    if (a.LK == 0) {  // no keys: every row is fully masked
        for (int64_t e = 0; e < a.B * a.HQ * a.LQ * DV; ++e) kz_st(o, e, 0.0f);
        return 0;
    }
    return a.G * a.LQ <= DECODE_ROWS ? decode(a, kz_nthreads) : prefill(a, kz_nthreads);
}
}  // namespace $NS$
#ifndef __clang__
#pragma GCC pop_options
#endif
