"""Prefill/decode disaggregation: moving a prompt's KV cache from the engine that computed it to another."""

from ninefold.llm.disagg.kv_transfer import PrefixKV, export_prefix, import_prefix, recv_prefix, send_prefix

__all__ = ["PrefixKV", "export_prefix", "import_prefix", "recv_prefix", "send_prefix"]
