"""Write a Touchstone dump (docs/DUMP_FORMAT.md, version 1) from any Python engine.

Copy this one file beside your engine; it needs Python 3.8+ and nothing else (numpy arrays are
taken as they are, lists of rows too). Touchstone runs your engine as `exec:CMD` with the request
in its environment; this module reads it, and writes what your engine computed:

    import touchstone_dump

    req = touchstone_dump.request()          # model path, ids, n_generate, output directory
    dump = touchstone_dump.Dump(device="my-engine", arithmetic={"storage": "f32", "accumulate": "f32"})
    if req.n_generate > 0:
        dump.generated(my_greedy(req.model, req.ids, req.n_generate))  # a token-only dump
    else:
        for name, rows in my_forward(req.model, req.ids):               # [n_positions, width] each
            dump.tap(name, rows)                 # "inp_embd", "blk.0.attn_norm", ..., "result_norm"
        dump.logits(my_logits)                   # [n_positions, n_vocab]
    dump.write()                                 # manifest.json, taps.safetensors, logits.safetensors

Tap names are the ones docs/DUMP_FORMAT.md lists (llama.cpp's eval-callback names are accepted
too). `arithmetic` declares how the engine computes; the budgets every tap is judged by derive
from it (docs/DUMP_FORMAT.md, "Optional fields"); absent, f32 storage and accumulation.
"""
import hashlib
import json
import os
import struct
import sys
from array import array

FORMAT = "touchstone-dump"
VERSION = 1


class Request:
    """One request, as Touchstone passes it in the environment."""

    def __init__(self, env=None):
        env = os.environ if env is None else env
        missing = [k for k in ("TOUCHSTONE_MODEL", "TOUCHSTONE_PROMPT_IDS", "TOUCHSTONE_OUT") if k not in env]
        if missing:
            raise SystemExit(f"touchstone_dump: {', '.join(missing)} not set: run this engine through Touchstone (--device \"exec:CMD\")")
        self.model = env["TOUCHSTONE_MODEL"]
        self.ids = [int(t) for t in env["TOUCHSTONE_PROMPT_IDS"].split(",") if t.strip()]
        self.n_generate = int(env.get("TOUCHSTONE_N_GENERATE", "0"))
        self.out = env["TOUCHSTONE_OUT"]
        self.model_sha256 = env.get("TOUCHSTONE_MODEL_SHA256")
        self.task = env.get("TOUCHSTONE_TASK")


def request(env=None):
    """The request Touchstone passed in the environment (model, ids, n_generate, out)."""
    return Request(env)


def sha256_of_model(path):
    """sha256 of a model file, or, for a directory (safetensors and config.json), of its files'
    names and sha256s in name order: what a manifest's `model.sha256` holds."""

    def of_file(p):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    if not os.path.isdir(path):
        return of_file(path)
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))):
        h.update(name.encode())
        h.update(of_file(os.path.join(path, name)).encode())
    return h.hexdigest()


def _f32_rows(x, what):
    """(rows, cols, little-endian f32 bytes) of a 2-D array: a numpy array or a list of rows."""
    if hasattr(x, "shape") and hasattr(x, "astype"):
        if len(x.shape) != 2:
            raise ValueError(f"{what}: shape {tuple(x.shape)}, not [n_positions, width]")
        return int(x.shape[0]), int(x.shape[1]), x.astype("<f4", order="C").tobytes()
    rows = [list(r) for r in x]
    cols = len(rows[0]) if rows else 0
    if any(len(r) != cols for r in rows):
        raise ValueError(f"{what}: rows of different lengths")
    a = array("f", (float(v) for r in rows for v in r))
    if sys.byteorder == "big":
        a.byteswap()
    return len(rows), cols, a.tobytes()


def write_safetensors(path, tensors, metadata=None):
    """Writes [(name, 2-D array)] (numpy arrays or lists of rows) as one safetensors file of f32,
    with `metadata` (a dict of strings) as its `__metadata__`."""
    _write_f32(path, [(name, *_f32_rows(rows, name)) for name, rows in tensors], metadata)


def _write_f32(path, tensors, metadata=None):
    """Writes [(name, rows, cols, f32 bytes)] as one safetensors file: an 8-byte header length, the
    JSON header padded to 8 bytes, the raw data."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, rows, cols, data in tensors:
        header[name] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, _, data in tensors:
            f.write(data)
    os.replace(tmp, path)


class Dump:
    """What an engine computed for one request, written as a dump by `write()`."""

    def __init__(self, device, arithmetic=None, request=None, arch="llama", precision="f32"):
        self.req = request or Request()
        self.device = device
        self.arithmetic = arithmetic
        self.arch = arch
        self.precision = precision
        self.taps = []
        self.logit_rows = None
        self.generated_ids = None

    def tap(self, name, rows):
        """One tap: [n_positions, width], a row per position of the request's ids."""
        if any(t[0] == name for t in self.taps):
            raise ValueError(f"tap {name} given twice")
        n, cols, data = _f32_rows(rows, name)
        if n != len(self.req.ids):
            raise ValueError(f"tap {name}: {n} rows for {len(self.req.ids)} positions")
        self.taps.append((name, n, cols, data))

    def logits(self, rows):
        """The logits of every position: [n_positions, n_vocab]."""
        n, cols, data = _f32_rows(rows, "logits")
        if n != len(self.req.ids):
            raise ValueError(f"logits: {n} rows for {len(self.req.ids)} positions")
        self.logit_rows = ("logits", n, cols, data)

    def generated(self, ids):
        """A token-only dump: the ids generated greedily after the request's ids."""
        self.generated_ids = [int(i) for i in ids]

    def write(self):
        """Writes manifest.json (and the safetensors files) into the request's output directory;
        returns the manifest's path."""
        out = self.req.out
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "model": {"name": os.path.basename(self.req.model.rstrip("/")), "sha256": self.req.model_sha256 or sha256_of_model(self.req.model), "arch": self.arch},
            "device": self.device,
            "precision": self.precision,
            "token_ids": self.req.ids,
            "positions": list(range(len(self.req.ids))),
            "taps": [],
            "logits": None,
        }
        if self.arithmetic is not None:
            manifest["arithmetic"] = self.arithmetic
        if self.generated_ids is not None:
            manifest["generated_ids"] = self.generated_ids
        if self.taps:
            _write_f32(os.path.join(out, "taps.safetensors"), self.taps)
            manifest["taps"] = [{"name": n, "shape": [r, c], "dtype": "f32", "file": "taps.safetensors"} for n, r, c, _ in self.taps]
        if self.logit_rows is not None:
            _write_f32(os.path.join(out, "logits.safetensors"), [self.logit_rows])
            _, r, c, _ = self.logit_rows
            manifest["logits"] = {"name": "logits", "shape": [r, c], "dtype": "f32", "file": "logits.safetensors"}
        if self.generated_ids is None and self.logit_rows is None:
            raise ValueError("nothing to write: give the logits (or, asked to generate, the generated ids)")
        path = os.path.join(out, "manifest.json")
        with open(path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)
        return path
