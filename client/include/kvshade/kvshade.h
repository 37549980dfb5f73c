/* The kvshade C ABI: a stable, C-only interface over the C++ client (libkvshade.so), for
 * runtimes that cannot link C++ (and for the ctypes-based Python package).
 *
 * Conventions
 * - Every call returns a kvshade_code (0 = KVSHADE_OK; the others are the gRPC / absl
 *   codes with the same numbers). On failure, kvshade_last_error() returns the message of
 *   the last failed call on the calling thread (valid until that thread's next call).
 * - Handles are opaque and owned by the caller: free each with its *_free function
 *   (passing NULL is allowed). A kvshade_client may be shared by threads; ingest writers and
 *   result handles belong to one thread at a time.
 * - Ids (sessions, attachments) are NUL-terminated strings of < KVSHADE_ID_CAP bytes.
 * - Tensors going in are row-major, shapes outer-to-inner, elements of the dtype named by
 *   the call (the model's dtype: KVSHADE_DTYPE_BF16 as raw uint16 bits, FP16, or FP32),
 *   host memory. Tensors coming out are always fp32, host memory, owned by the handle that
 *   returned them.
 * - Keys go in pre-RoPE; queries are post-RoPE; keys coming out are post-RoPE.
 * - No C++ types, no exceptions cross this boundary; nothing aborts on bad input.
 * - ABI: KVSHADE_ABI_VERSION changes when a struct layout or a signature changes;
 *   kvshade_abi_version() says which one the library implements.
 */
#ifndef KVSHADE_KVSHADE_H_
#define KVSHADE_KVSHADE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVSHADE_API __attribute__((visibility("default")))
#else
#define KVSHADE_API
#endif

#define KVSHADE_ABI_VERSION 13 /* 2: UCX options and status, attachment data-plane fields;
                                 3: profile selection options, ucx_busy_poll_us, slot delta
                                 fallback and tokens, the _ex decode calls;
                                 4: slot delta positions, static set positions, held
                                 staging (kvshade_new_tokens.hold, kvshade_commit_staged);
                                 5: kvshade_profile.key_signature_bits;
                                 6: kvshade_session_info.ingest_parts_taken;
                                 7: selection units: kvshade_profile.selection_unit,
                                 kvshade_attachment.slot_tokens,
                                 kvshade_session_info.selection_unit;
                                 8: segment ends: kvshade_create_session_ex,
                                 kvshade_session_created.segment_ends;
                                 9: devices: kvshade_session_created.device,
                                 kvshade_session_info.device,
                                 kvshade_attach_options.device,
                                 kvshade_create_session_on, kvshade_lookup_prefix_on;
                                 10: per-device statistics: kvshade_device_stats,
                                 kvshade_get_device_stats;
                                 11: tensor-parallel sessions: kvshade_tensor_parallel,
                                 kvshade_create_session_tp,
                                 kvshade_tensor_parallel_shard,
                                 kvshade_get_tensor_parallel_shards, the tp_* fields of
                                 kvshade_session_created and kvshade_session_info;
                                 12: prepared joins: kvshade_prepared_sequence,
                                 kvshade_local_decoder_prepare,
                                 kvshade_local_decoder_join_prepared;
                                 13: rows in the session's dtype:
                                 kvshade_select_delta_rows, kvshade_static_set_rows */
#define KVSHADE_ID_CAP 128
/* The most segment ends a CreateSession takes (docs/DESIGN.md "Segment ends"). */
#define KVSHADE_MAX_SEGMENT_ENDS 5
/* Bytes of a device name field ("cuda:1", "cpu:0"; docs/OPERATIONS.md "Devices"). */
#define KVSHADE_DEVICE_CAP 64

typedef enum kvshade_code {
  KVSHADE_OK = 0,
  KVSHADE_CANCELLED = 1,
  KVSHADE_UNKNOWN = 2,
  KVSHADE_INVALID_ARGUMENT = 3,
  KVSHADE_DEADLINE_EXCEEDED = 4,
  KVSHADE_NOT_FOUND = 5,
  KVSHADE_ALREADY_EXISTS = 6,
  KVSHADE_PERMISSION_DENIED = 7,
  KVSHADE_RESOURCE_EXHAUSTED = 8,
  KVSHADE_FAILED_PRECONDITION = 9,
  KVSHADE_ABORTED = 10,
  KVSHADE_OUT_OF_RANGE = 11,
  KVSHADE_UNIMPLEMENTED = 12,
  KVSHADE_INTERNAL = 13,
  KVSHADE_UNAVAILABLE = 14,
  KVSHADE_DATA_LOSS = 15,
  KVSHADE_UNAUTHENTICATED = 16
} kvshade_code;

/* Values of kvshade.v1.DType, ProfileKind, ValueCodec, RopeScaling, RopePairing. */
enum { KVSHADE_DTYPE_BF16 = 1, KVSHADE_DTYPE_FP16 = 2, KVSHADE_DTYPE_FP32 = 3 };
enum {
  KVSHADE_PROFILE_AUTO = 1,
  KVSHADE_PROFILE_SHADOW = 2,
  KVSHADE_PROFILE_MINI = 3,
  KVSHADE_PROFILE_EXACT = 4
};

KVSHADE_API uint32_t kvshade_abi_version(void);
KVSHADE_API const char* kvshade_last_error(void);
/* "OK", "INVALID_ARGUMENT", ... ("UNKNOWN" for numbers outside 0..16). */
KVSHADE_API const char* kvshade_code_name(int code);

typedef struct kvshade_client kvshade_client;
typedef struct kvshade_ingest kvshade_ingest;
typedef struct kvshade_static_set kvshade_static_set;
typedef struct kvshade_select_result kvshade_select_result;
typedef struct kvshade_select_future kvshade_select_future;
typedef struct kvshade_attend_future kvshade_attend_future;

