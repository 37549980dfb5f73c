"""ctypes bindings of libkvshade.so (the C ABI of client/include/kvshade/kvshade.h).

The library is found, in order, at $KVSHADE_LIB (a file), next to this package
(kvshade/libkvshade.so), in a CMake build tree above the source checkout
(build*/client/libkvshade.so), in the lib/ directory of a `cmake --install` prefix that
holds this package (PREFIX/lib/python3.X/dist-packages/kvshade), or by its soname
(libkvshade.so.1) where the dynamic loader looks. Nothing here is compiled against
Python, so the package loads in any Python 3 with ctypes.
"""
import ctypes
import glob
import os

ABI_VERSION = 6
ID_CAP = 128

_c_char_p = ctypes.c_char_p
_u32, _i32, _i64, _u64, _f32 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float
_size_t = ctypes.c_size_t
_vp = ctypes.c_void_p


class ClientOptions(ctypes.Structure):
    _fields_ = [("target", _c_char_p), ("bearer_token", _c_char_p), ("tls", _i32),
                ("ca_file", _c_char_p), ("cert_file", _c_char_p), ("key_file", _c_char_p),
                ("tls_server_name", _c_char_p), ("timeout_ms", _i64), ("max_message_bytes", _u64),
                ("use_ucx", _i32), ("ucx_transports", _c_char_p), ("ucx_ingest_window", _i32),
                ("ucx_busy_poll_us", _i32)]


class Model(ctypes.Structure):
    _fields_ = [("model_id", _c_char_p), ("num_layers", _u32), ("num_query_heads", _u32),
                ("num_kv_heads", _u32), ("head_dim", _u32), ("rope_theta", _f32),
                ("rotary_dim", _u32), ("rope_scaling", _i32), ("rope_pairing", _i32),
                ("rope_factor", _f32), ("rope_low_freq_factor", _f32),
                ("rope_high_freq_factor", _f32), ("rope_original_max_position", _u32),
                ("rope_beta_fast", _f32), ("rope_beta_slow", _f32), ("dtype", _i32)]


class Profile(ctypes.Structure):
    _fields_ = [("kind", _i32), ("rank", _u32), ("chunk_size", _u32), ("sparse_budget", _u32),
                ("outliers", _u32), ("keep_sink", _i32), ("local_window", _u32),
                ("heavy_chunks", _u32), ("value_codec", _i32), ("min_tokens", _u32),
                ("refactor_threshold", _f32), ("energy_target", _f32),
                ("mini_recent_ratio", _f32), ("mini_heavy_ratio", _f32), ("kivi_group", _u32),
                ("rerank_factor", _u32), ("mass_top_p", _f32), ("mass_min_chunks", _u32),
                ("recall_sample_rate", _f32), ("recall_floor", _f32), ("recall_action", _i32),
                ("key_signature_bits", _u32)]


class SessionCreated(ctypes.Structure):
    _fields_ = [("session_id", ctypes.c_char * ID_CAP), ("reused_tokens", _u64),
                ("tokens_to_ingest", _u64), ("effective_profile", _i32)]


class SessionInfo(ctypes.Structure):
    _fields_ = [("session_id", ctypes.c_char * ID_CAP), ("model_id", ctypes.c_char * ID_CAP),
                ("state", ctypes.c_char * 32), ("label", ctypes.c_char * 260),
                ("profile", _i32), ("durable", _i32), ("attachments", _u32),
                ("layers_ingested", _u32), ("tokens", _u64), ("reused_tokens", _u64),
                ("gpu_bytes", _u64), ("host_bytes", _u64), ("damaged", _i32),
                ("damage", ctypes.c_char * 512), ("tokens_lost", _u64), ("ingest_parts_taken", _u64)]


class LayerSelection(ctypes.Structure):
    _fields_ = [("layer", _u32), ("samples", _u64), ("recall", ctypes.c_double),
                ("recent_recall", ctypes.c_double), ("budget", _u32), ("fallback", _i32),
                ("actions", _u64)]


class Attachment(ctypes.Structure):
    _fields_ = [("attachment_id", ctypes.c_char * ID_CAP), ("lease_expires_unix_ms", _u64),
                ("chunk_size", _u32), ("slots_per_head", _u32), ("local_window", _u32),
                ("writer", _i32), ("data_plane", _i32), ("delivery", _i32), ("slot_buffer_bytes", _u64)]


