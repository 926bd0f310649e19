/* The rate and CPU cost of reading a file past the page cache (O_DIRECT) against buffered reads:
 * the file read in 48 MiB blocks, the page cache dropped first, each block read by N threads in
 * pieces, buffered (each block dropped after it) or direct into one aligned buffer. Results:
 * traces/hot-set/archive/direct-reads/README.md.
 *
 *     gcc -O2 -pthread crates/bench/c/read-rate.c -o /tmp/read-rate
 *     /tmp/read-rate FILE 2
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *path;
static int fd_buf, fd_dir;
static size_t fsize, block = 48u << 20;
static char *dest;
typedef struct { int direct; size_t piece; size_t start, len; int nthreads, id; } Arg;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static size_t next_piece; static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *worker(void *p){ Arg *a=p; for(;;){ pthread_mutex_lock(&mu); size_t off=next_piece; next_piece+=a->piece; pthread_mutex_unlock(&mu);
  if(off>=a->len) return 0; size_t n=a->len-off; if(n>a->piece)n=a->piece;
  if(a->direct){ size_t nn=(n+4095)&~4095ul; ssize_t r=pread(fd_dir,dest+off,nn,a->start+off); if(r<(ssize_t)n && a->start+off+r<fsize){perror("pread d");exit(1);} }
  else { ssize_t r=pread(fd_buf,dest+off,n,a->start+off); if(r!=(ssize_t)n){perror("pread");exit(1);} } } }
static double cpu(void){struct rusage u;getrusage(RUSAGE_SELF,&u);return u.ru_utime.tv_sec+u.ru_utime.tv_usec*1e-6+u.ru_stime.tv_sec+u.ru_stime.tv_usec*1e-6;}
static void run(int direct,int threads,size_t piece){
  posix_fadvise(fd_buf,0,0,POSIX_FADV_DONTNEED);
  double t0=now(), c0=cpu(); size_t total=0;
  for(size_t s=0;s<fsize;s+=block){ size_t len=fsize-s<block?fsize-s:block; if(direct) len=(len+4095)&~4095ul;
    next_piece=0; pthread_t th[32]; Arg a={direct,piece,s,len,threads,0};
    for(int i=0;i<threads;i++)pthread_create(&th[i],0,worker,&a); for(int i=0;i<threads;i++)pthread_join(th[i],0);
    if(!direct) posix_fadvise(fd_buf,s,len,POSIX_FADV_DONTNEED); total+=len; }
  double t=now()-t0, c=cpu()-c0;
  printf("%-8s threads %2d piece %2zu MiB: %.2f GB/s, cpu %.3f s per GB\n", direct?"direct":"buffered", threads, piece>>20, total/t/1e9, c/(total/1e9));
  fflush(stdout);
}
int main(int argc,char**argv){ path=argv[1]; int rounds=atoi(argv[2]);
  fd_buf=open(path,O_RDONLY); fd_dir=open(path,O_RDONLY|O_DIRECT); struct stat st; fstat(fd_buf,&st); fsize=st.st_size&~4095ul;
  if(posix_memalign((void**)&dest,4096,block+4096)) return 1; memset(dest,1,block+4096);
  for(int r=0;r<rounds;r++){ printf("-- round %d\n",r+1);
    run(0,4,4<<20); run(1,4,4<<20); run(1,8,4<<20); run(1,8,2<<20); run(1,16,2<<20); run(1,4,16<<20); }
  return 0; }
