"""What a new process pays before its first Triton launch, cut where ninefold can.

1. Triton's installation key, kept on disk so a new process does not recompute it.

Every Triton compile-cache lookup starts with ``triton.runtime.cache.triton_key()``: a SHA-256 of
Triton's compiler and language sources and of its whole ``libtriton`` shared library (~400-500 MB),
computed once per process. On a warm cache that hash is most of a new process's first kernel call
(0.6 s on the development machine). :func:`install` replaces it, for this process, by the value
stored under ``$NINEFOLD_CACHE_DIR/dsl/triton/key.json``, found by a fingerprint of the same files'
paths, sizes and modification times (a stat each, a few ms); on a miss it computes the real key
once and stores it. Triton's own compile workers substitute the key the same way.

2. The directory of ``libcuda.so.1``: Triton runs ``/sbin/ldconfig -p`` to find it unless
``TRITON_LIBCUDA_PATH`` is set; once torch has initialised CUDA the library is mapped into the
process, so :func:`install` sets that variable (if unset) from ``/proc/self/maps``.
"""

from __future__ import annotations

import hashlib
import os

from ninefold.dsl.cache import cache_dir, read_json, write_json

_STATE: dict = {}


def fingerprint(root: str) -> str:
    """SHA-256 over path, size and mtime of every source and shared library under Triton's ``root``."""
    entries = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".so")):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                entries.append(f"{os.path.relpath(path, root)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def install() -> str:
    """Make ``triton.runtime.cache.triton_key`` return the stored key (computed once per
    installation); returns how the key was obtained: ``"stored"``, ``"computed"`` or ``"kept"``
    (already replaced, e.g. inside Triton's own workers, or disabled by
    ``NINEFOLD_DSL_TRITON_KEY=off``)."""
    if "how" in _STATE:
        return _STATE["how"]
    import triton
    import triton.runtime.cache as cache

    _libcuda_path()

    original = cache.triton_key
    if os.environ.get("NINEFOLD_DSL_TRITON_KEY") == "off" or getattr(original, "__module__", "") != cache.__name__:
        _STATE["how"] = "kept"
        return "kept"
    print_key = f"{triton.__version__}:{fingerprint(os.path.dirname(triton.__file__))}"
    path = cache_dir("triton") / "key.json"
    stored = read_json(path)
    key = stored.get(print_key)
    how = "stored"
    if not isinstance(key, str):
        key, how = original(), "computed"
        stored[print_key] = key
        write_json(path, stored)

    def triton_key():
        return key

    cache.triton_key = triton_key
    _STATE["how"] = how
    return how


def _libcuda_path() -> None:
    """Set ``TRITON_LIBCUDA_PATH`` to the directory of the ``libcuda.so.1`` this process mapped."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().rsplit(" ", 1)[-1]
                folder = os.path.dirname(path)
                if "/libcuda.so." in path and os.path.exists(os.path.join(folder, "libcuda.so.1")):
                    os.environ["TRITON_LIBCUDA_PATH"] = folder  # where ldconfig would point Triton
                    return
    except OSError:  # not Linux: Triton finds the library itself
        return
