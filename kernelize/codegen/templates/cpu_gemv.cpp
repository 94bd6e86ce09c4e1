$PRELUDE$
$GEMV_LIB$

// $NAME$: few-row matmul over $DOMAIN$, $NMM$ matmul(s) sharing the left operand, epilogue fused
extern "C" int $NAME$($PARAMS$int kz_nthreads) {
    const int64_t kz_rows = $ROWS$;
    const int64_t kz_n = $N$;
    const int64_t kz_k = $K$;
    if (kz_rows <= 0 || kz_n <= 0) return 0;
    int kz_err_all = 0;
    const int64_t kz_ldx = (kz_k + 15) / 16 * 16 + 16;  // +16: rows do not start on the same cache set
    $ACC_T$* kz_x = kz_scratch<$ACC_T$>(0, KZ_MAXR * kz_ldx);
    for (int64_t kz_r0 = 0; kz_r0 < kz_rows; kz_r0 += KZ_MAXR) {
        const int kz_nr = (int)(kz_rows - kz_r0 < KZ_MAXR ? kz_rows - kz_r0 : KZ_MAXR);
        int64_t kz_rb[$NSLOT$][KZ_MAXR];  // per access, the row's base offset
        int64_t kz_ri[$NOUTER$][KZ_MAXR];  // per outer axis, the row's index
        for (int kz_r = 0; kz_r < kz_nr; ++kz_r) {
            const int64_t kz_o = kz_r0 + kz_r;
$ROW_SETUP$
        }
        const int64_t kz_kfull = kz_k / (2 * KZ_VL) * (2 * KZ_VL);
        for (int kz_r = 0; kz_r < kz_nr; ++kz_r) {  // the rows of x, once, as $ACC_T$
            const int64_t kz_la = kz_rb[0][kz_r];
            for (int64_t kz_kk = 0; kz_kk < kz_k; ++kz_kk)
                kz_x[kz_r * kz_ldx + kz_xpos<$PAIRS$>(kz_kk, kz_kfull)] = $A_LOAD$;
        }
        // threads split the columns, or (few column blocks, long K) the contraction with a final combine
        const kz_team_t kz_tm = kz_team_open(kz_nthreads, (int64_t)kz_nr * kz_n * kz_k >= $PARALLEL_MIN$);
        const int kz_nt = kz_tm.n;
        const int64_t kz_cb = $CB$;  // columns per block
        const int64_t kz_nblk = (kz_n + kz_cb - 1) / kz_cb;
        const bool kz_splitk = kz_nt > 1 && kz_nblk < 4 * kz_nt && kz_k >= 256 * kz_nt;
        $ACC_T$* kz_part = kz_splitk ? ($ACC_T$*)malloc(sizeof($ACC_T$) * kz_nt * $NMM$ * kz_nr * kz_n) : 0;
        kz_err_all |= kz_parallel_region(kz_tm, kz_splitk, [=](int kz_t, int kz_tn) KZ_BODY {
            int kz_err = 0;
            auto kz_epi = [&](int kz_r, int64_t $J$, const $ACC_T$* kz_mv) {
$EPILOGUE$
            };
            $ACC_T$ kz_blk[$NMM$][KZ_MAXR * $CB$];
            $ACC_T$ kz_mv[$NMM$];
            if (!kz_splitk) {
                const int64_t kz_b0 = kz_nblk * kz_t / kz_tn, kz_b1 = kz_nblk * (kz_t + 1) / kz_tn;
                const int64_t kz_k0 = 0, kz_k1 = kz_k;
                for (int64_t kz_b = kz_b0; kz_b < kz_b1; ++kz_b) {
                    const int64_t kz_c0 = kz_b * kz_cb;
                    const int64_t kz_nb = kz_n - kz_c0 < kz_cb ? kz_n - kz_c0 : kz_cb;
$COLS$
                    for (int kz_r = 0; kz_r < kz_nr; ++kz_r)
                        for (int64_t kz_jj = 0; kz_jj < kz_nb; ++kz_jj) {
                            for (int kz_m = 0; kz_m < $NMM$; ++kz_m) kz_mv[kz_m] = kz_blk[kz_m][kz_r * kz_cb + kz_jj];
                            kz_epi(kz_r, kz_c0 + kz_jj, kz_mv);
                        }
                }
            } else {
                int64_t kz_kc = (kz_k + kz_tn - 1) / kz_tn;
                kz_kc = (kz_kc + 2 * KZ_VL - 1) / (2 * KZ_VL) * (2 * KZ_VL);  // whole bf16 pair chunks
                const int64_t kz_k0 = kz_t * kz_kc < kz_k ? kz_t * kz_kc : kz_k;
                const int64_t kz_k1 = kz_k0 + kz_kc < kz_k ? kz_k0 + kz_kc : kz_k;
                $ACC_T$* kz_mine = kz_part + (int64_t)kz_t * $NMM$ * kz_nr * kz_n;
                const int64_t kz_b1 = kz_nblk;
                for (int64_t kz_b = 0; kz_b < kz_nblk; ++kz_b) {
                    const int64_t kz_c0 = kz_b * kz_cb;
                    const int64_t kz_nb = kz_n - kz_c0 < kz_cb ? kz_n - kz_c0 : kz_cb;
$COLS$
                    for (int kz_m = 0; kz_m < $NMM$; ++kz_m)
                        for (int kz_r = 0; kz_r < kz_nr; ++kz_r)
                            for (int64_t kz_jj = 0; kz_jj < kz_nb; ++kz_jj)
                                kz_mine[(kz_m * kz_nr + kz_r) * kz_n + kz_c0 + kz_jj] =
                                    kz_blk[kz_m][kz_r * kz_cb + kz_jj];
                }
                kz_barrier(kz_tn);
                const int64_t kz_tot = (int64_t)kz_nr * kz_n;
                for (int64_t kz_i = kz_tot * kz_t / kz_tn; kz_i < kz_tot * (kz_t + 1) / kz_tn; ++kz_i) {
                    const int kz_r = (int)(kz_i / kz_n);
                    const int64_t kz_col = kz_i % kz_n;
                    for (int kz_m = 0; kz_m < $NMM$; ++kz_m) {
                        $ACC_T$ kz_s = 0;
                        for (int kz_u = 0; kz_u < kz_tn; ++kz_u)
                            kz_s += kz_part[(((int64_t)kz_u * $NMM$ + kz_m) * kz_nr + kz_r) * kz_n + kz_col];
                        kz_mv[kz_m] = kz_s;
                    }
                    kz_epi(kz_r, kz_col, kz_mv);
                }
            }
            return kz_err;
        });
        free(kz_part);
    }
    return kz_err_all;
}