/* ---- Connection --------------------------------------------------------------------- */
typedef struct kvshade_client_options {
  const char* target;          /* "HOST:PORT" or "unix:PATH"; NULL = 127.0.0.1:50551 */
  const char* bearer_token;    /* NULL or "" = none */
  int32_t tls;                 /* 0 plaintext, 1 TLS */
  const char* ca_file;         /* PEM roots; NULL = system roots */
  const char* cert_file;       /* mTLS client certificate */
  const char* key_file;        /* mTLS client key */
  const char* tls_server_name; /* overrides the name checked in the certificate */
  int64_t timeout_ms;          /* deadline of each call; <= 0 = 60000 */
  uint64_t max_message_bytes;  /* 0 = 512 MiB */
  /* UCX data plane: when 1 and the daemon offers one, the client connects over UCX at its
   * first attach (or ingest, append) and the data calls use it. If UCX cannot connect (or
   * dies), calls fall back to gRPC inline with a line on stderr, counted
   * (kvshade_ucx_status). */
  int32_t use_ucx;
  const char* ucx_transports;  /* UCX_TLS of the client's worker; NULL or "" = UCX's choice */
  int32_t ucx_ingest_window;   /* ingest messages in flight per stream over UCX; <= 0 = 4 */
  /* Microseconds the client's UCX progress thread keeps polling after its last message
   * (and spins on a decode call's reply) before sleeping: lower latency, a busy core.
   * 0 = the library's default (50); < 0 = no busy polling. */
  int32_t ucx_busy_poll_us;
} kvshade_client_options;

KVSHADE_API void kvshade_client_options_init(kvshade_client_options* options);
KVSHADE_API int kvshade_connect(const kvshade_client_options* options, kvshade_client** out);
KVSHADE_API void kvshade_client_free(kvshade_client* client);
/* Polls grpc.health.v1 until SERVING or the timeout passes (DEADLINE_EXCEEDED). */
KVSHADE_API int kvshade_wait_ready(kvshade_client* client, int64_t timeout_ms);
/* *serving = 1 when the server reports SERVING, else 0. */
KVSHADE_API int kvshade_health(kvshade_client* client, int32_t* serving);
/* The UCX data plane of this client: *connected = 1 while calls go over UCX; *fallbacks =
 * times a call (or the connection) fell back to gRPC inline. Either pointer may be NULL. */
KVSHADE_API int kvshade_ucx_status(kvshade_client* client, int32_t* connected, uint64_t* fallbacks);

/* ---- Model and profile ------------------------------------------------------------- */
typedef struct kvshade_model {
  const char* model_id;
  uint32_t num_layers, num_query_heads, num_kv_heads, head_dim;
  float rope_theta;           /* 0 = 10000 */
  uint32_t rotary_dim;        /* 0 = head_dim */
  int32_t rope_scaling;       /* 0 none, 1 linear, 2 llama3, 3 yarn */
  int32_t rope_pairing;       /* 0 half-split (HF Llama), 1 interleaved (GPT-J) */
  float rope_factor, rope_low_freq_factor, rope_high_freq_factor;
  uint32_t rope_original_max_position;
  float rope_beta_fast, rope_beta_slow;
  int32_t dtype;              /* KVSHADE_DTYPE_*; 0 = BF16 */
} kvshade_model;

/* Zero means "the server's default" for every numeric field. */
/* "The server's default" for the profile fields that take 0 as a value of their own. */
#define KVSHADE_UNSET_U32 0xFFFFFFFFu

/* rank, chunk_size, sparse_budget, local_window, kivi_group, rerank_factor, mass_top_p,
 * recall_action: 0 = the server's default (0 is not valid for them). outliers,
 * heavy_chunks, min_tokens, mass_min_chunks, key_signature_bits, selection_unit:
 * KVSHADE_UNSET_U32 = the server's default, 0 is a value (outliers = 0: no outlier chunks;
 * selection_unit = 0: whole chunks). The other floats: NaN = the server's default, 0
 * is a value. kvshade_profile_init sets every field to its default.
 * Selection options (docs/ALGORITHM.md "Selection options"): rerank_factor (two-stage
 * selection: stage 1 keeps rerank_factor x k candidates per head, stage 2 re-ranks them;
 * 1 = one stage), mass_top_p and mass_min_chunks (budget by attention mass, between the
 * floor and sparse_budget), recall_sample_rate, recall_floor, recall_action (the recall
 * guard: KVSHADE_RECALL_*). */
#define KVSHADE_RECALL_REPORT 1
#define KVSHADE_RECALL_WIDEN 2
#define KVSHADE_RECALL_EXACT 3
typedef struct kvshade_profile {
  int32_t kind;               /* KVSHADE_PROFILE_* (0 = auto) */
  uint32_t rank, chunk_size, sparse_budget, outliers;
  int32_t keep_sink;          /* -1 = server default, 0 = no, 1 = yes */
  uint32_t local_window, heavy_chunks;
  int32_t value_codec;        /* 0 default (bf16), 1 bf16, 2 fp8, 3 int4, 4 int2 */
  uint32_t min_tokens;
  float refactor_threshold, energy_target, mini_recent_ratio, mini_heavy_ratio;
  uint32_t kivi_group;
  uint32_t rerank_factor;
  float mass_top_p;
  uint32_t mass_min_chunks;
  float recall_sample_rate, recall_floor;
  int32_t recall_action;      /* KVSHADE_RECALL_*; 0 = server default */
  uint32_t key_signature_bits; /* shadow: 2, 4 or 8-bit key signatures of the chunked tokens
                                * (docs/ALGORITHM.md "Key signatures"), which two-stage
                                * selection scores; 0 = none; KVSHADE_UNSET_U32 = server default */
  uint32_t selection_unit;     /* shadow: select units of this many tokens instead of whole
                                * chunks (docs/ALGORITHM.md "Selection units"): a divisor of
                                * chunk_size below it, with rerank_factor > 1; the same token
                                * budget (sparse_budget * chunk_size / selection_unit units per
                                * head); 0 or chunk_size = whole chunks; KVSHADE_UNSET_U32 =
                                * server default */
} kvshade_profile;

/* Model: zero-filled, dtype = BF16. Profile: every field the server's default (zeros,
 * keep_sink = -1, outliers / heavy_chunks / min_tokens / mass_min_chunks / key_signature_bits /
 * selection_unit = KVSHADE_UNSET_U32, the floats that take 0 as a value NaN). */
KVSHADE_API void kvshade_model_init(kvshade_model* model);
KVSHADE_API void kvshade_profile_init(kvshade_profile* profile);

