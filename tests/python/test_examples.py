"""The examples (client/examples/doc_qa.py, two_workers.py) and the Python snippet of
client/README.md run twice against ONE long-lived kvshade-server, as a user following the
README would: the second run finds its document in the prefix cache (nothing to ingest)
and must work too, and no run leaves a session open, also when it fails."""
import os
import re
import subprocess
import sys
import tempfile
import unittest

from kvshade_testutil import Server

import kvshade

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLES = os.path.join(ROOT, "client", "examples")


def config(text):
    """A server config file with `text`; the caller deletes it."""
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kvshade-examples-", delete=False)
    f.write(text)
    f.close()
    return f.name


def run(args, timeout=240):
    out = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


class ExamplesRerunTest(unittest.TestCase):
    def open_sessions(self, target):
        with kvshade.Client(target, timeout=30) as c:
            return c.stats()["sessions"]

    def test_doc_qa_twice_on_one_server(self):
        with Server() as server:
            args = [os.path.join(EXAMPLES, "doc_qa.py"), "--target", server.target, "--doc-tokens", "1024",
                    "--questions", "2", "--steps", "2"]
            rc, first, err = run(args)
            self.assertEqual(rc, 0, first + err)
            self.assertIn("document: 1024 tokens ingested", first)
            self.assertEqual(self.open_sessions(server.target), 0)
            rc, second, err = run(args)
            self.assertEqual(rc, 0, second + err + server.log())
            self.assertIn("document: all 1024 tokens reused from the prefix cache, nothing to ingest", second)
            self.assertEqual(len(re.findall(r"^question \d+: forked 1024 shared tokens", second, re.M)), 2, second)
            for out in (first, second):
                self.assertEqual(len(re.findall(r"needle chunk attended by every head in 4 of 4 layer-steps", out)),
                                 2, out)
            self.assertEqual(self.open_sessions(server.target), 0)

    def test_doc_qa_fails_when_the_needle_is_not_attended(self):
        # Without a needle in the document its chunk is not what the queries select: the
        # example's check must fail the run (exit status 1), and still close its sessions.
        with Server() as server:
            rc, out, err = run([os.path.join(EXAMPLES, "doc_qa.py"), "--target", server.target, "--doc-tokens",
                                "1024", "--questions", "1", "--steps", "2", "--needle-scale", "0"])
            self.assertEqual(rc, 1, out + err)
            self.assertIn("error: question 0: the needle's chunk 64 was missing", err)
            self.assertEqual(self.open_sessions(server.target), 0)

    def test_doc_qa_that_fails_closes_its_sessions(self):
        # A per-session token limit that the document fits and document + question does
        # not: the first AppendTokens fails (RESOURCE_EXHAUSTED) after the document and a
        # fork exist.
        cfg = config("limits:\n  max_tokens_per_session: 1030\n")
        try:
            with Server("-c", cfg) as server:
                rc, out, err = run([os.path.join(EXAMPLES, "doc_qa.py"), "--target", server.target,
                                    "--doc-tokens", "1024", "--question-tokens", "16", "--questions", "1"])
                self.assertNotEqual(rc, 0, out + err)
                self.assertIn("ResourceExhausted", err)
                self.assertEqual(self.open_sessions(server.target), 0)
        finally:
            os.unlink(cfg)

    def test_two_workers_twice_on_one_server_over_ucx(self):
        cfg = config('ucx:\n  enable: true\n  transports: "tcp,self"\n')
        try:
            with Server("-c", cfg) as server:
                args = [os.path.join(EXAMPLES, "two_workers.py"), "--target", server.target, "--ucx", "tcp,self",
                        "--doc-tokens", "1024", "--steps", "3"]
                rc, first, err = run(args)
                self.assertEqual(rc, 0, first + err)
                self.assertIn("1024 tokens ingested once", first)
                self.assertEqual(self.open_sessions(server.target), 0)
                rc, second, err = run(args)
                self.assertEqual(rc, 0, second + err + server.log())
                self.assertIn("all 1024 tokens reused from the prefix cache, nothing to ingest", second)
                self.assertIn("reader step 2:", second)
                self.assertIn("document session now: 1027 tokens (3 appended by the writer)", second)
                self.assertIn("reader: decoded over UCX, 0 fallbacks to gRPC", second)
                self.assertEqual(self.open_sessions(server.target), 0)
        finally:
            os.unlink(cfg)

    def test_readme_python_snippet_twice_on_one_server(self):
        with open(os.path.join(ROOT, "client", "README.md")) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        snippet = [b for b in blocks if 'kvshade.Client("127.0.0.1:50551"' in b
                   and "LocalDecoder" not in b and "RemoteDecoder" not in b]
        self.assertEqual(len(snippet), 1, "the Python package snippet of client/README.md")
        with Server() as server:
            code = snippet[0].replace("127.0.0.1:50551", server.target)
            code += "\nprint('reused', s.reused_tokens, 'ingested', s.tokens_to_ingest, 'out', out.shape)\n"
            rc, first, err = run(["-c", code])
            self.assertEqual(rc, 0, first + err)
            self.assertIn("reused 0 ingested 1024 out (1, 8, 64)", first)
            rc, second, err = run(["-c", code])
            self.assertEqual(rc, 0, second + err + server.log())
            self.assertIn("reused 1024 ingested 0 out (1, 8, 64)", second)
            self.assertEqual(self.open_sessions(server.target), 0)

    def run_snippet_twice(self, marker, what, expect):
        """The one client/README.md Python block containing `marker`, run twice against one
        server: both runs print `expect` and leave no session open."""
        with open(os.path.join(ROOT, "client", "README.md")) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        snippet = [b for b in blocks if marker in b]
        self.assertEqual(len(snippet), 1, "the %s snippet of client/README.md" % what)
        with Server() as server:
            code = snippet[0].replace("127.0.0.1:50551", server.target)
            for run_no in range(2):
                rc, out, err = run(["-c", code])
                self.assertEqual(rc, 0, out + err + server.log())
                self.assertIn(expect, out)
            self.assertEqual(self.open_sessions(server.target), 0)

    def test_readme_same_node_snippet_twice_on_one_server(self):
        self.run_snippet_twice("LocalDecoder(c,", "same-node", "same-node decode: (1, 8, 64) torch.float32")

    def test_readme_remote_decode_snippet_twice_on_one_server(self):
        self.run_snippet_twice("RemoteDecoder(c,", "remote-decode",
                               "remote decode: (1, 8, 64) torch.float32 delivery inline")


if __name__ == "__main__":
    unittest.main()
