/* vpdpbusd with the activation word broadcast by a separate vpbroadcastd load (what GCC emits for the
   kernels, EMB=0) or as the instruction's own {1to16} memory operand (EMB=1), R accumulator chains, one
   thread, operands in L1: int8 dot instructions per ns. Built by panel_calls.sh. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#ifndef R
#define R 8
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static inline __m512i bc(const void*p){int32_t v;memcpy(&v,p,4);return _mm512_set1_epi32(v);}
static inline __m512i dpb_emb(__m512i acc, __m512i u, const void*p){
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t*)p)); return acc;}
uint8_t W[64*64*16] __attribute__((aligned(64)));
int8_t X[R*4096] __attribute__((aligned(64)));
__attribute__((noinline)) void run(long nb, const uint8_t*Wp, const int8_t*xb, long stride, int32_t*out){
  __m512i S[R]; for(int r=0;r<R;r++)S[r]=_mm512_setzero_si512();
  const __m512i m4=_mm512_set1_epi8(15);
  for(long b=0;b<nb;b++){
    const uint8_t*wp=Wp+512*(b&31); const int8_t*xp=xb+32*(b&63);
    #pragma GCC unroll 8
    for(int c=0;c<8;c++){
      __m512i raw=_mm512_load_si512(wp+64*c);
#if UNPACK
      __m512i w=_mm512_and_si512(_mm512_srli_epi16(raw,4),m4);
#else
      __m512i w=raw;
#endif
      #pragma GCC unroll 16
      for(int r=0;r<R;r++){
#if EMB
        S[r]=dpb_emb(S[r],w,xp+r*stride+4*c);
#else
        S[r]=_mm512_dpbusd_epi32(S[r],w,bc(xp+r*stride+4*c));
#endif
      }
    }
  }
  __m512i a=S[0]; for(int r=1;r<R;r++)a=_mm512_add_epi32(a,S[r]); _mm512_storeu_si512(out,a);
}
int main(){
  memset(W,3,sizeof W); memset(X,1,sizeof X); int32_t o[16];
  long nb=20000000/(8*R);
  run(nb/10,W,X,4096,o);
  double t0=now(); run(nb,W,X,4096,o); double t=now()-t0;
  printf("R=%d EMB=%d UNPACK=%d: %.2f dpbusd/ns\n",R,EMB,UNPACK,nb*8.0*R/t/1e9);
}
