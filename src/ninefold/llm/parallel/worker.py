"""A worker rank of a tensor-parallel engine: ``python -m ninefold.llm.parallel.worker`` (started by rank 0).

It joins rank 0's communicator, loads its slice of the model, then makes every call rank 0 sends
(``protocol``) until a STOP command or the end of its input (rank 0 is gone).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

from ninefold.llm.config import ModelConfig
from ninefold.llm.parallel import protocol
from ninefold.llm.parallel.protocol import Op
from ninefold.llm.parallel.rank_model import TensorParallel, build_rank_model


def load_rank_model(parallel: TensorParallel, device: torch.device, *, model, load_format: str, quantization: str,
                    dtype: torch.dtype, max_positions: int, seed: int, block_size: int, lora: dict | None = None,
                    kv_dtype: torch.dtype | None = None):
    """This rank's slice of ``model`` (as ``LLMEngine`` loads it), with a one-block scratch cache bound until
    rank 0 sends the real cache's size; and with ``lora`` (``max_loras``, ``max_rank``, ``dtype``: rank 0's slots),
    this rank's LoRA slots (else None)."""
    from ninefold.llm.loader import load_checkpoint
    from ninefold.llm.lora import LoRASlots
    from ninefold.llm.parallel.sharding import shard_plan

    ckpt = load_checkpoint(model, load_format, quantization=quantization,
                           tensor_parallel=(parallel.rank, parallel.size), read_tokenizer=False)
    config = ModelConfig.from_dict(ckpt.config)
    rank_model = build_rank_model(config, ckpt.tensors, parallel, dtype=dtype, device=device,
                                  max_positions=max_positions, seed=seed, sliced=ckpt.tensor_parallel is not None)
    rank_model.bind_scratch_kv_cache(block_size)
    slots = None
    if lora is not None:
        slots = LoRASlots(config, dtype=lora["dtype"], device=device, max_loras=lora["max_loras"],
                          max_rank=lora["max_rank"], plan=shard_plan(config, parallel.rank, parallel.size))
    rank_model.kv_dtype = kv_dtype or dtype  # what BIND_KV_CACHE's pool holds (rank 0's kv_cache_dtype)
    return rank_model, slots


def serve(rank_model, comm, device: torch.device, block_size: int, commands, lora_slots=None) -> None:
    """Make rank 0's calls, read from ``commands`` (a binary stream), until STOP or its end."""
    from ninefold.runtime import KVCachePool

    c = rank_model.config
    with torch.inference_mode():
        while True:
            header = _read_exactly(commands, protocol.HEADER_BYTES)
            if header is None:
                return
            op, value = protocol.decode(header, comm, device)
            if op is Op.STOP:
                return
            if op is Op.BIND_KV_CACHE:
                error = None
                try:
                    rank_model.bind_kv_cache(KVCachePool(c.num_layers, c.num_kv_heads, c.head_dim, block_size,
                                                         rank_model.kv_dtype, device, value))
                except (RuntimeError, ValueError) as e:  # out of memory: rank 0 raises, naming this rank
                    error = e
                if not _all_succeeded(comm, error):
                    return
            elif op is Op.FIT_ROPE:
                rank_model.fit_rope(value)
            elif op is Op.LORA_SLOT:
                error = None
                try:
                    lora_slots.place(value, comm.recv_object(0))
                except Exception as e:  # rank 0 raises, naming this rank; the slots would disagree
                    error = e
                if not _all_succeeded(comm, error):
                    return
            else:
                ids, positions, meta, row_slots = value
                lora = None if row_slots is None else lora_slots.step(row_slots)
                rank_model.forward(ids, positions, meta, lora=lora)


def _all_succeeded(comm, error: BaseException | None) -> bool:
    """This rank's side of rank 0's ``WorkerGroup.agree_loaded``: tell every rank ``error`` (None: done),
    and whether every rank succeeded."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    return all(text is None for text in comm.all_gather_object(mine))


def _exit_with_parent(parent: int, period_s: float = 0.5) -> None:
    """Exit at once when ``parent`` (rank 0) is gone, whatever this process is doing (a wait in a collective
    included). A watcher thread: the parent-death signal would fire when the parent's *thread* that started
    this process ends, which may be long before the parent does."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(3)

    threading.Thread(target=watch, name="ninefold-tp-parent", daemon=True).start()


def _read_exactly(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--ready-fd", type=int, default=-1, help="a pipe to write one byte to once started")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process (rank 0) is gone")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import ninefold.comm as nc
    from ninefold.llm import loader  # noqa: F401  (what loading needs, imported before saying "started")

    if args.ready_fd >= 0:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    device = torch.device(args.device)
    comm = nc.init(device=device, rank=args.rank, world_size=args.world_size, init_method=args.init_method,
                   timeout_s=args.timeout_s)
    try:
        parallel = TensorParallel(comm, args.rank, args.world_size,  # collective: where rank 0 makes its own
                                  timeout_s=args.timeout_s)
        settings = comm.broadcast_object(None)
        error = None
        try:
            rank_model, lora_slots = load_rank_model(parallel, device, **settings)
        except Exception as e:
            error = e
        if not _all_succeeded(comm, error):
            return 1  # rank 0 raises, naming every rank's error
        serve(rank_model, comm, device, settings["block_size"], sys.stdin.buffer, lora_slots)
        parallel.close()
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
