/* C ABI test: compiled as C (no C++ anywhere), linked against libkvshade.so, run against a
 * real kvshade-server at $KVSHADE_TARGET (tests/python/run_with_server.py starts it).
 * Covers connect/health, create + ingest (exact) + get_session, attach, static set (values
 * come back bit-identical), attend against attention over the static set, select, append,
 * stats, the recall guard's figures (kvshade_get_session_selection), segment ends
 * (kvshade_create_session_ex: a second prompt reuses the first's document), per-device
 * statistics (kvshade_get_device_stats; with $KVSHADE_TEST_DEVICES the daemon has that many
 * CPU devices: `run_with_server.py --backend cpu:0,cpu:1`), a tensor-parallel session of two
 * ranks (kvshade_create_session_tp, kvshade_get_tensor_parallel_shards, the tp_* fields; on
 * the last device, or one rank per device with two), the error contract
 * (codes and messages, NULL arguments), and the UCX options and status: with
 * $KVSHADE_UCX_TRANSPORTS set the server offers a UCX data plane (started with
 * `run_with_server.py --ucx ...`) and a use_ucx client must connect with no fallback;
 * without it, a use_ucx client must fall back to gRPC, counted. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvshade/kvshade.h"

static int failures = 0;
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, kvshade_last_error());                                         \
      ++failures;                                                                   \
    }                                                                               \
  } while (0)
#define REQUIRE_OK(expr)                                                             \
  do {                                                                               \
    int rc_ = (expr);                                                                \
    if (rc_ != KVSHADE_OK) {                                                         \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr,            \
              kvshade_code_name(rc_), kvshade_last_error());                         \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

enum { L = 2, HQ = 4, H = 2, D = 16, N = 96 };


static float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t rng_state;
static uint16_t rand_bf16(void) {
  /* xorshift32; values in [-2, 2) rounded to bf16 by truncation (exact in bf16) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 17;
  rng_state ^= rng_state << 5;
  float f = ((float)(rng_state >> 8) / (float)(1u << 24)) * 4.0f - 2.0f;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

/* Segment ends: a prompt of DOC + 300 tokens cut at DOC (a prefix block); a second prompt with
 * the same document and another question reuses the document. Bad ends create nothing. */
enum { DOC = 256, QN = DOC + 300 };
static int check_segment_ends(kvshade_client* c, const kvshade_model* base, const kvshade_profile* p) {
  kvshade_model m = *base;
  m.model_id = "capi-test-ends";
  static int32_t tokens[QN];
  static uint16_t k[L][QN * H * D], v[L][QN * H * D];
  for (int i = 0; i < QN; ++i) tokens[i] = (int32_t)(rng_state % 1000) + i;
  for (int l = 0; l < L; ++l) {
    for (int i = 0; i < QN * H * D; ++i) {
      k[l][i] = rand_bf16();
      v[l][i] = rand_bf16();
    }
  }
  const uint64_t doc_end[1] = {DOC};
  kvshade_session_created sc;
  /* Refused: not a multiple of 256, too many, NULL with a count. */
  const uint64_t odd[1] = {200};
  CHECK(kvshade_create_session_ex(c, &m, p, tokens, QN, 0, "ends", odd, 1, NULL, &sc) == KVSHADE_INVALID_ARGUMENT);
  CHECK(strstr(kvshade_last_error(), "segment_ends") != NULL);
  const uint64_t many[KVSHADE_MAX_SEGMENT_ENDS + 1] = {0};
  CHECK(kvshade_create_session_ex(c, &m, p, tokens, QN, 0, "ends", many, KVSHADE_MAX_SEGMENT_ENDS + 1, NULL, &sc) ==
        KVSHADE_INVALID_ARGUMENT);
  CHECK(kvshade_create_session_ex(c, &m, p, tokens, QN, 0, "ends", NULL, 1, NULL, &sc) == KVSHADE_INVALID_ARGUMENT);
  uint64_t reusable = 1, segments = 1;
  REQUIRE_OK(kvshade_lookup_prefix(c, &m, p, tokens, QN, &reusable, &segments));
  CHECK(reusable == 0 && segments == 0);

  REQUIRE_OK(kvshade_create_session_ex(c, &m, p, tokens, QN, 0, "ends", doc_end, 1, NULL, &sc));
  CHECK(sc.reused_tokens == 0 && sc.tokens_to_ingest == QN);
  CHECK(sc.n_segment_ends == 1 && sc.segment_ends[0] == DOC && sc.automatic_segment_end == 0);
  kvshade_ingest* ing = NULL;
  REQUIRE_OK(kvshade_ingest_begin(c, sc.session_id, &ing));
  for (int l = 0; l < L; ++l) {
    REQUIRE_OK(kvshade_ingest_layer(ing, (uint32_t)l, KVSHADE_DTYPE_BF16, QN, H, D, k[l], v[l], NULL, 0, 0));
  }
  REQUIRE_OK(kvshade_ingest_commit(ing, NULL));
  kvshade_ingest_free(ing);
  REQUIRE_OK(kvshade_lookup_prefix(c, &m, p, tokens, QN, &reusable, &segments));
  CHECK(reusable == QN && segments == 2);

  for (int i = DOC; i < QN; ++i) tokens[i] += 5000;  /* another question */
  kvshade_session_created sq;
  REQUIRE_OK(kvshade_create_session_ex(c, &m, p, tokens, QN, 0, "ends", doc_end, 1, NULL, &sq));
  CHECK(sq.reused_tokens == DOC && sq.tokens_to_ingest == QN - DOC);
  CHECK(sq.n_segment_ends == 0);  /* the document's end is a boundary already */
  REQUIRE_OK(kvshade_close_session(c, sq.session_id));
  REQUIRE_OK(kvshade_close_session(c, sc.session_id));
  return 0;
}