/* ---- Sessions ------------------------------------------------------------------------ */
typedef struct kvshade_session_created {
  char session_id[KVSHADE_ID_CAP];
  uint64_t reused_tokens;    /* covered by a cached prefix: ingest starts here */
  uint64_t tokens_to_ingest;
  int32_t effective_profile; /* KVSHADE_PROFILE_* */
  /* Where the ingest cuts the new tokens into segments (the requested ends it kept and the
   * automatic one): segment_ends[0 .. n_segment_ends); automatic_segment_end 0 = none. */
  uint32_t n_segment_ends;
  uint64_t segment_ends[KVSHADE_MAX_SEGMENT_ENDS];
  uint64_t automatic_segment_end;
  char device[KVSHADE_DEVICE_CAP]; /* the daemon device it was placed on ("cuda:1") */
  /* A tensor-parallel rank's create (kvshade_create_session_tp): the logical session's id,
   * its ranks, this rank and the ranks joined so far; session_id above is this rank's
   * shard. tp_session_id "" and the others 0 for any other session. */
  char tp_session_id[KVSHADE_ID_CAP];
  uint32_t tp_ranks, tp_rank, tp_ranks_joined;
} kvshade_session_created;

typedef struct kvshade_session_info {
  char session_id[KVSHADE_ID_CAP];
  char model_id[KVSHADE_ID_CAP];
  char state[32];            /* "ingesting", "ready", "damaged", "closed" */
  char label[260];
  int32_t profile;
  int32_t durable;
  uint32_t attachments, layers_ingested;
  uint64_t tokens, reused_tokens, gpu_bytes, host_bytes;
  /* Damage (docs/OPERATIONS.md "Damage"): 1 when the session lost acknowledged data or holds
   * records that fail their checksums; it is then never served (its reads fail with
   * DATA_LOSS) until it is closed. damage: what was lost (cut to 511 bytes); tokens_lost:
   * acknowledged tokens lost, where known (0: none or unknown). */
  int32_t damaged;
  char damage[512];
  uint64_t tokens_lost;
  /* Parts the open Ingest stream has placed (0 when none is open): a part sent from this
   * process's GPU memory (kvshade_ingest_layer_part_cuda_ipc) may be freed once counted. */
  uint64_t ingest_parts_taken;
  /* Tokens per selection unit of the session's resolved profile (docs/ALGORITHM.md
   * "Selection units"); 0 = whole chunks. */
  uint32_t selection_unit;
  /* The daemon device the session lives on ("cpu", "cuda:0", "cpu:1"); "" for a
   * tensor-parallel logical session (its shards': kvshade_get_tensor_parallel_shards). */
  char device[KVSHADE_DEVICE_CAP];
  /* Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions"): tp_ranks 0 for
   * any other session. A shard: its logical session (tp_session_id), rank and KV heads
   * [tp_kv_head_begin, tp_kv_head_end) of the model's tp_num_kv_heads. The logical session
   * (tp_session_id == session_id): tokens the fewest any rank has committed, state
   * "joining" until every rank joined, tp_ranks_joined, KV heads [0, tp_num_kv_heads). */
  char tp_session_id[KVSHADE_ID_CAP];
  uint32_t tp_ranks, tp_rank, tp_kv_head_begin, tp_kv_head_end, tp_num_kv_heads, tp_ranks_joined;
} kvshade_session_info;

KVSHADE_API int kvshade_create_session(kvshade_client* client, const kvshade_model* model,
                                       const kvshade_profile* profile, const int32_t* token_ids,
                                       size_t n_tokens, int32_t durable, const char* label,
                                       kvshade_session_created* out);
/* kvshade_create_session with segment ends (docs/DESIGN.md "Segment ends"): token
 * positions where the ingested prompt is cut into separate cached segments, so that a later
 * prompt sharing only its first part (a document before another question) reuses that
 * part. At most KVSHADE_MAX_SEGMENT_ENDS, strictly increasing, inside (0, n_tokens),
 * multiples of 256 and of the profile's chunk_size (KVSHADE_INVALID_ARGUMENT otherwise,
 * nothing created). segment_ends may be NULL when n_segment_ends is 0. `device` as
 * kvshade_create_session_on's (NULL or "": the daemon's first device). */
KVSHADE_API int kvshade_create_session_ex(kvshade_client* client, const kvshade_model* model,
                                          const kvshade_profile* profile, const int32_t* token_ids,
                                          size_t n_tokens, int32_t durable, const char* label,
                                          const uint64_t* segment_ends, size_t n_segment_ends,
                                          const char* device, kvshade_session_created* out);
KVSHADE_API int kvshade_lookup_prefix(kvshade_client* client, const kvshade_model* model,
                                      const kvshade_profile* profile, const int32_t* token_ids,
                                      size_t n_tokens, uint64_t* reusable_tokens,
                                      uint64_t* cached_segments);
/* The same, on a daemon with several devices (docs/OPERATIONS.md "Devices"): `device` names
 * the worker's GPU as the daemon names it ("cuda:1") or by PCI bus id ("0000:3b:00.0");
 * NULL or "" = the daemon's first device. A device the daemon does not serve is
 * KVSHADE_INVALID_ARGUMENT. Prefixes are cached per device. */
KVSHADE_API int kvshade_create_session_on(kvshade_client* client, const kvshade_model* model,
                                          const kvshade_profile* profile,
                                          const int32_t* token_ids, size_t n_tokens,
                                          int32_t durable, const char* label, const char* device,
                                          kvshade_session_created* out);
KVSHADE_API int kvshade_lookup_prefix_on(kvshade_client* client, const kvshade_model* model,
                                         const kvshade_profile* profile, const int32_t* token_ids,
                                         size_t n_tokens, const char* device,
                                         uint64_t* reusable_tokens, uint64_t* cached_segments);
/* ---- Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions") ----------- */
/* A rank of a tensor-parallel session: KV heads [kv_head_begin, kv_head_end) of the
 * model's num_kv_heads (rank 0 from head 0, the last rank to the end, each rank where the
 * one before it ends) and their GQA groups' query heads. session_id: the logical session
 * to join (its tp_session_id); "" creates a new one. query_head_begin/end: an optional
 * check of the rank's query heads (both 0: none). */
typedef struct kvshade_tensor_parallel {
  uint32_t ranks, rank, kv_head_begin, kv_head_end;
  uint32_t query_head_begin, query_head_end;
  char session_id[KVSHADE_ID_CAP];
} kvshade_tensor_parallel;

