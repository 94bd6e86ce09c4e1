$PRELUDE$
// $NAME$: row kernel over $DOMAIN$ (row = last $ROW_RANK$ axes). Rows are split across threads; each row
// is read in passes that stay in cache: statistics first (simd reductions), then one write pass. Column sums
// (over every row) add into per-thread partial sums in the write pass; after the rows, one reduce over the
// threads' partials writes them.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_rowlen = $ROWLEN$;
    const kz_team_t kz_tm = kz_team_work(kz_nthreads, kz_outer * kz_rowlen * $FLOPS$, kz_outer * kz_rowlen * $BYTES$);
    const bool kz_stream = kz_streams(kz_outer * kz_rowlen * $STREAM_BYTES$);
$COL_ALLOC$
    return kz_parallel_region(kz_tm, $COL_TOGETHER$, [=](int kz_tid, int kz_tn) KZ_BODY {
        int kz_err = 0;
$COL_SETUP$
        int64_t kz_lo, kz_hi;
        kz_range(kz_outer, kz_tid, kz_tn, kz_lo, kz_hi);
        for (int64_t kz_o = kz_lo; kz_o < kz_hi; ++kz_o) {
$OUTER_INDEX$
$ROW$
        }
        if (kz_stream) kz_stream_fence();
$COL_FINISH$
        return kz_err;
    });
}
