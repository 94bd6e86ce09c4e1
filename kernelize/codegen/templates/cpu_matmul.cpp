$PRELUDE$
// $NAME$: matmul over $DOMAIN$ with K = $K$ and a fused epilogue. Output rows are split across threads;
// each output row accumulates a[m, k] * b[k, :] with the N axis as the unit-stride simd loop.
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_n = $N$;
    const int64_t kz_k = $K$;
    int kz_err = 0;
#pragma omp parallel for num_threads(kz_nthreads) schedule(static) reduction(|: kz_err) \
    if (kz_outer * kz_n * kz_k >= $PARALLEL_MIN$)
    for (int64_t kz_o = 0; kz_o < kz_outer; ++kz_o) {
$OUTER_INDEX$
        $ACC_T$* kz_acc = ($ACC_T$*)malloc(sizeof($ACC_T$) * (kz_n ? kz_n : 1));  // one output row
        for (int64_t $J$ = 0; $J$ < kz_n; ++$J$) kz_acc[$J$] = 0;
        for (int64_t kz_kk = 0; kz_kk < kz_k; ++kz_kk) {
            const $ACC_T$ kz_av = $A_LOAD$;
#pragma omp simd
            for (int64_t $J$ = 0; $J$ < kz_n; ++$J$) kz_acc[$J$] += kz_av * $B_LOAD$;
        }
#pragma omp simd
        for (int64_t $J$ = 0; $J$ < kz_n; ++$J$) {
$BODY$
        }
        free(kz_acc);
    }
    return kz_err;
}