/* kvshade_create_session_ex as rank tp->rank of a tensor-parallel session: creates (or
 * joins) the logical session and this rank's shard on `device` (the rank's GPU). Every
 * rank passes the same model (the whole model's geometry), profile, tokens, durable, label
 * and segment ends. out->session_id is the shard's, which every per-session call
 * (ingest, append, attach, decode) takes, with the shard's heads only (K/V [n,
 * kv_head_end - kv_head_begin, d]); out->tp_session_id the logical session's, which
 * kvshade_get_session, kvshade_fork_session and kvshade_close_session take. A bad range, a
 * rank that joined already or a mismatch with the other ranks: KVSHADE_INVALID_ARGUMENT /
 * KVSHADE_FAILED_PRECONDITION, nothing created. */
KVSHADE_API int kvshade_create_session_tp(kvshade_client* client, const kvshade_model* model,
                                          const kvshade_profile* profile, const int32_t* token_ids,
                                          size_t n_tokens, int32_t durable, const char* label,
                                          const uint64_t* segment_ends, size_t n_segment_ends,
                                          const char* device, const kvshade_tensor_parallel* tp,
                                          kvshade_session_created* out);

/* One rank's shard of a logical session. state: the shard's ("ready", ...), "joining"
 * before the rank joined (session_id ""), "missing" when it is gone. */
typedef struct kvshade_tensor_parallel_shard {
  uint32_t rank, kv_head_begin, kv_head_end;
  char session_id[KVSHADE_ID_CAP];
  char device[KVSHADE_DEVICE_CAP];
  char state[32];
  uint64_t tokens, reused_tokens;
} kvshade_tensor_parallel_shard;

/* The shards of logical session `session_id` in rank order: writes min(cap, ranks) of them
 * to out and the number of ranks to *n (out may be NULL when cap is 0). A session that is
 * no logical session: KVSHADE_INVALID_ARGUMENT. */
KVSHADE_API int kvshade_get_tensor_parallel_shards(kvshade_client* client, const char* session_id,
                                                   kvshade_tensor_parallel_shard* out, size_t cap,
                                                   size_t* n);

/* out_session_id: KVSHADE_ID_CAP bytes. shared_tokens may be NULL. A tensor-parallel logical
 * session forks every rank's shard at at_token: out_session_id is the child logical session. */
KVSHADE_API int kvshade_fork_session(kvshade_client* client, const char* parent_session_id,
                                     uint64_t at_token, char* out_session_id,
                                     uint64_t* shared_tokens);
KVSHADE_API int kvshade_get_session(kvshade_client* client, const char* session_id,
                                    kvshade_session_info* out);
KVSHADE_API int kvshade_close_session(kvshade_client* client, const char* session_id);

/* The recall guard's figures of a session (docs/ALGORITHM.md "Recall guard"; GetSession
 * with include_selection): sampled decode steps and mean recall@k over all its layers, and
 * one record per layer with samples or a fallback, the lowest mean recall first. */
typedef struct kvshade_session_selection kvshade_session_selection;
typedef struct kvshade_layer_selection {
  uint32_t layer;
  uint64_t samples;       /* sampled decode steps of the layer */
  double recall;          /* mean recall@k over them */
  double recent_recall;   /* mean over the guard's current window */
  uint32_t budget;        /* chunks per KV head the guard widened to; 0 = the profile's
                             sparse_budget */
  int32_t fallback;       /* KVSHADE_RECALL_WIDEN or KVSHADE_RECALL_EXACT once the guard put
                             the layer under a fallback (attend it with kvshade_attend), else 0 */
  uint64_t actions;       /* times the guard acted on the layer (report included) */
} kvshade_layer_selection;

KVSHADE_API int kvshade_get_session_selection(kvshade_client* client, const char* session_id,
                                              kvshade_session_selection** out);
/* Sampled steps over all layers and their mean recall@k (either pointer may be NULL). */
KVSHADE_API void kvshade_session_selection_summary(const kvshade_session_selection* s,
                                                   uint64_t* samples, double* recall);
/* Layers with samples or a fallback; kvshade_session_selection_layer(s, i, &out) for i
 * below it. */
KVSHADE_API size_t kvshade_session_selection_count(const kvshade_session_selection* s);
KVSHADE_API int kvshade_session_selection_layer(const kvshade_session_selection* s, size_t i,
                                                kvshade_layer_selection* out);
KVSHADE_API void kvshade_session_selection_free(kvshade_session_selection* s);

/* ---- Ingest (one stream per session; nothing is visible before commit) --------------- */
KVSHADE_API int kvshade_ingest_begin(kvshade_client* client, const char* session_id,
                                     kvshade_ingest** out);
/* One whole layer: k, v [n, h, d] pre-RoPE of `dtype`; obs [w, hq, d] post-RoPE
 * observation queries or NULL (w = hq = 0). Split into parts of <= 8 MiB on the wire. */
KVSHADE_API int kvshade_ingest_layer(kvshade_ingest* ingest, uint32_t layer, int32_t dtype,
                                     int64_t n, int32_t h, int32_t d, const void* k,
                                     const void* v, const void* obs, int64_t w, int32_t hq);
/* Same node, daemon on a GPU backend: one whole layer straight from this process's GPU
 * memory (no host copy here, no bytes on the wire): k, v [n, h, d] bf16 pre-RoPE, each
 * named by the cudaIpcMemHandle_t (64 bytes) of the allocation holding it and the byte
 * offset of its first element there. The memory must hold the data (the producing stream
 * synchronized) and stay allocated and unchanged until the commit returns. */
KVSHADE_API int kvshade_ingest_layer_cuda_ipc(kvshade_ingest* ingest, uint32_t layer, int64_t n,
                                              int32_t h, int32_t d, const void* k_handle,
                                              uint64_t k_offset, const void* v_handle,
                                              uint64_t v_offset);
/* One part of a layer: its tokens [token_offset, token_offset + n) of the ingested range
 * (the prompt after the reused prefix); last_part != 0 on the part that completes the layer
 * (only then may obs come). A layer's parts arrive in order; parts of different layers may
 * interleave: a chunked prefill sends each chunk's part of every layer in turn, and the
 * daemon keeps incomplete layers in host memory, at most one of them in device memory. */
KVSHADE_API int kvshade_ingest_layer_part(kvshade_ingest* ingest, uint32_t layer, uint64_t token_offset,
                                          int32_t last_part, int32_t dtype, int64_t n, int32_t h, int32_t d,
                                          const void* k, const void* v, const void* obs, int64_t w,
                                          int32_t hq);
/* The same from this process's GPU memory (as kvshade_ingest_layer_cuda_ipc); the memory
 * must stay allocated and unchanged until the daemon has read the part (the session's
 * ingest_parts_taken counts it: parts are counted in the order sent) or the commit returns. */