class SlotDelta(ctypes.Structure):
    _fields_ = [("attachment_id", _c_char_p), ("m", _u64),
                ("head", ctypes.POINTER(_u32)), ("slot", ctypes.POINTER(_u32)),
                ("chunk", ctypes.POINTER(_i32)), ("keys", ctypes.POINTER(_f32)),
                ("values", ctypes.POINTER(_f32)), ("chunk_size", _i64), ("head_dim", _i64),
                ("hits", _u32), ("selected", _u32), ("delivered", _i32),
                ("fallback", _i32), ("tokens", _u64), ("position", ctypes.POINTER(_i64))]


class NewTokens(ctypes.Structure):
    _fields_ = [("h", _i32), ("k_new", ctypes.c_void_p), ("v_new", ctypes.c_void_p),
                ("stage_token_ids", ctypes.POINTER(_i32)), ("hold", _i32)]


class AttachOptions(ctypes.Structure):
    _fields_ = [("session_id", _c_char_p), ("worker_id", _c_char_p), ("lease_ms", _u32),
                ("writer", _i32), ("delivery", _i32), ("cuda_ipc_k_handle", ctypes.c_uint8 * 64),
                ("cuda_ipc_k_offset", _u64), ("cuda_ipc_v_handle", ctypes.c_uint8 * 64),
                ("cuda_ipc_v_offset", _u64), ("cuda_ipc_bytes", _u64)]


class Stats(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_char * 64), ("version", ctypes.c_char * 64)] + [
        (name, _u64) for name in (
            "sessions", "attachments", "segments", "device_bytes_used", "device_bytes_budget",
            "host_bytes_used", "host_bytes_budget", "spilled_bytes", "prefix_lookups",
            "prefix_hits", "chunks_selected", "chunk_hits")]


_P = ctypes.POINTER

