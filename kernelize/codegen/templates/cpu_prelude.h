// kernelize CPU prelude: the kz_* helpers the shared render table calls, with the reference semantics
// of kernelize/ir/reference.py. Everything is static inline and branch-free where it sits in hot loops,
// so `#pragma omp simd` loops vectorise (AVX2 / AVX-512 with -march=native).
//
// Storage types: f32 float, f64 double, bf16 kz_bf16 and f16 kz_f16 (16-bit patterns), ints as <stdint.h>,
// bool as bool. 16-bit floats are widened to float on load and rounded to nearest even on store.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else  // built without OpenMP (Apple clang): the pragmas are ignored and every region is the calling thread
static inline int omp_get_thread_num() { return 0; }
static inline int omp_get_num_threads() { return 1; }
#endif

#define KZ_INLINE static inline __attribute__((always_inline))

// ---- thread teams under load ----------------------------------------------------------------------------
// An OpenMP region ends with a barrier that waits for every thread of the team. When other processes hold
// the cores, a worker can start a whole scheduler slice late: measured with other jobs running, a 32 MB f32
// matrix-vector product took 14-16 ms on two threads against ~2.9 ms on one. So a region records how late
// its workers started; after a late start, regions of every kernel in the process run on the calling
// thread alone for KZ_SOLO_NS, then try the full team again. The deadline is one process-wide value: the
// loader hands each kernel library its address (kz_bind_team_state), so one late start covers all kernels.
// KZ_SOLO_NS is short because a quiet machine has false alarms too (a sleeping worker woken late on a VM):
// GPT-2 medium decode, 2 threads, quiet: 250 ms solo kept the kernels on one thread 30-45% of the time
// (155-174 ms per token); 20 ms: 3-4% (128-136 ms per token).
// With more than two threads a late start sends the kernels solo only when the cores are oversubscribed:
// more threads runnable than the machine has cores plus an eighth (/proc/loadavg's running count, read
// after a late region only; the eighth: 16 threads on 16 cores and one kernel thread are not contention).
// Going solo gives up (n - 1) / n of a team: at two threads half, which a late worker costs anyway; at 16,
// 15 of 16, while on a quiet 16-core VM some worker of 16 was late often enough that ResNet-50 ran solo
// much of the time (34.9 ms at 16 threads; 16.7 ms with this check; onnxruntime 11.6-12.1). Two threads
// keep the unconditional rule (solo costs them no more than a late worker; the check does not see another
// runtime's threads spinning in the same process). The bound policy (kz_bind_late_policy, from
// $KERNELIZE_LATE_WORKERS) picks: 0 auto (this), 1 every late start, 2 never.
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#define KZ_LATE_NS 500000LL
#define KZ_SOLO_NS 20000000LL
static int64_t kz_team_local = 0;
static int64_t* kz_team_deadline = &kz_team_local;
extern "C" void kz_bind_team_state(int64_t* deadline) { kz_team_deadline = deadline; }
static int64_t kz_late_local = 0;
static int64_t* kz_late_policy = &kz_late_local;
extern "C" void kz_bind_late_policy(int64_t* policy) { kz_late_policy = policy; }
// more threads runnable now than the machine has cores (true where /proc/loadavg cannot be read)
static bool kz_cores_oversubscribed() {
    char buf[128];
    const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    const ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
    if (fd >= 0) close(fd);
    if (n <= 0) return true;
    buf[n] = 0;
    const char* p = buf;  // "1.02 0.88 0.70 3/412 12345": the fourth field's numerator
    for (int field = 0; field < 3 && p; ++field)
        if ((p = strchr(p, ' '))) ++p;
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);  // a margin of cores / 8 for the kernel's own threads
    return !p || cores < 1 || strtol(p, nullptr, 10) > cores + cores / 8;
}
KZ_INLINE int64_t kz_now_ns() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}
// threads for a region starting at `t0`: one while a recent region's workers started late
KZ_INLINE int kz_team(int nthreads, int64_t t0) {
    return t0 < __atomic_load_n(kz_team_deadline, __ATOMIC_RELAXED) ? 1 : (nthreads < 1 ? 1 : nthreads);
}
// after a region of `team` threads whose latest thread started `lag` ns after `t0`
// (auto) a check that found the cores not oversubscribed holds for KZ_SOLO_NS: reading /proc/loadavg costs
// ~15 us, and beside another runtime's spinning threads nearly every region is late (SqueezeNet and
// ShuffleNet beside OpenVINO's: a check per region made ShuffleNet 3.4 -> 6.4 ms)
static int64_t kz_quiet_until = 0;
KZ_INLINE void kz_team_done(int team, int64_t lag) {
    if (team < 2 || lag <= KZ_LATE_NS) return;
    const int64_t policy = __atomic_load_n(kz_late_policy, __ATOMIC_RELAXED), now = kz_now_ns();
    bool solo = policy == 1 || (policy == 0 && team == 2);
    if (policy == 0 && team > 2 && now >= __atomic_load_n(&kz_quiet_until, __ATOMIC_RELAXED)) {
        solo = kz_cores_oversubscribed();
        if (!solo) __atomic_store_n(&kz_quiet_until, now + KZ_SOLO_NS, __ATOMIC_RELAXED);
    }
    if (solo) __atomic_store_n(kz_team_deadline, now + KZ_SOLO_NS, __ATOMIC_RELAXED);
}
// ---- the one parallel-for: every kernel's threads come from here (docs/runtime.md, "Threads") -----------
// kernelize's workers (templates/cpu_workers.cpp, one pool per process, bound into every kernel library by
// the loader: kz_bind_workers) run every region of every kernel; the caller passes the team size
// (torch.get_num_threads()).
//     return kz_parallel_for(kz_team_open(nthreads, big), [=](int kz_tid, int kz_tn) KZ_BODY { ...; return err; });
// runs the body once per share of a team (kz_tid in [0, kz_tn)) and returns the OR of the bodies' error
// flags. The caller and the workers claim shares as they come, so the caller never waits for a worker that
// has not started (one share may then run after another on the same thread). The team is one thread, the
// caller's, when the work is not `big` or a recent region was slowed by a late worker (above). Bodies
// split their work with kz_range or a shared kz_next counter; a body that waits for the others with
// kz_barrier(kz_tn) opens its region with kz_parallel_together (its shares run on tn threads at once).
// A library the loader has not bound, or any while the bound switch (cpu_build.WORKERS) is off, opens
// OpenMP regions on torch's pool instead: under $KERNELIZE_CPU_WORKERS=auto the switch is on only during
// compiled-graph runs that call no long torch op (the two pools take turns; docs/runtime.md, "Threads").
// Nothing else of OpenMP but `omp simd` appears in a kernel.
// (perf) A body captures by value and is inlined into the region (KZ_BODY), where each thread's copy of it
// is a local: its pointers are then registers and its simd loops unit-stride loads. Captured by reference,
// or called out of line, the loops read the pointers through memory and gcc vectorised a layer norm's
// statistics loop into gathers (4096 x 4096 f32: 14 ms -> 24 ms).
#define KZ_BODY __attribute__((always_inline))
struct kz_team_t {
    int64_t t0;  // when the region was opened (its workers' lateness is measured from here)
    int n;       // threads asked for
};
KZ_INLINE kz_team_t kz_team_open(int nthreads, bool big) {
    const int64_t t0 = kz_now_ns();
    return {t0, big ? kz_team(nthreads, t0) : 1};
}
typedef int (*kz_body_fn)(void*, int, int);
typedef int (*kz_run_fn)(int, int, kz_body_fn, void*, int64_t, int64_t*);
static kz_run_fn kz_workers_run = nullptr;
static void (*kz_workers_barrier)() = nullptr;
static void (*kz_away_fn)(int) = nullptr;
static int64_t kz_workers_local = 0;
static int64_t* kz_workers_on = &kz_workers_local;
extern "C" void kz_bind_workers(void* run, void* barrier, void* away, int64_t* on) {
    kz_workers_run = (kz_run_fn)run, kz_workers_barrier = (void (*)())barrier, kz_workers_on = on;
    kz_away_fn = (void (*)(int))away;
}
// one share of a body, as the workers call it: a local copy of the body, inlined here (KZ_BODY)
template <class F> static int kz_share(void* body, int t, int tn) {
    F local = *(const F*)body;
    return local(t, tn);
}
// ---- grain: the threads a region's work pays for ---------------------------------------------------------
// Opening a region costs the caller ~2-5 us while the workers spin, and tens of us when one has gone to
// sleep (a futex wake of a halted vCPU on a VM). So a region gets as many threads as give each at least
// KZ_GRAIN_NS of work, estimated from its size for one thread: flops at KZ_FLOPS_PER_NS (a generated conv's
// rate: ~60 GFLOP/s on an AVX2 Zen 3 core) plus bytes moved at KZ_BYTES_PER_NS (what one core streams from
// L2 / L3). At batch 1 the smallest regions of SqueezeNet and GoogLeNet (a 13 x 13 1x1 conv to 144 channels,
// a 14 x 14 one to 8, a 14 x 14 pool) are estimated at 24-36 us: one thread of two; their others get two.
// A region gets the caller alone or the whole team, never a part of it: libgomp ends the pool threads a
// smaller team leaves out (team.c, "those that aren't part of the team will exit") and creates new ones for
// the next larger team, so teams of varying sizes cost a pthread_create per worker per region. On the
// 16-core host, with teams sized 2..16 by work, SqueezeNet took 5.5 ms at 16 threads against 3.2 at 4.
#define KZ_GRAIN_NS 20000LL
#if defined(__AVX512F__)
#define KZ_FLOPS_PER_NS 128LL
#else
#define KZ_FLOPS_PER_NS 64LL
#endif
#define KZ_BYTES_PER_NS 16LL
// the estimated nanoseconds of one thread for `flops` arithmetic operations and `bytes` moved
KZ_INLINE int64_t kz_work_ns(int64_t flops, int64_t bytes) { return flops / KZ_FLOPS_PER_NS + bytes / KZ_BYTES_PER_NS; }
// the threads a region worth `flops` and `bytes` pays for: 1, or all `nthreads` once two would get their grain
KZ_INLINE int kz_grain(int nthreads, int64_t flops, int64_t bytes) {
    return kz_work_ns(flops, bytes) / KZ_GRAIN_NS < 2 || nthreads < 1 ? 1 : nthreads;
}
// a region of `flops` and `bytes` (the generated convs, pools and pointwise kernels open theirs so)
KZ_INLINE kz_team_t kz_team_work(int nthreads, int64_t flops, int64_t bytes) {
    const int64_t t0 = kz_now_ns();
    return {t0, kz_team(kz_grain(nthreads, flops, bytes), t0)};
}
// A worker preempted inside the region is late too: the caller then waits at the closing barrier. That wait
// counts as lateness when it is longer than the caller's own share took (a balanced region's caller waits
// far less), so uneven work in a long region does not send the kernels solo.
// the lateness of a region whose latest thread started `lag` ns after it opened, whose caller took `own` ns
// from the opening to the end of its share and then waited `wait` ns at the closing barrier
KZ_INLINE int64_t kz_region_lag(int64_t lag, int64_t own, int64_t wait) { return wait > own && wait > lag ? wait : lag; }
// Every path runs the body through one kz_share<F>: a body compiled once per kernel (not once per path, as
// inlining it into each would), and the same instructions whichever path runs it. Inlined into the solo
// path of its own, a layer-norm backward's one-thread dx came out an ulp apart between its plain and its
// non-temporal-store branches (tests/codegen/test_cpu_stream.py).
template <class F> static inline int kz_parallel_region(const kz_team_t& team, bool together, F body) {
    if (team.n < 2) return kz_share<F>(&body, 0, 1);
    int64_t lag = 0;
    int err = 0;
    if (kz_workers_run && __atomic_load_n(kz_workers_on, __ATOMIC_RELAXED)) {
        int64_t s[3];  // the latest share's start, the caller's own time, its wait after
        err = kz_workers_run(team.n, together, &kz_share<F>, &body, team.t0, s);
        lag = kz_region_lag(together ? s[0] : 0, s[1], s[2]);
    } else {
        int64_t done = 0;
        int64_t* caller_done = &done;
        if (kz_away_fn) kz_away_fn(team.n);  // OpenMP's pool off this core (cpu_workers.cpp)
#pragma omp parallel num_threads(team.n) firstprivate(body) reduction(|: err) reduction(max: lag)
        {
            lag = kz_now_ns() - team.t0;
            err |= kz_share<F>(&body, omp_get_thread_num(), omp_get_num_threads());
            if (omp_get_thread_num() == 0) *caller_done = kz_now_ns();
        }
        lag = kz_region_lag(lag, done - team.t0, kz_now_ns() - done);
    }
    kz_team_done(team.n, lag);
    return err;
}
template <class F> static inline int kz_parallel_for(const kz_team_t& team, F body) {
    return kz_parallel_region(team, false, body);
}
template <class F> static inline int kz_parallel_together(const kz_team_t& team, F body) {
    return kz_parallel_region(team, true, body);
}
// thread `t` of `tn`'s share [lo, hi) of [0, n): the split an OpenMP loop with schedule(static) makes
KZ_INLINE void kz_range(int64_t n, int t, int tn, int64_t& lo, int64_t& hi) {
    int64_t q = n / tn;
    const int64_t r = n - q * tn;
    if (t < r) ++q;
    lo = q * t + (t < r ? 0 : r);
    hi = lo + q;
}
// the next item of a shared counter (dynamic scheduling: declare `int64_t next = 0` before the region)
KZ_INLINE int64_t kz_next(int64_t* next) { return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); }
// every thread of a kz_parallel_together region's team of `tn` waits here for the others
KZ_INLINE void kz_barrier(int tn) {
    if (tn < 2) return;
    if (kz_workers_run && __atomic_load_n(kz_workers_on, __ATOMIC_RELAXED)) kz_workers_barrier();
    else {
#pragma omp barrier
    }
}
// the team a region would get now, and a region's bookkeeping as the kernels do it (for tests and tools)
extern "C" int kz_team_size(int nthreads) { return kz_team(nthreads, kz_now_ns()); }
extern "C" int kz_grain_threads(int nthreads, int64_t flops, int64_t bytes) { return kz_grain(nthreads, flops, bytes); }
extern "C" void kz_team_report(int team, int64_t lag) { kz_team_done(team, lag); }
extern "C" int64_t kz_region_lateness(int64_t lag, int64_t own, int64_t wait) { return kz_region_lag(lag, own, wait); }
extern "C" int kz_oversubscribed() { return kz_cores_oversubscribed(); }
// the team a big region of `nthreads` gets from OpenMP now, as its bodies see it
extern "C" int kz_parallel_team(int nthreads) {
    int seen = 0;
    int* at = &seen;
    kz_parallel_for(kz_team_open(nthreads, true), [=](int t, int tn) KZ_BODY {
        if (t == 0) *at = tn;
        return 0;
    });
    return seen;
}
// a region of `nthreads` whose shares each run on a thread of their own (kz_parallel_together), where the
// caller's busy-waits `caller_ns` and every other thread's `worker_ns`: how the closing wait is judged (tests)
static thread_local int kz_thread_mark;  // its address names the thread
extern "C" int kz_uneven_region(int nthreads, int64_t caller_ns, int64_t worker_ns) {
    const int* caller = &kz_thread_mark;
    return kz_parallel_together(kz_team_open(nthreads, true), [=](int t, int tn) KZ_BODY {
        const int64_t until = kz_now_ns() + (&kz_thread_mark == caller ? caller_ns : worker_ns);
        while (kz_now_ns() < until) {
        }
        return tn < 0;
    });
}
// a free region of `nthreads` whose every share busy-waits `ns` and writes into who[t] 1 when it ran on
// the calling thread, 2 on another (tests)
extern "C" int kz_share_threads(int nthreads, int64_t ns, int* who) {
    const int* caller = &kz_thread_mark;
    return kz_parallel_for(kz_team_open(nthreads, true), [=](int t, int tn) KZ_BODY {
        const int64_t until = kz_now_ns() + ns;
        while (kz_now_ns() < until) {
        }
        who[t] = &kz_thread_mark == caller ? 1 : 2;
        return 0;
    });
}