KVSHADE_API int kvshade_ingest_layer_part_cuda_ipc(kvshade_ingest* ingest, uint32_t layer,
                                                   uint64_t token_offset, int32_t last_part, int64_t n,
                                                   int32_t h, int32_t d, const void* k_handle,
                                                   uint64_t k_offset, const void* v_handle,
                                                   uint64_t v_offset);
/* Commits; *tokens (may be NULL) = committed tokens of the session. The handle must still
 * be freed. */
KVSHADE_API int kvshade_ingest_commit(kvshade_ingest* ingest, uint64_t* tokens);
/* Frees; cancels the stream (nothing committed) when kvshade_ingest_commit did not run. */
KVSHADE_API void kvshade_ingest_free(kvshade_ingest* ingest);

/* ---- Append: t new tokens for all L layers: k, v [L, t, h, d] pre-RoPE of `dtype`. ---- */
KVSHADE_API int kvshade_append(kvshade_client* client, const char* session_id,
                               const char* attachment_id, const int32_t* token_ids, int64_t t,
                               uint32_t num_layers, int32_t dtype, int32_t h, int32_t d,
                               const void* k, const void* v, uint64_t* tokens);

/* ---- Workers ------------------------------------------------------------------------- */
typedef struct kvshade_attachment {
  char attachment_id[KVSHADE_ID_CAP];
  uint64_t lease_expires_unix_ms;
  uint32_t chunk_size, slots_per_head, local_window;
  int32_t writer;
  int32_t data_plane;          /* 1 when the daemon offered a UCX data-plane address */
  int32_t delivery;            /* KVSHADE_DELIVERY_* granted */
  uint64_t slot_buffer_bytes;  /* bytes each of the K and V slot buffers needs (0 = not given) */
  uint32_t slot_tokens;        /* tokens (rows) per slot: chunk_size, or the profile's
                                * selection_unit; slots_per_head then counts units */
} kvshade_attachment;

/* Values of kvshade.v1.DeliveryMode. */
enum { KVSHADE_DELIVERY_INLINE = 0, KVSHADE_DELIVERY_UCX_RMA = 1, KVSHADE_DELIVERY_CUDA_IPC = 2 };

KVSHADE_API int kvshade_attach(kvshade_client* client, const char* session_id,
                               const char* worker_id, uint32_t lease_ms, int32_t writer,
                               kvshade_attachment* out);

/* Attach with a delivery mode. Slot buffers (both modes) hold K and V, each
 * [L, h, slots_per_head, C, d] bf16; the chunk in (layer, head, slot) is row
 * ((layer * h + head) * slots_per_head + slot) of C * d elements; each needs
 * kvshade_attachment.slot_buffer_bytes bytes.
 * - KVSHADE_DELIVERY_UCX_RMA: then kvshade_register_slot_buffers (needs the UCX data plane).
 * - KVSHADE_DELIVERY_CUDA_IPC: the worker's GPU buffers as cudaIpcMemHandle_t bytes. */
typedef struct kvshade_attach_options {
  const char* session_id;
  const char* worker_id;         /* NULL = "" */
  uint32_t lease_ms;             /* 0 = server default */
  int32_t writer;
  int32_t delivery;              /* KVSHADE_DELIVERY_*; 0 = inline */
  uint8_t cuda_ipc_k_handle[64]; /* CUDA_IPC only: the allocation holding K */
  uint64_t cuda_ipc_k_offset;    /* byte offset of K in it */
  uint8_t cuda_ipc_v_handle[64]; /* the allocation holding V (may be K's) */
  uint64_t cuda_ipc_v_offset;
  uint64_t cuda_ipc_bytes;       /* usable bytes of each buffer from its offset */
  /* The worker's device (as kvshade_create_session_on's): a session on another device of
   * the daemon is KVSHADE_FAILED_PRECONDITION. NULL or "" = not checked. */
  const char* device;
} kvshade_attach_options;

/* Zero-fills. */
KVSHADE_API void kvshade_attach_options_init(kvshade_attach_options* options);
KVSHADE_API int kvshade_attach_ex(kvshade_client* client, const kvshade_attach_options* options,
                                  kvshade_attachment* out);
/* DELIVERY_UCX_RMA: host buffers k and v of `bytes` each (>= slot_buffer_bytes) that
 * selects over UCX write the attachment's misses into (their deltas then say delivered).
 * They must stay valid until kvshade_detach or kvshade_client_free. FAILED_PRECONDITION
 * when the client has no UCX data plane. */
KVSHADE_API int kvshade_register_slot_buffers(kvshade_client* client, const char* attachment_id,
                                              void* k, void* v, uint64_t bytes);
KVSHADE_API int kvshade_detach(kvshade_client* client, const char* attachment_id);

/* The static set of one layer: k, v [h, s_max, d] post-RoPE; lengths [h] valid rows per
 * head; tail_k, tail_v [t, h, d] post-RoPE exact tail. kvshade_static_set_data gives them
 * as fp32 (widened on its first call), kvshade_static_set_rows as the server sent them, in
 * the session's dtype (KVSHADE_DTYPE_BF16: raw bf16 bits, 2 bytes an element), with no
 * conversion. All owned by the handle. */
KVSHADE_API int kvshade_get_static_set(kvshade_client* client, const char* attachment_id,
                                       uint32_t layer, kvshade_static_set** out);
KVSHADE_API void kvshade_static_set_shape(const kvshade_static_set* s, int64_t* h,
                                          int64_t* s_max, int64_t* d, int64_t* t);
KVSHADE_API void kvshade_static_set_data(const kvshade_static_set* s, const float** k,
                                         const float** v, const uint32_t** lengths,
                                         const float** tail_k, const float** tail_v);
/* positions [h, s_max]: the absolute token position of each static row (-1 past
 * lengths[hh], or unknown for a durable session restored from an older record);
 * tail_positions [t]: each tail row's. */
KVSHADE_API void kvshade_static_set_rows(const kvshade_static_set* s, int32_t* dtype,
                                         const void** k, const void** v, const void** tail_k,
                                         const void** tail_v);
KVSHADE_API void kvshade_static_set_positions(const kvshade_static_set* s, const int64_t** positions,
                                              const int64_t** tail_positions);
KVSHADE_API void kvshade_static_set_free(kvshade_static_set* s);

