/* An independent computation of prefix keys, written from the definition in storage/README.md
 * ("Prefix keys") against libxxhash alone, sharing no code with storage/prefix_index.cc.
 * storage_test (PrefixHasher.MatchesTheIndependentProgram) runs it and compares its keys with
 * PrefixHasher's, the README's worked example included.
 *
 * Usage: prefix_key_reference B model_id profile tenant_salt < tokens
 * tokens: decimal unsigned 32-bit token ids separated by white space.
 * Prints key_0, key_1 .. key_floor(n/B), one lower-case hex key (32 digits) per line. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#define PREFIX_HASH_SEED 0x6B76736861646531ULL /* "kvshade1" read as a big-endian u64 */

struct buf {
  unsigned char* p;
  size_t n, cap;
};

static void put(struct buf* b, const void* data, size_t n) {
  if (b->n + n > b->cap) {
    b->cap = (b->n + n) * 2 + 64;
    b->p = realloc(b->p, b->cap);
    if (b->p == NULL) {
      perror("realloc");
      exit(2);
    }
  }
  memcpy(b->p + b->n, data, n);
  b->n += n;
}

static void put_u32le(struct buf* b, uint32_t v) {
  unsigned char x[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                        (unsigned char)(v >> 24)};
  put(b, x, 4);
}

static void put_field(struct buf* b, const char* s) {
  put_u32le(b, (uint32_t)strlen(s));
  put(b, s, strlen(s));
}

/* canonical(k): the high 64 bits big-endian, then the low 64 bits big-endian. */
static void canonical(XXH128_hash_t h, unsigned char out[16]) {
  for (int i = 0; i < 8; ++i) {
    out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
    out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
  }
}

static void print_key(const unsigned char k[16]) {
  for (int i = 0; i < 16; ++i) printf("%02x", k[i]);
  printf("\n");
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s B model_id profile tenant_salt < tokens\n", argv[0]);
    return 2;
  }
  const unsigned long block = strtoul(argv[1], NULL, 10);
  if (block == 0) {
    fprintf(stderr, "B must be positive\n");
    return 2;
  }
  struct buf scope = {0};
  put(&scope, "kvshade.prefix.v1", 17);
  put_u32le(&scope, (uint32_t)block);
  put_field(&scope, argv[2]);
  put_field(&scope, argv[3]);
  put_field(&scope, argv[4]);

  unsigned char key[16];
  canonical(XXH3_128bits_withSeed(scope.p, scope.n, PREFIX_HASH_SEED), key);
  print_key(key);

  struct buf step = {0};
  unsigned long long token;
  unsigned long in_block = 0;
  put(&step, key, 16);
  while (scanf("%llu", &token) == 1) {
    if (token > 0xFFFFFFFFULL) {
      fprintf(stderr, "token %llu is not a u32\n", token);
      return 2;
    }
    put_u32le(&step, (uint32_t)token);
    if (++in_block == block) {
      canonical(XXH3_128bits_withSeed(step.p, step.n, PREFIX_HASH_SEED), key);
      print_key(key);
      step.n = 0;
      put(&step, key, 16);
      in_block = 0;
    }
  }
  free(scope.p);
  free(step.p);
  return 0;
}
