// kz_replay: call a list of generated CPU kernels in order, with the arguments the Python launchers would
// pass (kernelize/runtime/replay.py builds the list once per input signature). Every kernel entry point
// takes only integer-class arguments (pointers, int64 sizes, the int thread count), which the x86-64 and
// AArch64 C calling conventions pass the same way, so one signature of KZ_REPLAY_ARGS int64 arguments calls
// them all: the arguments past a kernel's own are ignored.
#include <stdint.h>
#include <string.h>

#define KZ_REPLAY_ARGS 16
struct kz_call {
    void* fn;
    int64_t args[KZ_REPLAY_ARGS];
};
typedef int (*kz_call_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

// 0 when every call returned 0, else 1 + the index of the first call that returned non-zero (the rest
// are not run)
extern "C" int kz_replay(const kz_call* calls, int n) {
    for (int i = 0; i < n; ++i) {
        const int64_t* a = calls[i].args;
        const int rc = ((kz_call_fn)calls[i].fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                                                  a[11], a[12], a[13], a[14], a[15]);
        if (rc) return i + 1;
    }
    return 0;
}

// kz_replay_patched: first `values[patches[3p + 1]] + patches[3p + 2]` into the int64 at address
// `patches[3p]`, for each of the `npatches` patches (the arguments and size cells that change per run: a
// decode step's input and output, the cache row, the key length, the thread count), then kz_replay
extern "C" int kz_replay_patched(const kz_call* calls, int n, const int64_t* patches, int npatches,
                                 const int64_t* values) {
    for (int p = 0; p < npatches; ++p) {
        const int64_t* q = patches + 3 * p;
        *(int64_t*)(intptr_t)q[0] = values[q[1]] + q[2];
    }
    return kz_replay(calls, n);
}

// kz_copy_rows: `rows` rows of `bytes` bytes from src (rows `src_stride` bytes apart) to dst (`dst_stride`
// apart): what a replay program runs for a copy between kernels (a decode step's new key / value into the
// cache's room). Returns 0 (the replay convention).
extern "C" int kz_copy_rows(const char* src, char* dst, int64_t rows, int64_t bytes, int64_t src_stride,
                            int64_t dst_stride) {
    for (int64_t r = 0; r < rows; ++r) memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)bytes);
    return 0;
}
