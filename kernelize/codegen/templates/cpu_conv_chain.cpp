$PRELUDE$
$CONV_LIB$

// $NAME$: $WHAT$ over NHWC f32, one pass (kz_conv_chain); each stage's epilogue fused
$EPILOGUES$
extern "C" int $NAME$(const float* kz_x, const float* kz_w0, const float* kz_b0, const float* kz_w1,
                      const float* kz_b1, const float* kz_w2, const float* kz_b2, const float* kz_r, float* kz_y,
                      const int64_t* kz_dims, int kz_nthreads) {
    kz_conv_dims kz_d[3];
    memcpy(kz_d, kz_dims, sizeof kz_d);
    const float* kz_w[3] = {kz_w0, kz_w1, kz_w2};
    const $NAME$_s0 kz_e0{kz_b0, nullptr, kz_d[0].co};
    const $NAME$_s1 kz_e1{kz_b1, nullptr, kz_d[1].co};
    const $NAME$_s2 kz_e2{kz_b2, kz_r, kz_d[2].co};
    (void)kz_e0, (void)kz_e2;
    return kz_conv_chain<$HAS_A$, $HAS_C$, $FORM$, $HALF_A$, $HALF_C$>(kz_d, kz_x, kz_w, kz_y, kz_nthreads, kz_e0, kz_e1, kz_e2);
}
