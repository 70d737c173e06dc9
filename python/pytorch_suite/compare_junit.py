"""Compares two pytest JUnit XML reports of one test file: the stock run and
the run with storage_sharing.torch enabled. Prints the totals of each and the
tests that pass stock but not with enable(); exits 1 when there is any."""

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


def main(stock_xml, enabled_xml):
    stock, enabled = outcomes(stock_xml), outcomes(enabled_xml)
    print(f"stock:   {len(stock)} tests: {totals(stock)}")
    print(f"enabled: {len(enabled)} tests: {totals(enabled)}")
    regressions = sorted(t for t, o in stock.items() if o == "passed" and enabled.get(t, "missing") != "passed")
    both = sorted(t for t, o in stock.items() if o == "failed" and enabled.get(t) == "failed")
    fixed = sorted(t for t, o in stock.items() if o == "failed" and enabled.get(t) == "passed")
    for title, tests in (
        ("fail in both runs", both),
        ("fail stock, pass with enable()", fixed),
        ("PASS STOCK BUT NOT WITH enable()", regressions),
    ):
        print(f"{title}: {len(tests)}")
        for test in tests:
            print(f"  {test} ({enabled.get(test, 'missing')})" if tests is regressions else f"  {test}")
    return 1 if regressions else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: compare_junit.py STOCK.xml ENABLED.xml")
    sys.exit(main(sys.argv[1], sys.argv[2]))