/* ---- Same-node decode: no RPC per step (client/README.md "Same-node decode") -------- */
/* A decoder maps the session state of n attachments (one session each, same model and
 * profile; n may be 0, then sequences join later) from the daemon on this node and runs
 * select, reconstruct and attend itself.
 * backend: "auto" (the daemon's kind), "cpu" or "cuda"/"cuda:N". local_capacity: tokens
 * per sequence kept exact locally between refreshes (0 = 1024). The client must outlive
 * the decoder: the decoder renews its attachments' leases through it from a thread of its
 * own, so free the decoder before the client (the Python Client closes its decoders
 * first). */
typedef struct kvshade_local_decoder kvshade_local_decoder;
KVSHADE_API int kvshade_local_decoder_open(kvshade_client* client, size_t n,
                                           const char* const* attachment_ids,
                                           const char* backend, int32_t local_capacity,
                                           int32_t count_hits, kvshade_local_decoder** out);
/* One layer of one step for the whole batch, asynchronous on `stream` (a cudaStream_t, or
 * NULL for the default stream; ignored on cpu). Pointers are in the decoder's memory space
 * (device memory for cuda): q [n, hq, d] bf16 post-RoPE; k_new, v_new [n, h, d] bf16
 * (post-RoPE key) or both NULL; out [n, hq, d] fp32. */
KVSHADE_API int kvshade_local_decoder_attend(kvshade_local_decoder* dec, uint32_t layer,
                                             const void* q, const void* k_new,
                                             const void* v_new, float* out, void* stream);
/* The same, and lse [n, hq] fp32 (same memory space): per query head the log-sum-exp of
 * the scaled scores over what it attended, to merge with attention over other tokens. */
KVSHADE_API int kvshade_local_decoder_attend_lse(kvshade_local_decoder* dec, uint32_t layer,
                                                 const void* q, const void* k_new,
                                                 const void* v_new, float* out, float* lse,
                                                 void* stream);
/* Ends a step whose Attend calls gave k_new/v_new. */
KVSHADE_API int kvshade_local_decoder_advance(kvshade_local_decoder* dec);
/* Maps the daemon's current generation (after appends), drops the local tokens it covers. */
KVSHADE_API int kvshade_local_decoder_refresh(kvshade_local_decoder* dec);
/* Geometry and counters (any may be NULL). */
KVSHADE_API int kvshade_local_decoder_info(kvshade_local_decoder* dec, int32_t* batch,
                                           int32_t* layers, int32_t* kv_heads,
                                           int32_t* query_heads, int32_t* head_dim,
                                           uint64_t* selected, uint64_t* hits, uint64_t* steps);
/* Continuous batching: between steps, a sequence joins at the end of the batch (*index
 * gets its batch index; index may be NULL) or leaves it (later sequences move down one
 * index; its local tokens are dropped, its memory freed). A decoder may be opened with
 * n = 0 sequences and filled by joins. */
KVSHADE_API int kvshade_local_decoder_join(kvshade_local_decoder* dec, const char* attachment_id,
                                           int32_t* index);
KVSHADE_API int kvshade_local_decoder_leave(kvshade_local_decoder* dec, uint32_t index);
/* A join in two parts, so that the steps go on while a sequence gets ready: _prepare makes
 * the daemon's calls and maps the session (it may run on another thread while the decoder
 * steps; not while this process captures a CUDA graph); _join_prepared then adds it between
 * steps, on the stepping thread, and takes `prepared` whatever it returns. A prepared
 * sequence holds its generation until it joins or is freed (kvshade_prepared_sequence_free;
 * before the client). Errors as kvshade_local_decoder_join's. */
typedef struct kvshade_prepared_sequence kvshade_prepared_sequence;
KVSHADE_API int kvshade_local_decoder_prepare(kvshade_local_decoder* dec, const char* attachment_id,
                                              kvshade_prepared_sequence** out);
KVSHADE_API int kvshade_local_decoder_join_prepared(kvshade_local_decoder* dec,
                                                    kvshade_prepared_sequence* prepared,
                                                    int32_t* index);
KVSHADE_API void kvshade_prepared_sequence_free(kvshade_prepared_sequence* prepared);
/* Between steps, adds n exact tokens at the end of sequence `index`'s local tail: tokens
 * its session does not hold (a prompt's last part, e.g. a question after a shared document
 * the session covers), attended by the next steps as the tokens of earlier steps are.
 * k, v [layers, n, h, d] bf16 (post-RoPE keys, layer-major) in the decoder's memory space,
 * copied in `stream`'s order (NULL: the default stream; ignored on cpu).
 * KVSHADE_RESOURCE_EXHAUSTED when they do not fit in local_capacity (nothing is added). */
KVSHADE_API int kvshade_local_decoder_extend(kvshade_local_decoder* dec, uint32_t index,
                                             uint32_t n, const void* k, const void* v,
                                             void* stream);
/* Model-native selection on the same-node path (docs/ALGORITHM.md "Selection options"):
 * chunks [n, h, m] int32 in the decoder's memory space, the chunks each sequence attends
 * in this layer (-1 = none, m <= slots per head), instead of the profile's selection; ids
 * out of range, static for the head or repeated are ignored. lse may be NULL. */
KVSHADE_API int kvshade_local_decoder_attend_chunks(kvshade_local_decoder* dec, uint32_t layer,
                                                    const void* q, const int32_t* chunks,
                                                    int32_t m, const void* k_new,
                                                    const void* v_new, float* out, float* lse,
                                                    void* stream);
/* The chunk ids sequence b's last step of `layer` selected: out [h, k] (host, -1 = none),
 * *k = slots per head (the profile's budget, or the recall guard's); at most cap entries
 * are written (cap >= h * *k for all). Synchronizes with the decoder's work. */
KVSHADE_API int kvshade_local_decoder_selected(kvshade_local_decoder* dec, uint32_t b,
                                               uint32_t layer, int32_t* out, size_t cap,
                                               int32_t* k);

/* The same-node decoder's recall guard for sequence b: layers it sampled or that are under
 * a fallback, the lowest mean recall first. Writes min(cap, *n) entries to out (may be
 * NULL with cap 0); *n gets the count. */
KVSHADE_API int kvshade_local_decoder_selection(kvshade_local_decoder* dec, uint32_t b,
                                                kvshade_layer_selection* out, size_t cap,
                                                size_t* n);