/* Per-device statistics (kvshade_get_device_stats): NULL arguments refused, the count alone,
 * a buffer with room for one (the count of all, nothing written past it), each device's
 * figures against kvshade_get_stats' sums, and a session placed on the last device counted
 * there and nowhere else. $KVSHADE_TEST_DEVICES: the devices of the daemon
 * (run_with_server.py --backend); 1 when unset. */
enum { MAX_TEST_DEVICES = 4 };
static int test_device_stats(kvshade_client* c, const kvshade_model* m, const kvshade_profile* p,
                             const int32_t* tokens) {
  const char* env = getenv("KVSHADE_TEST_DEVICES");
  const size_t want = env != NULL ? (size_t)atoi(env) : 1;
  CHECK(want >= 1 && want <= MAX_TEST_DEVICES);
  size_t count = 99;
  CHECK(kvshade_get_device_stats(NULL, NULL, 0, &count) == KVSHADE_INVALID_ARGUMENT);
  CHECK(kvshade_get_device_stats(c, NULL, 0, NULL) == KVSHADE_INVALID_ARGUMENT);
  CHECK(kvshade_get_device_stats(c, NULL, 1, &count) == KVSHADE_INVALID_ARGUMENT);
  REQUIRE_OK(kvshade_get_device_stats(c, NULL, 0, &count));
  CHECK(count == want);
  kvshade_device_stats before[MAX_TEST_DEVICES + 1];
  memset(before, 0xAB, sizeof(before));
  REQUIRE_OK(kvshade_get_device_stats(c, before, 1, &count));
  CHECK(count == want);
  CHECK(strlen(before[0].device) > 0);
  CHECK(((const unsigned char*)&before[1])[0] == 0xAB); /* room for one: one written */
  REQUIRE_OK(kvshade_get_device_stats(c, before, MAX_TEST_DEVICES + 1, &count));
  CHECK(count == want);
  if (count != want) return 1;
  const char* last = before[count - 1].device;
  if (want > 1) {
    char name[16];
    for (size_t i = 0; i < count; ++i) {
      snprintf(name, sizeof(name), "cpu:%zu", i);
      CHECK(strcmp(before[i].device, name) == 0); /* the backend list's order */
    }
  }

  kvshade_model dm = *m;
  dm.model_id = "capi-device-stats";
  kvshade_session_created sc;
  REQUIRE_OK(kvshade_create_session_on(c, &dm, p, tokens, N, 0, "capi-dev", last, &sc));
  CHECK(strcmp(sc.device, last) == 0);
  kvshade_device_stats after[MAX_TEST_DEVICES];
  REQUIRE_OK(kvshade_get_device_stats(c, after, MAX_TEST_DEVICES, &count));
  kvshade_stats st;
  REQUIRE_OK(kvshade_get_stats(c, &st));
  CHECK(count == want);
  uint64_t sessions = 0, attachments = 0, segments = 0, dev_used = 0, host_used = 0, host_budget = 0,
           spilled = 0, lookups = 0, hits = 0, selected = 0, chunk_hits = 0;
  for (size_t i = 0; i < count && i < MAX_TEST_DEVICES; ++i) {
    const kvshade_device_stats* a = &after[i];
    const kvshade_device_stats* b = &before[i];
    const uint64_t here = i + 1 == count ? 1 : 0;
    CHECK(strcmp(a->device, b->device) == 0);
    CHECK(a->sessions == b->sessions + here);      /* the new session is on `last` alone */
    CHECK(a->prefix_lookups == b->prefix_lookups + here); /* its create looked up a prefix there */
    CHECK(a->prefix_hits == b->prefix_hits);
    CHECK(a->device_bytes_budget == st.device_bytes_budget); /* each device's */
    CHECK(a->device_bytes_used <= a->device_bytes_budget);
    if (strcmp(st.backend, "cpu") == 0) CHECK(a->pci_bus_id[0] == '\0');
    sessions += a->sessions;
    attachments += a->attachments;
    segments += a->segments;
    dev_used += a->device_bytes_used;
    host_used += a->host_bytes_used;
    host_budget += a->host_bytes_budget;
    spilled += a->spilled_bytes;
    lookups += a->prefix_lookups;
    hits += a->prefix_hits;
    selected += a->chunks_selected;
    chunk_hits += a->chunk_hits;
  }
  /* kvshade_get_stats' figures are the devices' sums (its host budget the daemon's). */
  CHECK(sessions == st.sessions && attachments == st.attachments && segments == st.segments);
  CHECK(dev_used == st.device_bytes_used && host_used == st.host_bytes_used && spilled == st.spilled_bytes);
  CHECK(lookups == st.prefix_lookups && hits == st.prefix_hits);
  CHECK(selected == st.chunks_selected && chunk_hits == st.chunk_hits);
  CHECK(host_budget <= st.host_bytes_budget && host_budget > st.host_bytes_budget / 2);
  fprintf(stderr, "device stats: %zu device(s), a session placed on %s\n", count, last);
  REQUIRE_OK(kvshade_close_session(c, sc.session_id));
  return 0;
}

