$PRELUDE$

// kz_pool: 2-D max / average pooling over NHWC f32 (kernelize/codegen/cpu_pool.py). An output pixel's window
// is clipped to the input first, then each tap adds one run of C contiguous channels into the output row,
// which stays in L1: the loops over channels are simd loops, and no padded copy or mask is made.
// dims: n h w c oh ow kh kw sh sw pt pl pb pr dh dw kind (0 max, 1 avg, 2 sum: a global sum) count_pad
struct kz_pool_dims {
    int64_t n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, kind, count_pad;
};

// max with NaN propagating (a NaN input makes the output NaN, as torch's max pool does); -inf where the
// window holds no input
KZ_INLINE void kz_pool_max(const kz_pool_dims& d, const float* x, float* y, int64_t n, int64_t iy0, int64_t ix0) {
    for (int64_t c = 0; c < d.c; ++c) y[c] = -INFINITY;
    for (int64_t ky = 0; ky < d.kh; ++ky) {
        const int64_t iy = iy0 + ky * d.dh;
        if (iy < 0 || iy >= d.h) continue;
        for (int64_t kx = 0; kx < d.kw; ++kx) {
            const int64_t ix = ix0 + kx * d.dw;
            if (ix < 0 || ix >= d.w) continue;
            const float* q = x + ((n * d.h + iy) * d.w + ix) * d.c;
#pragma omp simd
            for (int64_t c = 0; c < d.c; ++c) y[c] = (q[c] > y[c] || q[c] != q[c]) ? q[c] : y[c];
        }
    }
}

// the sum of the window's inputs over the count of its taps inside the input, or inside input and padding
// (count_pad); windows have no dilation
KZ_INLINE void kz_pool_avg(const kz_pool_dims& d, const float* x, float* y, int64_t n, int64_t iy0, int64_t ix0) {
    const int64_t y0 = iy0 > 0 ? iy0 : 0, x0 = ix0 > 0 ? ix0 : 0;
    const int64_t y1 = iy0 + d.kh < d.h ? iy0 + d.kh : d.h, x1 = ix0 + d.kw < d.w ? ix0 + d.kw : d.w;
    int64_t count = (y1 - y0) * (x1 - x0);
    if (d.count_pad) {
        const int64_t py0 = iy0 > -d.pt ? iy0 : -d.pt, px0 = ix0 > -d.pl ? ix0 : -d.pl;
        const int64_t py1 = iy0 + d.kh < d.h + d.pb ? iy0 + d.kh : d.h + d.pb;
        const int64_t px1 = ix0 + d.kw < d.w + d.pr ? ix0 + d.kw : d.w + d.pr;
        count = (py1 - py0) * (px1 - px0);
    }
    for (int64_t c = 0; c < d.c; ++c) y[c] = 0.0f;
    for (int64_t iy = y0; iy < y1; ++iy)
        for (int64_t ix = x0; ix < x1; ++ix) {
            const float* q = x + ((n * d.h + iy) * d.w + ix) * d.c;
#pragma omp simd
            for (int64_t c = 0; c < d.c; ++c) y[c] += q[c];
        }
    const float k = d.kind == 2 ? 1.0f : (float)count;
#pragma omp simd
    for (int64_t c = 0; c < d.c; ++c) y[c] = y[c] / k;
}

extern "C" int kz_pool(const float* x, float* y, const int64_t* dims, int nthreads) {
    kz_pool_dims d;
    memcpy(&d, dims, sizeof d);
    if (d.kind != 0 && (d.dh != 1 || d.dw != 1)) return 1;
    const int64_t rows = d.n * d.oh;
    const kz_team_t team = kz_team_work(nthreads, rows * d.ow * d.c * d.kh * d.kw, 4 * d.n * d.c * (d.h * d.w + d.oh * d.ow));
    // items are runs of output pixels along a row: whole rows, or rows cut into `cuts` runs when there are
    // few rows for the team (a 13 x 13 output in rows over 2 threads is split 7 : 6)
    if (rows == 0 || d.ow == 0) return 0;
    const int64_t want = (8 * team.n + rows - 1) / rows, cuts = want < d.ow ? want : d.ow;
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(rows * cuts, t, tn, lo, hi);
        // (perf) by output rows: the divisions finding a pixel's coordinates cost more than a small
        // pixel's taps (the 24-channel stem pool of ShuffleNet ran 0.39 ms per pixel, 0.1 by rows)
        for (int64_t item = lo; item < hi; ++item) {
            const int64_t r = item / cuts, cut = item % cuts;
            const int64_t n = r / d.oh, iy0 = (r % d.oh) * d.sh - d.pt;
            float* yr = y + r * d.ow * d.c;
            for (int64_t ox = d.ow * cut / cuts; ox < d.ow * (cut + 1) / cuts; ++ox) {
                if (d.kind == 0)
                    kz_pool_max(d, x, yr + ox * d.c, n, iy0, ox * d.sw - d.pl);
                else
                    kz_pool_avg(d, x, yr + ox * d.c, n, iy0, ox * d.sw - d.pl);
            }
        }
        return 0;
    });
}

// kz_channel_gather: y[p, c] = x[p, map[c]] for every pixel p of NHWC f32 buffers (kernelize/codegen/
// cpu_pool.py): a layout view between two convs that only reorders or selects channels (ShuffleNet's channel
// shuffle, a channel split), in the replayed run instead of torch copies from NHWC to NCHW and back.
// dims: pixels, channels of x, channels of y, then y's channels' indices into x's
extern "C" int kz_channel_gather(const float* x, float* y, const int64_t* dims, int nthreads) {
    const int64_t pixels = dims[0], cx = dims[1], cy = dims[2];
    const int64_t* map = dims + 3;
    for (int64_t c = 0; c < cy; ++c)
        if (map[c] < 0 || map[c] >= cx) return 1;
    const kz_team_t team = kz_team_work(nthreads, 0, 8 * pixels * cy);
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(pixels, t, tn, lo, hi);
        for (int64_t p = lo; p < hi; ++p) {
            const float* xp = x + p * cx;
            float* yp = y + p * cy;
            for (int64_t c = 0; c < cy; ++c) yp[c] = xp[map[c]];
        }
        return 0;
    });
}

// kz_to_nhwc: the NHWC copy of a contiguous NCHW f32 tensor (a graph input read by a conv): for each image
// and block of pixels, every channel's run of pixels is read contiguously. dims: n, c, pixels (h * w)
extern "C" int kz_to_nhwc(const float* x, float* y, const int64_t* dims, int nthreads) {
    const int64_t n = dims[0], c = dims[1], hw = dims[2];
    const int64_t block = 256, blocks = (hw + block - 1) / block;
    const kz_team_t team = kz_team_work(nthreads, 0, 8 * n * c * hw);
    return kz_parallel_for(team, [=](int t, int tn) KZ_BODY {
        int64_t lo, hi;
        kz_range(n * blocks, t, tn, lo, hi);
        for (int64_t b = lo; b < hi; ++b) {
            const int64_t i = b / blocks, p0 = (b % blocks) * block;
            const int64_t p1 = p0 + block < hw ? p0 + block : hw;
            const float* xi = x + i * c * hw;
            float* yi = y + i * hw * c;
            for (int64_t ch = 0; ch < c; ++ch)
                for (int64_t p = p0; p < p1; ++p) yi[p * c + ch] = xi[ch * hw + p];
        }
        return 0;
    });
}
