"""The package's layout: kvshade.decoders (the Decoder protocol, LocalDecoder, RemoteDecoder)
and kvshade.integrations (torch_hook, hf_cache, serving, hf_batching) beside the core
(client, errors, routing, testing) and the private ctypes layer (_native, _native_abi).
The former flat module paths (kvshade.local, kvshade.hf_cache, ...) are the same module
objects as the new ones, so code written against either sees one module (one set of
globals to patch, one class identity). Torch stays optional: the core and the two
subpackages import without it."""
import importlib
import os
import subprocess
import sys
import unittest

import kvshade_testutil  # noqa: F401  (puts client/python on sys.path)

import kvshade

FORMER = {
    "kvshade.decoder": "kvshade.decoders.base",
    "kvshade.local": "kvshade.decoders.local",
    "kvshade.remote": "kvshade.decoders.remote",
    "kvshade.torch_hook": "kvshade.integrations.torch_hook",
    "kvshade.hf_cache": "kvshade.integrations.hf_cache",
    "kvshade.serving": "kvshade.integrations.serving",
    "kvshade.hf_batching": "kvshade.integrations.hf_batching",
}


def importable(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


class PackageTest(unittest.TestCase):
    def test_former_paths_are_the_new_modules(self):
        checked = 0
        for old, new in FORMER.items():
            with self.subTest(old=old):
                if not importable(new):  # torch or transformers missing here
                    with self.assertRaises(ImportError):
                        importlib.import_module(old)
                    continue
                self.assertIs(importlib.import_module(old), importlib.import_module(new))
                self.assertIs(sys.modules[old], sys.modules[new])
                parent, _, leaf = old.rpartition(".")
                self.assertIs(getattr(importlib.import_module(parent), leaf), sys.modules[new])
                checked += 1
        self.assertGreaterEqual(checked, 1)  # kvshade.decoder at least: it needs nothing

    def test_one_class_identity(self):
        from kvshade.decoders import Decoder
        self.assertIs(kvshade.Decoder, Decoder)
        if importable("kvshade.decoders.local"):
            from kvshade.local import LocalDecoder as old
            from kvshade.decoders.local import LocalDecoder as new
            self.assertIs(old, new)

    def test_core_and_subpackages_import_without_torch(self):
        code = ("import sys; sys.modules['torch'] = None\n"
                "import kvshade, kvshade.decoders, kvshade.integrations, kvshade.routing, kvshade.errors\n"
                "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
                "print(kvshade.decoders.Decoder.__name__)")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "Decoder")


if __name__ == "__main__":
    unittest.main()
