// kernelize's CPU workers: the one pool every generated kernel library's kz_parallel_for runs its regions on
// (cpu_prelude.h, "the one parallel-for"; docs/runtime.md, "Threads"). Built once per process and bound
// into each kernel library by the loader (codegen/cpu_build.py, kz_bind_workers).
//
// Why not OpenMP's pool: an OpenMP region ends with a barrier at which the caller waits for every thread
// of the team, started or not. On a VM a worker that slept for a while starts milliseconds late (its vCPU
// was halted): SqueezeNet, 2 threads, after a 100 ms pause took 11.3 ms against 3.45 back to back, and a
// 2-thread torch.add_ right after the pause 5.9 ms against 0.7. Here a region's shares (thread ids
// 0..tn-1) are claimed from one counter by whoever comes first: the caller takes shares until none is left
// and then waits only for shares a worker has claimed. A worker that comes late finds nothing to do, and
// the region costs what the caller alone would take, never more (onnxruntime's pool does the same).
//
// A region whose body waits at kz_barrier (a split-k reduction, attention decode's combine) needs its tn
// shares on tn different threads at once: `together` regions let every thread claim one share only, and
// their caller waits for the workers as an OpenMP region's does.
//
// Workers spin for KZ_SPIN_NS after their last share (the next region of a decode step or a graph is
// usually microseconds away), yielding the core when another thread wants it, then sleep on a condition
// variable. One region runs at a time: a second caller (another Python thread, a nested region) runs its
// body on its own thread with a team of one.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define KZ_SPIN_NS 200000LL  // a worker's spin after a region before it sleeps
#define KZ_YIELD_NS 20000LL  // a wait's spin before it yields the core between polls

typedef int (*kz_body_fn)(void* ctx, int t, int tn);

namespace {
int64_t now_ns() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}
// spin on `done()` for KZ_YIELD_NS, then poll it between sched_yield calls
template <class F> void wait_for(F done) {
    const int64_t until = now_ns() + KZ_YIELD_NS;
    for (int i = 0; !done(); ++i) {
        if (i < 64 || now_ns() < until) relax();
        else sched_yield();
    }
}

struct Pool {
    std::mutex busy;  // held by the region's caller
    // the region's claim word: generation << 32 | tn << 16 | next share (a late worker's claim of an
    // earlier generation fails, so it never touches a finished region's body)
    std::atomic<uint64_t> claim{0};
    std::atomic<uint32_t> gen{0};          // bumped per region; workers wait for it to change
    std::atomic<int> left{0}, err{0};      // shares not finished; OR of the bodies' error flags
    std::atomic<int64_t> late{0};          // the latest share's start, ns after t0
    std::atomic<int> arrived{0};           // kz_barrier: threads in, and its phase
    std::atomic<uint32_t> phase{0};
    std::atomic<int> sleepers{0}, held{0}; // workers asleep; held: workers take no shares (tests)
    std::atomic<int64_t> shares{0};        // shares workers have run (tools, tests)
    std::atomic<int> caller_cpu{-1};       // the core the last region's caller ran on
    kz_body_fn fn = nullptr;
    void* ctx = nullptr;
    int64_t t0 = 0;
    int tn = 1, workers = 0;
    std::atomic<bool> together{false};
    std::mutex sleep_lock;
    std::condition_variable wake;
};
// never destroyed: workers may still wait on it while the process exits; a forked child starts a new one
Pool* pool = new Pool;

