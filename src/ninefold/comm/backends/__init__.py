"""Transports of ninefold.comm: the Backend contract and its implementations."""
