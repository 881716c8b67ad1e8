#!/usr/bin/env python3
"""Runs a command and checks how it ends: its exit code, that it ends within a time limit (no
hang), and that its output carries an expected message exactly once (one clear message, not one
per rank)."""
import argparse
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--code", required=True, help="expected exit code, or 'nonzero'")
parser.add_argument("--message", action="append", default=[], help="text that must appear in the output")
parser.add_argument("--once", default="tessera: error", help="text that must appear at most once")
parser.add_argument("--timeout", type=float, default=120)
parser.add_argument("command", nargs=argparse.REMAINDER)
args = parser.parse_args()
command = args.command[1:] if args.command and args.command[0] == "--" else args.command

try:
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.timeout)
except subprocess.TimeoutExpired as e:
    print((e.stdout or b"").decode(errors="replace"))
    sys.exit(f"FAIL: the command did not end within {args.timeout} s (a hang)")
output = result.stdout.decode(errors="replace")
print(output)
problems = []
if args.code == "nonzero":
    if result.returncode == 0:
        problems.append("exit code 0, expected non-zero")
elif result.returncode != int(args.code):
    problems.append(f"exit code {result.returncode}, expected {args.code}")
for m in args.message:
    if m not in output:
        problems.append(f"message {m!r} not in the output")
if args.once and output.count(args.once) > 1:
    problems.append(f"{args.once!r} printed {output.count(args.once)} times, expected once")
if problems:
    sys.exit("FAIL: " + "; ".join(problems))
print("OK")
