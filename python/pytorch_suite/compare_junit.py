"""Compares two pytest JUnit XML reports of one test file: the stock run and
the run with our code in PyTorch's place (storage_sharing.torch enabled, or
our content store's names swapped in). Prints the totals of each and the
tests that pass stock but not with ours; exits 1 when there is any, or when
no test passed stock (then the run itself is broken)."""

import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    """{test id: "passed" | "failed" | "skipped"} of one report."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            result[test_id] = "failed"
        elif "skipped" in tags:
            result[test_id] = "skipped"
        else:
            result[test_id] = "passed"
    return result


def totals(result):
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in result.values():
        counts[outcome] += 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def main(stock_xml, ours_xml):
    stock, enabled = outcomes(stock_xml), outcomes(ours_xml)
    print(f"stock:   {len(stock)} tests: {totals(stock)}")
    print(f"ours:    {len(enabled)} tests: {totals(enabled)}")
    regressions = sorted(t for t, o in stock.items() if o == "passed" and enabled.get(t, "missing") != "passed")
    both = sorted(t for t, o in stock.items() if o == "failed" and enabled.get(t) == "failed")
    fixed = sorted(t for t, o in stock.items() if o == "failed" and enabled.get(t) == "passed")
    for title, tests in (
        ("fail in both runs", both),
        ("fail stock, pass with ours", fixed),
        ("PASS STOCK BUT NOT WITH OURS", regressions),
    ):
        print(f"{title}: {len(tests)}")
        for test in tests:
            print(f"  {test} ({enabled.get(test, 'missing')})" if tests is regressions else f"  {test}")
    if not any(o == "passed" for o in stock.values()):
        print("no test passed stock: the run itself is broken (see its output above)")
        return 1
    return 1 if regressions else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: compare_junit.py STOCK.xml OURS.xml")
    sys.exit(main(sys.argv[1], sys.argv[2]))
