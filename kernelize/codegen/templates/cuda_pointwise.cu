// kernelize pointwise kernel: $KERNEL$
// A grid-stride loop over the $NUMEL$ elements of the domain; each element's domain index is decomposed
// from the linear index, operands are read through compile-time strides (0 for broadcast axes) and the
// fused scalar body is substituted below.
#define KZ_BLOCK $BLOCK$
$PRELUDE$
extern "C" __global__ void __launch_bounds__(KZ_BLOCK) $NAME$($PARAMS$) {
  typedef $IDX$ idx_t;
  const idx_t n = $NUMEL$;
  for (idx_t i = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (idx_t)blockDim.x * gridDim.x) {
$INDEX$
$BODY$
$STORES$
  }
}