// ---- 16-bit loads and stores (integer bit tricks: gcc vectorises these, not _Float16 conversions) --------
struct kz_bf16 { uint16_t u; };
struct kz_f16 { uint16_t u; };
KZ_INLINE float kz_bf16_to_f32(kz_bf16 h) { return __builtin_bit_cast(float, (uint32_t)h.u << 16); }
// round to nearest even; a NaN stays a (quiet) NaN. The select is on 32-bit values and narrowed once at the
// end: gcc vectorises this form with ~10% fewer instructions than selecting between 16-bit results
KZ_INLINE uint16_t kz_f32_to_bf16_bits(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(r >> 16);
}
KZ_INLINE kz_bf16 kz_f32_to_bf16(float f) {
    kz_bf16 h;
    h.u = kz_f32_to_bf16_bits(f);
    return h;
}
KZ_INLINE float kz_f16_to_f32(kz_f16 h) {  // exact for every bit pattern (F. Giesen's magic-number method)
    uint32_t o = (uint32_t)(h.u & 0x7fffu) << 13;
    uint32_t e = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    uint32_t inf = o + ((uint32_t)(128 - 16) << 23);
    float den = __builtin_bit_cast(float, o + (1u << 23)) - __builtin_bit_cast(float, 113u << 23);
    uint32_t r = e == 0x0f800000u ? inf : (e == 0 ? __builtin_bit_cast(uint32_t, den) : o);
    return __builtin_bit_cast(float, r | ((uint32_t)(h.u & 0x8000u) << 16));
}
KZ_INLINE kz_f16 kz_f32_to_f16(float f) {  // round to nearest even, overflow to inf, NaN stays NaN
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    float dm = __builtin_bit_cast(float, 126u << 23);
    uint32_t sub = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, u) + dm) - (126u << 23);
    uint32_t nrm = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    uint32_t r = u >= (143u << 23) ? special : (u < (113u << 23) ? sub : nrm);
    kz_f16 h;
    h.u = (uint16_t)(r | (sign >> 16));
    return h;
}

