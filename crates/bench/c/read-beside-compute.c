/* What reads cost a compute beside them: two threads multiply 512x512 matrices with a barrier
 * after each of 120 steps, alone and beside a reader reading the file over and over in 48 MiB
 * blocks by 4 threads in 4 MiB pieces (buffered, direct in place, direct through a bounce
 * buffer). Results: traces/hot-set/archive/direct-reads/README.md.
 *
 *     gcc -O2 -pthread crates/bench/c/read-beside-compute.c -o /tmp/read-beside-compute
 *     /tmp/read-beside-compute FILE ROUNDS
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <stdatomic.h>
// Compute: 2 threads, each iterations of a 1024x1024 float "matmul-ish" sweep, with a barrier per step.
static int fd_buf, fd_dir; static size_t fsize, block=48u<<20, piece=4u<<20; static char *dest;
static atomic_int stop; static atomic_size_t bytes;
static int mode; // 0 none, 1 buffered+dontneed, 2 direct in place, 3 direct bounce+memcpy
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static pthread_barrier_t bar; static float *A,*B,*C; enum{N=512};
static void *compute(void*p){ long id=(long)p; for(int s=0;s<120;s++){ for(int i=id*N/2;i<(id+1)*N/2;i++) for(int k=0;k<N;k++){float a=A[i*N+k]; for(int j=0;j<N;j++) C[i*N+j]+=a*B[k*N+j];} pthread_barrier_wait(&bar);} return 0; }
static size_t nextp; static size_t bstart,blen; static pthread_mutex_t mu=PTHREAD_MUTEX_INITIALIZER;
static void *reader(void*p){ char *bounce=0; if(mode==3){posix_memalign((void**)&bounce,4096,piece);} for(;;){ pthread_mutex_lock(&mu); size_t off=nextp; nextp+=piece; pthread_mutex_unlock(&mu); if(off>=blen) break; size_t n=blen-off<piece?blen-off:piece;
  if(mode==1) pread(fd_buf,dest+off,n,bstart+off); else if(mode==2) pread(fd_dir,dest+off,n,bstart+off); else { pread(fd_dir,bounce,n,bstart+off); memcpy(dest+off+64,bounce,n-64);} } free(bounce); return 0; }
static void *streamer(void*p){ while(!stop){ for(size_t s=0;s+block<=fsize && !stop;s+=block){ nextp=0; bstart=s; blen=block; pthread_t th[4]; for(int i=0;i<4;i++)pthread_create(&th[i],0,reader,0); for(int i=0;i<4;i++)pthread_join(th[i],0); if(mode==1)posix_fadvise(fd_buf,s,block,POSIX_FADV_DONTNEED); bytes+=block; } } return 0; }
int main(int argc,char**argv){ fd_buf=open(argv[1],O_RDONLY); fd_dir=open(argv[1],O_RDONLY|O_DIRECT); struct stat st; fstat(fd_buf,&st); fsize=st.st_size&~4095ul; int rounds=atoi(argv[2]);
 posix_memalign((void**)&dest,4096,block+8192); memset(dest,1,block+8192); A=calloc(N*N,4);B=calloc(N*N,4);C=calloc(N*N,4); for(int i=0;i<N*N;i++){A[i]=i%7;B[i]=i%5;}
 pthread_barrier_init(&bar,0,2);
 for(int r=0;r<rounds;r++) for(mode=0;mode<4;mode++){ posix_fadvise(fd_buf,0,0,POSIX_FADV_DONTNEED); stop=0; bytes=0; pthread_t s; if(mode) pthread_create(&s,0,streamer,0);
   double t0=now(); pthread_t c[2]; for(long i=0;i<2;i++)pthread_create(&c[i],0,compute,(void*)i); for(int i=0;i<2;i++)pthread_join(c[i],0); double t=now()-t0; stop=1; if(mode) pthread_join(s,0);
   printf("round %d %-22s compute %.2f s, read %.2f GB/s during it\n", r+1, (const char*[]){"alone","buffered+dontneed","direct in place","direct+bounce memcpy"}[mode], t, bytes/t/1e9); fflush(stdout);} }
