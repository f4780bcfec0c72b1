// Two traversals of a dense f32 matrix-vector product y[N] = x[K] @ W[K, N] (W row-major),
// 30 distinct 576x1536 matrices in turn (cache-cold, as a decode step's matmuls are), on 2
// threads, to show how the CPU's prefetchers take each access pattern:
//   A  the CPU kernel's (jaxdec/quant/csrc/qmatmul.cc) register path: N split between the
//      threads, 64-column chunks read down all K rows (256 bytes at a stride of N * 4);
//   B  K split between the threads, every row read whole and contiguously into an L1
//      accumulator row, the two partial rows summed at the end.
// An ad-hoc probe for issue 3 (not built by make, not a test):
//   gcc -O3 -march=native -fopenmp scripts/matvec_traversal.c -o /tmp/mv && /tmp/mv
// Session 18, AMD EPYC (Zen 4): A 16.8-19.0 GB/s, B 24.0-30.7 GB/s over 6 rounds.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define K 576
#define N 1536
#define NM 30
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// A: kernel-like: column chunks of 64, groups of 16 rows, accumulators in registers
static void mvA(const float*x,const float*W,float*y,int c0,int c1){
  for(int c=c0;c<c1;c+=64){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    for(int k=0;k<K;k++){const float*w=W+(size_t)k*N+c;__m512 xb=_mm512_set1_ps(x[k]);
      a0=_mm512_fmadd_ps(xb,_mm512_loadu_ps(w),a0);a1=_mm512_fmadd_ps(xb,_mm512_loadu_ps(w+16),a1);
      a2=_mm512_fmadd_ps(xb,_mm512_loadu_ps(w+32),a2);a3=_mm512_fmadd_ps(xb,_mm512_loadu_ps(w+48),a3);}
    _mm512_storeu_ps(y+c,a0);_mm512_storeu_ps(y+c+16,a1);_mm512_storeu_ps(y+c+32,a2);_mm512_storeu_ps(y+c+48,a3);}
}
// B: rows streamed contiguously over a K slab, accumulators in L1 (acc[N])
static void mvB(const float*x,const float*W,float*acc,int k0,int k1){
  for(int c=0;c<N;c+=16)_mm512_storeu_ps(acc+c,_mm512_setzero_ps());
  for(int k=k0;k<k1;k+=4){const float*w=W+(size_t)k*N;
    __m512 x0=_mm512_set1_ps(x[k]),x1=_mm512_set1_ps(x[k+1]),x2=_mm512_set1_ps(x[k+2]),x3=_mm512_set1_ps(x[k+3]);
    for(int c=0;c<N;c+=16){__m512 a=_mm512_loadu_ps(acc+c);
      a=_mm512_fmadd_ps(x0,_mm512_loadu_ps(w+c),a);a=_mm512_fmadd_ps(x1,_mm512_loadu_ps(w+N+c),a);
      a=_mm512_fmadd_ps(x2,_mm512_loadu_ps(w+2*N+c),a);a=_mm512_fmadd_ps(x3,_mm512_loadu_ps(w+3*N+c),a);
      _mm512_storeu_ps(acc+c,a);}}
}
int main(){
  float*Ws=aligned_alloc(64,(size_t)NM*K*N*4);for(size_t i=0;i<(size_t)NM*K*N;i++)Ws[i]=(float)(i%7)*0.1f;
  float x[K];for(int i=0;i<K;i++)x[i]=0.01f*i;
  float*y=aligned_alloc(64,N*4);float*acc=aligned_alloc(64,2*N*4);
  float*flush=malloc(64<<20);
  for(int rep=0;rep<6;rep++){
   for(int v=0;v<2;v++){
    memset(flush,rep,64<<20);
    double t=now();
    for(int it=0;it<5;it++)for(int m=0;m<NM;m++){const float*W=Ws+(size_t)m*K*N;
      if(v==0){
#pragma omp parallel num_threads(2)
        {int id=omp_get_thread_num();mvA(x,W,y,id*N/2,(id+1)*N/2);}
      }else{
#pragma omp parallel num_threads(2)
        {int id=omp_get_thread_num();mvB(x,W,acc+id*N,id*K/2,(id+1)*K/2);}
        for(int c=0;c<N;c++)y[c]=acc[c]+acc[N+c];
      }}
    double dt=(now()-t)/(5*NM);
    printf("%s %.1f us/call %.1f GB/s\n",v?"B rows+L1 acc, K split":"A 64-col chunks, N split",dt*1e6,K*N*4/dt/1e9);
   }}
}
