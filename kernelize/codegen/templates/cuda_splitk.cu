// kernelize split-K few-row matmul: $KERNEL$
// Decode shape (up to KZ_ROWS rows, every row in this block): blockIdx.x owns KZ_COLS columns, blockIdx.y
// one slice of K. Each 32-thread group walks its column's slice with consecutive k across its lanes (an
// nn.Linear weight is K-contiguous: coalesced reads, each weight element read once per launch) and keeps
// one f32 partial sum per row; the 32 partials of a row are summed through shared memory and the block's
// sums added to the zeroed f32 output with atomicAdd. The epilogue runs as a separate pointwise kernel.
#define KZ_BLOCK 256
#define KZ_COLS 8
#define KZ_ROWS 16
$PRELUDE$
extern "C" __global__ void __launch_bounds__(KZ_BLOCK) $NAME$($PARAMS$) {
  typedef $IDX$ idx_t;
  __shared__ float kz_red[KZ_COLS][KZ_ROWS][33];
  const idx_t ROWS = $ROWS$, N = $N$, K = $K$;
  const int lane = threadIdx.x % 32, col = threadIdx.x / 32;
  const idx_t in = (idx_t)blockIdx.x * KZ_COLS + col;
  const idx_t kslice = (K + gridDim.y - 1) / gridDim.y;
  const idx_t k0 = (idx_t)blockIdx.y * kslice, k1 = k0 + kslice < K ? k0 + kslice : K;
  idx_t a_row[KZ_ROWS];
  float acc[KZ_ROWS];
  for (int r = 0; r < KZ_ROWS; ++r) {
    acc[r] = 0.0f;
    a_row[r] = 0;
    if (r < ROWS) {
      const idx_t kz_row = r;
$ROW_INDEX$
      a_row[r] = $A_ROW$;
    }
  }
  if (in < N) {
    for (idx_t ik = k0 + lane; ik < k1; ik += 32) {
      const float b = (float)kz_ld($B$);
      for (int r = 0; r < KZ_ROWS; ++r)
        if (r < ROWS) acc[r] += (float)kz_ld($A_PTR$[a_row[r] + ik * $A_SK$]) * b;
    }
  }
  for (int r = 0; r < KZ_ROWS; ++r) kz_red[col][r][lane] = acc[r];
  __syncthreads();
  if (lane < KZ_ROWS && lane < ROWS && in < N) {
    float s = 0.0f;
    for (int l = 0; l < 32; ++l) s += kz_red[col][lane][l];
    atomicAdd(&o0[(idx_t)lane * N + in], s);
  }
}
