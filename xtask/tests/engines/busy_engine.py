#!/usr/bin/env python3
"""A stand-in engine for A/B tests, speaking the arm protocol: each "token" takes a fixed 4 ms
(a timed wait: CPython's own speed varies by 15% between processes with the memory layout, which
would test Python rather than the harness); with EXTRA_SLEEP_PCT=3 every decode step also waits 3%
of that step's own time, a real 3% slowdown. Prints one JSON line: prefill_ms, decode_ms,
n_prompt, n_gen, tokens, step_ms, peak_rss_kb."""
import json
import os
import resource
import time

extra = float(os.environ.get("EXTRA_SLEEP_PCT", "0")) / 100.0
ids = [int(t) for t in os.environ["TOUCHSTONE_PROMPT_IDS"].split(",")]
n_gen = int(os.environ["TOUCHSTONE_N_GENERATE"])


def work(seconds=0.004):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(max(0.0, end - time.perf_counter()) * 0.9)


work()  # warm-up
t0 = time.perf_counter()
work(0.001 * len(ids))
tokens = [ids[-1] % 97]
prefill_ms = (time.perf_counter() - t0) * 1e3
steps = []
t1 = time.perf_counter()
for k in range(n_gen - 1):
    ts = time.perf_counter()
    work()
    if extra > 0:
        time.sleep((time.perf_counter() - ts) * extra)
    tokens.append((tokens[-1] * 31 + k) % 97)
    steps.append((time.perf_counter() - ts) * 1e3)
decode_ms = (time.perf_counter() - t1) * 1e3
print(json.dumps({"prefill_ms": prefill_ms, "decode_ms": decode_ms, "n_prompt": len(ids), "n_gen": n_gen, "tokens": tokens, "step_ms": steps,
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
