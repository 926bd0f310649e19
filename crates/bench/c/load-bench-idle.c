/* Fills 1 GB of anonymous memory from a warm file with 4 threads of 4 MiB preads (as stageload
 * loads), three times each: into memory written just before, and into memory written IDLE seconds
 * before. Cited by traces/load-bench.md.
 *
 *     gcc -O2 -pthread crates/bench/c/load-bench-idle.c -o /tmp/idle
 *     /tmp/idle target/stageload-bench/model.safetensors 75   (then 5)
 *
 * 2026-12-05, this machine (2 cores, DAMON pageout scheme on, no swap):
 *   IDLE=75: just before 7.26, 7.74, 7.83 GB/s; 75 s before 6.67, 6.48, 6.90 (0.85-0.92x)
 *   IDLE=5:  just before 8.73, 8.96, 8.89 GB/s;  5 s before 8.93, 8.91, 8.76 (0.98-1.02x)
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#define W (4<<20)
static int fd; static size_t size; static char *dst; static size_t next_off; static pthread_mutex_t mu=PTHREAD_MUTEX_INITIALIZER;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void* work(void*a){for(;;){pthread_mutex_lock(&mu);size_t o=next_off;next_off+=W;pthread_mutex_unlock(&mu);if(o>=size)return 0;size_t n=size-o<W?size-o:W;
 size_t d=0;while(d<n){ssize_t r=pread(fd,dst+o+d,n-d,o+d);if(r<=0){perror("pread");exit(1);}d+=r;}}}
static double pass(){next_off=0;double t=now();pthread_t th[4];for(int i=0;i<4;i++)pthread_create(&th[i],0,work,0);for(int i=0;i<4;i++)pthread_join(th[i],0);return size/(now()-t)/1e9;}
static void warm(){char*b=malloc(W);for(size_t o=0;o<size;o+=W)pread(fd,b,W,o);free(b);}
int main(int c,char**v){fd=open(v[1],O_RDONLY);struct stat st;fstat(fd,&st);size=st.st_size;int idle=atoi(v[2]);
 dst=mmap(0,size,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 for(int r=0;r<3;r++){
 warm();memset(dst,1,size);printf("written just before: %.2f GB/s\n",pass());fflush(stdout);
 memset(dst,1,size);sleep(idle);warm();printf("written %ds before: %.2f GB/s\n",idle,pass());fflush(stdout);}
}
