"""kvshade._native against the C ABI it declares (client/include/kvshade/kvshade.h), read
here by a parser of this test's own, independent of scripts/gen_native.py that generates
the declarations: every function the header exports is declared in _native._SIGNATURES
with the header's number of parameters, nothing is declared that the header lacks, and
every ctypes structure mirrors its C struct field for field (names and order). A function
or field added on one side only fails here, not as a crash in a caller. No library, no
server. (test_native_gen.py checks that the generated module is current.)"""
import os
import re
import unittest

import kvshade_testutil  # noqa: F401  (puts client/python on sys.path)
from kvshade import _native

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "include",
                      "kvshade", "kvshade.h")

# ctypes structure -> the C struct it mirrors.
STRUCTS = {
    "ClientOptions": "kvshade_client_options",
    "Model": "kvshade_model",
    "Profile": "kvshade_profile",
    "SessionCreated": "kvshade_session_created",
    "SessionInfo": "kvshade_session_info",
    "Attachment": "kvshade_attachment",
    "SlotDelta": "kvshade_slot_delta",
    "NewTokens": "kvshade_new_tokens",
    "AttachOptions": "kvshade_attach_options",
    "Stats": "kvshade_stats",
    "DeviceStats": "kvshade_device_stats",
    "LayerSelection": "kvshade_layer_selection",
    "TensorParallel": "kvshade_tensor_parallel",
    "TensorParallelShard": "kvshade_tensor_parallel_shard",
}


def header_text():
    with open(HEADER) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_functions():
    out = {}
    for m in re.finditer(r"KVSHADE_API\s+[^;{}()]*?\b(kvshade_\w+)\s*\(([^)]*)\)\s*;", header_text()):
        params = m.group(2).strip()
        out[m.group(1)] = 0 if params in ("", "void") else len([p for p in params.split(",") if p.strip()])
    return out


def header_structs():
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(kvshade_\w+)\s*\{(.*?)\}\s*\1\s*;", header_text(), flags=re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            # "uint32_t a, b" declares two fields; arrays and pointers keep their names.
            head, *rest = decl.split(",")
            names = [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", head)[0]]
            names += [re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", r)[0] for r in rest]
            fields += names
        out[m.group(1)] = fields
    return out


class NativeAbiTest(unittest.TestCase):
    def test_every_function_is_declared_with_the_headers_arity(self):
        header = header_functions()
        self.assertGreater(len(header), 50, "the header parser found too few functions")
        declared = _native._SIGNATURES
        self.assertEqual(sorted(set(header) - set(declared)), [], "in kvshade.h, not in _native._SIGNATURES")
        self.assertEqual(sorted(set(declared) - set(header)), [], "in _native._SIGNATURES, not in kvshade.h")
        wrong = {name: (len(declared[name][1]), n) for name, n in header.items() if len(declared[name][1]) != n}
        self.assertEqual(wrong, {}, "(declared, header) parameter counts differ")

    def test_structures_mirror_the_c_structs(self):
        structs = header_structs()
        import ctypes
        mirrored = {name for name, v in vars(_native).items()
                    if isinstance(v, type) and issubclass(v, ctypes.Structure) and v is not ctypes.Structure}
        self.assertEqual(mirrored, set(STRUCTS), "a ctypes structure of _native not checked here, or gone")
        self.assertEqual(set(structs), set(STRUCTS.values()), "a C struct of kvshade.h without its mirror")
        for py, c in STRUCTS.items():
            with self.subTest(struct=c):
                self.assertIn(c, structs, "kvshade.h has no typedef struct %s" % c)
                fields = [f[0] for f in getattr(_native, py)._fields_]
                self.assertEqual(fields, structs[c])

    def test_error_classes_carry_the_headers_codes(self):
        from kvshade import _native_abi, errors
        for code, cls in errors.BY_CODE.items():
            with self.subTest(cls=cls.__name__):
                name = "KVSHADE_" + re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()
                self.assertEqual(getattr(_native_abi, name, None), code, "%s.code != %s" % (cls.__name__, name))
        self.assertEqual(len(errors.BY_CODE), 16)


if __name__ == "__main__":
    unittest.main()