/* "cpu" or "cuda": the backend the decoder runs on (where attend's pointers must be). */
KVSHADE_API const char* kvshade_local_decoder_backend(const kvshade_local_decoder* dec);
KVSHADE_API void kvshade_local_decoder_free(kvshade_local_decoder* dec);

/* ---- Decode -------------------------------------------------------------------------- */
/* One layer, a batch of n queries: attachment_ids[n], q [n, hq, d] post-RoPE of `dtype`. */
KVSHADE_API int kvshade_select(kvshade_client* client, uint32_t layer, size_t n,
                               const char* const* attachment_ids, int32_t dtype, int32_t hq,
                               int32_t d, const void* q, kvshade_select_result** out);
KVSHADE_API size_t kvshade_select_count(const kvshade_select_result* r);
/* Model-native selection (docs/ALGORITHM.md "Selection options"): the chunks each query
 * attends are chosen by the caller (a model's own indexer) instead of by kvshade, and
 * served through the same slot tables as kvshade_select's: chunks [n, h, m] int32, one
 * [h, m] block per attachment, -1 = none, m <= slots_per_head; ids distinct per head and
 * below the layer's chunk count (else KVSHADE_INVALID_ARGUMENT); static chunks skipped. */
KVSHADE_API int kvshade_select_chunks(kvshade_client* client, uint32_t layer, size_t n,
                                      const char* const* attachment_ids, int32_t h, int32_t m,
                                      const int32_t* chunks, kvshade_select_result** out);

/* The slot-table delta of query i: m misses, each (head, slot, chunk) with its
 * reconstructed keys and values [m, C, d] fp32 (widened from the session's dtype on the
 * first call; kvshade_select_delta_rows gives them without conversion). Pointers owned by
 * the result. When
 * `delivered` is 1 the misses' K and V were written into the attachment's registered slot
 * buffers instead: keys and values are NULL (C and d still given). With selection units
 * (profile selection_unit = u) each miss is a unit: `chunk` holds unit ids, chunk_size is u
 * (rows per miss) and `position` the first of its u tokens. */
typedef struct kvshade_slot_delta {
  const char* attachment_id;
  uint64_t m;
  const uint32_t* head;
  const uint32_t* slot;
  const int32_t* chunk;
  const float* keys;
  const float* values;
  int64_t chunk_size, head_dim; /* rows per miss (C, or the unit u), d (0 when m == 0) */
  uint32_t hits, selected;
  int32_t delivered;
  /* The recall guard put this layer under a fallback that does not fit the slots (then
   * m == 0): attend this layer with kvshade_attend instead. */
  int32_t fallback;
  /* The session's length after the call (one more when this call staged the last layer of
   * a token: kvshade_select_ex). */
  uint64_t tokens;
  /* [m] absolute position of the first of each miss's C tokens. */
  const int64_t* position;
} kvshade_slot_delta;

KVSHADE_API int kvshade_select_delta(const kvshade_select_result* r, size_t i,
                                     kvshade_slot_delta* out);
/* Delta i as kvshade_select_delta gives it, but out->keys and out->values NULL: its keys
 * and values [m, C, d] come in *keys and *values as the server sent them, in the session's
 * dtype (*dtype a KVSHADE_DTYPE_*; KVSHADE_DTYPE_BF16: raw bf16 bits, 2 bytes an element),
 * with no conversion; NULL and *dtype = 0 when the delta has no rows (m == 0, or
 * delivered). Owned by the result. */
KVSHADE_API int kvshade_select_delta_rows(const kvshade_select_result* r, size_t i,
                                          kvshade_slot_delta* out, int32_t* dtype,
                                          const void** keys, const void** values);
KVSHADE_API void kvshade_select_free(kvshade_select_result* r);

/* Attention inside the service: out [n, hq, d] fp32 (caller-allocated). */
KVSHADE_API int kvshade_attend(kvshade_client* client, uint32_t layer, size_t n,
                               const char* const* attachment_ids, int32_t dtype, int32_t hq,
                               int32_t d, const void* q, float* out);

/* A decode step's new tokens for one layer, one per query: k_new, v_new [n, h, d] of the
 * call's dtype (keys pre-RoPE). With stage_token_ids (NULL: none) the daemon stages query
 * i's token as token stage_token_ids[i] (< 0: that query stages nothing), and the call
 * that stages a session's last missing layer appends the token to it (the attachment must
 * be its writer); docs/API.md "RPCs" (Attend, SelectAndReconstruct). */
typedef struct kvshade_new_tokens {
  int32_t h;
  const void* k_new;
  const void* v_new;
  const int32_t* stage_token_ids;
  /* 1: hold each token once its last layer is staged instead of appending it;
   * kvshade_commit_staged appends (or discards) it, e.g. a draft token of a speculative
   * decoder. */
  int32_t hold;
} kvshade_new_tokens;

/* Appends the attachment's held staged token stage_token_id to its session (discard = 1:
 * drops it instead); *tokens (may be NULL) gets the session's length. FAILED_PRECONDITION
 * when no such token is staged, a layer is missing, or the session changed since. */
KVSHADE_API int kvshade_commit_staged(kvshade_client* client, const char* attachment_id,
                                      int32_t stage_token_id, int32_t discard, uint64_t* tokens);

/* Why a select is sent (v1.SelectPurpose), counted by the daemon in
 * kvshade_decode_selects_total{purpose}: a speculating worker's correction rate. */
#define KVSHADE_SELECT_SYNCHRONOUS 0
#define KVSHADE_SELECT_SPECULATIVE 1 /* for the next step (speculate-and-correct) */
#define KVSHADE_SELECT_CORRECTION 2  /* the query drifted from the speculated one */

/* kvshade_select that also stages new tokens (tokens != NULL needs stage_token_ids; a
 * query whose id is < 0 sends no token) and says its purpose (KVSHADE_SELECT_*). Each
 * delta's `tokens` says the session's length. */
KVSHADE_API int kvshade_select_ex(kvshade_client* client, uint32_t layer, size_t n,
                                  const char* const* attachment_ids, int32_t dtype, int32_t hq,
                                  int32_t d, const void* q, const kvshade_new_tokens* tokens,
                                  int32_t purpose, kvshade_select_result** out);
/* kvshade_select_async with kvshade_select_ex's tokens and purpose. */
KVSHADE_API int kvshade_select_async_ex(kvshade_client* client, uint32_t layer, size_t n,
                                        const char* const* attachment_ids, int32_t dtype,
                                        int32_t hq, int32_t d, const void* q,
                                        const kvshade_new_tokens* tokens, int32_t purpose,
                                        kvshade_select_future** out);
