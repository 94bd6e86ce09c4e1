$PRELUDE$
$CONV_LIB$

// $NAME$: $WHAT$ over NHWC f32 with its epilogue fused. No size appears in this source (they come in `kz_dims`,
// see kz_conv_dims), so the convs of a model that share an epilogue compile once.
$EPILOGUE$
extern "C" int $NAME$(const float* kz_x, const float* kz_w, const float* kz_b, const float* kz_r, float* kz_y,
                      const int64_t* kz_dims, int kz_nthreads) {
    kz_conv_dims kz_d;
    memcpy(&kz_d, kz_dims, sizeof kz_d);
    const $NAME$_epilogue kz_epi{kz_b, kz_r, kz_d.co};
    return $DRIVER$(kz_d, kz_x, kz_w, kz_y, kz_nthreads, kz_epi);
}
