"""Child process of the interpret backend: Triton imported with ``TRITON_INTERPRET=1``.

Triton decides at decoration time whether ``@triton.jit`` functions (its own standard library
included) are interpreted, so the interpreter needs a process where the variable is set before
Triton is imported. Requests and replies are pickles on stdin/stdout: the request carries the
generated module's path, the grid and the arguments; the reply carries the tensor arguments
after the run, which the caller copies back.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import traceback


def main():
    """Serve launch requests ``(path, module_name, function_name, grid, args)`` until EOF."""
    os.environ["TRITON_INTERPRET"] = "1"
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    import torch  # noqa: F401  (tensors in the requests)

    modules = {}
    while True:
        try:
            path, name, function_name, grid, args = pickle.load(requests)
        except EOFError:
            return
        try:
            if path not in modules:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
                modules[path] = module
            getattr(modules[path], function_name)[grid](*args)
            reply = ("ok", None, args)
        except Exception as error:  # reported to the caller, which raises it
            reply = ("error", type(error).__name__, f"{error}\n{traceback.format_exc(limit=6)}")
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    main()
