struct $STRUCT$ {
    const float* kz_b;  // channel bias
    const float* kz_r;  // residual, NHWC like the output
    int64_t kz_co;      // output channels
    static constexpr bool vector = $VECTOR$;          // `vec` below is the epilogue (else it returns v0)
    static constexpr bool bias_first = $BIAS_FIRST$;  // the accumulators start at the bias
    static constexpr bool tile_pass = false;            // no pass over each stored tile (cpu_conv.h)
    void tile(float*, int64_t, int64_t, int64_t, int, int) const {}
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