KZ_INLINE float kz_ld(const float* p, int64_t i) { return p[i]; }
KZ_INLINE double kz_ld(const double* p, int64_t i) { return p[i]; }
// bf16 loads and stores through uint16_t: with the struct, gcc loads each vector twice (measured ~12% on a
// bf16 SiLU-and-mul)
KZ_INLINE float kz_ld(const kz_bf16* p, int64_t i) {
    return __builtin_bit_cast(float, (uint32_t)((const uint16_t*)p)[i] << 16);
}
KZ_INLINE float kz_ld(const kz_f16* p, int64_t i) { return kz_f16_to_f32(p[i]); }
KZ_INLINE int8_t kz_ld(const int8_t* p, int64_t i) { return p[i]; }
KZ_INLINE int16_t kz_ld(const int16_t* p, int64_t i) { return p[i]; }
KZ_INLINE int32_t kz_ld(const int32_t* p, int64_t i) { return p[i]; }
KZ_INLINE int64_t kz_ld(const int64_t* p, int64_t i) { return p[i]; }
KZ_INLINE uint8_t kz_ld(const uint8_t* p, int64_t i) { return p[i]; }
KZ_INLINE bool kz_ld(const bool* p, int64_t i) { return p[i]; }

template <class T, class V> KZ_INLINE void kz_st(T* p, int64_t i, V v) { p[i] = (T)v; }
KZ_INLINE void kz_st(kz_bf16* p, int64_t i, float v) { ((uint16_t*)p)[i] = kz_f32_to_bf16_bits(v); }
KZ_INLINE void kz_st(kz_f16* p, int64_t i, float v) { p[i] = kz_f32_to_f16(v); }
KZ_INLINE void kz_st(bool* p, int64_t i, float v) { p[i] = v != 0.0f; }
KZ_INLINE void kz_st(bool* p, int64_t i, double v) { p[i] = v != 0.0; }

