#!/usr/bin/env python3
"""Seeds for the `chat_template` and `ab_line` fuzz targets.

chat_template: the chat templates of the real fixtures (SmolLM2's and Gemma 3's, read with
gguf-py from the GGUF files `cargo xtask fixtures` fetched) and a few that use what templates use
(loops, conditions, macros, filters, raise_exception, Python string methods), each followed by
NUL-separated message contents, as the target splits its input.
ab_line: valid JSON lines of the arm protocol (with and without the optional fields) and near
misses.

    python3 fuzz/seeds/make_text_seeds.py fuzz/corpus        (from the repository root)
"""
import glob
import json
import os
import sys

from gguf import GGUFReader


def fixture_templates():
    out = []
    for path in sorted(glob.glob(".cache/touchstone/real/*/*.gguf")):
        field = GGUFReader(path).fields.get("tokenizer.chat_template")
        if field is not None:
            out.append(bytes(field.parts[field.data[0]]).decode("utf-8"))
    return out


HAND_MADE = [
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
    "{% macro turn(r, c) %}<start_of_turn>{{ r }}\n{{ c }}<end_of_turn>\n{% endmacro %}{% for m in messages %}{{ turn(m.role, m.content) }}{% endfor %}",
    "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}{{ messages | length }}",
    "{% for m in messages %}{{ m.content.strip().upper().replace('a', 'b') }}{{ loop.index }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}{{ 'x' * 3 }}",
]

AB_LINES = [
    {"prefill_ms": 12.5, "decode_ms": 80.0, "n_prompt": 16, "n_gen": 4, "tokens": [1, 2, 3, 4]},
    {"prefill_ms": 1.0, "decode_ms": 2.0, "n_prompt": 1, "n_gen": 2, "tokens": [7, 8], "step_ms": [1.0, 1.0], "cpu": "x86_64", "peak_rss_kb": 123456},
    {"prefill_ms": 0, "decode_ms": 0, "n_prompt": 0, "n_gen": 0, "tokens": []},
]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_text_seeds.py CORPUS_ROOT")
    root = sys.argv[1]
    chat = os.path.join(root, "chat_template")
    ab = os.path.join(root, "ab_line")
    os.makedirs(chat, exist_ok=True)
    os.makedirs(ab, exist_ok=True)
    messages = ["Hello!", "Hi, how can I help?", "The capital of France is"]
    for i, t in enumerate(fixture_templates() + HAND_MADE):
        with open(os.path.join(chat, f"seed-{i:02}"), "wb") as f:
            f.write("\0".join([t] + messages).encode("utf-8"))
    for i, line in enumerate(AB_LINES):
        with open(os.path.join(ab, f"seed-{i:02}"), "w") as f:
            f.write(json.dumps(line))
    with open(os.path.join(ab, "seed-text"), "w") as f:
        f.write('{"prefill_ms": 1e308, "decode_ms": -0.0, "n_gen": 18446744073709551615, "tokens": [4294967295]}')
    print(f"{len(os.listdir(chat))} chat_template seeds, {len(os.listdir(ab))} ab_line seeds under {root}")


if __name__ == "__main__":
    main()
