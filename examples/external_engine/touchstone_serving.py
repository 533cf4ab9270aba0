"""Touchstone's schedule task (docs/SERVING_PROTOCOL.md), for an engine to copy beside its own code.

With TOUCHSTONE_TASK=schedule, Touchstone passes TOUCHSTONE_SCHEDULE (a schedule.json: requests,
the step each arrives at, its chunks, its cache slot, the earlier request whose cached prefix it
reuses), TOUCHSTONE_MODEL and TOUCHSTONE_OUT. The engine runs the schedule the way it serves --
every step one batch of the active requests' next chunks -- and `serve()` writes
TOUCHSTONE_OUT/served.safetensors: one f32 tensor [positions, n_vocab] per request, named by its
id, the logits of the positions it computed (from the end of its reused prefix to its last token).

Your engine gives `serve()` three functions over its own cache type:
    empty()              -> a fresh cache for a request that takes a slot
    prefix(cache, n)     -> a cache holding the first n positions of `cache` (a reused prefix)
    step(batch)          -> batch is [(cache, token ids)], one entry per active request; runs them
                            as one batch, appends each chunk to its cache, and returns each entry's
                            logits ([len(ids), n_vocab] rows), in order.
`batch_invariant` declares whether a request's numbers are the same bits whatever it is batched
with and however it is chunked: Touchstone then holds it to that bit for bit.

With TOUCHSTONE_SERVE_TAPS=ID, Touchstone asks for request ID's taps as it was served (to name
the first tap where a red request departs); an engine that can gives `taps_of(cache)`: the taps
(name -> [rows, width]) of the positions computed into that cache, chunk after chunk, and
`serve()` writes, after the request's last chunk, those of the positions it computed (the last
rows) as tensors `ID/NAME`.
"""
import json
import os

import touchstone_dump

SERVED_FILE = "served.safetensors"


def serve(empty, prefix, step, batch_invariant, env=None, taps_of=None):
    env = os.environ if env is None else env
    with open(env["TOUCHSTONE_SCHEDULE"]) as f:
        schedule = json.load(f)
    reqs = schedule["requests"]
    index = {r["id"]: i for i, r in enumerate(reqs)}
    last_step = max(r["arrive"] + len(r["chunks"]) - 1 for r in reqs)
    # A request whose prefix a later one reuses keeps its cache until that arrival.
    reused_until = {}
    for r in reqs:
        if r.get("prefix"):
            src = index[r["prefix"]["from"]]
            reused_until[src] = max(reused_until.get(src, 0), r["arrive"])
    slots = [None] * schedule["slots"]
    kept = {}
    computed = [0] * len(reqs)
    logits = {r["id"]: [] for r in reqs}
    tapped = []
    for t in range(last_step + 1):
        for i, r in enumerate(reqs):
            if r["arrive"] != t:
                continue
            p = r.get("prefix")
            if p:
                src = index[p["from"]]
                source = kept[src] if src in kept else slots[reqs[src]["slot"]]
                slots[r["slot"]] = prefix(source, p["tokens"])
                computed[i] = p["tokens"]
            else:
                slots[r["slot"]] = empty()
        active = [i for i, r in enumerate(reqs) if r["arrive"] <= t < r["arrive"] + len(r["chunks"])]
        batch = []
        for i in active:
            n = reqs[i]["chunks"][t - reqs[i]["arrive"]]
            batch.append((slots[reqs[i]["slot"]], reqs[i]["tokens"][computed[i]:computed[i] + n]))
            computed[i] += n
        for i, rows in zip(active, step(batch)):
            logits[reqs[i]["id"]].extend(list(rows))
        for i in active:
            last = t == reqs[i]["arrive"] + len(reqs[i]["chunks"]) - 1
            if last and reused_until.get(i, -1) > t:
                kept[i] = slots[reqs[i]["slot"]]
            if last and taps_of is not None and reqs[i]["id"] == env.get("TOUCHSTONE_SERVE_TAPS"):
                # The rows of the positions it computed: the last ones its cache holds.
                n = len(reqs[i]["tokens"]) - (reqs[i].get("prefix") or {}).get("tokens", 0)
                tapped = [(f"{reqs[i]['id']}/{name}", rows[len(rows) - n:]) for name, rows in taps_of(slots[reqs[i]["slot"]]).items() if len(rows) >= n]
        kept = {i: c for i, c in kept.items() if reused_until[i] > t}
    out = os.path.join(env["TOUCHSTONE_OUT"], SERVED_FILE)
    touchstone_dump.write_safetensors(out, list(logits.items()) + tapped, {"batch_invariant": "true" if batch_invariant else "false"})
