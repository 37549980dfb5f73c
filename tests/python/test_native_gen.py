"""client/python/kvshade/_native_abi.py is what scripts/gen_native.py writes from kvshade.h
today: regenerated into a temporary file, it must equal the checked-in one (else: run
`make native` and commit the result). And the generator stops, naming the line, on a
declaration it cannot read instead of guessing. No library, no server."""
import difflib
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
GENERATOR = os.path.join(ROOT, "scripts", "gen_native.py")
CHECKED_IN = os.path.join(ROOT, "client", "python", "kvshade", "_native_abi.py")


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_native", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NativeGenTest(unittest.TestCase):
    def test_checked_in_module_is_current(self):
        with tempfile.TemporaryDirectory(prefix="kvshade-gen-") as d:
            out = os.path.join(d, "_native_abi.py")
            subprocess.run([sys.executable, GENERATOR, "-o", out], check=True)
            with open(out) as f:
                fresh = f.read()
        with open(CHECKED_IN) as f:
            current = f.read()
        if fresh != current:
            diff = "".join(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True),
                                                CHECKED_IN, "regenerated from kvshade.h"))
            self.fail("%s is stale: run `make native` (/usr/bin/python3 scripts/gen_native.py) and "
                      "commit it\n%s" % (CHECKED_IN, diff))

    def test_check_mode_reports_a_stale_module(self):
        with tempfile.TemporaryDirectory(prefix="kvshade-gen-") as d:
            out = os.path.join(d, "_native_abi.py")
            with open(CHECKED_IN) as f, open(out, "w") as g:
                g.write(f.read().replace("KVSHADE_ID_CAP = ", "KVSHADE_ID_CAP = 1 + "))
            stale = subprocess.run([sys.executable, GENERATOR, "--check", "-o", out],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(stale.returncode, 1, stale.stderr)
            self.assertIn("is stale", stale.stderr)
            self.assertIn("-KVSHADE_ID_CAP = 1 + 128", stale.stdout)
            subprocess.run([sys.executable, GENERATOR, "-o", out], check=True)
            current = subprocess.run([sys.executable, GENERATOR, "--check", "-o", out])
            self.assertEqual(current.returncode, 0)

    def test_unreadable_declarations_stop_the_generator(self):
        gen = load_generator()
        ok = "#include <stdint.h>\nKVSHADE_API int kvshade_f(int32_t a);\n"
        self.assertIn("kvshade_f", [f[0] for f in gen.parse(ok).functions])
        bad = {
            "unknown type": "KVSHADE_API int kvshade_f(long a);",
            "parameter without a name": "KVSHADE_API int kvshade_f(int32_t);",
            "empty parameter list": "KVSHADE_API int kvshade_f();",
            "function pointer": "KVSHADE_API int kvshade_f(void (*cb)(void));",
            "unknown preprocessor line": "#define KVSHADE_X (1 << 2)",
            "unknown conditional": "#ifdef _WIN32\n#endif",
            "declaration of another kind": "typedef int kvshade_int;",
            "enumerator without a value": "enum { KVSHADE_A, KVSHADE_B };",
            "unknown array size": "typedef struct kvshade_s { char x[N]; } kvshade_s;",
            "bit field": "typedef struct kvshade_s { uint32_t x : 3; } kvshade_s;",
            "opaque type by value": "typedef struct kvshade_h kvshade_h;\nKVSHADE_API int kvshade_f(kvshade_h h);",
            "declared twice": "KVSHADE_API int kvshade_f(void);\nKVSHADE_API int kvshade_f(void);",
        }
        for what, text in bad.items():
            with self.subTest(what):
                with self.assertRaises(gen.ParseError):
                    gen.parse(text)


if __name__ == "__main__":
    unittest.main()
