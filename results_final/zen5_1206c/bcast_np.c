/* Dot instructions per ns of R rows x NP weight vectors of vpdpbusd chains, one thread, operands in L1
   (kernel_experiments.sh): the activation word broadcast from memory per (row, chunk) as the kernels
   do (MODE 0), taken from a 128-bit load by an in-register shuffle (MODE 1), or not loaded at all
   (MODE 2: a constant). Weights unpacked from nibbles (shift + and) as Q4_K's high half. */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#ifndef R
#define R 8
#endif
#ifndef NP
#define NP 1
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
uint8_t W[64*64*16*2] __attribute__((aligned(64)));
int8_t X[R*4160] __attribute__((aligned(64)));
__attribute__((noinline)) void run(long nb, const uint8_t*Wp, const int8_t*xb, long stride, int32_t*out){
  __m512i S[NP][R]; for(int h=0;h<NP;h++)for(int r=0;r<R;r++)S[h][r]=_mm512_setzero_si512();
  const __m512i m4=_mm512_set1_epi8(15);
  for(long b=0;b<nb;b++){
    const uint8_t*wp=Wp+1024*(b&15); const int8_t*xp=xb+64*(b&31);
#if MODE==1
    __m512i xq[R][4];
    for(int r=0;r<R;r++) for(int q=0;q<4;q++) xq[r][q]=_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xp+r*stride+16*q)));
#endif
    #pragma GCC unroll 16
    for(int c=0;c<16;c++){
      __m512i w[NP];
      for(int h=0;h<NP;h++){__m512i raw=_mm512_load_si512(wp+64*(NP*c+h)); w[h]=_mm512_and_si512(_mm512_srli_epi16(raw,4),m4);}
      #pragma GCC unroll 16
      for(int r=0;r<R;r++){
#if MODE==0
        int32_t v; memcpy(&v,xp+r*stride+4*c,4); __m512i x=_mm512_set1_epi32(v);
#elif MODE==1
        __m512i x=_mm512_shuffle_epi32(xq[r][c/4], (_MM_PERM_ENUM)((c%4)*0x55));
#else
        __m512i x=_mm512_set1_epi32(r+1);
#endif
        for(int h=0;h<NP;h++) S[h][r]=_mm512_dpbusd_epi32(S[h][r],w[h],x);
      }
    }
  }
  __m512i a=S[0][0]; for(int h=0;h<NP;h++)for(int r=0;r<R;r++)a=_mm512_add_epi32(a,S[h][r]); _mm512_storeu_si512(out,a);
}
int main(){
  memset(W,3,sizeof W); memset(X,1,sizeof X); int32_t o[16];
  long nb=20000000/(16*R*NP);
  run(nb/10,W,X,4160,o);
  double best=1e9; for(int k=0;k<3;k++){double t0=now(); run(nb,W,X,4160,o); double t=now()-t0; if(t<best)best=t;}
  printf("MODE=%d NP=%d R=%d: %.2f dpbusd/ns\n",MODE,NP,R,nb*16.0*R*NP/best/1e9);
}