// ---- min / max / clamp: NaN propagates (torch.minimum / maximum / clamp) --------------------------------
template <class T> KZ_INLINE T kz_min(T a, T b) { return a < b ? a : b; }
template <class T> KZ_INLINE T kz_max(T a, T b) { return a > b ? a : b; }
KZ_INLINE float kz_min(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
KZ_INLINE float kz_max(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
KZ_INLINE double kz_min(double a, double b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
KZ_INLINE double kz_max(double a, double b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
template <class T, class L> KZ_INLINE T kz_clamp(T x, L lo, L hi) { return kz_min(kz_max(x, (T)lo), (T)hi); }

// ---- integer division and modulo (no trap on zero: the result is 0) -------------------------------------
template <class T> KZ_INLINE T kz_idiv(T a, T b) { return b == 0 ? (T)0 : (T)(a / b); }  // truncates
template <class T> KZ_INLINE T kz_imod(T a, T b) {                                      // floor mod
    if (b == 0) return 0;
    T r = (T)(a % b);
    return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
KZ_INLINE bool kz_imod(bool a, bool b) { return b ? false : a; }
KZ_INLINE float kz_fmod(float a, float b) { return fmodf(a, b); }
KZ_INLINE double kz_fmod(double a, double b) { return fmod(a, b); }

// ---- simple unary ---------------------------------------------------------------------------------------
template <class T> KZ_INLINE T kz_abs(T x) { return x < 0 ? (T)-x : x; }
KZ_INLINE float kz_abs(float x) { return fabsf(x); }
KZ_INLINE double kz_abs(double x) { return fabs(x); }
KZ_INLINE bool kz_abs(bool x) { return x; }
template <class T> KZ_INLINE T kz_sign(T x) { return (T)((x > 0) - (x < 0)); }
KZ_INLINE float kz_sign(float x) { return (float)((x > 0.0f) - (x < 0.0f)); }  // NaN -> 0 like torch
KZ_INLINE double kz_sign(double x) { return (double)((x > 0.0) - (x < 0.0)); }
KZ_INLINE bool kz_sign(bool x) { return x; }
KZ_INLINE float kz_floor(float x) { return floorf(x); }
KZ_INLINE double kz_floor(double x) { return floor(x); }
KZ_INLINE float kz_ceil(float x) { return ceilf(x); }
KZ_INLINE double kz_ceil(double x) { return ceil(x); }
KZ_INLINE float kz_round(float x) { return rintf(x); }  // half to even, like torch.round
KZ_INLINE double kz_round(double x) { return rint(x); }
KZ_INLINE float kz_sqrt(float x) { return sqrtf(x); }
KZ_INLINE double kz_sqrt(double x) { return sqrt(x); }
KZ_INLINE float kz_rsqrt(float x) { return 1.0f / sqrtf(x); }
KZ_INLINE double kz_rsqrt(double x) { return 1.0 / sqrt(x); }
KZ_INLINE float kz_log(float x) { return logf(x); }
KZ_INLINE double kz_log(double x) { return log(x); }
KZ_INLINE float kz_sin(float x) { return sinf(x); }
KZ_INLINE double kz_sin(double x) { return sin(x); }
KZ_INLINE float kz_cos(float x) { return cosf(x); }
KZ_INLINE double kz_cos(double x) { return cos(x); }
KZ_INLINE float kz_pow(float a, float b) { return powf(a, b); }
KZ_INLINE double kz_pow(double a, double b) { return pow(a, b); }
template <class T> KZ_INLINE T kz_pow(T a, T b) {  // integer power by squaring; negative exponent -> 0
    if (b < 0) return (T)(a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0));
    T r = 1;
    while (b) { if (b & 1) r = (T)(r * a); a = (T)(a * a); b = (T)(b >> 1); }
    return r;
}

// ---- exp and friends: vectorisable float versions (~1 ulp), libm for double ------------------------------
// Adding 1.5 * 2^23 to a float of magnitude < 2^22 rounds it to an integer (to nearest even, as rintf) that
// sits in the low mantissa bits; subtracting it again gives that integer as a float. One fma and one add
// instead of a multiply, a round and (for 2^k) a conversion: the exps below are throughput-bound on the FP
// pipes (the sigmoid of a SiLU-and-mul on AVX-512 took ~36 vector instructions per 16 elements)
#define KZ_EXP_SHIFT 12582912.0f
#define KZ_LOG2E 1.44269504088896341f
#define KZ_LN2_HI 0.693359375f  // Cody-Waite: ln2 in two parts
#define KZ_LN2_LO -2.12194440e-4f
// exp(r) for the reduced argument r = x - k ln2, |r| <= ln2 / 2: a degree-6 minimax polynomial (relative
// error 2e-9 before rounding; exp stays within 1.06 ulp, checked over every float in [-87, 0]), Horner
// ending in 1 + r * (1 + ...), so exp(0) is exactly 1; k = rint(x / ln2). The constants are shared with the
// vector spelling in cpu_conv.h (kz_vexp_normal). Literal constants, not an array read in a loop: in a simd
// loop gcc left that form scalar (a SiLU-and-mul's forward + backward took 5x as long)
#define KZ_EXP_C0 1.3843607157e-3f
#define KZ_EXP_C1 8.3741955459e-3f
#define KZ_EXP_C2 4.1668005288e-2f
#define KZ_EXP_C3 1.6666430235e-1f
#define KZ_EXP_C4 4.9999994040e-1f
KZ_INLINE float kz_exp_poly(float r) {
    float p = fmaf(KZ_EXP_C0, r, KZ_EXP_C1);
    p = fmaf(p, r, KZ_EXP_C2);
    p = fmaf(p, r, KZ_EXP_C3);
    p = fmaf(p, r, KZ_EXP_C4);
    p = fmaf(p, r, 1.0f);
    return fmaf(p, r, 1.0f);
}
KZ_INLINE float kz_exp_reduced(float xc, float* k_out) {
    float k = fmaf(xc, KZ_LOG2E, KZ_EXP_SHIFT) - KZ_EXP_SHIFT;
    float r = fmaf(k, -KZ_LN2_HI, xc);
    r = fmaf(k, -KZ_LN2_LO, r);
    *k_out = k;
    return kz_exp_poly(r);
}
// exp(x) for x in [-87.3, 88.3], where 2^k is one normal float: the shift also adds the exponent bias 127,
// so the low mantissa bits hold k + 127 and, moved up by 23, are the bits of 2^k
KZ_INLINE float kz_exp_normal(float x) {
    float t = fmaf(x, KZ_LOG2E, KZ_EXP_SHIFT + 127.0f);
    float k = t - (KZ_EXP_SHIFT + 127.0f);
    float r = fmaf(k, -KZ_LN2_HI, x);
    r = fmaf(k, -KZ_LN2_LO, r);
    return kz_exp_poly(r) * __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, t) << 23);
}
KZ_INLINE float kz_pow2i(int32_t k) { return __builtin_bit_cast(float, (uint32_t)(k + 127) << 23); }  // normal k
// exp over the whole float range, denormal results included, without denormal arithmetic: x86 takes a
// microcode assist (~100x slower per element) whenever an operation produces or reads a denormal, and
// every masked (-inf / very negative) score would produce one. Normal results are y * 2^k with 2^k split
// into two normal factors (k reaches 128 next to overflow) and k clamped so this lane never goes
// denormal; denormal results (k <= -126) are y * 2^(k + 149), the result in units of 2^-149 (a normal
// float), rounded to an integer n < 2^24 whose bit pattern is exactly the denormal n * 2^-149. Bit for bit
// the same results as the straightforward y * 2^k1 * 2^k2 (checked over every float in [-120, 100]).
KZ_INLINE float kz_exp(float x) {
    float k;
    float y = kz_exp_reduced(x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x), &k);
    int32_t ki = (int32_t)k;
    int32_t kn = ki < -125 ? -125 : ki;
    int32_t k1 = kn >> 1;
    float nrm = y * kz_pow2i(k1) * kz_pow2i(kn - k1);
    int32_t kd = ki > -126 ? -126 : ki;
    float den = __builtin_bit_cast(float, (int32_t)rintf(y * kz_pow2i(kd + 149)));
    float out = ki < -125 ? den : nrm;
    return x != x ? x : out;
}
KZ_INLINE double kz_exp(double x) { return exp(x); }
// exp of x <= 0 (softmax's x - max, erf's -x^2): one scale factor; results below FLT_MIN (x < -87.3) are 0,
// not denormals (they vanish next to the row's exp(0) = 1, or the 1 they are subtracted from, anyway). NaN
// stays NaN through the arithmetic; gcc computes the unclamped lanes and masks them, no clamp instruction
KZ_INLINE float kz_exp_neg(float x) { return x < -87.3f ? 0.0f : kz_exp_normal(x); }
KZ_INLINE double kz_exp_neg(double x) { return exp(x); }

KZ_INLINE float kz_tanh(float x) {
    // Eigen's rational 13/6 approximation on [-7.9, 7.9] (|error| < 3e-7, no exp, one division). From
    // 9.01084 on, the f32 tanh is exactly +-1, as torch's is: the clamped approximation stops at
    // 0.99999976, and a comparison with -1 or 1 would take the other branch.
    const float c = 7.90531110763549805f;
    float xc = x < -c ? -c : (x > c ? c : x);  // NaN passes through
    float x2 = xc * xc;
    float p = fmaf(x2, -2.76076847742355e-16f, 2.00018790482477e-13f);
    p = fmaf(p, x2, -8.60467152213735e-11f);
    p = fmaf(p, x2, 5.12229709037114e-08f);
    p = fmaf(p, x2, 1.48572235717979e-05f);
    p = fmaf(p, x2, 6.37261928875436e-04f);
    p = fmaf(p, x2, 4.89352455891786e-03f);
    float q = fmaf(x2, 1.19825839466702e-06f, 1.18534705686654e-04f);
    q = fmaf(q, x2, 2.26843463243900e-03f);
    q = fmaf(q, x2, 4.89352518554385e-03f);
    float r = p * xc / q;
    r = fabsf(x) >= 9.01084f ? (x > 0.0f ? 1.0f : -1.0f) : r;
    return fabsf(x) < 0.0004f ? x : r;
}
KZ_INLINE double kz_tanh(double x) { return tanh(x); }

// 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, with e = exp(-|x|) <= 1: one exp that never overflows
// and needs one scale factor; below -87.3 the result (< FLT_MIN) is 0. NaN stays NaN. 1.13 -> 0.85 cycles
// per element for x * sigmoid(x) * y on AVX-512 in L1 (the previous form exp'd -x with a two-sided clamp)
KZ_INLINE float kz_sigmoid(float x) {
    float e = kz_exp_neg(__builtin_bit_cast(float, __builtin_bit_cast(uint32_t, x) | 0x80000000u));
    float r = 1.0f / (1.0f + e);
    return x < 0.0f ? e * r : r;
}
KZ_INLINE double kz_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

KZ_INLINE float kz_erf(float x) {
    // |x| < 0.5: Taylor series; else Abramowitz-Stegun 7.1.26 (abs error < 1.5e-7)
    float ax = fabsf(x), z = x * x;
    float small = x * fmaf(fmaf(fmaf(fmaf(fmaf(-8.54832702e-4f, z, 5.22397762e-3f), z, -2.68661706e-2f), z,
                                     1.12837917e-1f), z, -3.76126389e-1f), z, 1.12837917f);
    float t = 1.0f / fmaf(0.3275911f, ax, 1.0f);
    float poly = fmaf(fmaf(fmaf(fmaf(1.061405429f, t, -1.453152027f), t, 1.421413741f), t, -0.284496736f), t,
                      0.254829592f) * t;
    float big = copysignf(1.0f - poly * kz_exp_neg(-z), x);
    return ax < 0.5f ? small : big;
}
KZ_INLINE double kz_erf(double x) { return erf(x); }

KZ_INLINE float kz_gelu(float x) { return 0.5f * x * (1.0f + kz_erf(x * 0.70710678118654752f)); }
KZ_INLINE double kz_gelu(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752)); }
KZ_INLINE float kz_gelu_tanh(float x) {
    float inner = 0.79788456080286536f * fmaf(0.044715f * x, x * x, x);
    return 0.5f * x * (1.0f + kz_tanh(inner));
}
KZ_INLINE double kz_gelu_tanh(double x) {
    return 0.5 * x * (1.0 + tanh(0.79788456080286536 * (x + 0.044715 * x * x * x)));
}
// torch's softplus (beta 1): linear above the threshold 20
KZ_INLINE float kz_softplus(float x) { return x > 20.0f ? x : log1pf(kz_exp(x)); }
KZ_INLINE double kz_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

