$PRELUDE$
// $NAME$: row kernel over $DOMAIN$ (row = last $ROW_RANK$ axes). Rows are split across threads; each row
// is read in passes that stay in cache: statistics first (simd reductions), then one write pass. Column sums
// (over every row) add into per-thread partial sums in the write pass; after the rows, one reduce over the
// threads' partials writes them.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_rowlen = $ROWLEN$;
    int kz_err = 0;
    KZ_TEAM_OPEN(kz_nthreads, kz_outer * kz_rowlen >= $PARALLEL_MIN$)
    const bool kz_stream = kz_streams(kz_outer * kz_rowlen * $STREAM_BYTES$);
$COL_ALLOC$
#pragma omp parallel num_threads(kz_team_n) reduction(|: kz_err) reduction(max: kz_lag) if (kz_team_n > 1)
    {
        KZ_TEAM_STARTED();
$COL_SETUP$
#pragma omp for schedule(static)
        for (int64_t kz_o = 0; kz_o < kz_outer; ++kz_o) {
$OUTER_INDEX$
$ROW$
        }
        if (kz_stream) kz_stream_fence();
$COL_FINISH$
    }
    kz_team_done(kz_team_n, kz_lag);
    return kz_err;
}
