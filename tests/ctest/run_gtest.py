#!/usr/bin/python3
"""Runs one gtest binary once for ctest and records the verdict of every case.

    run_gtest.py --name NAME --results DIR -- BINARY [ARGS...]

vlm_add_test (top-level CMakeLists.txt) registers this as the ctest test NAME
and one ctest test NAME/Suite.Case per case, which reports the verdict recorded
here (case_result.sh): one process per binary (a LibTorch process costs about
0.4 s to start, and suite fixtures start servers), yet every case, skipped ones
with their reason, is visible in ctest.

The binary's output passes through. Verdicts go to DIR/cases/<case>.{pass,
fail,skip} ('/' in a case name becomes '%'), holding the failure or skip
message. Exit status: 0 when the binary ran to its end and every non-zero exit
is explained by failed cases (their tests fail); 1 when it crashed, timed out
inside, or exited non-zero with no failed case (e.g. a sanitizer report at
exit), since then the cases' verdicts do not tell the whole story.
"""
import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET


def case_file(cases_dir, case):
    return os.path.join(cases_dir, case.replace("/", "%"))


def reason_first(detail):
    """gtest's "file:line\nmessage" as "message (file:line)"."""
    location, _, message = detail.strip().partition("\n")
    if message and location.rpartition(":")[2].isdigit():
        return f"{message.strip()} ({location})"
    return detail.strip()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no binary given")
    shutil.rmtree(args.results, ignore_errors=True)
    cases_dir = os.path.join(args.results, "cases")
    os.makedirs(cases_dir)
    report = os.path.join(args.results, "report.xml")
    sys.stdout.flush()
    try:
        rc = subprocess.call(command + ["--gtest_output=xml:" + report])
    except OSError as e:
        print(f"vlm: {args.name}: cannot run {command[0]}: {e}")
        return 1
    how = f"exit status {rc}" if rc >= 0 else f"signal {-rc}"
    if not os.path.exists(report):
        print(f"vlm: {args.name}: the binary ended ({how}) without writing its report: "
              f"it crashed or exited early; its cases have no recorded result")
        return 1
    try:
        root = ET.parse(report).getroot()
    except ET.ParseError as e:
        print(f"vlm: {args.name}: unreadable report {report}: {e}")
        return 1
    failed = 0
    for case in root.iter("testcase"):
        full = f"{case.get('classname')}.{case.get('name')}"
        failures = case.findall("failure")
        skipped = case.findall("skipped")
        if failures:
            kind = "fail"
            failed += 1
            text = "\n".join((f.text or f.get("message") or "").strip() for f in failures)
        elif case.get("status") == "notrun" or case.get("result") == "suppressed":
            kind, text = "skip", "disabled (DISABLED_ prefix)"
        elif skipped or case.get("result") == "skipped":
            kind = "skip"
            text = "; ".join(reason_first(s.text or s.get("message") or "") for s in skipped)
            if not text:
                text = "skipped by its suite's setup (see the output of ctest test " + args.name + ")"
        else:
            kind, text = "pass", ""
        with open(case_file(cases_dir, full) + "." + kind, "w", encoding="utf-8") as f:
            f.write(text + "\n" if text else "")
    if rc == 0 or (rc == 1 and failed > 0):
        return 0
    print(f"vlm: {args.name}: the binary ended with {how} although "
          f"{'no case failed' if failed == 0 else f'{failed} case(s) failed'}: "
          f"look for a report at exit (sanitizer, leak) above")
    return 1


if __name__ == "__main__":
    sys.exit(main())