// claim and run shares of generation `g` (one at most when the region is `together`) as the caller
// (index -1) or worker `index`; returns false when the region's team leaves that worker out
bool take(Pool* p, uint32_t g, int index) {
    for (;;) {
        uint64_t w = p->claim.load(std::memory_order_acquire);
        const int tn = (int)(w >> 16 & 0xffff), t = (int)(w & 0xffff);
        if ((uint32_t)(w >> 32) != g) return true;
        if (index >= tn - 1) return false;  // workers 0..tn-2 and the caller make a team of tn
        if (t >= tn || (index >= 0 && !p->together.load(std::memory_order_relaxed) && p->held.load())) return true;
        if (!p->claim.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
        const int64_t start = now_ns() - p->t0;  // the region cannot end before this share does
        for (int64_t l = p->late.load(std::memory_order_relaxed); start > l;)
            if (p->late.compare_exchange_weak(l, start, std::memory_order_relaxed)) break;
        const bool once = p->together.load(std::memory_order_relaxed);
        if (const int e = p->fn(p->ctx, t, tn)) p->err.fetch_or(e, std::memory_order_relaxed);
        if (index >= 0) p->shares.fetch_add(1, std::memory_order_relaxed);
        p->left.fetch_sub(1, std::memory_order_acq_rel);
        if (once) return true;
    }
}

// A sleeping worker keeps off the core of the last region's caller. Woken by the caller, Linux may place it
// on the waker's core (busy: the caller runs the region there) rather than on the idle one, where it waits
// for the load balancer: on a 2-core VM, DenseNet after a 100 ms pause got no share from its worker in 3
// of 8 calls (8.7-10.4 ms against 5.4-6.6). Kept off that core while it sleeps, it joined in 8 of 8.
#ifdef __linux__
typedef cpu_set_t Cores;
Cores cores_of_this_thread() {
    Cores c;
    CPU_ZERO(&c);
    if (pthread_getaffinity_np(pthread_self(), sizeof c, &c)) CPU_ZERO(&c);
    return c;
}
void set_cores(const Cores& c) { pthread_setaffinity_np(pthread_self(), sizeof c, &c); }
// `allowed` but `cpu` into `away`; false (away untouched) when that leaves nothing or changes nothing
bool without(int cpu, const Cores& allowed, Cores& away) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return false;
    away = allowed;
    CPU_CLR(cpu, &away);
    return true;
}
// restrict this thread to `allowed` but `cpu`; false when that leaves nothing or changes nothing
bool keep_away(int cpu, const Cores& allowed) {
    Cores away;
    if (!without(cpu, allowed, away)) return false;
    set_cores(away);
    return true;
}
int this_cpu() { return sched_getcpu(); }
#else
typedef int Cores;
Cores cores_of_this_thread() { return 0; }
void set_cores(const Cores&) {}
bool keep_away(int, const Cores&) { return false; }
int this_cpu() { return -1; }
#endif

// worker `index`'s loop; `seen` is the generation before the region it was started for. It spins after a
// region it was part of, unless the threads outnumber the cores (a spinning worker would then take the
// caller's core), and sleeps at once after one whose team left it out.
void work(Pool* p, uint32_t seen, int index) {
    static const int cores = (int)std::thread::hardware_concurrency();
    const Cores allowed = cores_of_this_thread();
    bool spin = false;
    for (;;) {
        const int64_t until = now_ns() + (spin ? KZ_SPIN_NS : 0);
        uint32_t g;
        for (int i = 0; (g = p->gen.load(std::memory_order_acquire)) == seen; ++i) {
            if (spin && (i < 256 || now_ns() < until)) {
                if (i % 64 == 63) sched_yield();  // another runtime's worker may want this core
                else relax();
                continue;
            }
            const bool away = keep_away(p->caller_cpu.load(std::memory_order_relaxed), allowed);
            {
                std::unique_lock<std::mutex> lock(p->sleep_lock);
                p->sleepers.fetch_add(1);
                p->wake.wait(lock, [&] { return p->gen.load() != seen; });
                p->sleepers.fetch_sub(1);
            }
            if (away) set_cores(allowed);
        }
        seen = g;
        spin = take(p, g, index) && (cores < 1 || p->tn <= cores);
    }
}

void forked_child() { pool = new Pool; }  // the parent's workers do not exist in the child
}  // namespace

