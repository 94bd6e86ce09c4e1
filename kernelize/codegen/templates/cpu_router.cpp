$PRELUDE$
// $NAME$: a mixture-of-experts router over rows of $E$ logits (kernelize/ir/router.py): score ($SCORE$),
// top-$K$ of the scores plus the choice bias (ties: the lower index; NaN the largest), the chosen scores
// renormalised ($RENORM$) and scaled, the weights and int64 indices written. One row per iteration, rows
// split across threads; E and K are constants, so a row's scores stay on the stack. Everything is local to
// the function: several routers share a translation unit.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    constexpr int E = $E$, K = $K$, SCORE = $SCORE_CODE$, RENORM = $RENORM_CODE$;  // 0 softmax / none
    const int64_t kz_rows = $ROWS$;
    const kz_team_t kz_tm = kz_team_open(kz_nthreads, kz_rows * E * K >= $PARALLEL_MIN$);
    return kz_parallel_for(kz_tm, [=](int kz_tid, int kz_tn) KZ_BODY {
        auto better = [](float v, float best) { return v > best || (v != v && best == best); };
        int64_t kz_lo, kz_hi;
        kz_range(kz_rows, kz_tid, kz_tn, kz_lo, kz_hi);
        float s[E], c[E], w[K];
        int64_t ix[K];
        for (int64_t r = kz_lo; r < kz_hi; ++r) {
            for (int e = 0; e < E; ++e) s[e] = kz_ld(kz_x, r * E + e);
            if constexpr (SCORE == 0) {
                float m = s[0];
                for (int e = 1; e < E; ++e) m = s[e] > m || s[e] != s[e] ? s[e] : m;
                float total = 0.0f;
                for (int e = 0; e < E; ++e) total += (s[e] = expf(s[e] - m));
                for (int e = 0; e < E; ++e) s[e] = s[e] / total;
            } else if constexpr (SCORE == 1) {
                for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + expf(-s[e]));
            }
            for (int e = 0; e < E; ++e) c[e] = s[e]$CHOICE_BIAS$;
            for (int k = 0; k < K; ++k) {  // K passes of a first-best scan: the lowest index wins ties
                int best = -1;
                float bv = 0.0f;
                for (int e = 0; e < E; ++e) {
                    bool skip = false;
                    for (int j = 0; j < k; ++j) skip |= ix[j] == e;
                    if (!skip && (best < 0 || better(c[e], bv))) best = e, bv = c[e];
                }
                ix[k] = best;
                w[k] = s[best];
            }
            if constexpr (RENORM == 1) {
                float sum = 0.0f;
                for (int k = 0; k < K; ++k) sum += w[k];
                for (int k = 0; k < K; ++k) w[k] = w[k] / (sum + $EPS$);
            } else if constexpr (RENORM == 2) {
                float wm = w[0];
                for (int k = 1; k < K; ++k) wm = w[k] > wm || w[k] != w[k] ? w[k] : wm;
                float ws = 0.0f;
                for (int k = 0; k < K; ++k) ws += (w[k] = expf(w[k] - wm));
                for (int k = 0; k < K; ++k) w[k] = w[k] / ws;
            }
$STORES$
        }
        return 0;
    });
}
