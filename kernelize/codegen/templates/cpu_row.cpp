$PRELUDE$
// $NAME$: row kernel over $DOMAIN$ (row = last $ROW_RANK$ axes). Rows are split across threads; each row
// is read in passes that stay in cache: statistics first (simd reductions), then one write pass.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_rowlen = $ROWLEN$;
    int kz_err = 0;
#pragma omp parallel for num_threads(kz_nthreads) schedule(static) reduction(|: kz_err) \
    if (kz_outer * kz_rowlen >= $PARALLEL_MIN$)
    for (int64_t kz_o = 0; kz_o < kz_outer; ++kz_o) {
$OUTER_INDEX$
$ROW$
    }
    return kz_err;
}
