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
    const bool kz_stream = kz_streams(kz_outer * kz_inner * $STREAM_BYTES$);
    const kz_team_t kz_tm = kz_team_work(kz_nthreads, kz_outer * kz_inner * $FLOPS$, kz_outer * kz_inner * $BYTES$);
    return kz_parallel_for(kz_tm, [=](int kz_tid, int kz_tn) KZ_BODY {
        int kz_err = 0;
        int64_t kz_lo, kz_hi;
        kz_range(kz_tiles, kz_tid, kz_tn, kz_lo, kz_hi);
        for (int64_t kz_t = kz_lo; kz_t < kz_hi; ++kz_t) {
            const int64_t kz_o = kz_t / kz_nblk;
            const int64_t kz_j0 = (kz_t - kz_o * kz_nblk) * $BLOCK$;
            const int64_t kz_j1 = kz_j0 + $BLOCK$ < kz_inner ? kz_j0 + $BLOCK$ : kz_inner;
$OUTER_INDEX$
$LOOPS$
        }
        if (kz_stream) kz_stream_fence();
        return kz_err;
    });
}
