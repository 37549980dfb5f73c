"""Runs unittest modules as `python3 -m unittest -v <module>...` does, with one more exit code
so that ctest can tell a suite that skipped from one that passed:

    0   every test ran and passed (some may have skipped: they are listed at the end)
    1   a failure or an error, or no test at all
    77  every test skipped (ctest: SKIP_RETURN_CODE 77, reported as "Not Run (Skipped)")

    cd tests/python && python3 run_unittest.py test_hf_adapter [more modules or Class.test names]
"""
import sys
import unittest

SKIPPED = 77


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    suite = unittest.defaultTestLoader.loadTestsFromNames(argv)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    ran, skipped = result.testsRun, len(result.skipped)
    if skipped:
        print("skipped %d of %d:" % (skipped, ran))
        for test, why in result.skipped:
            print("  %s: %s" % (test.id(), why))
    if not result.wasSuccessful():
        return 1
    if ran == 0:
        print("no tests ran", file=sys.stderr)
        return 1
    if skipped == ran:
        print("all %d tests skipped" % ran)
        return SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
