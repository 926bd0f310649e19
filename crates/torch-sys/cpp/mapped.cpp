// Copying a range of a file from a mapping of just that range, with a guard that turns a SIGBUS
// raised by the copy (the file shrank under the mapping, or its disk failed) into an error code.
//
// Kept apart from shim.cpp: it needs no libtorch header, only the C library.
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__linux__) && !defined(MADV_POPULATE_READ)
#define MADV_POPULATE_READ 22
#endif

namespace {

// The copy in progress on this thread: its source range and where a SIGBUS inside it jumps.
struct Guard {
  sigjmp_buf resume;
  const char* begin;
  const char* end;
};

// Trivially initialised, so reading it from the handler runs no TLS constructor.
thread_local Guard* active = nullptr;

struct sigaction before;  // the SIGBUS action installed before ours, written once before ours goes in
std::once_flag install_once;
int install_error = 0;

void on_bus(int sig, siginfo_t* info, void* context) {
  Guard* guard = active;
  const char* at = static_cast<const char*>(info->si_addr);
  if (guard != nullptr && info->si_code > 0 && at >= guard->begin && at < guard->end) {
    siglongjmp(guard->resume, 1);
  }
  // Not a fault of a guarded copy: what the action before ours would have done.
  if (before.sa_flags & SA_SIGINFO) {
    before.sa_sigaction(sig, info, context);
    return;
  }
  if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
    before.sa_handler(sig);
    return;
  }
  // The default action ends the process: for a fault, when the instruction runs again on
  // return; for a SIGBUS sent by someone, when it is raised again and unblocked on return.
  signal(sig, SIG_DFL);
  if (info->si_code <= 0) raise(sig);
}

void install() {
  struct sigaction ours;
  std::memset(&ours, 0, sizeof ours);
  ours.sa_sigaction = on_bus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, nullptr, &before) != 0 || sigaction(SIGBUS, &ours, nullptr) != 0) install_error = errno;
}

#if defined(__x86_64__)
// Non-temporal stores: the destination (a model's weights) is not read soon, so it need not pass
// through the caches, and its lines are not read for ownership before being written. The widest
// stores the CPU has: a 64-byte store fills a whole line at once. Copying a 1 GB checkpoint from
// the page cache into a model's memory with 4 threads here (Xeon, AVX-512), medians of 9 rounds:
// 16-byte stores 12.5 GB/s, 32-byte 12.7, 64-byte 15.6, `pread` 10.5; in an hour when the
// machine's memory was busier, 8.5, 8.9, 9.5 and 8.6
// (crates/bench/c/load-bench-mapped-stores.c).
//
// Each copies single bytes up to the destination's alignment (align_dst), then whole blocks,
// and returns how many bytes it copied: copy_with copies the tail and fences. Not inlined into
// guarded_copy: a function calling sigsetjmp is compiled with fewer optimisations.
inline size_t align_dst(char* dst, const char* src, size_t n, uintptr_t align) {
  size_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & (align - 1)) != 0; i++) dst[i] = src[i];
  return i;
}

__attribute__((noinline)) size_t copy_sse2(char* dst, const char* src, size_t n) {
  size_t i = align_dst(dst, src, n, 16);
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  return i;
}

__attribute__((noinline, target("avx2"))) size_t copy_avx2(char* dst, const char* src, size_t n) {
  size_t i = align_dst(dst, src, n, 32);
  for (; i + 64 <= n; i += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
  return i;
}

__attribute__((noinline, target("avx512f"))) size_t copy_avx512(char* dst, const char* src, size_t n) {
  size_t i = align_dst(dst, src, n, 64);
  for (; i + 128 <= n; i += 128) {
    __m512i a = _mm512_loadu_si512(src + i);
    __m512i b = _mm512_loadu_si512(src + i + 64);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
  }
  return i;
}

using StreamCopy = size_t (*)(char*, const char*, size_t);

// The copy with stores of `width` bytes (16, 32 or 64), or nullptr where this CPU (and its OS)
// cannot run it.
StreamCopy with_width(int width) {
  __builtin_cpu_init();
  switch (width) {
    case 64:
      return __builtin_cpu_supports("avx512f") ? copy_avx512 : nullptr;
    case 32:
      return __builtin_cpu_supports("avx2") ? copy_avx2 : nullptr;
    case 16:
      return copy_sse2;
    default:
      return nullptr;
  }
}

// The widest this CPU runs.
StreamCopy widest() {
  for (int width : {64, 32}) {
    if (StreamCopy copy = with_width(width)) return copy;
  }
  return copy_sse2;
}

// Copies with `streamed`, then the tail with memcpy, then fences: the streamed stores are
// visible before the caller reports the piece done.
void copy_with(char* dst, const char* src, size_t n, StreamCopy streamed) {
  size_t i = streamed(dst, src, n);
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
}
#endif

void copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  static const StreamCopy widest_here = widest();
  copy_with(dst, src, n, widest_here);
#else
  std::memcpy(dst, src, n);
#endif
}