// Run `fn(ctx, t, tn)` once for each t in [0, tn) on the caller and the workers, from `t0` (when the
// caller opened the region); returns the OR of the bodies' flags. stats[0..2]: the latest share's start,
// the caller's own time (t0 to the end of its shares) and its wait for the workers' shares after it, in ns.
extern "C" int kz_workers_region(int tn, int together, kz_body_fn fn, void* ctx, int64_t t0, int64_t* stats) {
    Pool* p = pool;
    stats[0] = stats[1] = stats[2] = 0;
    if (tn < 2 || tn > 0xffff || !p->busy.try_lock()) return fn(ctx, 0, 1);
    static std::once_flag at_fork;
    std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, forked_child); });
    try {
        for (; p->workers < tn - 1; ++p->workers) std::thread(work, p, p->gen.load(), p->workers).detach();
    } catch (const std::system_error&) {  // no thread to be had (a process or container limit): run alone
        p->busy.unlock();
        return fn(ctx, 0, 1);
    }
    p->fn = fn, p->ctx = ctx, p->t0 = t0, p->tn = tn;
    p->caller_cpu.store(this_cpu(), std::memory_order_relaxed);
    p->together.store(together != 0, std::memory_order_relaxed);
    p->left.store(tn, std::memory_order_relaxed);
    p->err.store(0, std::memory_order_relaxed);
    p->late.store(0, std::memory_order_relaxed);
    p->arrived.store(0, std::memory_order_relaxed);
    const uint32_t g = p->gen.load(std::memory_order_relaxed) + 1;
    p->claim.store((uint64_t)g << 32 | (uint64_t)tn << 16, std::memory_order_release);
    p->gen.store(g);
    if (p->sleepers.load() > 0) {
        { std::lock_guard<std::mutex> lock(p->sleep_lock); }
        p->wake.notify_all();
    }
    take(p, g, -1);
    const int64_t own = now_ns();
    wait_for([p] { return p->left.load(std::memory_order_acquire) == 0; });
    const int64_t end = now_ns();
    stats[0] = p->late.load(std::memory_order_relaxed), stats[1] = own - t0, stats[2] = end - own;
    const int err = p->err.load(std::memory_order_relaxed);
    p->busy.unlock();
    return err;
}

// Wake the workers a region of `tn` threads would use, if any sleeps, and return at once: called when a
// compiled graph's run begins (codegen/cpu_build.py with_workers), so that a worker woken from its sleep (a
// halted vCPU on a VM takes 0.1-0.3 ms to come back) is spinning by the time the run's first region opens.
// Without it, the first region after a pause ran on the caller alone: MobileNet's stem at 2 threads took
// 0.31-0.33 ms against 0.35 at 1 thread, its later regions 1.4-1.9x faster. An empty region: the woken
// workers find it done and spin for the next.
extern "C" void kz_workers_wake(int tn) {
    Pool* p = pool;
    if (tn < 2 || (p->sleepers.load() == 0 && p->workers >= tn - 1)) return;
    int64_t stats[3];
    kz_workers_region(tn, 0, [](void*, int, int) { return 0; }, nullptr, now_ns(), stats);
}

// every thread of the running `together` region waits here for the others
extern "C" void kz_workers_wait() {
    Pool* p = pool;
    const uint32_t phase = p->phase.load(std::memory_order_acquire);
    if (p->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == p->tn) {
        p->arrived.store(0, std::memory_order_relaxed);
        p->phase.fetch_add(1, std::memory_order_release);
        return;
    }
    wait_for([p, phase] { return p->phase.load(std::memory_order_acquire) != phase; });
}

// tests and tools: while `on`, workers claim no shares of free regions (the caller then runs them all); the
// pool's workers started so far; the shares workers have run; the workers asleep now
extern "C" void kz_workers_hold(int on) { pool->held.store(on); }
extern "C" int kz_workers_started() { return pool->workers; }
extern "C" int64_t kz_workers_shares() { return pool->shares.load(); }
extern "C" int kz_workers_sleeping() { return pool->sleepers.load(); }

