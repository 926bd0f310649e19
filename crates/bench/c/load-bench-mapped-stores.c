/* How wide a non-temporal store copies the page cache into a model's memory fastest: 1 GB, warm
 * (the file read whole before each pass), into memory written just before each pass (as a loaded
 * model's is), 4 threads each copying a contiguous quarter in 4 MiB pieces, the arms alternating
 * per round:
 *   pread     pread straight into the destination (stageload's HostRead::Pread);
 *   sse2      each piece mapped, MADV_POPULATE_READ, copied with 16-byte _mm_stream_si128
 *             (HostRead::Mapped before 2026-12-06);
 *   avx2      the same with 32-byte _mm256_stream_si256;
 *   avx512    the same with 64-byte _mm512_stream_si512: one store fills a cache line
 *             (HostRead::Mapped since 2026-12-06, where the CPU has AVX-512F);
 *   reused    pread into a reused 4 MiB buffer per thread, not the destination: the load
 *             benchmark's parallel limit, whose 16 MiB of buffers stay in this machine's L3.
 *
 *     gcc -O2 -pthread crates/bench/c/load-bench-mapped-stores.c -o /tmp/stores
 *     /tmp/stores target/stageload-bench/model.safetensors 9
 *
 * 2026-12-06, this machine (2 cores of a Xeon with AVX-512, L3 300 MiB), GB/s, median of 9
 * rounds: pread 10.49, sse2 12.47, avx2 12.66, avx512 15.62 (13.79-16.34); an earlier run of
 * 9 rounds without avx512: pread 9.35, sse2 12.40, avx2 13.20. A 16-byte store writes a quarter
 * of a line; 64-byte stores write whole lines, which the CPU sends to memory without reading
 * them first. pread's kernel copy uses ordinary stores: each destination line is read for
 * ownership before it is written.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PIECE (4 << 20)
#define READERS 4

static const char *path;
static size_t len;
static char *dest;
static int arm;
static char *reused[READERS];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void sse2(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16)),
            c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a);
    _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c);
    _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

__attribute__((target("avx2"))) static void avx2(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(s + i)), b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
    _mm256_stream_si256((__m256i *)(d + i), a);
    _mm256_stream_si256((__m256i *)(d + i + 32), b);
  }
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

__attribute__((target("avx512f"))) static void avx512(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    _mm512_stream_si512((__m512i *)(d + i), a);
    _mm512_stream_si512((__m512i *)(d + i + 64), b);
  }
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

static void *reader(void *arg) {
  long r = (long)arg;
  int fd = open(path, O_RDONLY);
  size_t share = ((len + READERS - 1) / READERS + PIECE - 1) / PIECE * PIECE;
  size_t off = share * r, end = share * (r + 1) < len ? share * (r + 1) : len;
  for (; off < end; off += PIECE) {
    size_t n = end - off < PIECE ? end - off : PIECE;
    if (arm == 0 || arm == 4) {
      if (pread(fd, arm == 0 ? dest + off : reused[r], n, off) != (ssize_t)n) abort();
      continue;
    }
    char *m = mmap(0, n, PROT_READ, MAP_SHARED, fd, off);
    if (m == MAP_FAILED || madvise(m, n, 22 /* MADV_POPULATE_READ */) != 0) abort();
    (arm == 1 ? sse2 : arm == 2 ? avx2 : avx512)(dest + off, m, n);
    munmap(m, n);
  }
  close(fd);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) return fprintf(stderr, "usage: %s FILE ROUNDS\n", argv[0]), 2;
  path = argv[1];
  struct stat st;
  if (stat(path, &st) != 0) return perror(path), 1;
  len = st.st_size;
  dest = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
  char *buffer = malloc(PIECE);
  const char *names[5] = {"pread", "sse2", "avx2", "avx512", "reused"};
  for (int i = 0; i < READERS; i++) memset(reused[i] = malloc(PIECE), 1, PIECE);
  for (int round = 0; round < atoi(argv[2]); round++) {
    for (arm = 0; arm < 5; arm++) {
      int fd = open(path, O_RDONLY);
      for (size_t o = 0; pread(fd, buffer, PIECE, o) > 0; o += PIECE) {
      }
      close(fd);
      memset(dest, 0, len);
      pthread_t threads[READERS];
      double start = now();
      for (long i = 0; i < READERS; i++) pthread_create(&threads[i], 0, reader, (void *)i);
      for (int i = 0; i < READERS; i++) pthread_join(threads[i], 0);
      printf("%s %.2f\n", names[arm], len / 1e9 / (now() - start));
      fflush(stdout);
    }
  }
  return 0;
}
