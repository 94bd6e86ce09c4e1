    // pass $PASS$: $WHAT$
    $ACC_DECL$
    for (idx_t j = threadIdx.x; j < rowlen; j += blockDim.x) {
$INNER_INDEX$
$BODY$
$UPDATE$
    }
$FINISH$
