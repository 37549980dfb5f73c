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

One daemon per GPU (the Helm chart's gpusPerNode; deploy/README.md "One daemon per GPU"):
the daemon of the node's GPU i listens on the base port + i, where i counts the node's GPUs
in PCI bus order. A worker finds the daemon of its own GPU, whatever GPUs its container sees:

    from kvshade.routing import gpu_daemon_target, local_gpu_index
    target = gpu_daemon_target("kvshade.kvshade.svc:50551", local_gpu_index(torch.cuda.current_device()))

One daemon for every GPU of the node (backend cuda:all; deploy/README.md "One daemon for
every GPU"): every worker talks to the one daemon and says which GPU it runs on, by PCI bus
id, when it creates or attaches a session:

    from kvshade.routing import local_gpu_pci_bus_id
    dev = local_gpu_pci_bus_id(torch.cuda.current_device())
    s = client.create_session(model, profile, ids, device=dev)
    a = client.attach(s.session_id, "worker-0", device=dev)

The transformers adapters (hf_cache, serving, hf_batching) and torch_hook do this for the
model's GPU by default: session_device() finds it among the daemon's devices
(Client.device_stats()) by PCI bus id, and choose_device() is the rule it applies.
"""
import ctypes
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


def gpu_daemon_target(base_target: str, gpu: int) -> str:
    """The address of the daemon of the node's GPU `gpu` where a node runs one daemon per GPU:
    base_target (HOST:PORT, the daemon of GPU 0) with its port plus gpu."""
    host, sep, port = base_target.rpartition(":")
    if not sep or not host or not port.isdigit() or base_target.startswith("unix:"):
        raise InvalidArgument("gpu_daemon_target: base_target must be HOST:PORT, got %r" % (base_target,))
    if gpu < 0 or int(port) + gpu > 65535:
        raise InvalidArgument("gpu_daemon_target: no port for GPU %d from %r" % (gpu, base_target))
    return "%s:%d" % (host, int(port) + gpu)


def _pci_address(text: str) -> Tuple[int, int, int, int]:
    """(domain, bus, device, function) of "DOMAIN:BUS:DEVICE.FUNCTION" (hexadecimal, any case and
    width: CUDA writes 0000:3B:00.0, NVML 00000000:3B:00.0, sysfs 0000:3b:00.0)."""
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        raise InvalidArgument("not a PCI address (DOMAIN:BUS:DEVICE.FUNCTION): %r" % (text,)) from None


def node_gpus(sysfs: str = "/sys/bus/pci/devices") -> List[str]:
    """The PCI addresses of the node's NVIDIA GPUs (vendor 0x10de, display or 3D controller,
    bound to the nvidia driver), in PCI bus order: the order, and so the numbering, of the
    CUDA devices of a process that sees every GPU with CUDA_DEVICE_ORDER=PCI_BUS_ID, as the
    per-GPU daemons do. sysfs shows every device of the node, also in a container that sees
    one GPU."""
    found = []
    for name in os.listdir(sysfs):
        d = os.path.join(sysfs, name)
        try:
            with open(os.path.join(d, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(d, "class")) as f:
                klass = f.read().strip()
            driver = os.path.basename(os.readlink(os.path.join(d, "driver")))
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03") and driver == "nvidia":
            found.append(name)
    return sorted(found, key=_pci_address)


def node_gpu_index(pci_bus_id: str, sysfs: str = "/sys/bus/pci/devices") -> int:
    """The node's index of the GPU at PCI address pci_bus_id (cudaDeviceGetPCIBusId,
    nvidia-smi's pci.bus_id): its place in node_gpus(), which is the cuda:i of its daemon."""
    want = _pci_address(pci_bus_id)
    gpus = node_gpus(sysfs)
    for i, address in enumerate(gpus):
        if _pci_address(address) == want:
            return i
    raise InvalidArgument("GPU %s is not among the node's NVIDIA GPUs in %s (%s)"
                          % (pci_bus_id, sysfs, ", ".join(gpus) or "none"))


def local_gpu_index(device: int = 0, sysfs: str = "/sys/bus/pci/devices") -> int:
    """The node's index of this process's CUDA device `device` (an ordinal under this process's
    own CUDA_VISIBLE_DEVICES and device order), found by its PCI address through the CUDA
    driver (cuInit, cuDeviceGetPCIBusId)."""
    return node_gpu_index(local_gpu_pci_bus_id(device), sysfs)


def local_gpu_pci_bus_id(device: int = 0) -> str:
    """The PCI bus id ("0000:3B:00.0") of this process's CUDA device `device`, through the CUDA
    driver: what a worker passes as `device` to Client.create_session and Client.attach on a
    daemon that serves every GPU of the node (docs/OPERATIONS.md "Devices"), whatever the two
    processes' CUDA_VISIBLE_DEVICES and device orders."""
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int()
    bus_id = ctypes.create_string_buffer(64)
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(handle), device)),
                       ("cuDeviceGetPCIBusId", (bus_id, 64, handle))):
        rc = getattr(lib, call)(*args)
        if rc != 0:
            raise InvalidArgument("%s failed (CUDA error %d) for device %d" % (call, rc, device))
    return bus_id.value.decode()


