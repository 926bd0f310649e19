/* Hints for a cold read, tried before the contiguous runs of load-bench-cold-runs.c: 1 GB read
 * into memory written just before each pass, the file's pages dropped before each, arms
 * alternating per round:
 *   seq1           one thread, 4 MiB preads in order;
 *   par4           4 threads taking 4 MiB pieces in turn from one fd (stageload's loads then);
 *   willneed+par4  posix_fadvise(WILLNEED) over the whole file first, then par4;
 *   seqhint+par4   posix_fadvise(SEQUENTIAL) first, then par4;
 *   map-par4       the file mapped, each piece memcpy'd from the mapping (its page faults read);
 *   map-pop-par4   the same, each piece populated first (MADV_POPULATE_READ);
 *   map-seq-par4   map-par4 with madvise(SEQUENTIAL).
 *
 *     gcc -O2 -pthread crates/bench/c/load-bench-cold-hints.c -o /tmp/hints
 *     /tmp/hints target/stageload-bench/model.safetensors 9
 *
 * 2026-12-06, two runs of 9 rounds, each arm over par4 in the same round, median: seq1 1.03,
 * 0.99; willneed 1.07, 0.99; seqhint 1.06, 0.96; map-par4 1.10, 1.05; map-pop 1.02, 1.03;
 * map-seq 0.94, 0.92 (single rounds 0.79-1.54: no hint a reliable gain). A copy faulting from a
 * mapping, built into stageload's mapped read for pieces not in the page cache, measured 1.28
 * GB/s against pread's 1.34 in the load benchmark (7 rounds) and was not kept.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#define PIECE (4 << 20)
#define ARMS 7
static const char *names[ARMS] = {"seq1", "par4", "willneed+par4", "seqhint+par4", "map-par4", "map-pop-par4", "map-seq-par4"};
static char *map;
static int fd, arm, threads;
static size_t size, next_off;
static volatile size_t done_off;
static char *dst;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *reader(void *unused) {
  for (;;) {
    pthread_mutex_lock(&mu); size_t off = next_off; next_off += PIECE; pthread_mutex_unlock(&mu);
    if (off >= size) return NULL;
    size_t n = size - off < PIECE ? size - off : PIECE;
    if (map) { if (arm == 5) madvise(map + off, n, MADV_POPULATE_READ); memcpy(dst + off, map + off, n); continue; }
    size_t got = 0;
    while (got < n) { ssize_t r = pread(fd, dst + off + got, n - got, off + got); if (r <= 0) { perror("pread"); exit(1);} got += r; }
    __atomic_store_n(&done_off, off, __ATOMIC_RELAXED);
  }
}
static volatile int stop_ahead;
static void *ahead(void *unused) {
  size_t issued = 0; const size_t window = 64 << 20, step = 16 << 20;
  while (!stop_ahead && issued < size) {
    size_t cur = __atomic_load_n(&next_off, __ATOMIC_RELAXED);
    if (issued < cur + window) { readahead(fd, issued, step); issued += step; }
    else usleep(200);
  }
  return NULL;
}
int main(int argc, char **argv) {
  fd = open(argv[1], O_RDONLY); int rounds = atoi(argv[2]);
  size = lseek(fd, 0, SEEK_END);
  dst = malloc(size);
  double res[ARMS][64];
  for (int r = 0; r < rounds; r++) for (arm = 0; arm < ARMS; arm++) {
    memset(dst, r, size);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    posix_fadvise(fd, 0, 0, POSIX_FADV_NORMAL);
    next_off = 0; stop_ahead = 0;
    threads = arm == 0 ? 1 : 4; map = NULL;
    if (arm >= 4) { map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0); if (arm == 6) madvise(map, size, MADV_SEQUENTIAL); }
    double t0 = now();
    pthread_t th[8], ah;
    if (arm == 2) posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
    if (arm == 3) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    
    for (int i = 1; i < threads; i++) pthread_create(&th[i], NULL, reader, NULL);
    reader(NULL);
    for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
    if (map) { munmap(map, size); }
    res[arm][r] = size / (now() - t0) / 1e9; /* unmap timed in */
    printf("round %d %-14s %.2f GB/s\n", r, names[arm], res[arm][r]); fflush(stdout);
  }
  for (int a = 0; a < ARMS; a++) {
    double *v = res[a];
    for (int i = 0; i < rounds; i++) for (int j = i + 1; j < rounds; j++) if (v[j] < v[i]) { double t = v[i]; v[i] = v[j]; v[j] = t; }
    printf("median %-14s %.2f\n", names[a], v[rounds / 2]);
  }
}
