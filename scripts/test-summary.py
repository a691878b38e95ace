#!/usr/bin/env python3
"""Summary of a scripts/test.sh run: one line per step, and for test steps one line per suite
(passed / failed / skipped), then every skip and failure by name.

Usage: test-summary.py LOGDIR STEP...   (reads LOGDIR/STEP.log and LOGDIR/STEP.status)
Exits 1 when any step failed or any test failed, else 0.

Rust suites: a test that printed a `SKIPPED: ...` line (tests/common `skipped`, which names the
test) counts as skipped, not passed. Python suites: pytest's own counts (run with -ra, so each
skip is listed with its reason).
"""
import os
import re
import sys

RUNNING = re.compile(r"^\s*Running (?:unittests )?(\S+)")
DOCTESTS = re.compile(r"^\s*Doc-tests (\S+)")
RESULT = re.compile(r"^test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored")
FAILED_TEST = re.compile(r"^test (\S+) \.\.\. FAILED")
SKIP_LINE = re.compile(r"^SKIPPED: (.*)$")
# A criterion bench run by `cargo test` (harness = false) prints "Testing NAME" then "Success".
CRITERION_OK = re.compile(r"^Success$")
PANICKED = re.compile(r"^thread '.*' .*panicked at ")
PYTEST_FINAL = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|error|errors|deselected).*) in [\d.]+s")
PYTEST_SKIP = re.compile(r"^SKIPPED \[\d+\] (.*)$")
PYTEST_FAIL = re.compile(r"^(?:FAILED|ERROR) (\S+)")


def cargo_suites(lines):
    """Yields (suite, passed, failed, skipped, skip_names, fail_names) per test binary."""
    suite, skips, fails, benches, panicked = None, [], [], 0, False

    def unfinished():
        # A binary that printed no libtest result: a criterion bench whose every case said
        # "Success" passed; anything else crashed or was killed.
        if benches and not panicked and not fails:
            return suite, benches, 0, 0, skips, fails
        return suite, 0, 1, 0, skips, fails + ["(no test result: the binary crashed or was killed)"]

    for line in lines:
        line = line.rstrip("\n")
        m = RUNNING.match(line) or DOCTESTS.match(line)
        if m:
            if suite is not None:
                yield unfinished()
            suite = m.group(1) if "Doc-tests" not in line else "doctests " + m.group(1)
            skips, fails, benches, panicked = [], [], 0, False
            continue
        if suite is not None and CRITERION_OK.match(line):
            benches += 1
            continue
        if suite is not None and PANICKED.match(line):
            panicked = True
        m = SKIP_LINE.match(line)
        if m and suite is not None:
            skips.append(m.group(1))
            continue
        m = FAILED_TEST.match(line)
        if m and suite is not None:
            fails.append(m.group(1))
            continue
        m = RESULT.match(line)
        if m and suite is not None:
            passed, failed = int(m.group(2)), int(m.group(3))
            # One skipped test per distinct test name before the first ": " of its SKIPPED line.
            skipped_tests = {s.split(": ", 1)[0] if ": " in s else s for s in skips}
            nskip = min(len(skipped_tests), passed)
            yield suite, passed - nskip, failed, nskip, skips, fails
            suite = None
    if suite is not None:
        yield unfinished()


def pytest_suite(lines):
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    skips, fails = [], []
    for line in lines:
        m = PYTEST_SKIP.match(line)
        if m:
            skips.append(m.group(1))
        m = PYTEST_FAIL.match(line)
        if m:
            fails.append(m.group(1))
        m = PYTEST_FINAL.match(line)
        if m:
            for part in m.group(1).split(","):
                n, _, what = part.strip().partition(" ")
                what = "error" if what.startswith("error") else what
                if what in counts and n.isdigit():
                    counts[what] = int(n)
    return counts, skips, fails


def main():
    logdir, steps = sys.argv[1], sys.argv[2:]
    bad = False
    rows, skip_list, fail_list = [], [], []
    for name in steps:
        path = os.path.join(logdir, name + ".log")
        lines = open(path, errors="replace").read().splitlines() if os.path.exists(path) else []
        try:
            rc, secs = open(os.path.join(logdir, name + ".status")).read().split()
        except (OSError, ValueError):
            rc, secs = "?", "?"
        ok = rc == "0"
        bad |= not ok
        suites = list(cargo_suites(lines))
        counts, pskips, pfails = pytest_suite(lines)
        rows.append((name, "ok" if ok else f"FAILED (exit {rc})", f"{secs} s"))
        for suite, p, f, s, skips, fails in suites:
            rows.append((f"  {suite}", f"{p} passed, {f} failed, {s} skipped", ""))
            skip_list += [f"{name} {suite}: {x}" for x in skips]
            fail_list += [f"{name} {suite}: {x}" for x in fails]
            bad |= f > 0
        if not suites and any(counts.values()):
            rows.append(
                (f"  pytest", f"{counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
                 f"{counts['skipped']} skipped", ""))
            skip_list += [f"{name}: {x}" for x in pskips]
            fail_list += [f"{name}: {x}" for x in pfails]
            bad |= counts["failed"] + counts["error"] > 0
    width = max(len(r[0]) for r in rows) if rows else 0
    print("\n== summary (full logs in %s/)" % logdir)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b}  {c}".rstrip())
    if skip_list:
        print(f"\n== skipped ({len(skip_list)})")
        for s in skip_list:
            print("  " + s)
    if fail_list:
        print(f"\n== failed ({len(fail_list)})")
        for s in fail_list:
            print("  " + s)
    print("\n== result: " + ("FAILED" if bad else "all steps passed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