/* kvshade_attend with the step's new tokens attended exactly beside each session (and
 * staged where stage_token_ids says so; tokens NULL: none), the log-sum-exp of each query
 * head's scaled scores in lse [n, hq] and the sessions' lengths after the call in
 * lengths [n] (each NULL: not wanted). */
KVSHADE_API int kvshade_attend_ex(kvshade_client* client, uint32_t layer, size_t n,
                                  const char* const* attachment_ids, int32_t dtype, int32_t hq,
                                  int32_t d, const void* q, const kvshade_new_tokens* tokens,
                                  float* out, float* lse, uint64_t* lengths);

/* Async select and attend, for a decode loop that issues layer l+1 while it applies layer
 * l. The arguments are copied before the call returns (q and the ids may be reused); the
 * future is waited on once (or freed unwaited: the answer is dropped). The client must
 * outlive its futures. */
KVSHADE_API int kvshade_select_async(kvshade_client* client, uint32_t layer, size_t n,
                                     const char* const* attachment_ids, int32_t dtype,
                                     int32_t hq, int32_t d, const void* q,
                                     kvshade_select_future** out);
/* *ready = 1 when the answer is there (the wait will not block). */
KVSHADE_API int kvshade_select_future_ready(const kvshade_select_future* f, int32_t* ready);
/* Waits; the answer as kvshade_select would give it. FAILED_PRECONDITION when waited twice. */
KVSHADE_API int kvshade_select_future_wait(kvshade_select_future* f, kvshade_select_result** out);
KVSHADE_API void kvshade_select_future_free(kvshade_select_future* f);

KVSHADE_API int kvshade_attend_async(kvshade_client* client, uint32_t layer, size_t n,
                                     const char* const* attachment_ids, int32_t dtype,
                                     int32_t hq, int32_t d, const void* q,
                                     kvshade_attend_future** out);
KVSHADE_API int kvshade_attend_future_ready(const kvshade_attend_future* f, int32_t* ready);
/* Waits; out [n, hq, d] fp32 (caller-allocated, n, hq, d as given to kvshade_attend_async). */
KVSHADE_API int kvshade_attend_future_wait(kvshade_attend_future* f, float* out);
KVSHADE_API void kvshade_attend_future_free(kvshade_attend_future* f);

/* ---- Operations ---------------------------------------------------------------------- */
typedef struct kvshade_stats {
  char backend[64];
  char version[64];
  uint64_t sessions, attachments, segments;
  uint64_t device_bytes_used, device_bytes_budget, host_bytes_used, host_bytes_budget;
  uint64_t spilled_bytes, prefix_lookups, prefix_hits, chunks_selected, chunk_hits;
} kvshade_stats;

/* The caller's (its tenant's) figures, summed over the daemon's devices; the budgets are
 * each device's (device_bytes_budget) and the daemon's (host_bytes_budget). Per device:
 * kvshade_get_device_stats. */
KVSHADE_API int kvshade_get_stats(kvshade_client* client, kvshade_stats* out);

/* One device of the daemon (docs/OPERATIONS.md "Devices"): the figures of kvshade_stats that
 * belong to a device. */
typedef struct kvshade_device_stats {
  char device[KVSHADE_DEVICE_CAP];     /* the daemon's name for it: "cpu", "cuda:1", "cpu:0" */
  char pci_bus_id[KVSHADE_DEVICE_CAP]; /* a CUDA device's ("0000:3b:00.0"); "" on a CPU device */
  uint64_t sessions, attachments, segments;          /* the caller's, on this device */
  uint64_t device_bytes_used, device_bytes_budget;   /* the caller's / the device's budget */
  uint64_t device_bytes_held;                        /* device memory the device's tier holds */
  uint64_t host_bytes_used, host_bytes_budget;       /* the caller's / the device's share */
  uint64_t spilled_bytes;
  uint64_t prefix_lookups, prefix_hits, chunks_selected, chunk_hits; /* the caller's, here */
} kvshade_device_stats;

/* The daemon's devices in its order (the order of its backend list; one entry on a daemon
 * with one device), from one Stats call: out[0..min(n, *count)) are filled and *count is
 * the number of devices the daemon has, so a caller whose n was too small calls again
 * with n = *count (out may be NULL when n is 0: the count alone). count must not be NULL.
 * A daemon too old to report its devices gives *count = 0. */
KVSHADE_API int kvshade_get_device_stats(kvshade_client* client, kvshade_device_stats* out, size_t n,
                                         size_t* count);

/* ---- Placement ------------------------------------------------------------------------
 * The C++ Router's placement (client/include/kvshade/client/router.h), so that a runtime
 * or a proxy in any language sends a prompt to the daemon that holds its prefix, exactly
 * as the C++ Router would:
 *   prefix key  = XXH3-64, seed KVSHADE_ROUTE_SEED, over the model id's bytes, one 0x00
 *                 byte, then the first min(n, route_prefix_tokens) token ids as int32
 *                 little-endian;
 *   weight(e,k) = XXH3-64, seed XXH3-64(endpoint name, seed KVSHADE_ROUTE_SEED), over k
 *                 as 8 bytes little-endian;
 *   rank(k)     = the endpoints by decreasing weight (ties: lower name first); the first
 *                 is the owner.
 * These need no client and make no call. */
#define KVSHADE_ROUTE_SEED 0x6B7673726F757465ull /* "kvsroute" */
#define KVSHADE_DEFAULT_ROUTE_PREFIX_TOKENS 256

/* The prefix key of a prompt. route_prefix_tokens 0 = KVSHADE_DEFAULT_ROUTE_PREFIX_TOKENS;
 * token_ids may be NULL when n is 0. */
KVSHADE_API int kvshade_route_prefix_key(const char* model_id, const int32_t* token_ids, size_t n,
                                         uint32_t route_prefix_tokens, uint64_t* key);
/* The rendezvous weight of one endpoint name for a key. */
KVSHADE_API int kvshade_rendezvous_weight(const char* endpoint_name, uint64_t key, uint64_t* weight);
/* order[0..n) = indices of names[0..n) by decreasing weight for key (order[0]: the owner).
 * INVALID_ARGUMENT for a NULL or repeated name. */
KVSHADE_API int kvshade_rendezvous_rank(const char* const* names, size_t n, uint64_t key,
                                        size_t* order);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSHADE_KVSHADE_H_ */