// 0, or 1 when a SIGBUS stopped the copy. Nothing with a destructor lives across the jump.
int guarded_copy(char* dst, const char* src, size_t n) {
  Guard guard;
  guard.begin = src;
  guard.end = src + n;
  // Saving the signal mask: the jump leaves the handler, where SIGBUS is blocked.
  if (sigsetjmp(guard.resume, 1) != 0) {
    active = nullptr;
    return 1;
  }
  active = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  copy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  active = nullptr;
  return 0;
}

#if defined(__linux__)
// 1 when page `i` of the mapping is in the page cache, 0 when not, or the errno of mincore
// (negative).
int cached_page(void* map, size_t i, size_t page) {
  unsigned char resident = 0;
  if (mincore(static_cast<char*>(map) + i * page, page, &resident) != 0) return -errno;
  return resident & 1;
}

// Whether the mapping's pages are in the page cache (0 or 1), or the errno of mincore (negative),
// from a sample: one page in every kSampleStride and the last. A mincore of every page of a 4 MiB
// piece took 49 us here, 5 % of the piece's copy; a range the sample passes but that is partly
// on the disk is still copied right, only slower.
constexpr size_t kSampleStride = 256;
int all_cached(void* map, size_t span, size_t page) {
  size_t pages = (span + page - 1) / page;
  for (size_t i = 0; i < pages; i += kSampleStride) {
    int cached = cached_page(map, i, page);
    if (cached != 1) return cached;
  }
  return cached_page(map, pages - 1, page);
}
#endif

}  // namespace

extern "C" {

// Copies `len` bytes of `fd` at `offset` into `dst`: maps the pages that hold them, and when
// every one is in the page cache, reads them in (MADV_POPULATE_READ), copies under the SIGBUS
// guard and unmaps (`prepare` 0, for tests: copies without looking at the page cache first). Returns 0; SL_MAPPED_UNSUPPORTED where this system
// cannot (not Linux 5.14 or later); SL_MAPPED_BUS when a SIGBUS stopped the copy;
// SL_MAPPED_NOT_CACHED when a page is not in the page cache (nothing copied); or the errno of a
// failed call (positive).
enum { SL_MAPPED_UNSUPPORTED = -1, SL_MAPPED_BUS = -2, SL_MAPPED_NOT_CACHED = -3 };

int sl_mapped_read(int fd, int64_t offset, void* dst, size_t len, int prepare) {
#if defined(__linux__)
  if (len == 0) return 0;
  std::call_once(install_once, install);
  if (install_error != 0) return install_error;
  long page = sysconf(_SC_PAGESIZE);
  if (page <= 0 || offset < 0) return EINVAL;
  int64_t start = offset - offset % page;
  size_t lead = static_cast<size_t>(offset - start);
  if (len > SIZE_MAX - lead) return EOVERFLOW;
  size_t span = lead + len;
  void* map = mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, start);
  if (map == MAP_FAILED) return errno;
  int result = 0;
  int cached = prepare != 0 ? all_cached(map, span, static_cast<size_t>(page)) : 1;
  if (cached < 0) {
    result = -cached;
  } else if (cached == 0) {
    result = SL_MAPPED_NOT_CACHED;
  } else if (prepare != 0 && madvise(map, span, MADV_POPULATE_READ) != 0) {
    result = errno == EINVAL ? SL_MAPPED_UNSUPPORTED : errno;
  } else if (guarded_copy(static_cast<char*>(dst), static_cast<const char*>(map) + lead, len) != 0) {
    result = SL_MAPPED_BUS;
  }
  munmap(map, span);
  return result;
#else
  (void)fd, (void)offset, (void)dst, (void)len, (void)prepare;
  return SL_MAPPED_UNSUPPORTED;
#endif
}

// Copies `n` bytes from `src` to `dst` with non-temporal stores of `width` bytes (16, 32 or 64),
// as a mapped read copies (for tests: each width, whatever the CPU's widest). Returns 0, or
// SL_MAPPED_UNSUPPORTED where this CPU cannot (or it is not x86-64), with nothing copied.
int sl_stream_copy(void* dst, const void* src, size_t n, int width) {
#if defined(__x86_64__)
  StreamCopy streamed = with_width(width);
  if (streamed == nullptr) return SL_MAPPED_UNSUPPORTED;
  copy_with(static_cast<char*>(dst), static_cast<const char*>(src), n, streamed);
  return 0;
#else
  (void)dst, (void)src, (void)n, (void)width;
  return SL_MAPPED_UNSUPPORTED;
#endif
}

}  // extern "C"
