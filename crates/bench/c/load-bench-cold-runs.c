/* How several threads read one file fastest: 1 GB into memory written just before each pass,
 * the arms alternating per round, from the disk (the file's pages dropped before each pass) or,
 * with `warm`, from the page cache (the file read whole before each pass):
 *   seq1        one thread, 4 MiB preads in order (one fd);
 *   inter4      4 threads taking 4 MiB pieces in turn from one shared fd (stageload's loads
 *               before 2026-12-06);
 *   inter4-fds  the same, each thread with its own fd (its own read-ahead state);
 *   quart4      4 threads, each reading a contiguous quarter in order, one shared fd;
 *   quart4-fds  the same, each thread with its own fd (stageload's loads since 2026-12-06);
 *   chunk4-fds  4 threads taking 64 MiB chunks in turn, each read in order in 4 MiB preads, own fds.
 *
 *     gcc -O2 -pthread crates/bench/c/load-bench-cold-runs.c -o /tmp/runs
 *     /tmp/runs target/stageload-bench/model.safetensors 9 [warm]
 *
 * 2026-12-06, this machine (2 cores, virtual disk), each arm's rate over inter4's in the same
 * round, median (range): cold, two runs of 7 and 9 rounds (inter4 1.31 and 1.35 GB/s):
 *   seq1 0.99, 0.98; inter4-fds 0.96, 1.01; quart4 1.17, 1.11; quart4-fds 1.25 (0.81-1.60),
 *   1.22 (1.01-1.88); chunk4-fds 1.01, 1.04.
 * Warm, 9 rounds (inter4 8.48 GB/s): seq1 0.50; inter4-fds 0.96; quart4 0.97; quart4-fds 0.98
 *   (0.87-1.13); chunk4-fds 0.94.
 * Interleaved readers on one fd look random to the kernel's read-ahead, whose state is per open
 * file; a contiguous run per reader through its own open file is a sequential stream each.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define PIECE (4 << 20)
#define CHUNK (64 << 20)
#define ARMS 6
static const char *names[ARMS] = {"seq1", "inter4", "inter4-fds", "quart4", "quart4-fds", "chunk4-fds"};
static const char *path;
static int shared_fd, arm, threads;
static size_t size, next_off;
static char *dst;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void span(int fd, size_t from, size_t to) {
  for (size_t off = from; off < to; off += PIECE) {
    size_t n = to - off < PIECE ? to - off : PIECE, got = 0;
    while (got < n) { ssize_t r = pread(fd, dst + off + got, n - got, off + got); if (r <= 0) { perror("pread"); exit(1); } got += r; }
  }
}
static void *reader(void *index) {
  long i = (long)index;
  int own = arm == 2 || arm == 4 || arm == 5;
  int fd = own ? open(path, O_RDONLY) : shared_fd;
  if (arm == 3 || arm == 4) {
    size_t quarter = (size / threads + PIECE - 1) / PIECE * PIECE;
    size_t from = i * quarter, to = from + quarter > size ? size : from + quarter;
    if (from < size) span(fd, from, to);
  } else {
    size_t step = arm == 5 ? CHUNK : PIECE;
    for (;;) {
      pthread_mutex_lock(&mu); size_t off = next_off; next_off += step; pthread_mutex_unlock(&mu);
      if (off >= size) break;
      span(fd, off, off + step > size ? size : off + step);
    }
  }
  if (own) close(fd);
  return NULL;
}
int main(int argc, char **argv) {
  path = argv[1]; int rounds = atoi(argv[2]);
  int warm = argc > 3 && !strcmp(argv[3], "warm");
  shared_fd = open(path, O_RDONLY);
  size = lseek(shared_fd, 0, SEEK_END);
  dst = malloc(size);
  double res[ARMS][64];
  for (int r = 0; r < rounds; r++) for (arm = 0; arm < ARMS; arm++) {
    memset(dst, r, size);
    if (warm) { for (size_t o = 0; o < size; o += PIECE) if (pread(shared_fd, dst, size - o < PIECE ? size - o : PIECE, o) < 0) exit(1); memset(dst, r, size); }
    else posix_fadvise(shared_fd, 0, 0, POSIX_FADV_DONTNEED);
    next_off = 0; threads = arm == 0 ? 1 : 4;
    double t0 = now();
    pthread_t th[8];
    for (long i = 1; i < threads; i++) pthread_create(&th[i], NULL, reader, (void *)i);
    reader((void *)0);
    for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
    res[arm][r] = size / (now() - t0) / 1e9;
    printf("round %d %-12s %.2f GB/s\n", r, names[arm], res[arm][r]); fflush(stdout);
  }
  for (int a = 0; a < ARMS; a++) {
    double *v = res[a];
    for (int i = 0; i < rounds; i++) for (int j = i + 1; j < rounds; j++) if (v[j] < v[i]) { double t = v[i]; v[i] = v[j]; v[j] = t; }
    printf("median %-12s %.2f\n", names[a], v[rounds / 2]);
  }
}