def _worker_gpu(worker_device) -> Optional[int]:
    """This process's CUDA ordinal of `worker_device` (a torch.device, "cuda", "cuda:N", an int
    N), or None when it names no GPU ("cpu", "meta", None)."""
    if worker_device is None:
        return None
    if isinstance(worker_device, bool) or not isinstance(worker_device, (int, str)) \
            and not hasattr(worker_device, "type"):
        raise InvalidArgument("worker device must be a torch.device, 'cuda[:N]', 'cpu' or a CUDA ordinal, got %r"
                              % (worker_device,))
    if isinstance(worker_device, int):
        if worker_device < 0:
            raise InvalidArgument("CUDA ordinal must be >= 0, got %d" % worker_device)
        return worker_device
    if isinstance(worker_device, str):
        kind, _, index = worker_device.partition(":")
        if kind != "cuda":
            return None
        if index and not index.isdigit():
            raise InvalidArgument("not a CUDA device: %r" % (worker_device,))
        ordinal: Optional[int] = int(index) if index else None
    else:  # a torch.device
        if worker_device.type != "cuda":
            return None
        ordinal = worker_device.index
    if ordinal is None:  # "cuda": the current device, as torch places a tensor there
        import torch
        ordinal = torch.cuda.current_device()
    return ordinal


def choose_device(daemon_devices: Sequence[Dict[str, Any]], worker_device: Any = None, same_node: bool = True,
                  pci_bus_id_of: Optional[Callable[[int], str]] = None) -> str:
    """The `device` a worker passes to Client.create_session, lookup_prefix and attach so that
    its sessions live on its own GPU (docs/OPERATIONS.md "Devices"), or "" for the daemon's
    first device (what a call without a device gets).

    daemon_devices: Client.device_stats() (each a dict with "device" and "pci_bus_id")
    worker_device : where the worker's model runs: a torch.device, "cuda:N" / "cuda" / an int
                    N (this process's CUDA ordinal, under its own CUDA_VISIBLE_DEVICES), or
                    "cpu" / None
    same_node     : the worker runs on the daemon's node (it decodes same-node, or its
                    decoder does); False for a worker elsewhere (the RPC decode path)
    pci_bus_id_of : ordinal -> PCI bus id (default local_gpu_pci_bus_id, the CUDA driver's)

    The daemon's name of the worker's GPU (e.g. "cuda:1"), found by PCI bus id, so that the
    two processes' CUDA_VISIBLE_DEVICES and device orders do not matter, when the daemon has
    several devices and one of them is that GPU. "" (nothing changes from a call without a
    device) for a worker not on a GPU, a daemon with one device (it serves every worker, as
    before: a daemon per GPU, a CPU daemon), a daemon whose devices are CPU devices (none is
    a GPU), and a worker on another node (same_node=False) whose GPU the daemon does not
    have. Raises InvalidArgument, naming the GPU and the daemon's devices, for a worker on
    the daemon's node whose GPU a daemon of several GPUs does not serve: its sessions would
    live in another GPU's memory and its same-node decode would read them there.
    """
    ordinal = _worker_gpu(worker_device)
    if ordinal is None or len(daemon_devices) <= 1:
        return ""
    gpus = [d for d in daemon_devices if d.get("pci_bus_id")]
    if not gpus:
        return ""
    bus_id = (pci_bus_id_of or local_gpu_pci_bus_id)(ordinal)
    want = _pci_address(bus_id)
    for d in gpus:
        if _pci_address(d["pci_bus_id"]) == want:
            return d["device"]
    if not same_node:
        return ""
    served = ", ".join("%s (%s)" % (d["device"], d["pci_bus_id"]) if d.get("pci_bus_id") else d["device"]
                       for d in daemon_devices)
    raise InvalidArgument(
        "this worker's GPU cuda:%d (PCI %s) is not one of the daemon's devices: %s. Its sessions would live in "
        "another GPU's memory: run the worker on a GPU the daemon serves or start the daemon with this one "
        "(backend cuda:all), or pass device= (a device of the daemon, or '' for its first; decode='rpc' for a "
        "worker on another node)" % (ordinal, bus_id, served))


def session_device(client: Any, device: Any = None, model_device: Any = None, same_node: bool = True,
                   pci_bus_id_of: Optional[Callable[[int], str]] = None) -> str:
    """The `device` string the adapters pass to the daemon, from their `device=` keyword:

    None (default): the GPU of the model (model_device), by choose_device over the daemon's
          devices (one Client.device_stats() call);
    a torch.device or an int: that GPU of this process instead, by the same rule;
    a str: as is, the daemon's own name of a device ("cuda:1", "cpu:0", "cpu") or a CUDA
          device's PCI bus id ("0000:3b:00.0", any case, a 4- or 8-digit domain), "" for
          the daemon's first device; the daemon refuses one it does not serve
          (InvalidArgument naming its devices). A str "cuda:N" is the daemon's numbering,
          not this process's: pass torch.device("cuda:N") for this process's GPU N."""
    if isinstance(device, str):
        return device
    worker = model_device if device is None else device
    if _worker_gpu(worker) is None:
        return ""  # no GPU, no question for the daemon
    return choose_device(client.device_stats(), worker, same_node=same_node, pci_bus_id_of=pci_bus_id_of)