# name -> (restype, argtypes)
_SIGNATURES = {
    "kvshade_abi_version": (_u32, []),
    "kvshade_last_error": (_c_char_p, []),
    "kvshade_code_name": (_c_char_p, [ctypes.c_int]),
    "kvshade_client_options_init": (None, [_P(ClientOptions)]),
    "kvshade_model_init": (None, [_P(Model)]),
    "kvshade_profile_init": (None, [_P(Profile)]),
    "kvshade_connect": (ctypes.c_int, [_P(ClientOptions), _P(_vp)]),
    "kvshade_client_free": (None, [_vp]),
    "kvshade_wait_ready": (ctypes.c_int, [_vp, _i64]),
    "kvshade_health": (ctypes.c_int, [_vp, _P(_i32)]),
    "kvshade_ucx_status": (ctypes.c_int, [_vp, _P(_i32), _P(_u64)]),
    "kvshade_create_session": (ctypes.c_int, [_vp, _P(Model), _P(Profile), _P(_i32), _size_t, _i32,
                                              _c_char_p, _P(SessionCreated)]),
    "kvshade_lookup_prefix": (ctypes.c_int, [_vp, _P(Model), _P(Profile), _P(_i32), _size_t,
                                             _P(_u64), _P(_u64)]),
    "kvshade_fork_session": (ctypes.c_int, [_vp, _c_char_p, _u64, ctypes.c_char_p, _P(_u64)]),
    "kvshade_get_session": (ctypes.c_int, [_vp, _c_char_p, _P(SessionInfo)]),
    "kvshade_close_session": (ctypes.c_int, [_vp, _c_char_p]),
    "kvshade_get_session_selection": (ctypes.c_int, [_vp, _c_char_p, _P(_vp)]),
    "kvshade_session_selection_summary": (None, [_vp, _P(_u64), _P(ctypes.c_double)]),
    "kvshade_session_selection_count": (_size_t, [_vp]),
    "kvshade_session_selection_layer": (ctypes.c_int, [_vp, _size_t, _P(LayerSelection)]),
    "kvshade_session_selection_free": (None, [_vp]),
    "kvshade_ingest_begin": (ctypes.c_int, [_vp, _c_char_p, _P(_vp)]),
    "kvshade_ingest_layer": (ctypes.c_int, [_vp, _u32, _i32, _i64, _i32, _i32, _vp, _vp, _vp,
                                            _i64, _i32]),
    "kvshade_ingest_layer_part": (ctypes.c_int, [_vp, _u32, _u64, _i32, _i32, _i64, _i32, _i32, _vp, _vp, _vp,
                                                 _i64, _i32]),
    "kvshade_ingest_commit": (ctypes.c_int, [_vp, _P(_u64)]),
    "kvshade_ingest_free": (None, [_vp]),
    "kvshade_append": (ctypes.c_int, [_vp, _c_char_p, _c_char_p, _P(_i32), _i64, _u32, _i32, _i32,
                                      _i32, _vp, _vp, _P(_u64)]),
    "kvshade_attach": (ctypes.c_int, [_vp, _c_char_p, _c_char_p, _u32, _i32, _P(Attachment)]),
    "kvshade_attach_options_init": (None, [_P(AttachOptions)]),
    "kvshade_attach_ex": (ctypes.c_int, [_vp, _P(AttachOptions), _P(Attachment)]),
    "kvshade_register_slot_buffers": (ctypes.c_int, [_vp, _c_char_p, _vp, _vp, _u64]),
    "kvshade_detach": (ctypes.c_int, [_vp, _c_char_p]),
    "kvshade_local_decoder_open": (ctypes.c_int, [_vp, ctypes.c_size_t, _P(_c_char_p), _c_char_p, _i32,
                                                  _i32, _P(_vp)]),
    "kvshade_local_decoder_attend": (ctypes.c_int, [_vp, _u32, _vp, _vp, _vp, _vp, _vp]),
    "kvshade_local_decoder_attend_lse": (ctypes.c_int, [_vp, _u32, _vp, _vp, _vp, _vp, _vp, _vp]),
    "kvshade_local_decoder_advance": (ctypes.c_int, [_vp]),
    "kvshade_local_decoder_refresh": (ctypes.c_int, [_vp]),
    "kvshade_local_decoder_info": (ctypes.c_int, [_vp, _P(_i32), _P(_i32), _P(_i32), _P(_i32), _P(_i32),
                                                  _P(ctypes.c_uint64), _P(ctypes.c_uint64), _P(ctypes.c_uint64)]),
    "kvshade_local_decoder_free": (None, [_vp]),
    "kvshade_local_decoder_join": (ctypes.c_int, [_vp, _c_char_p, _P(_i32)]),
    "kvshade_local_decoder_leave": (ctypes.c_int, [_vp, _u32]),
    "kvshade_local_decoder_attend_chunks": (ctypes.c_int, [_vp, _u32, _vp, _vp, _i32, _vp, _vp, _vp, _vp, _vp]),
    "kvshade_local_decoder_selected": (ctypes.c_int, [_vp, _u32, _u32, _P(_i32), ctypes.c_size_t, _P(_i32)]),
    "kvshade_local_decoder_selection": (ctypes.c_int, [_vp, _u32, _P(LayerSelection), ctypes.c_size_t,
                                                       _P(ctypes.c_size_t)]),
    "kvshade_ingest_layer_cuda_ipc": (ctypes.c_int, [_vp, _u32, _i64, _i32, _i32, _c_char_p, ctypes.c_uint64,
                                                     _c_char_p, ctypes.c_uint64]),
    "kvshade_ingest_layer_part_cuda_ipc": (ctypes.c_int, [_vp, _u32, _u64, _i32, _i64, _i32, _i32, _c_char_p,
                                                          ctypes.c_uint64, _c_char_p, ctypes.c_uint64]),
    "kvshade_local_decoder_backend": (_c_char_p, [_vp]),
    "kvshade_get_static_set": (ctypes.c_int, [_vp, _c_char_p, _u32, _P(_vp)]),
    "kvshade_static_set_shape": (None, [_vp, _P(_i64), _P(_i64), _P(_i64), _P(_i64)]),
    "kvshade_static_set_data": (None, [_vp, _P(_P(_f32)), _P(_P(_f32)), _P(_P(_u32)),
                                       _P(_P(_f32)), _P(_P(_f32))]),
    "kvshade_static_set_positions": (None, [_vp, _P(_P(_i64)), _P(_P(_i64))]),
    "kvshade_static_set_free": (None, [_vp]),
    "kvshade_commit_staged": (ctypes.c_int, [_vp, _c_char_p, _i32, _i32, _P(_u64)]),
    "kvshade_select": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                      _P(_vp)]),
    "kvshade_select_chunks": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32,
                                             _P(_i32), _P(_vp)]),
    "kvshade_select_count": (_size_t, [_vp]),
    "kvshade_select_delta": (ctypes.c_int, [_vp, _size_t, _P(SlotDelta)]),
    "kvshade_select_free": (None, [_vp]),
    "kvshade_attend": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                      _P(_f32)]),
    "kvshade_select_ex": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                         _P(NewTokens), _i32, _P(_vp)]),
    "kvshade_select_async_ex": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                               _P(NewTokens), _i32, _P(_vp)]),
    "kvshade_attend_ex": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                         _P(NewTokens), _P(_f32), _P(_f32), _P(_u64)]),
    "kvshade_select_async": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                            _P(_vp)]),
    "kvshade_select_future_ready": (ctypes.c_int, [_vp, _P(_i32)]),
    "kvshade_select_future_wait": (ctypes.c_int, [_vp, _P(_vp)]),
    "kvshade_select_future_free": (None, [_vp]),
    "kvshade_attend_async": (ctypes.c_int, [_vp, _u32, _size_t, _P(_c_char_p), _i32, _i32, _i32, _vp,
                                            _P(_vp)]),
    "kvshade_attend_future_ready": (ctypes.c_int, [_vp, _P(_i32)]),
    "kvshade_attend_future_wait": (ctypes.c_int, [_vp, _P(_f32)]),
    "kvshade_attend_future_free": (None, [_vp]),
    "kvshade_get_stats": (ctypes.c_int, [_vp, _P(Stats)]),
    "kvshade_route_prefix_key": (ctypes.c_int, [_c_char_p, _P(_i32), _size_t, _u32, _P(_u64)]),
    "kvshade_rendezvous_weight": (ctypes.c_int, [_c_char_p, _u64, _P(_u64)]),
    "kvshade_rendezvous_rank": (ctypes.c_int, [_P(_c_char_p), _size_t, _u64, _P(_size_t)]),
}


