// kernelize row kernel: $KERNEL$
// One block per row (grid-stride over the $NROWS$ rows), the block's threads stride over the $ROWLEN$
// elements of the row. Each reduction or row op of the body is one statistics pass (cuda_row_pass.cu)
// whose per-thread accumulator kz_block_reduce combines (warp shuffles, then one slot per warp in shared
// memory); per-row values are computed once per row; the output pass computes the full values (the
// normalized row and its fused epilogue) and stores them.
#define KZ_BLOCK $BLOCK$
$PRELUDE$
extern "C" __global__ void __launch_bounds__(KZ_BLOCK) $NAME$($PARAMS$) {
  typedef $IDX$ idx_t;
  const idx_t nrows = $NROWS$;
  const idx_t rowlen = $ROWLEN$;
  for (idx_t row = blockIdx.x; row < nrows; row += gridDim.x) {
$OUTER_INDEX$
$ROW_BODY$
  }
}
