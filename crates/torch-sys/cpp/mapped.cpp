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
#include <emmintrin.h>
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

void copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  // Non-temporal stores: the destination (a model's weights) is not read soon, so it need not
  // pass through the caches, and the lines are not read for ownership before being written.
  size_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 15) != 0; i++) dst[i] = src[i];
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
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // the streamed stores are visible before the caller reports the piece done
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

}  // extern "C"
