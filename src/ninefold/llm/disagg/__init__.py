"""Prefill/decode disaggregation: a prompt's KV cache moved from the engine that computed it to another,
and a router that splits requests over prefill and decode workers with a ratio that follows the load."""

from ninefold.llm.disagg.cluster import Plan, Result, Router, start
from ninefold.llm.disagg.kv_transfer import PrefixKV, export_prefix, import_prefix, recv_prefix, send_prefix

__all__ = ["Plan", "PrefixKV", "Result", "Router", "export_prefix", "import_prefix", "recv_prefix", "send_prefix",
           "start"]