/* A tensor-parallel session of two ranks, one KV head each (the first rank's on the daemon's
 * first device, the second's on its last): create and join, the created and info fields, the
 * shards, a range that overlaps refused, ingest of a rank's head, close of the whole. */
static int test_tensor_parallel(kvshade_client* c, const kvshade_model* m, const int32_t* tokens,
                                const char* first, const char* last) {
  kvshade_model tm = *m;
  tm.model_id = "capi-tp";
  kvshade_profile ex;
  kvshade_profile_init(&ex);
  ex.kind = KVSHADE_PROFILE_EXACT;
  kvshade_tensor_parallel tp;
  memset(&tp, 0, sizeof(tp));
  tp.ranks = 2;
  tp.rank = 0;
  tp.kv_head_begin = 0;
  tp.kv_head_end = 1;
  kvshade_session_created r0, r1;
  REQUIRE_OK(kvshade_create_session_tp(c, &tm, &ex, tokens, N, 0, "capi-tp", NULL, 0, first, &tp, &r0));
  CHECK(r0.tp_ranks == 2 && r0.tp_rank == 0 && r0.tp_ranks_joined == 1);
  CHECK(strlen(r0.tp_session_id) > 0 && strcmp(r0.tp_session_id, r0.session_id) != 0);
  CHECK(strcmp(r0.device, first) == 0);
  snprintf(tp.session_id, sizeof(tp.session_id), "%s", r0.tp_session_id);
  tp.rank = 1;
  tp.kv_head_begin = 0; /* rank 0's head too: none left for rank 0 */
  tp.kv_head_end = 2;
  CHECK(kvshade_create_session_tp(c, &tm, &ex, tokens, N, 0, "capi-tp", NULL, 0, last, &tp, &r1) ==
        KVSHADE_INVALID_ARGUMENT);
  CHECK(strstr(kvshade_last_error(), "fewer than one KV head") != NULL);
  tp.kv_head_begin = 1;
  REQUIRE_OK(kvshade_create_session_tp(c, &tm, &ex, tokens, N, 0, "capi-tp", NULL, 0, last, &tp, &r1));
  CHECK(r1.tp_rank == 1 && r1.tp_ranks_joined == 2 && strcmp(r1.tp_session_id, r0.tp_session_id) == 0);
  /* Each rank ingests its head: K/V [N, 1, D]. */
  static uint16_t k[N * D], v[N * D];
  for (size_t i = 0; i < (size_t)N * D; ++i) {
    k[i] = rand_bf16();
    v[i] = rand_bf16();
  }
  for (int r = 0; r < 2; ++r) {
    kvshade_ingest* ing = NULL;
    REQUIRE_OK(kvshade_ingest_begin(c, r == 0 ? r0.session_id : r1.session_id, &ing));
    for (int l = 0; l < L; ++l) {
      REQUIRE_OK(kvshade_ingest_layer(ing, (uint32_t)l, KVSHADE_DTYPE_BF16, N, 1, D, k, v, NULL, 0, 0));
    }
    uint64_t committed = 0;
    REQUIRE_OK(kvshade_ingest_commit(ing, &committed));
    kvshade_ingest_free(ing);
  }
  kvshade_session_info info;
  REQUIRE_OK(kvshade_get_session(c, r0.tp_session_id, &info));
  CHECK(strcmp(info.state, "ready") == 0 && info.tokens == N);
  CHECK(strcmp(info.tp_session_id, r0.tp_session_id) == 0 && info.tp_ranks == 2 && info.tp_ranks_joined == 2);
  CHECK(info.tp_kv_head_begin == 0 && info.tp_kv_head_end == H && info.tp_num_kv_heads == H);
  REQUIRE_OK(kvshade_get_session(c, r1.session_id, &info));
  CHECK(info.tp_rank == 1 && info.tp_kv_head_begin == 1 && info.tp_kv_head_end == 2);
  CHECK(strcmp(info.device, last) == 0);
  size_t n = 0;
  CHECK(kvshade_get_tensor_parallel_shards(c, r0.tp_session_id, NULL, 1, &n) == KVSHADE_INVALID_ARGUMENT);
  REQUIRE_OK(kvshade_get_tensor_parallel_shards(c, r0.tp_session_id, NULL, 0, &n));
  CHECK(n == 2);
  kvshade_tensor_parallel_shard shards[2];
  REQUIRE_OK(kvshade_get_tensor_parallel_shards(c, r0.tp_session_id, shards, 2, &n));
  CHECK(strcmp(shards[0].session_id, r0.session_id) == 0 && strcmp(shards[1].session_id, r1.session_id) == 0);
  CHECK(strcmp(shards[1].device, last) == 0 && shards[1].kv_head_begin == 1 && shards[1].tokens == N);
  CHECK(kvshade_get_tensor_parallel_shards(c, r0.session_id, shards, 2, &n) == KVSHADE_INVALID_ARGUMENT);
  CHECK(kvshade_close_session(c, r0.session_id) == KVSHADE_FAILED_PRECONDITION);
  REQUIRE_OK(kvshade_close_session(c, r0.tp_session_id));
  CHECK(kvshade_get_session(c, r1.session_id, &info) == KVSHADE_NOT_FOUND);
  return 0;
}

