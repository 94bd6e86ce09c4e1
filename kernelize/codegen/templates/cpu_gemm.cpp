$PRELUDE$
$CONV_LIB$

// GEMMs [m, k] x [k, n] over a packed constant weight as 1x1 convs of m pixels of k channels (the dense tiles of
// cpu_conv.h; cpu_gemv.GeneratedGemm), each with an epilogue applied before the tile leaves L1: the channel
// bias (where kz_b is given: the accumulators start at it), then a GELU or a residual add / multiply (kz_r,
// row major like the output) in a pass over each stored tile. The epilogue is chosen at run time, so one
// compiled driver serves every form and every model: one entry point per form (a conv's arguments), built once
// (1.7 s cold here; a driver compiled per form took 1.6-2.2 s each).
enum { KZ_GEMM_PLAIN, KZ_GEMM_GELU, KZ_GEMM_GELU_TANH, KZ_GEMM_ADD, KZ_GEMM_MUL };

struct kz_gemm_epilogue;
static void kz_gemm_tile(const kz_gemm_epilogue& e, float* y, int64_t ld, int64_t p0, int64_t c0, int rows, int nc);

struct kz_gemm_epilogue {
    const float* kz_b;  // channel bias, or null
    const float* kz_r;  // residual, row major like the output
    int64_t kz_co;      // output channels (columns)
    int form;           // KZ_GEMM_*
    bool bias_first;    // kz_b given: the accumulators start at it
    static constexpr bool vector = true, tile_pass = true;
    inline __attribute__((always_inline)) float operator()(float v0, int64_t, int64_t) const { return v0; }
    inline __attribute__((always_inline)) kz_vec vec(kz_vec v0, int64_t, int64_t, int) const { return v0; }
    inline __attribute__((always_inline)) void tile(float* y, int64_t ld, int64_t p0, int64_t c0, int rows,
                                                    int nc) const {
        if (form != KZ_GEMM_PLAIN) kz_gemm_tile(*this, y, ld, p0, c0, rows, nc);
    }
};

// the epilogue over one stored tile: `rows` rows of `nc` values from y (row stride ld), output pixel p0, column c0
static __attribute__((noinline)) void kz_gemm_tile(const kz_gemm_epilogue& e, float* y, int64_t ld, int64_t p0,
                                                   int64_t c0, int rows, int nc) {
    for (int i = 0; i < rows; ++i) {
        float* __restrict yi = y + i * ld;
        if (e.form == KZ_GEMM_GELU) {
#pragma omp simd
            for (int j = 0; j < nc; ++j) yi[j] = kz_gelu(yi[j]);
        } else if (e.form == KZ_GEMM_GELU_TANH) {
#pragma omp simd
            for (int j = 0; j < nc; ++j) yi[j] = kz_gelu_tanh(yi[j]);
        } else {
            const float* __restrict ri = e.kz_r + (p0 + i) * e.kz_co + c0;
            if (e.form == KZ_GEMM_ADD) {
#pragma omp simd
                for (int j = 0; j < nc; ++j) yi[j] += ri[j];
            } else {
#pragma omp simd
                for (int j = 0; j < nc; ++j) yi[j] *= ri[j];
            }
        }
    }
}

static int kz_gemm(int form, const float* kz_x, const float* kz_w, const float* kz_b, const float* kz_r,
                   float* kz_y, const int64_t* kz_dims, int kz_nthreads) {
    kz_conv_dims kz_d;
    memcpy(&kz_d, kz_dims, sizeof kz_d);
    if (kz_d.kh * kz_d.kw != 1 || kz_d.g != 1) return 1;
    const kz_gemm_epilogue kz_epi{kz_b, kz_r, kz_d.co, form, kz_b != nullptr};
    return kz_conv_dense<-1, false>(kz_d, kz_x, kz_w, kz_y, kz_nthreads, kz_epi);
}

#define KZ_GEMM_FORM(NAME, FORM)                                                                              \
    extern "C" int NAME(const float* x, const float* w, const float* b, const float* r, float* y,             \
                        const int64_t* dims, int nthreads) {                                                  \
        return kz_gemm(FORM, x, w, b, r, y, dims, nthreads);                                                  \
    }
KZ_GEMM_FORM(kz_gemm_plain, KZ_GEMM_PLAIN)
KZ_GEMM_FORM(kz_gemm_gelu, KZ_GEMM_GELU)
KZ_GEMM_FORM(kz_gemm_gelu_tanh, KZ_GEMM_GELU_TANH)
KZ_GEMM_FORM(kz_gemm_add, KZ_GEMM_ADD)
KZ_GEMM_FORM(kz_gemm_mul, KZ_GEMM_MUL)
