"""ctypes bindings of libkvshade.so (the C ABI of client/include/kvshade/kvshade.h).

The declarations (structures, restype and argtypes of every function) are in
_native_abi.py, generated from the header by scripts/gen_native.py (`make native`); this
module finds and loads the library and applies them.

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

from . import _native_abi as _abi
# The structures callers fill and read, as kvshade.h declares them (generated: _native_abi.py).
from ._native_abi import (Attachment, AttachOptions, ClientOptions, DeviceStats, LayerSelection, Model,  # noqa: F401
                          NewTokens, Profile, SessionCreated, SessionInfo, SlotDelta, Stats,
                          TensorParallel, TensorParallelShard)

ABI_VERSION = _abi.KVSHADE_ABI_VERSION
ID_CAP = _abi.KVSHADE_ID_CAP

# name -> (restype, argtypes), generated from kvshade.h by scripts/gen_native.py.
_SIGNATURES = _abi.SIGNATURES


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
