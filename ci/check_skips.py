"""Fail when a test run skipped a test for any reason but a missing CUDA device.

Used by ``.ci/run``'s second leg (no vLLM there: its test files are deselected by name, so any
other skip means a test that should run did not). Usage: ``python ci/check_skips.py REPORT.xml``
(pytest's ``--junitxml``); prints each skip and exits 1 when one is not about CUDA.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

#: the reason tests that need a CUDA device skip with (tests/test_cuda.py, tests/test_decode_step.py)
ALLOWED = "needs a CUDA GPU"


def main(path: str) -> int:
    bad = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        for skipped in case.findall("skipped"):
            reason = skipped.get("message", "")
            ok = reason.startswith(ALLOWED)
            bad += not ok
            print(f"{'skipped' if ok else 'SKIPPED, NOT ALLOWED'}: {case.get('classname')}::"
                  f"{case.get('name')}: {reason}")
    if bad:
        print(f"{bad} test(s) skipped for a reason other than a missing CUDA device")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
