// Same-host all-reduce through one POSIX shared-memory segment (kernelize.shm_collective).
//
// Segment layout: a 4 KiB header of per-rank arrival counters (one 64-byte line each, so a rank's store
// does not invalidate the line another rank polls), then two slots of `cap` bytes per rank (call `seq`
// uses slot seq & 1). A call: copy this rank's partial into its slot, publish `seq` in its counter
// (release), wait until every counter reaches `seq` (acquire), then sum the slots in rank order into the
// caller's tensor, so every rank computes the same expression and gets the same bits. Two slots make one
// wait per call enough: a rank that starts call seq + 2 has seen every rank arrive at seq + 1, and a rank
// arrives there only after it finished reading call seq's slots.
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const int64_t KZ_SHM_HEADER = 4096;
static const int64_t KZ_SHM_LINE = 64;  // rank r's counter at r * 64 (32 ranks at most), the token at 2048

extern "C" int64_t kz_shm_header_bytes() { return KZ_SHM_HEADER; }

// create: a new segment of `bytes` (zero-filled), failing if the name exists; else an existing one of at
// least `bytes`. Returns the mapping, or nullptr.
extern "C" void* kz_shm_map(const char* name, int64_t bytes, int create) {
    int fd = shm_open(name, create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    if (fd < 0) return nullptr;
    struct stat st;
    bool sized = create ? ftruncate(fd, (off_t)bytes) == 0 : fstat(fd, &st) == 0 && st.st_size >= bytes;
    void* p = sized ? mmap(nullptr, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED && create) shm_unlink(name);
    return p == MAP_FAILED ? nullptr : p;
}

extern "C" int kz_shm_unlink(const char* name) { return shm_unlink(name); }

extern "C" int kz_shm_unmap(void* p, int64_t bytes) { return munmap(p, (size_t)bytes); }

static inline void kz_shm_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline double kz_shm_now() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Wait until `counter` reaches `seq`: spin ~50 us (a peer on another core arrives within that), then yield
// the core (a peer sharing this core needs it), then sleep 50 us at a time after 5 ms (a peer far behind,
// e.g. compiling kernels, gets the machine). False when `timeout_s` passed first.
static bool kz_shm_wait(const int64_t* counter, int64_t seq, double timeout_s) {
    if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= seq) return true;
    double start = kz_shm_now();
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= seq) return true;
            kz_shm_relax();
        }
        double waited = kz_shm_now() - start;
        if (waited > timeout_s) return false;
        if (waited > 5e-3) {
            struct timespec nap = {0, 50000};
            nanosleep(&nap, nullptr);
        } else if (waited > 5e-5) {
            sched_yield();
        }
    }
}

static inline float kz_shm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t kz_shm_f32_to_bf16(float f) {  // round to nearest even, one NaN (as torch's c10)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Rank order, one rounding per add for bf16 (as torch's bf16 `a + b` rounds its float sum).
static void kz_shm_sum(void* out, char* const* slots, int world, int64_t n, int dtype) {
    if (dtype == 0) {
        float* o = (float*)out;
        memcpy(o, slots[0], (size_t)n * 4);
        for (int r = 1; r < world; ++r) {
            const float* s = (const float*)slots[r];
            for (int64_t i = 0; i < n; ++i) o[i] += s[i];
        }
        return;
    }
    uint16_t* o = (uint16_t*)out;
    memcpy(o, slots[0], (size_t)n * 2);
    for (int r = 1; r < world; ++r) {
        const uint16_t* s = (const uint16_t*)slots[r];
        for (int64_t i = 0; i < n; ++i) {
            o[i] = kz_shm_f32_to_bf16(kz_shm_bf16_to_f32(o[i]) + kz_shm_bf16_to_f32(s[i]));
        }
    }
}

// The sum over the `world` ranks of each one's `n` elements at `data` (dtype 0: f32, 1: bf16), in place.
// Returns -1, or the first rank that did not arrive within `timeout_s` (the caller raises).
extern "C" int kz_shm_all_reduce(char* base, int64_t cap, int rank, int world, int64_t seq, void* data,
                                 int64_t n, int dtype, double timeout_s) {
    char* slots[32] = {};
    for (int r = 0; r < world; ++r) slots[r] = base + KZ_SHM_HEADER + (2 * (int64_t)r + (seq & 1)) * cap;
    memcpy(slots[rank], data, (size_t)n * (dtype == 0 ? 4 : 2));
    __atomic_store_n((int64_t*)(base + rank * KZ_SHM_LINE), seq, __ATOMIC_RELEASE);
    for (int r = 0; r < world; ++r) {
        if (!kz_shm_wait((const int64_t*)(base + r * KZ_SHM_LINE), seq, timeout_s)) return r;
    }
    kz_shm_sum(data, slots, world, n, dtype);
    return -1;
}
