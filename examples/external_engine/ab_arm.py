#!/usr/bin/env python3
"""The template engine (engine.py, beside this file) as an `ab` arm: a template.

`cargo xtask ab --a "exec:python3 base/ab_arm.py" --b "exec:python3 head/ab_arm.py" --model tiny-llama`
runs this once per measured request, each time a fresh process, A and B interleaved. The arm
protocol (docs/COMMANDS.md, "The exec: arm"): read TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS and
TOUCHSTONE_N_GENERATE; generate that many tokens greedily; print ONE line of JSON on stdout:

    {"prefill_ms": ..., "decode_ms": ..., "n_prompt": ..., "n_gen": ..., "tokens": [...],
     "step_ms": [...], "peak_rss_kb": ...}

prefill_ms is the time to the first generated token, decode_ms the time from it to the last,
step_ms each decode step (optional: `ab` then compares the fastest step, the engine's own speed on
a noisy machine), peak_rss_kb the process's peak memory (optional). Time only the request, not
loading the model; anything else goes to stderr.

To adapt it: keep `main()`; replace `prefill()` and `step()` with your engine's (a real engine
keeps its KV cache between steps; this template recomputes the sequence, as engine.py has no cache).
"""
import json
import os
import resource
import sys
import time

import engine  # engine.py beside this file (it needs numpy and gguf)

np = engine.np


def prefill(state, ids):
    """Runs the prompt; returns the logits of its last position."""
    state["seq"] = list(ids)
    return engine.forward(state["cfg"], state["w"], state["seq"], {})[-1]


def step(state, token):
    """Appends one token; returns the logits of the new last position."""
    state["seq"].append(token)
    return engine.forward(state["cfg"], state["w"], state["seq"], {})[-1]


def main():
    ids = [int(t) for t in os.environ["TOUCHSTONE_PROMPT_IDS"].split(",")]
    n_gen = int(os.environ["TOUCHSTONE_N_GENERATE"])
    cfg, w = engine.load(os.environ["TOUCHSTONE_MODEL"])
    state = {"cfg": cfg, "w": w}
    t0 = time.perf_counter()
    tokens = [int(np.argmax(prefill(state, ids)))]
    stamps = [time.perf_counter()]
    while len(tokens) < n_gen:
        tokens.append(int(np.argmax(step(state, tokens[-1]))))
        stamps.append(time.perf_counter())
    line = {
        "prefill_ms": (stamps[0] - t0) * 1e3,
        "decode_ms": (stamps[-1] - stamps[0]) * 1e3,
        "n_prompt": len(ids),
        "n_gen": len(tokens),
        "tokens": tokens,
        "step_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])],
        # Linux states ru_maxrss in KiB.
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
