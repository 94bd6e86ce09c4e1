// kernelize matmul kernel: $KERNEL$
// Tiled matmul: each 256-thread block computes a 64x64 tile of C = A @ B in $ACC_T$, staging 64x16 / 16x64
// tiles of A and B in shared memory; each thread owns a 4x4 sub-tile. The fused epilogue runs on the
// accumulator before the single store. blockIdx.z walks the batch.
#define KZ_BLOCK 256
#define KZ_BM 64
#define KZ_BN 64
#define KZ_BK 16
$PRELUDE$
extern "C" __global__ void __launch_bounds__(KZ_BLOCK) $NAME$($PARAMS$) {
  typedef $IDX$ idx_t;
  typedef $ACC_T$ acc_t;
  __shared__ acc_t kz_as[KZ_BK][KZ_BM + 1];
  __shared__ acc_t kz_bs[KZ_BK][KZ_BN + 1];
  const idx_t M = $M$, N = $N$, K = $K$;
  idx_t bz = blockIdx.z;
$BATCH_INDEX$
  const idx_t m0 = (idx_t)blockIdx.y * KZ_BM, n0 = (idx_t)blockIdx.x * KZ_BN;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  acc_t acc[4][4];
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b) acc[a][b] = (acc_t)0;
  for (idx_t k0 = 0; k0 < K; k0 += KZ_BK) {
    for (int t = threadIdx.x; t < KZ_BM * KZ_BK; t += KZ_BLOCK) {
      const idx_t im = m0 + t / KZ_BK, ik = k0 + t % KZ_BK;
      kz_as[t % KZ_BK][t / KZ_BK] = (im < M && ik < K) ? (acc_t)kz_ld($A$) : (acc_t)0;
    }
    for (int t = threadIdx.x; t < KZ_BK * KZ_BN; t += KZ_BLOCK) {
      const idx_t ik = k0 + t / KZ_BN, in = n0 + t % KZ_BN;
      kz_bs[t / KZ_BN][t % KZ_BN] = (ik < K && in < N) ? (acc_t)kz_ld($B$) : (acc_t)0;
    }
    __syncthreads();
    for (int kk = 0; kk < KZ_BK; ++kk) {
      acc_t ra[4], rb[4];
      for (int a = 0; a < 4; ++a) ra[a] = kz_as[kk][ty + 16 * a];
      for (int b = 0; b < 4; ++b) rb[b] = kz_bs[kk][tx + 16 * b];
      for (int a = 0; a < 4; ++a)
        for (int b = 0; b < 4; ++b) acc[a][b] += ra[a] * rb[b];
    }
    __syncthreads();
  }
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      const idx_t $IM$ = m0 + ty + 16 * a, $IN$ = n0 + tx + 16 * b;
      if ($IM$ >= M || $IN$ >= N) continue;
      const acc_t $MM$ = acc[a][b];
$BODY$
$STORES$
    }
  }
}