// ---- torch's OpenMP pool kept off the caller's core ------------------------------------------------------
// Regions that run on OpenMP (a graph with oneDNN convs, a layer of a torch model; cpu_prelude.h) and
// torch's own parallel ops wake libgomp's pool threads the same way, and Linux places a woken one on the
// waker's busy core as it does kernelize's workers (above): on the 2-core VM a 2-thread OpenMP region of two
// 0.3 ms shares took 2.5-3.5 ms after a 100 ms pause and 1.1-1.5 ms the region after (0.3 ms back to back),
// ResNet-18 15 ms against 5.5. Kept off the caller's core, the first region took 0.4 ms and the next 0.3.
// libgomp's threads cannot be hooked where they sleep, so they stay off the caller's last core: each
// region on OpenMP asks kz_openmp_away, which costs a getcpu (vDSO) unless the caller changed cores. A
// thread of the pool may then not run on that core while the caller runs elsewhere; the caller itself is
// never restricted, so the scheduler moves it instead. The pool's threads (one pool per calling thread in
// libgomp, and a team of n takes the pool's first n - 1) are found by a region that reports their ids,
// again when the team size changes or one of them has gone. Off where the user placed OpenMP's threads
// (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY), and with $KERNELIZE_OPENMP_AWAY=0.
#if defined(__linux__) && defined(_OPENMP)
namespace {
constexpr int kMaxPool = 256;  // pool threads kept off the caller's core (more stay as they are)
struct OpenmpPool {
    int n = 0;        // the team size the threads were found for
    int away = -1;    // the core they are kept off now
    int count = 0;    // threads found (n - 1, at most kMaxPool)
    Cores allowed;    // the caller's cores (a pool thread inherits its creator's; the caller is never kept off)
    pid_t tids[kMaxPool];
};
thread_local OpenmpPool omp_pool;
bool openmp_away_on() {
    static const bool on = [] {
        const char* bind = getenv("OMP_PROC_BIND");
        if ((bind && *bind && strcmp(bind, "false") != 0) || getenv("OMP_PLACES") || getenv("GOMP_CPU_AFFINITY"))
            return false;
        const char* e = getenv("KERNELIZE_OPENMP_AWAY");
        return !(e && strcmp(e, "0") == 0);
    }();
    return on;
}
void find_openmp_pool(OpenmpPool& q, int n) {
    q.n = n, q.away = -1, q.count = 0;
    pid_t found[kMaxPool + 1] = {};
    int seen = 0;
#pragma omp parallel num_threads(n) reduction(max : seen)
    {
        const int t = omp_get_thread_num();
        if (t > 0 && t <= kMaxPool) found[t] = (pid_t)syscall(SYS_gettid);
        seen = omp_get_num_threads();
    }
    for (int t = 1; t < seen && t <= kMaxPool; ++t)
        if (found[t] > 0) q.tids[q.count++] = found[t];
    q.allowed = cores_of_this_thread();
}
}  // namespace

extern "C" void kz_openmp_away(int nthreads) {
    if (nthreads < 2 || !openmp_away_on()) return;
    OpenmpPool& q = omp_pool;
    const int cpu = this_cpu();
    if (nthreads == q.n && cpu == q.away) return;
    if (nthreads != q.n) find_openmp_pool(q, nthreads);
    Cores c;
    if (!without(cpu, q.allowed, c)) return;  // one core, or the caller outside the cores it may use
    for (int i = 0; i < q.count; ++i)
        if (sched_setaffinity(q.tids[i], sizeof c, &c) != 0) {  // gone (the pool changed): find it again
            q.n = 0;
            return;
        }
    q.away = cpu;
}
#else
extern "C" void kz_openmp_away(int) {}
#endif
