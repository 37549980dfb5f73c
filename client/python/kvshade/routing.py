"""Placement of prompts over several kvshade daemons: the C++ Router's rendezvous hash
(client/include/kvshade/client/router.h), computed by libkvshade.so, so that Python and C++
send the same prompt to the same daemon.

    from kvshade.routing import Placement
    p = Placement(["kv-0", "kv-1", "kv-2"])          # stable endpoint names
    owner = p.owner("llama-3-8b", token_ids)         # "kv-1": the daemon holding the prefix
    p.rank("llama-3-8b", token_ids)                  # every name, owner first (failover order)

prefix key  = XXH3-64 (seed ROUTE_SEED) of the model id's bytes, one 0x00 byte, and the first
              min(n, route_prefix_tokens) token ids as int32 little-endian;
weight(e,k) = XXH3-64 (seed XXH3-64(endpoint name, seed ROUTE_SEED)) of k as 8 bytes
              little-endian; the owner has the highest weight (ties: the lower name).
"""
import ctypes
from typing import List, Sequence

import numpy as np

from . import _native
from . import _native_abi as _abi
from .errors import InvalidArgument, from_code

ROUTE_SEED = _abi.KVSHADE_ROUTE_SEED  # "kvsroute"
DEFAULT_ROUTE_PREFIX_TOKENS = _abi.KVSHADE_DEFAULT_ROUTE_PREFIX_TOKENS


def _check(rc):
    if rc != 0:
        raise from_code(rc, _native.lib().kvshade_last_error().decode("utf-8", "replace"))


def prefix_key(model_id: str, token_ids, route_prefix_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS) -> int:
    """The prompt's prefix key (an unsigned 64-bit int), as Router::PrefixKey computes it."""
    if route_prefix_tokens <= 0:
        raise InvalidArgument("route_prefix_tokens must be > 0, got %d" % route_prefix_tokens)
    ids = np.ascontiguousarray(np.asarray(token_ids).reshape(-1)[:route_prefix_tokens], dtype=np.int32)
    out = ctypes.c_uint64()
    _check(_native.lib().kvshade_route_prefix_key(
        model_id.encode("utf-8"), ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), ids.size,
        route_prefix_tokens, ctypes.byref(out)))
    return out.value


def rendezvous_weight(endpoint_name: str, key: int) -> int:
    """The weight of one endpoint for a key."""
    out = ctypes.c_uint64()
    _check(_native.lib().kvshade_rendezvous_weight(endpoint_name.encode("utf-8"), key, ctypes.byref(out)))
    return out.value


def rendezvous_rank(names: Sequence[str], key: int) -> List[int]:
    """Indices of `names` by decreasing weight for `key` (the first is the owner)."""
    n = len(names)
    if n == 0:
        return []
    arr = (ctypes.c_char_p * n)(*[s.encode("utf-8") for s in names])
    order = (ctypes.c_size_t * n)()
    _check(_native.lib().kvshade_rendezvous_rank(arr, n, key, order))
    return list(order)


class Placement:
    """A static list of endpoint names (the same names, in any order, that the C++ Router is
    given: RouterEndpoint.name, or the target when no name is set)."""

    def __init__(self, names: Sequence[str], route_prefix_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS):
        if not names:
            raise InvalidArgument("Placement: names must not be empty")
        if len(set(names)) != len(names):
            raise InvalidArgument("Placement: endpoint names must be unique")
        if route_prefix_tokens <= 0:
            raise InvalidArgument("route_prefix_tokens must be > 0, got %d" % route_prefix_tokens)
        self.names = list(names)
        self.route_prefix_tokens = route_prefix_tokens

    def key(self, model_id: str, token_ids) -> int:
        return prefix_key(model_id, token_ids, self.route_prefix_tokens)

    def rank(self, model_id: str, token_ids) -> List[str]:
        """Every endpoint name, owner first, then the order new keys fail over in."""
        return [self.names[i] for i in rendezvous_rank(self.names, self.key(model_id, token_ids))]

    def owner(self, model_id: str, token_ids) -> str:
        return self.rank(model_id, token_ids)[0]