def _candidates():
    env = os.environ.get("KVSHADE_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libkvshade.so")
    # Source checkout: client/python/kvshade -> repository root.
    root = os.path.abspath(os.path.join(here, "..", "..", ".."))
    for path in sorted(glob.glob(os.path.join(root, "build*", "client", "libkvshade.so"))):
        yield path
    # `cmake --install`: PREFIX/lib/python3.X/dist-packages/kvshade -> PREFIX/lib.
    yield os.path.abspath(os.path.join(here, "..", "..", "..", "libkvshade.so.1"))
    # By soname, where the dynamic loader looks (ld.so.conf, LD_LIBRARY_PATH).
    yield "libkvshade.so.1"


def _dlpath(lib):
    """The file a library handle was loaded from (dlinfo RTLD_DI_LINKMAP), or None."""
    try:
        class _LinkMap(ctypes.Structure):
            _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]
        libdl = ctypes.CDLL(None)
        lm = ctypes.POINTER(_LinkMap)()
        if libdl.dlinfo(ctypes.c_void_p(lib._handle), 2, ctypes.byref(lm)) != 0:
            return None
        return lm.contents.l_name.decode()
    except (AttributeError, OSError, ValueError):
        return None


def _load():
    tried = []
    for path in _candidates():
        tried.append(path)
        if os.sep not in path:  # a soname: the dynamic loader searches for it
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            path = _dlpath(lib) or path
        elif os.path.exists(path):
            lib = ctypes.CDLL(path)
        else:
            continue
        if lib.kvshade_abi_version() != ABI_VERSION:
            raise ImportError("%s implements kvshade ABI %d, this package needs %d"
                              % (path, lib.kvshade_abi_version(), ABI_VERSION))
        # Functions added since the library was built (the ABI version counts changed
        # layouts and signatures, not additions): said by name, not as an AttributeError.
        missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
        if missing:
            raise ImportError("%s lacks %s%s: it is older than this package; rebuild libkvshade.so"
                              % (path, ", ".join(missing[:4]), " and %d more" % (len(missing) - 4)
                                 if len(missing) > 4 else ""))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        lib._kvshade_path = path
        return lib
    raise ImportError("libkvshade.so not found (set KVSHADE_LIB); tried: " + ", ".join(tried))


_lib = None


def lib():
    """The loaded library (loaded on first use, so importing kvshade never fails)."""
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib
