#!/usr/bin/env python3
"""llama.cpp as an A/B arm (`cargo xtask ab --a "exec:python3 tools/peers/llama_cpp_arm.py" ...`).

A development peer, never a runtime dependency: it needs the PyPI sdist `llama-cpp-python`
(`pip install llama-cpp-python`, which builds llama.cpp from source, ~12 min on 2 cores).
It speaks the arm protocol: reads TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS and
TOUCHSTONE_N_GENERATE, runs one warm-up and one measured greedy generation on 2 threads, and prints
one JSON line: prefill_ms (to the first token), decode_ms, n_prompt, n_gen, tokens, step_ms.
TOUCHSTONE_LLAMA_EXTRA_BUFTS=0 loads the weights without llama.cpp's repacked/AMX buffers (its
AMX matmul crashes on an AMX CPU whose kernel does not grant the process AMX state), as the dump
peer does.
"""
import json
import os
import time

import llama_cpp.llama_cpp as low
from llama_cpp import Llama

if os.environ.get("TOUCHSTONE_LLAMA_EXTRA_BUFTS", "1") == "0":
    # `Llama` takes its model parameters from this function when it loads the model.
    default_params = low.llama_model_default_params

    def no_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_extra_bufts

ids = [int(t) for t in os.environ["TOUCHSTONE_PROMPT_IDS"].split(",")]
n_gen = int(os.environ["TOUCHSTONE_N_GENERATE"])
threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
# The context holds the prompt and what it generates (a 1,000-token prompt needs more than 512).
n_ctx = max(512, len(ids) + n_gen + 16)
llm = Llama(model_path=os.environ["TOUCHSTONE_MODEL"], n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)


def run():
    llm.reset()
    tokens, stamps = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(tok))
        if len(tokens) == n_gen:
            break
    steps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return {"prefill_ms": (stamps[0] - t0) * 1e3, "decode_ms": (stamps[-1] - stamps[0]) * 1e3, "n_prompt": len(ids), "n_gen": len(tokens), "tokens": tokens, "step_ms": steps}


run()  # warm-up
print(json.dumps(run()))
