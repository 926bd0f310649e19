/* What copying from a mapping with non-temporal stores would give a warm load, against stageload's
 * way (4 threads of 4 MiB preads into the model's memory). Fills 1 GB of anonymous memory, written
 * just before each pass, from the warm file, ROUNDS rounds, the arms alternating, 4 threads taking
 * 4 MiB pieces in turn:
 *   pread        stageload's way: pread straight into the destination;
 *   limit        the bench's parallel limit: pread into a reused 4 MiB buffer per thread;
 *   whole-map    the file mapped whole, each piece populated (MADV_POPULATE_READ) by its thread
 *                and copied with non-temporal 16-byte stores; the map and unmap timed in;
 *   piece-map    each piece mapped, populated, copied the same way and unmapped by its thread
 *                (mapped file pages in the process bounded by 4 pieces).
 * Prints each arm's GB/s per round, the medians, and the most file pages each arm had mapped at
 * once (RssFile, sampled after every piece).
 *
 *     gcc -O2 -pthread crates/bench/c/load-bench-mapped.c -o /tmp/mapped
 *     /tmp/mapped target/stageload-bench/model.safetensors 7
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#define PIECE (4 << 20)
#define THREADS 4
#define ARMS 4
static const char *names[ARMS] = {"pread", "limit", "whole-map", "piece-map"};
static int fd, arm;
static size_t size, next_off;
static char *dst, *map;
static long peak_file_kb;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void fail(const char *what) { perror(what); exit(1); }
static long rss_file_kb(void) {
  FILE *f = fopen("/proc/self/status", "r"); char l[256]; long kb = 0;
  while (fgets(l, sizeof l, f)) if (!strncmp(l, "RssFile:", 8)) kb = atol(l + 8);
  fclose(f); return kb;
}
static void nt_copy(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i < n && ((size_t)(d + i) & 15); i++) d[i] = s[i];
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a); _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c); _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}
static void read_at(char *p, size_t n, size_t off) {
  for (size_t d = 0; d < n;) { ssize_t r = pread(fd, p + d, n - d, off + d); if (r <= 0) fail("pread"); d += r; }
}
static void *work(void *unused) {
  char *own = arm == 1 ? malloc(PIECE) : NULL;
  for (;;) {
    pthread_mutex_lock(&mu); size_t o = next_off; next_off += PIECE; pthread_mutex_unlock(&mu);
    if (o >= size) break;
    size_t n = size - o < PIECE ? size - o : PIECE;
    if (arm == 0) read_at(dst + o, n, o);
    else if (arm == 1) read_at(own, n, o);
    else if (arm == 2) { if (madvise(map + o, n, MADV_POPULATE_READ)) fail("populate"); nt_copy(dst + o, map + o, n); }
    else {
      char *s = mmap(NULL, n, PROT_READ, MAP_SHARED, fd, o); if (s == MAP_FAILED) fail("mmap");
      if (madvise(s, n, MADV_POPULATE_READ)) fail("populate");
      nt_copy(dst + o, s, n);
      long kb = rss_file_kb(); pthread_mutex_lock(&mu); if (kb > peak_file_kb) peak_file_kb = kb; pthread_mutex_unlock(&mu);
      munmap(s, n);
    }
    if (arm == 2) { long kb = rss_file_kb(); pthread_mutex_lock(&mu); if (kb > peak_file_kb) peak_file_kb = kb; pthread_mutex_unlock(&mu); }
  }
  free(own);
  return NULL;
}
static double pass(void) {
  next_off = 0; double t = now();
  if (arm == 2) { map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0); if (map == MAP_FAILED) fail("mmap"); }
  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, work, NULL);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  if (arm == 2) munmap(map, size);
  return size / (now() - t) / 1e9;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s FILE ROUNDS\n", argv[0]); return 2; }
  fd = open(argv[1], O_RDONLY); if (fd < 0) fail(argv[1]);
  struct stat st; fstat(fd, &st); size = st.st_size;
  int rounds = atoi(argv[2]); if (rounds < 1 || rounds > 99) return 2;
  dst = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *check = malloc(size), *buf = malloc(PIECE);
  read_at(check, size, 0);
  double gbs[ARMS][99]; long file_kb[ARMS] = {0};
  for (int r = 0; r < rounds; r++) {
    for (arm = 0; arm < ARMS; arm++) {
      for (size_t o = 0; o < size; o += PIECE) read_at(buf, size - o < PIECE ? size - o : PIECE, o); /* warm, untimed */
      memset(dst, r + 1, size); peak_file_kb = 0;
      gbs[arm][r] = pass();
      if (peak_file_kb > file_kb[arm]) file_kb[arm] = peak_file_kb;
      if (arm != 1 && memcmp(dst, check, size)) { fprintf(stderr, "%s: wrong bytes\n", names[arm]); return 1; }
      printf("round %d %-9s %.2f GB/s\n", r + 1, names[arm], gbs[arm][r]); fflush(stdout);
    }
  }
  double median[ARMS], low[ARMS], high[ARMS];
  for (arm = 0; arm < ARMS; arm++) {
    double sorted[99]; memcpy(sorted, gbs[arm], rounds * sizeof(double)); qsort(sorted, rounds, sizeof(double), cmp);
    median[arm] = sorted[rounds / 2]; low[arm] = sorted[0]; high[arm] = sorted[rounds - 1];
  }
  for (arm = 0; arm < ARMS; arm++)
    printf("%-9s median %.2f GB/s (%.2f-%.2f), %.2fx pread, %.2fx limit, most file pages mapped %ld MiB\n", names[arm],
           median[arm], low[arm], high[arm], median[arm] / median[0], median[arm] / median[1], file_kb[arm] >> 10);
  return 0;
}
