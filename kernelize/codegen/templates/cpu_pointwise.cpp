$PRELUDE$
// $NAME$: pointwise over $DOMAIN$. The domain is cut into tiles of one outer index and up to $BLOCK$
// inner elements; tiles are split across threads, the inner loop is a unit-stride simd loop (with a
// constant trip count when the inner size is static and fits one tile, so it needs no remainder loop).
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_inner = $INNER$;
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_nblk = (kz_inner + $BLOCK$ - 1) / $BLOCK$;
    const int64_t kz_tiles = kz_outer * kz_nblk;
    int kz_err = 0;
#pragma omp parallel for num_threads(kz_nthreads) schedule(static) reduction(|: kz_err) \
    if (kz_outer * kz_inner >= $PARALLEL_MIN$)
    for (int64_t kz_t = 0; kz_t < kz_tiles; ++kz_t) {
        const int64_t kz_o = kz_t / kz_nblk;
        const int64_t kz_j0 = (kz_t - kz_o * kz_nblk) * $BLOCK$;
        const int64_t kz_j1 = kz_j0 + $BLOCK$ < kz_inner ? kz_j0 + $BLOCK$ : kz_inner;
$OUTER_INDEX$
#pragma omp simd
        for (int64_t $J$ = $J0$; $J$ < $J1$; ++$J$) {
$BODY$
        }
    }
    return kz_err;
}
