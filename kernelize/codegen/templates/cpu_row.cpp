$PRELUDE$
// $NAME$: row kernel over $DOMAIN$ (row = last $ROW_RANK$ axes). Rows are split across threads; each row
// is read in passes that stay in cache: statistics first (simd reductions), then one write pass.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_rowlen = $ROWLEN$;
    int kz_err = 0;
    const int64_t kz_t0 = kz_now_ns();
    const int kz_team_n = kz_outer * kz_rowlen >= $PARALLEL_MIN$ ? kz_team(kz_nthreads, kz_t0) : 1;
    int64_t kz_lag = 0;
#pragma omp parallel num_threads(kz_team_n) reduction(|: kz_err) reduction(max: kz_lag) if (kz_team_n > 1)
    {
        kz_lag = kz_now_ns() - kz_t0;
#pragma omp for schedule(static)
        for (int64_t kz_o = 0; kz_o < kz_outer; ++kz_o) {
$OUTER_INDEX$
$ROW$
        }
    }
    kz_team_done(kz_team_n, kz_lag);
    return kz_err;
}
