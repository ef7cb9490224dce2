"""``ninefold ops tune``: time every candidate implementation and remember the fastest."""

from __future__ import annotations

import torch
from tqdm import tqdm

from ninefold.ops import dispatch, timing, tuning, workloads
from ninefold.ops.spec import dtype_name


def tune(ops=None, shape_set: str = "llama-8b", device="cuda", dtypes=(torch.bfloat16,), *, path=None,
         progress: bool = True, repeats: int = 20) -> list[dict]:
    """Benchmark the candidates of ``ops`` (default: all) at ``shape_set`` and record the winners.

    Returns the entries written to the tuning cache (``path``, default the user's cache file);
    operators with a single candidate for a call are recorded too, so the table is complete.
    """
    if isinstance(ops, str):  # one operator, not its letters
        ops = [ops]
    if ops is not None and not list(ops):
        raise ValueError(f"ops: empty; name operators from {', '.join(workloads.OPS)}, or None for all of them")
    names = list(ops or workloads.OPS)
    unknown = [n for n in names if n not in workloads.OPS]
    if unknown:
        raise ValueError(f"--ops: unknown operator(s) {', '.join(unknown)}; known: {', '.join(workloads.OPS)}")
    shapes = workloads.shapes(shape_set)
    device = torch.device(device)
    calls = [c for dtype in dtypes for op in names for c in workloads.cases(op, shapes, device, dtype)]
    model = dispatch.device_model(device)
    entries = []
    for case in tqdm(calls, desc=f"tuning on {model}", unit="call", disable=not progress):
        operator = dispatch.operator(case.op)
        bound = operator.bind(*case.args, **case.kwargs)
        key = operator.keyfn(*bound)
        times = {impl.name: timing.measure(lambda impl=impl, bound=bound: impl.fn(*bound), device, repeats=repeats)
                 for impl in dispatch.supporting(case.op, key[0], key[1], bound)}
        entries.append({"op": case.op, "device": model, "dtype": dtype_name(key[1]), "bucket": list(key[2]),
                        "impl": min(times, key=times.get), "times_us": {k: round(v, 3) for k, v in times.items()},
                        "case": case.label})
    tuning.record(entries, path)
    return entries
