"""Backends: ``cpu`` (torch, batched over programs), ``triton`` (generated Triton) and ``interpret``."""