// ---- indirect (gather) index: negative wraps once; out of range sets the error flag and reads element 0 --
KZ_INLINE int64_t kz_wrap(int64_t i, int64_t size, int* err) {
    int64_t j = i < 0 ? i + size : i;
    if (j < 0 || j >= size) { *err = 1; return 0; }
    return j;
}

// ---- per-thread scratch rows (row kernels keep a row of intermediate values in cache); never freed, they
// grow to the longest row seen by each thread
template <class T> static T* kz_scratch(int slot, int64_t n) {
    static thread_local T* buf[4] = {0, 0, 0, 0};
    static thread_local int64_t cap[4] = {0, 0, 0, 0};
    if (n > cap[slot]) {
        free(buf[slot]);
        buf[slot] = (T*)aligned_alloc(64, (size_t)((n * (int64_t)sizeof(T) + 63) / 64 * 64));
        cap[slot] = n;
    }
    return buf[slot];
}

// ---- bf16 stores through a float chunk ---------------------------------------------------------------------
// With AVX512-BF16, a simd loop storing bf16 values contiguously writes them as floats into a 64-value chunk
// on the stack, converted with one instruction per 32 values (kz_st_bf16_row): rounding in integer
// arithmetic (kz_f32_to_bf16_bits) costs ~9 vector instructions per 16 values (2.8 against 6.8 cycles per 32
// values in L1). The instruction flushes denormal inputs to zero, so a block of 32 holding one is converted
// the integer way: the results are kz_f32_to_bf16_bits' bit for bit (checked over every float). Without
// AVX512-BF16 (KZ_BF16_ROWS 0) kernels store each value with kz_st.
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define KZ_BF16_ROWS 1
KZ_INLINE void kz_st_bf16_row(kz_bf16* __restrict dst, const float* __restrict src, int64_t n) {
    uint16_t* d = (uint16_t*)dst;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a = _mm512_loadu_ps(src + i), b = _mm512_loadu_ps(src + i + 16);
        if (_mm512_fpclass_ps_mask(a, 0x20) | _mm512_fpclass_ps_mask(b, 0x20)) {  // 0x20: denormal
            for (int64_t j = i; j < i + 32; ++j) d[j] = kz_f32_to_bf16_bits(src[j]);
        } else {
            _mm512_storeu_si512((void*)(d + i), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
    for (; i < n; ++i) d[i] = kz_f32_to_bf16_bits(src[i]);
}
#else
#define KZ_BF16_ROWS 0
#endif

// ---- non-temporal stores of large outputs -----------------------------------------------------------------
// A kernel with contiguous f32 / bf16 outputs that moves at least *kz_nt_min bytes (its outputs plus the
// inputs it reads at full size; the loader binds it to kernelize.codegen.cpu_build.NT_BYTES: half the last-level
// cache) streams those outputs past the caches: its values go to a 64-value chunk on the stack, written out
// 64 bytes at a time with non-temporal stores when the address is aligned. With that much traffic the output
// does not stay cached for the next op, and a regular store first reads each line it writes (read for
// ownership): a third of a copy's traffic. Each thread fences its streamed stores before the region's
// closing barrier.
static int64_t kz_nt_local = INT64_MAX;
static int64_t* kz_nt_min = &kz_nt_local;
extern "C" void kz_bind_nt_bytes(int64_t* min_bytes) { kz_nt_min = min_bytes; }
#if defined(__AVX512F__)
#include <immintrin.h>
#define KZ_NT_ROWS 1
KZ_INLINE void kz_stream_fence() { _mm_sfence(); }
KZ_INLINE void kz_stream_row(float* __restrict dst, const float* __restrict src, int64_t n) {
    if ((uintptr_t)dst & 63) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
}
KZ_INLINE void kz_stream_row(kz_bf16* __restrict dst, const float* __restrict src, int64_t n) {
#if KZ_BF16_ROWS
    if ((uintptr_t)dst & 63) {
        kz_st_bf16_row(dst, src, n);
        return;
    }
    for (int64_t i = 0; i < n; i += 32) {
        alignas(64) uint16_t bits[32];
        kz_st_bf16_row((kz_bf16*)bits, src + i, 32);  // the rounding of every bf16 store, denormals included
        _mm512_stream_si512((__m512i*)((uint16_t*)dst + i), _mm512_load_si512((const void*)bits));
    }
#else
    for (int64_t i = 0; i < n; ++i) ((uint16_t*)dst)[i] = kz_f32_to_bf16_bits(src[i]);
#endif
}
#else
#define KZ_NT_ROWS 0
KZ_INLINE void kz_stream_fence() {}
KZ_INLINE void kz_stream_row(float* dst, const float* src, int64_t n) { memcpy(dst, src, (size_t)n * 4); }
KZ_INLINE void kz_stream_row(kz_bf16* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) ((uint16_t*)dst)[i] = kz_f32_to_bf16_bits(src[i]);
}
#endif
// whether a kernel moving `bytes` (its streamable outputs plus the inputs it reads at full size) streams
KZ_INLINE bool kz_streams(int64_t bytes) {
    return KZ_NT_ROWS && bytes > 0 && bytes >= __atomic_load_n(kz_nt_min, __ATOMIC_RELAXED);
}
extern "C" int kz_streams_bytes(int64_t bytes) { return kz_streams(bytes); }

// ---- column partial sums of a row kernel (slot 0: float partials, 1: double totals): one block per thread
// of the team, taken by the calling thread before the region (concurrent callers do not share one); never
// freed, each grows to the largest seen
template <class T> static T* kz_partials(int slot, int64_t n) {
    static thread_local T* buf[2] = {0, 0};
    static thread_local int64_t cap[2] = {0, 0};
    if (n > cap[slot]) {
        free(buf[slot]);
        buf[slot] = (T*)aligned_alloc(64, (size_t)((n * (int64_t)sizeof(T) + 63) / 64 * 64));
        cap[slot] = n;
    }
    return buf[slot];
}

// ---- reduction identities for integer max / min
template <class T> KZ_INLINE T kz_lowest() { return (T)(-1) > (T)0 ? (T)0 : (T)((uint64_t)1 << (sizeof(T) * 8 - 1)); }
template <class T> KZ_INLINE T kz_highest() { return (T)(-1) > (T)0 ? (T)(-1) : (T)~kz_lowest<T>(); }

// ---- 0-size-safe row helpers ----------------------------------------------------------------------------
KZ_INLINE float kz_div_or_nan(float a, int64_t n) { return n ? a / (float)n : NAN; }
KZ_INLINE double kz_div_or_nan(double a, int64_t n) { return n ? a / (double)n : (double)NAN; }