int main(void) {
  const char* target = getenv("KVSHADE_TARGET");
  if (target == NULL) {
    fprintf(stderr, "KVSHADE_TARGET not set\n");
    return 2;
  }
  rng_state = (uint32_t)time(NULL) | 1u;
  fprintf(stderr, "seed %u\n", rng_state);
  CHECK(kvshade_abi_version() == KVSHADE_ABI_VERSION);
  CHECK(strcmp(kvshade_code_name(KVSHADE_NOT_FOUND), "NOT_FOUND") == 0);
  CHECK(strcmp(kvshade_code_name(99), "UNKNOWN") == 0);

  /* NULL arguments are errors, not crashes. */
  CHECK(kvshade_connect(NULL, NULL) == KVSHADE_INVALID_ARGUMENT);
  CHECK(strlen(kvshade_last_error()) > 0);
  CHECK(kvshade_health(NULL, NULL) == KVSHADE_INVALID_ARGUMENT);

  kvshade_client_options o;
  kvshade_client_options_init(&o);
  o.target = target;
  o.timeout_ms = 30000;
  kvshade_client* c = NULL;
  REQUIRE_OK(kvshade_connect(&o, &c));
  REQUIRE_OK(kvshade_wait_ready(c, 20000));
  int32_t serving = 0;
  REQUIRE_OK(kvshade_health(c, &serving));
  CHECK(serving == 1);

  kvshade_model m;
  kvshade_model_init(&m);
  m.model_id = "capi-test";
  m.num_layers = L;
  m.num_query_heads = HQ;
  m.num_kv_heads = H;
  m.head_dim = D;
  kvshade_profile p;
  kvshade_profile_init(&p);
  p.kind = KVSHADE_PROFILE_EXACT;

  int32_t tokens[N];
  for (int i = 0; i < N; ++i) tokens[i] = (int32_t)(rng_state % 1000) + i;
  kvshade_session_created created;
  REQUIRE_OK(kvshade_create_session(c, &m, &p, tokens, N, 0, "capi", &created));
  CHECK(created.tokens_to_ingest == N);
  CHECK(created.effective_profile == KVSHADE_PROFILE_EXACT);
  CHECK(strlen(created.device) > 0); /* the daemon's one device: "cpu" (or "cuda") */
  {
    /* A device the daemon does not serve is refused, and nothing is created. */
    kvshade_session_created none;
    CHECK(kvshade_create_session_on(c, &m, &p, tokens, N, 0, "capi", "cpu:7", &none) ==
          KVSHADE_INVALID_ARGUMENT);
    CHECK(strstr(kvshade_last_error(), "is not one of this daemon's devices") != NULL);
    uint64_t reusable = 1;
    CHECK(kvshade_lookup_prefix_on(c, &m, &p, tokens, N, "cpu:7", &reusable, NULL) ==
          KVSHADE_INVALID_ARGUMENT);
  }

  static uint16_t k[L][N * H * D], v[L][N * H * D];
  for (int l = 0; l < L; ++l) {
    for (int i = 0; i < N * H * D; ++i) {
      k[l][i] = rand_bf16();
      v[l][i] = rand_bf16();
    }
  }
  kvshade_ingest* ing = NULL;
  REQUIRE_OK(kvshade_ingest_begin(c, created.session_id, &ing));
  CHECK(kvshade_ingest_layer(ing, 0, KVSHADE_DTYPE_BF16, N, H, D, NULL, v[0], NULL, 0, 0) ==
        KVSHADE_INVALID_ARGUMENT);
  for (int l = 0; l < L; ++l) REQUIRE_OK(kvshade_ingest_layer(ing, (uint32_t)l, KVSHADE_DTYPE_BF16, N, H, D, k[l], v[l], NULL, 0, 0));
  uint64_t committed = 0;
  REQUIRE_OK(kvshade_ingest_commit(ing, &committed));
  CHECK(committed == N);
  CHECK(kvshade_ingest_commit(ing, NULL) == KVSHADE_FAILED_PRECONDITION);
  kvshade_ingest_free(ing);

  kvshade_session_info info;
  REQUIRE_OK(kvshade_get_session(c, created.session_id, &info));
  CHECK(strcmp(info.state, "ready") == 0);
  CHECK(info.tokens == N);
  CHECK(strcmp(info.device, created.device) == 0);
  {
    /* Attach naming the session's own device is served; another device is refused. */
    kvshade_attach_options dao;
    kvshade_attach_options_init(&dao);
    dao.session_id = created.session_id;
    dao.device = "cpu:7";
    kvshade_attachment datt;
    CHECK(kvshade_attach_ex(c, &dao, &datt) == KVSHADE_INVALID_ARGUMENT);
    dao.device = created.device;
    REQUIRE_OK(kvshade_attach_ex(c, &dao, &datt));
    REQUIRE_OK(kvshade_detach(c, datt.attachment_id));
  }

  /* The same K/V in parts, each chunk's part of every layer in turn (a chunked prefill),
   * into a session of another model id (no prefix reuse): committed whole. A last_part on
   * a part that does not complete its layer, and obs without last_part, are refused. */
  {
    kvshade_model pm = m;
    pm.model_id = "capi-test-parts";
    kvshade_session_created pc;
    REQUIRE_OK(kvshade_create_session(c, &pm, &p, tokens, N, 0, "capi-parts", &pc));
    kvshade_ingest* pi = NULL;
    REQUIRE_OK(kvshade_ingest_begin(c, pc.session_id, &pi));
    const int64_t cut = N / 3;
    CHECK(kvshade_ingest_layer_part(pi, 0, 0, 0, KVSHADE_DTYPE_BF16, cut, H, D, k[0], v[0], v[0], 1, HQ) ==
          KVSHADE_INVALID_ARGUMENT);
    for (int l = 0; l < L; ++l) {
      REQUIRE_OK(kvshade_ingest_layer_part(pi, (uint32_t)l, 0, 0, KVSHADE_DTYPE_BF16, cut, H, D, k[l], v[l], NULL,
                                           0, 0));
    }
    for (int l = 0; l < L; ++l) {
      REQUIRE_OK(kvshade_ingest_layer_part(pi, (uint32_t)l, (uint64_t)cut, 1, KVSHADE_DTYPE_BF16, N - cut, H, D,
                                           k[l] + cut * H * D, v[l] + cut * H * D, NULL, 0, 0));
    }
    uint64_t got = 0;
    REQUIRE_OK(kvshade_ingest_commit(pi, &got));
    CHECK(got == N);
    kvshade_ingest_free(pi);
    kvshade_session_info pinfo;
    REQUIRE_OK(kvshade_get_session(c, pc.session_id, &pinfo));
    CHECK(strcmp(pinfo.state, "ready") == 0 && pinfo.tokens == N);
    REQUIRE_OK(kvshade_close_session(c, pc.session_id));

    REQUIRE_OK(kvshade_create_session(c, &pm, &p, tokens, N, 0, "capi-parts", &pc));
    REQUIRE_OK(kvshade_ingest_begin(c, pc.session_id, &pi));
    /* The daemon's refusal may come with the part or, over a stream, at the commit. */
    const int early = kvshade_ingest_layer_part(pi, 0, 0, 1, KVSHADE_DTYPE_BF16, cut, H, D, k[0], v[0], NULL, 0, 0);
    CHECK(early != KVSHADE_OK || kvshade_ingest_commit(pi, NULL) == KVSHADE_INVALID_ARGUMENT);
    kvshade_ingest_free(pi);
    REQUIRE_OK(kvshade_close_session(c, pc.session_id));
  }
  CHECK(strcmp(info.model_id, "capi-test") == 0);
  CHECK(strcmp(info.label, "capi") == 0);
  if (check_segment_ends(c, &m, &p) != 0) return 1;

  kvshade_attachment att;
  REQUIRE_OK(kvshade_attach(c, created.session_id, "capi-worker", 0, 0, &att));
  CHECK(strlen(att.attachment_id) > 0);
  CHECK(att.delivery == KVSHADE_DELIVERY_INLINE);

  /* UCX: a plain client never connects; a use_ucx client connects when the daemon offers
   * a data plane, and otherwise falls back (counted). Select works either way. */
  const char* ucx_tls = getenv("KVSHADE_UCX_TRANSPORTS");
  const int expect_ucx = ucx_tls != NULL && *ucx_tls;
  int32_t connected = -1;
  uint64_t fallbacks = 99;
  CHECK(kvshade_ucx_status(NULL, &connected, &fallbacks) == KVSHADE_INVALID_ARGUMENT);
  REQUIRE_OK(kvshade_ucx_status(c, &connected, &fallbacks));
  CHECK(connected == 0 && fallbacks == 0);
  CHECK(att.data_plane == expect_ucx);
  {
    kvshade_client_options uo = o;
    uo.use_ucx = 1;
    uo.ucx_transports = expect_ucx ? ucx_tls : NULL;
    kvshade_client* cu = NULL;
    REQUIRE_OK(kvshade_connect(&uo, &cu));
    kvshade_attachment att_u;
    REQUIRE_OK(kvshade_attach(cu, created.session_id, "capi-ucx-worker", 0, 0, &att_u));
    REQUIRE_OK(kvshade_ucx_status(cu, &connected, NULL));
    REQUIRE_OK(kvshade_ucx_status(cu, NULL, &fallbacks));
    fprintf(stderr, "use_ucx client: connected %d, fallbacks %llu\n", connected, (unsigned long long)fallbacks);
    CHECK(connected == expect_ucx);
    CHECK(fallbacks == (uint64_t)(expect_ucx ? 0 : 1));
    uint16_t qz[HQ * D];
    for (int i = 0; i < HQ * D; ++i) qz[i] = rand_bf16();
    const char* uid[1] = {att_u.attachment_id};
    kvshade_select_result* su = NULL;
    REQUIRE_OK(kvshade_select(cu, 0, 1, uid, KVSHADE_DTYPE_BF16, HQ, D, qz, &su));
    CHECK(kvshade_select_count(su) == 1);
    kvshade_select_free(su);
    REQUIRE_OK(kvshade_ucx_status(cu, &connected, &fallbacks));
    CHECK(connected == expect_ucx && fallbacks == (uint64_t)(expect_ucx ? 0 : 1));
    REQUIRE_OK(kvshade_detach(cu, att_u.attachment_id));
    kvshade_client_free(cu);
  }

  /* exact: every token is in the tail, values bit-identical to what went in. */
  kvshade_static_set* st = NULL;
  REQUIRE_OK(kvshade_get_static_set(c, att.attachment_id, 1, &st));
  int64_t sh = 0, smax = 0, sd = 0, st_t = 0;
  kvshade_static_set_shape(st, &sh, &smax, &sd, &st_t);
  CHECK(st_t == N && sh == H && sd == D);
  const float *sk, *sv, *tk, *tv;
  const uint32_t* lens;
  kvshade_static_set_data(st, &sk, &sv, &lens, &tk, &tv);
  int v_mismatch = 0;
  for (int i = 0; i < N * H * D; ++i) v_mismatch += tv[i] != bf16_to_f32(v[1][i]);
  CHECK(v_mismatch == 0);
  /* The same rows as the server sent them: a bf16 session's, bit for bit, no conversion. */
  {
    int32_t rows_dtype = 0;
    const void *rk = NULL, *rv = NULL, *rtk = NULL, *rtv = NULL;
    kvshade_static_set_rows(st, &rows_dtype, &rk, &rv, &rtk, &rtv);
    CHECK(rows_dtype == KVSHADE_DTYPE_BF16);
    CHECK(rtv != NULL && memcmp(rtv, v[1], sizeof(uint16_t) * N * H * D) == 0);
    const uint16_t* rtk16 = (const uint16_t*)rtk;
    int k_mismatch = 0;
    for (int i = 0; i < N * H * D; ++i) k_mismatch += tk[i] != bf16_to_f32(rtk16[i]);
    CHECK(k_mismatch == 0);
  }
  /* Row t of the tail is token t. */
  const int64_t *spos = NULL, *tpos = NULL;
  kvshade_static_set_positions(st, &spos, &tpos);
  int pos_mismatch = 0;
  for (int t = 0; t < N; ++t) pos_mismatch += tpos[t] != t;
  CHECK(pos_mismatch == 0);

  /* attend == softmax(q K^T / sqrt(d)) V over the tail, per query head (GQA). */
  float q[HQ * D], out[HQ * D];
  uint16_t qb[HQ * D]; /* the model's dtype (bf16) goes on the wire */
  for (int i = 0; i < HQ * D; ++i) q[i] = bf16_to_f32(qb[i] = rand_bf16());
  const char* ids[1] = {att.attachment_id};
  REQUIRE_OK(kvshade_attend(c, 1, 1, ids, KVSHADE_DTYPE_BF16, HQ, D, qb, out));
  double max_err = 0;
  for (int hq = 0; hq < HQ; ++hq) {
    const int j = hq / (HQ / H);
    double logits[N], mx = -1e30, sum = 0;
    for (int t = 0; t < N; ++t) {
      double s = 0;
      for (int e = 0; e < D; ++e) s += (double)q[hq * D + e] * tk[(t * H + j) * D + e];
      logits[t] = s / sqrt((double)D);
      if (logits[t] > mx) mx = logits[t];
    }
    for (int t = 0; t < N; ++t) sum += (logits[t] = exp(logits[t] - mx));
    for (int e = 0; e < D; ++e) {
      double o_ref = 0;
      for (int t = 0; t < N; ++t) o_ref += logits[t] / sum * tv[(t * H + j) * D + e];
      const double err = fabs(o_ref - out[hq * D + e]);
      if (err > max_err) max_err = err;
    }
  }
  fprintf(stderr, "attend max abs error vs reference: %g\n", max_err);
  CHECK(max_err < 2e-3);
  kvshade_static_set_free(st);

  /* select on an exact session: one (empty) delta for the one query. */
  kvshade_select_result* sel = NULL;
  REQUIRE_OK(kvshade_select(c, 0, 1, ids, KVSHADE_DTYPE_BF16, HQ, D, qb, &sel));
  CHECK(kvshade_select_count(sel) == 1);
  kvshade_slot_delta delta;
  REQUIRE_OK(kvshade_select_delta(sel, 0, &delta));
  CHECK(strcmp(delta.attachment_id, att.attachment_id) == 0);
  CHECK(delta.m == 0);
  CHECK(kvshade_select_delta(sel, 1, &delta) == KVSHADE_OUT_OF_RANGE);
  {
    kvshade_slot_delta rd;
    int32_t rows_dtype = -1;
    const void *rk = &rd, *rv = &rd;
    REQUIRE_OK(kvshade_select_delta_rows(sel, 0, &rd, &rows_dtype, &rk, &rv));
    CHECK(rd.m == 0 && rows_dtype == 0 && rk == NULL && rv == NULL && rd.keys == NULL);
    CHECK(kvshade_select_delta_rows(sel, 1, &rd, &rows_dtype, &rk, &rv) == KVSHADE_OUT_OF_RANGE);
  }
  CHECK(delta.delivered == 0);
  kvshade_select_free(sel);

  /* Async: the same answers as the sync calls; several in flight; one wait each. */
  kvshade_select_future* sf = NULL;
  REQUIRE_OK(kvshade_select_async(c, 0, 1, ids, KVSHADE_DTYPE_BF16, HQ, D, qb, &sf));
  kvshade_attend_future* af[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; ++i) REQUIRE_OK(kvshade_attend_async(c, 1, 1, ids, KVSHADE_DTYPE_BF16, HQ, D, qb, &af[i]));
  REQUIRE_OK(kvshade_select_future_wait(sf, &sel));
  int32_t ready = 0;
  REQUIRE_OK(kvshade_select_future_ready(sf, &ready));
  CHECK(ready == 1);
  CHECK(kvshade_select_count(sel) == 1);
  kvshade_select_free(sel);
  CHECK(kvshade_select_future_wait(sf, &sel) == KVSHADE_FAILED_PRECONDITION);
  kvshade_select_future_free(sf);
  for (int i = 0; i < 3; ++i) {
    float out_async[HQ * D];
    REQUIRE_OK(kvshade_attend_future_wait(af[i], out_async));
    CHECK(memcmp(out_async, out, sizeof(out)) == 0);
    kvshade_attend_future_free(af[i]);
  }
  kvshade_select_future_free(NULL);
  CHECK(kvshade_select_async(c, 0, 0, ids, KVSHADE_DTYPE_BF16, HQ, D, qb, &sf) == KVSHADE_INVALID_ARGUMENT);
  {
    const char* bad_ids[1] = {"no-such-attachment"};
    REQUIRE_OK(kvshade_select_async(c, 0, 1, bad_ids, KVSHADE_DTYPE_BF16, HQ, D, qb, &sf));
    CHECK(kvshade_select_future_wait(sf, &sel) == KVSHADE_NOT_FOUND);
    kvshade_select_future_free(sf);
  }
  /* attach_ex validates the delivery mode; register needs a data plane. */
  kvshade_attach_options ao;
  kvshade_attach_options_init(&ao);
  ao.session_id = created.session_id;
  ao.delivery = 7;
  kvshade_attachment att_bad;
  CHECK(kvshade_attach_ex(c, &ao, &att_bad) == KVSHADE_INVALID_ARGUMENT);
  CHECK(kvshade_register_slot_buffers(c, att.attachment_id, NULL, NULL, 0) == KVSHADE_INVALID_ARGUMENT);
  {
    static uint16_t kb[64], vb[64];
    CHECK(kvshade_register_slot_buffers(c, att.attachment_id, kb, vb, sizeof(kb)) == KVSHADE_FAILED_PRECONDITION);
  }

  /* The recall guard's figures: none for a session without the guard; a shadow session
   * sampling every step has one record for the layer it selected, no fallback (report). */
  {
    kvshade_session_selection* gs = NULL;
    REQUIRE_OK(kvshade_get_session_selection(c, created.session_id, &gs));
    CHECK(kvshade_session_selection_count(gs) == 0);
    uint64_t gsamples = 99;
    double grecall = -1;
    kvshade_session_selection_summary(gs, &gsamples, &grecall);
    CHECK(gsamples == 0 && grecall == 0);
    kvshade_layer_selection ls;
    CHECK(kvshade_session_selection_layer(gs, 0, &ls) == KVSHADE_OUT_OF_RANGE);
    kvshade_session_selection_free(gs);
    kvshade_session_selection_free(NULL);
    gs = NULL;
    CHECK(kvshade_get_session_selection(c, "no-such-session", &gs) == KVSHADE_NOT_FOUND);
    CHECK(gs == NULL);
    CHECK(kvshade_get_session_selection(NULL, created.session_id, &gs) == KVSHADE_INVALID_ARGUMENT);
    CHECK(kvshade_get_session_selection(c, created.session_id, NULL) == KVSHADE_INVALID_ARGUMENT);

    kvshade_model gm = m;
    gm.model_id = "capi-test-guard";
    kvshade_profile gp;
    kvshade_profile_init(&gp);
    gp.kind = KVSHADE_PROFILE_SHADOW;
    gp.rank = 8;
    gp.chunk_size = 8;
    gp.sparse_budget = 1;
    gp.outliers = 0;
    gp.heavy_chunks = 0;
    gp.local_window = 16;
    gp.recall_sample_rate = 1;
    gp.recall_floor = 1;
    gp.recall_action = KVSHADE_RECALL_REPORT;
    kvshade_session_created gc;
    REQUIRE_OK(kvshade_create_session(c, &gm, &gp, tokens, N, 0, "capi-guard", &gc));
    CHECK(gc.effective_profile == KVSHADE_PROFILE_SHADOW);
    REQUIRE_OK(kvshade_ingest_begin(c, gc.session_id, &ing));
    for (int l = 0; l < L; ++l) REQUIRE_OK(kvshade_ingest_layer(ing, (uint32_t)l, KVSHADE_DTYPE_BF16, N, H, D, k[l], v[l], NULL, 0, 0));
    REQUIRE_OK(kvshade_ingest_commit(ing, NULL));
    kvshade_ingest_free(ing);
    kvshade_attachment ga;
    REQUIRE_OK(kvshade_attach(c, gc.session_id, "capi-guard", 0, 0, &ga));
    const char* gids[1] = {ga.attachment_id};
    for (int step = 0; step < 4; ++step) {
      uint16_t gq[HQ * D];
      for (int i = 0; i < HQ * D; ++i) gq[i] = rand_bf16();
      kvshade_select_result* gr = NULL;
      REQUIRE_OK(kvshade_select(c, 0, 1, gids, KVSHADE_DTYPE_BF16, HQ, D, gq, &gr));
      kvshade_select_free(gr);
    }
    REQUIRE_OK(kvshade_get_session_selection(c, gc.session_id, &gs));
    CHECK(kvshade_session_selection_count(gs) == 1);
    kvshade_session_selection_summary(gs, &gsamples, NULL);
    CHECK(gsamples == 4);
    REQUIRE_OK(kvshade_session_selection_layer(gs, 0, &ls));
    fprintf(stderr, "guard: layer %u samples %llu recall %g recent %g budget %u fallback %d actions %llu\n",
            ls.layer, (unsigned long long)ls.samples, ls.recall, ls.recent_recall, ls.budget, ls.fallback,
            (unsigned long long)ls.actions);
    CHECK(ls.layer == 0 && ls.samples == 4);
    CHECK(ls.recall >= 0 && ls.recall <= 1 && ls.recent_recall >= 0 && ls.recent_recall <= 1);
    CHECK(ls.fallback == 0 && ls.budget == 0);  /* report: counted, never a fallback */
    CHECK(ls.actions <= 1);
    kvshade_session_selection_free(gs);
    REQUIRE_OK(kvshade_detach(c, ga.attachment_id));
    REQUIRE_OK(kvshade_close_session(c, gc.session_id));

    /* Selection units (CPU daemons: the CUDA backend has no kernels for them yet): the
     * profile field, its echo, slots of units in the attachment, deltas of u rows per
     * miss; a unit that does not divide the chunk size is refused. */
    kvshade_profile up;
    kvshade_profile_init(&up);
    CHECK(up.selection_unit == KVSHADE_UNSET_U32);
    kvshade_stats ust;
    REQUIRE_OK(kvshade_get_stats(c, &ust));
    if (strcmp(ust.backend, "cpu") == 0) {
      up = gp;
      up.recall_sample_rate = 0;
      up.sparse_budget = 2;
      up.rerank_factor = 2;
      up.selection_unit = 3;
      kvshade_session_created uc;
      CHECK(kvshade_create_session(c, &gm, &up, tokens, N, 0, "capi-units", &uc) == KVSHADE_INVALID_ARGUMENT);
      up.selection_unit = 2;
      REQUIRE_OK(kvshade_create_session(c, &gm, &up, tokens, N, 0, "capi-units", &uc));
      REQUIRE_OK(kvshade_ingest_begin(c, uc.session_id, &ing));
      for (int l = 0; l < L; ++l) REQUIRE_OK(kvshade_ingest_layer(ing, (uint32_t)l, KVSHADE_DTYPE_BF16, N, H, D, k[l], v[l], NULL, 0, 0));
      REQUIRE_OK(kvshade_ingest_commit(ing, NULL));
      kvshade_ingest_free(ing);
      kvshade_session_info ui;
      REQUIRE_OK(kvshade_get_session(c, uc.session_id, &ui));
      CHECK(ui.selection_unit == 2);
      kvshade_attachment ua;
      REQUIRE_OK(kvshade_attach(c, uc.session_id, "capi-units", 0, 0, &ua));
      CHECK(ua.chunk_size == 8 && ua.slot_tokens == 2 && ua.slots_per_head == 8);
      const char* uids[1] = {ua.attachment_id};
      uint16_t uq[HQ * D];
      for (int i = 0; i < HQ * D; ++i) uq[i] = rand_bf16();
      kvshade_select_result* ur = NULL;
      REQUIRE_OK(kvshade_select(c, 0, 1, uids, KVSHADE_DTYPE_BF16, HQ, D, uq, &ur));
      kvshade_slot_delta ud;
      REQUIRE_OK(kvshade_select_delta(ur, 0, &ud));
      CHECK(ud.m == (uint64_t)H * 8 && ud.chunk_size == 2 && ud.head_dim == D);
      for (uint64_t i = 0; i < ud.m; ++i) CHECK(ud.position[i] == (int64_t)ud.chunk[i] * 2);
      fprintf(stderr, "selection units: %llu misses of %lld rows\n", (unsigned long long)ud.m,
              (long long)ud.chunk_size);
      kvshade_select_free(ur);
      REQUIRE_OK(kvshade_detach(c, ua.attachment_id));
      REQUIRE_OK(kvshade_close_session(c, uc.session_id));
    }
  }

  /* append two tokens for every layer ([L, t, h, d]). */
  static uint16_t ak[L * 2 * H * D], av[L * 2 * H * D];
  for (int i = 0; i < L * 2 * H * D; ++i) {
    ak[i] = rand_bf16();
    av[i] = rand_bf16();
  }
  int32_t new_tokens[2] = {7, 8};
  uint64_t after = 0;
  REQUIRE_OK(kvshade_append(c, created.session_id, NULL, new_tokens, 2, L, KVSHADE_DTYPE_BF16, H, D, ak, av, &after));
  CHECK(after == N + 2);

  /* Error contract: codes from the server, messages kept per thread. */
  CHECK(kvshade_get_session(c, "no-such-session", &info) == KVSHADE_NOT_FOUND);
  CHECK(strlen(kvshade_last_error()) > 0);
  CHECK(kvshade_append(c, created.session_id, NULL, new_tokens, 2, L, KVSHADE_DTYPE_BF16, H + 1, D, ak, av, &after) ==
        KVSHADE_INVALID_ARGUMENT);
  fprintf(stderr, "server said: %s\n", kvshade_last_error());
  CHECK(kvshade_attend(c, 1, 1, ids, 42, HQ, D, qb, out) == KVSHADE_INVALID_ARGUMENT);

  kvshade_stats stats;
  REQUIRE_OK(kvshade_get_stats(c, &stats));
  CHECK(stats.sessions >= 1);
  CHECK(strlen(stats.backend) > 0);
  if (test_device_stats(c, &m, &p, tokens) != 0) return 1;
  {
    kvshade_device_stats ds[MAX_TEST_DEVICES];
    size_t nd = 0;
    REQUIRE_OK(kvshade_get_device_stats(c, ds, MAX_TEST_DEVICES, &nd));
    if (test_tensor_parallel(c, &m, tokens, ds[0].device, ds[nd - 1].device) != 0) return 1;
  }

  REQUIRE_OK(kvshade_detach(c, att.attachment_id));
  CHECK(kvshade_detach(c, att.attachment_id) == KVSHADE_NOT_FOUND);
  REQUIRE_OK(kvshade_close_session(c, created.session_id));
  kvshade_client_free(c);
  kvshade_client_free(NULL);
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else fprintf(stderr, "capi_test: all checks passed\n");
  return failures ? 1 : 0;
}
