"""The profile's knobs, one schema: the protobuf `Profile` message (proto/kvshade/v1/
kvshade.proto) is the definition, and every mirror of it names the same knobs:

  * the C ABI's `kvshade_profile` (client/include/kvshade/kvshade.h), and the Python ctypes
    structure generated from it (test_native_abi checks that one against the header);
  * `kvshade.Profile` (client/python/kvshade/client.py), and the knobs its `_c()` copies
    into the C structure (each one, or handled by name: kind, keep_sink, value_codec,
    recall_action);
  * the server's profile defaults (`profile:` in the daemon's YAML, service/config.cc), which
    may add server-only settings and leave out the knobs that have no server default;
  * the settings table of docs/ALGORITHM.md;
  * the two C++ conversions into the message: the C ABI's (client/capi.cc) and the server's
    defaults (service/model.cc) each set every knob (`set_<knob>(`).

A knob added to the proto and forgotten in one of them fails here, naming the file. Pure
text checks: no library, no server."""
import dataclasses
import inspect
import os
import re
import unittest

import kvshade_testutil  # noqa: F401  (puts client/python on sys.path)
import kvshade

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

# Knobs with no server default (a session's own choice), so absent from the YAML's profile.
NO_SERVER_DEFAULT = {"kind": "the profile kind is the session's choice",
                     "energy_target": "adaptive rank is per session (0 = the fixed rank)"}
# Server-wide settings of the YAML's profile that a session does not set.
SERVER_ONLY = {"int4_from_tokens", "factorize_iterations", "factorize_host_min_tokens"}
# kvshade.Profile._c() sets these by name (conversions), not through its list of numbers.
CONVERTED = {"kind", "keep_sink", "value_codec", "recall_action"}


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def without_comments(text):
    return re.sub(r"//[^\n]*", " ", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def proto_knobs():
    body = re.search(r"message Profile \{(.*?)\n\}", read("proto", "kvshade", "v1", "kvshade.proto"), re.S)
    return re.findall(r"^\s*(?:optional\s+)?\w+\s+(\w+)\s*=\s*\d+\s*;", without_comments(body.group(1)), re.M)


def c_struct_fields():
    body = re.search(r"typedef struct kvshade_profile \{(.*?)\}",
                     without_comments(read("client", "include", "kvshade", "kvshade.h")), re.S)
    names = []
    for decl in body.group(1).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        first, *rest = [d.strip() for d in decl.split(",")]
        names.append(first.split()[-1])
        names.extend(rest)
    return names


def config_keys():
    return re.findall(r'\{"(\w+)", Scalar\(&C::profile', read("service", "config.cc"))


def documented_knobs():
    text = read("docs", "ALGORITHM.md")
    start = text.index("\n## Settings")
    table = text[start:text.index("\n## ", start + 1)]
    names = set()
    for row in re.findall(r"^\| ([^|]*)\|", table, re.M):
        names.update(re.findall(r"`(\w+)`", row))
    return names


class ProfileSchemaTest(unittest.TestCase):
    def setUp(self):
        self.proto = proto_knobs()
        self.assertIn("rank", self.proto)  # the parser found the message
        self.assertEqual(len(self.proto), len(set(self.proto)))

    def assertSameKnobs(self, got, want, where):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        self.assertFalse(missing or extra, "%s: missing %s, not in the proto's Profile %s" % (where, missing, extra))

    def test_the_c_abi_names_every_knob(self):
        self.assertSameKnobs(c_struct_fields(), self.proto, "kvshade.h kvshade_profile")

    def test_the_python_profile_names_every_knob(self):
        fields = [f.name for f in dataclasses.fields(kvshade.Profile)]
        self.assertSameKnobs(fields, self.proto, "kvshade.Profile")

    def test_the_python_profile_copies_every_knob_to_the_c_abi(self):
        source = inspect.getsource(kvshade.Profile._c)
        listed = re.search(r"for name in \((.*?)\):", source, re.S)
        self.assertIsNotNone(listed, "kvshade.Profile._c: its list of knobs")
        names = re.findall(r'"(\w+)"', listed.group(1))
        self.assertSameKnobs(names + sorted(CONVERTED), self.proto, "kvshade.Profile._c")
        for name in CONVERTED:
            self.assertRegex(source, r"\bp\.%s\b" % name, "kvshade.Profile._c sets %s" % name)

    def test_the_server_has_a_default_for_every_knob(self):
        keys = config_keys()
        self.assertSameKnobs([k for k in keys if k not in SERVER_ONLY] + sorted(NO_SERVER_DEFAULT), self.proto,
                             "service/config.cc profile keys")
        self.assertLessEqual(SERVER_ONLY, set(keys))

    def test_the_cpp_conversions_set_every_knob(self):
        for path in (("client", "capi.cc"), ("service", "model.cc")):
            text = without_comments(read(*path))
            missing = [k for k in self.proto if "set_%s(" % k not in text]
            self.assertFalse(missing, "%s sets no %s" % ("/".join(path), missing))

    def test_the_settings_table_documents_every_knob(self):
        documented = documented_knobs()
        missing = sorted(set(self.proto) - documented)
        self.assertFalse(missing, "docs/ALGORITHM.md Settings: no row for %s" % missing)


if __name__ == "__main__":
    unittest.main()
