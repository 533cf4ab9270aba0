#!/usr/bin/env python3
"""Build ggml's CPU library from the llama-cpp-python sdist on PyPI (a test peer, never a runtime
dependency), for examples/ops_ggml/engine.py to judge ggml's own kernels op by op.

The sdist (pinned version and sha256, the one tools/reference/llama_vocab.py reads) vendors
llama.cpp and ggml. Only ggml's three libraries are built (ggml, ggml-base, ggml-cpu; about 40 s
on 2 cores), with CMake from PyPI when none is installed, for the CPU it runs on (GGML_NATIVE),
without OpenMP. The libraries and headers go to DEST (default `$TOUCHSTONE_CACHE/ggml`, else
`.cache/touchstone/ggml`); a stamp holds the sdist's sha256, and a second run with it there does
nothing.

    python3 tools/peers/build_ggml.py [DEST]
"""
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CMAKE = "cmake==4.1.0"


def default_dest() -> pathlib.Path:
    cache = os.environ.get("TOUCHSTONE_CACHE")
    root = pathlib.Path(cache) if cache else pathlib.Path(__file__).resolve().parents[2] / ".cache" / "touchstone"
    return root / "ggml"


def cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    print(f"installing {CMAKE} from PyPI ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", CMAKE], check=True)
    found = shutil.which("cmake")
    if not found:
        sys.exit("cmake installed but not on PATH")
    return found


def main() -> int:
    dest = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default_dest()
    stamp = dest / "STAMP"
    if stamp.exists() and stamp.read_text().strip() == SHA256 and (dest / "lib" / "libggml.so").exists():
        print(f"ggml already built in {dest}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        print(f"fetching {PACKAGE}=={VERSION} (source distribution) with pip download ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
             "--no-binary", PACKAGE, "-d", str(tmp), f"{PACKAGE}=={VERSION}"],
            check=True,
        )
        sdists = list(tmp.glob("*.tar.gz"))
        if len(sdists) != 1:
            sys.exit(f"pip download gave {[p.name for p in tmp.iterdir()]}, not one .tar.gz")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SHA256:
            sys.exit(f"{sdists[0]}: sha256 {digest}, expected {SHA256}")
        src = tmp / "src"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(src, members=members, filter="data")
        root = next(src.glob("*/vendor/llama.cpp"))
        build = tmp / "build"
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"]
        print("building ggml, ggml-base and ggml-cpu ...", flush=True)
        exe = cmake()
        subprocess.run([exe, "-S", str(root), "-B", str(build), *flags], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([exe, "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "ggml", "ggml-base", "ggml-cpu"], check=True, stdout=subprocess.DEVNULL)
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "lib").mkdir(parents=True)
        for so in (build / "bin").glob("libggml*.so*"):
            shutil.copy2(so, dest / "lib" / so.name, follow_symlinks=False)
        shutil.copytree(root / "ggml" / "include", dest / "include")
    stamp.write_text(f"{SHA256}\n")
    print(f"ggml's libraries (from {PACKAGE} {VERSION}) in {dest / 'lib'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
