$PRELUDE$
$CONV_LIB$

// $NAME$: $WHAT$ over NHWC f32 with its epilogue fused; the sizes come in `kz_dims` (see kz_conv_dims)
struct $NAME$_epilogue {
    const float* kz_b;  // channel bias
    const float* kz_r;  // residual, NHWC like the output
    int64_t kz_co;      // output channels
    static constexpr bool vector = $VECTOR$;          // `vec` below is the epilogue (else it returns v0)
    static constexpr bool bias_first = $BIAS_FIRST$;  // the accumulators start at the bias
    // v0: the convolution (plus the bias when bias_first) at output pixel kz_p (flat NHW index), channel kz_c
    inline __attribute__((always_inline)) float operator()(float v0, int64_t kz_p, int64_t kz_c) const {
        (void)kz_p, (void)kz_c;
$EPILOGUE$
    }
    // the same on the kz_n <= KZ_VW channels from kz_c at once
    inline __attribute__((always_inline)) kz_vec vec(kz_vec v0, int64_t kz_p, int64_t kz_c, int kz_n) const {
        (void)kz_p, (void)kz_c, (void)kz_n;
$VECTOR_EPILOGUE$
    }
};

extern "C" int $NAME$(const float* kz_x, const float* kz_w, const float* kz_b, const float* kz_r, float* kz_y,
                      const int64_t* kz_dims, int kz_nthreads) {
    kz_conv_dims kz_d;
    memcpy(&kz_d, kz_dims, sizeof kz_d);
    const $NAME$_epilogue kz_epi{kz_b, kz_r, kz_d.co};
    return $DRIVER$(kz_d, kz_x, kz_w, kz_y, kz_nthreads, kz_epi);
}
