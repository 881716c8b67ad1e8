"""The failure collector of the multi-process test scripts: check() records and prints each failed
condition and goes on, so that one run reports every problem; exit_if_failed() then ends the
script with all of them."""
import sys

problems = []


def check(condition, message):
    """Records `message` as a failure when `condition` is false; returns the condition."""
    if not condition:
        problems.append(message)
        print(f"FAIL: {message}", flush=True)
    return condition


def exit_if_failed():
    """Exits non-zero naming every failure recorded so far; returns when there is none."""
    if problems:
        print(f"{len(problems)} problem(s)", flush=True)
        sys.exit("FAIL: " + "; ".join(problems))
