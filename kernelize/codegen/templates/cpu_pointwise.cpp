$PRELUDE$
// $NAME$: pointwise over $DOMAIN$. The domain is cut into tiles of one outer index and up to $BLOCK$
// inner elements; tiles are split across threads, the inner loop is a unit-stride simd loop (with a
// constant trip count when the inner size is static and fits one tile, so it needs no remainder loop;
// a static inner axis whose masks or concats test the index at static bounds is one loop per sub-range
// between the bounds, where the tests are constants and the loads plain).
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_inner = $INNER$;
    const int64_t kz_outer = $OUTER$;
    const int64_t kz_nblk = (kz_inner + $BLOCK$ - 1) / $BLOCK$;
    const int64_t kz_tiles = kz_outer * kz_nblk;
    int kz_err = 0;
    KZ_TEAM_OPEN(kz_nthreads, kz_outer * kz_inner >= $PARALLEL_MIN$)
    const bool kz_stream = kz_streams(kz_outer * kz_inner * $STREAM_BYTES$);
#pragma omp parallel num_threads(kz_team_n) reduction(|: kz_err) reduction(max: kz_lag) if (kz_team_n > 1)
    {
        KZ_TEAM_STARTED();
#pragma omp for schedule(static)
        for (int64_t kz_t = 0; kz_t < kz_tiles; ++kz_t) {
            const int64_t kz_o = kz_t / kz_nblk;
            const int64_t kz_j0 = (kz_t - kz_o * kz_nblk) * $BLOCK$;
            const int64_t kz_j1 = kz_j0 + $BLOCK$ < kz_inner ? kz_j0 + $BLOCK$ : kz_inner;
$OUTER_INDEX$
$LOOPS$
        }
        if (kz_stream) kz_stream_fence();
    }
    kz_team_done(kz_team_n, kz_lag);
    return kz_err;
}
