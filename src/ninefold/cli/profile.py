"""``ninefold profile device``: measure (or read from the cache) a device's hardware profile."""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    """Add ``profile device [--device cuda:0|cpu|all] [--json] [--refresh]``."""
    parser = subparsers.add_parser("profile", help="measure hardware profiles",
                                   description="Measure hardware profiles (cached per device).")
    kinds = parser.add_subparsers(dest="profile_kind", metavar="KIND", required=True)
    device = kinds.add_parser("device", help="compute, memory bandwidth, capacity and interconnect of a device",
                              description="Measure (or read from the cache) a device's matmul rates, memory "
                                          "bandwidth, capacity and interconnect.")
    device.add_argument("--device", default=None,
                        help="cpu, cuda:0, any torch device, or 'all' (default: the current accelerator, else cpu)")
    device.add_argument("--json", action="store_true", help="print JSON instead of a table")
    device.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    device.set_defaults(func=run_device)


def run_device(args) -> int:
    """Profile the chosen devices and print them."""
    from ninefold.runtime import Device
    from ninefold.runtime.profile import profile_device

    try:
        devices = Device.all() if args.device == "all" else [Device(args.device) if args.device else Device.current()]
    except (ValueError, TypeError) as exc:
        print(f"ninefold profile device: error: --{exc}", file=sys.stderr)
        return 2
    profiles = [profile_device(d, refresh=args.refresh) for d in devices]
    if args.json:
        data = [p.to_dict() for p in profiles]
        print(json.dumps(data if args.device == "all" else data[0], indent=1))
    else:
        print(format_table(profiles))
    return 0


def format_table(profiles) -> str:
    """One row per device: matmul rates, copy bandwidth, capacity and interconnect."""
    header = ["device", "name", "bf16 TFLOP/s", "fp16 TFLOP/s", "fp32 TFLOP/s", "copy GB/s",
              "total GiB", "free GiB", "H2D GB/s", "D2H GB/s", "TCP GB/s"]
    rows = [header]
    for p in profiles:
        link = p.interconnect
        rows.append([p.device, p.name[:28], *(f"{p.compute[k] / 1e12:.3g}" for k in ("bfloat16", "float16", "float32")),
                     f"{p.bandwidth['copy'] / 1e9:.4g}", f"{p.capacity['total'] / 2**30:.1f}",
                     f"{p.capacity['free'] / 2**30:.1f}",
                     *(f"{link[k] / 1e9:.3g}" if k in link else "-" for k in ("host_to_device", "device_to_host")),
                     f"{link['loopback_tcp'] / 1e9:.3g}"])
        for peer, rate in link.get("device_to_device", {}).items():
            rows.append([f"  -> {peer}", "device to device", *[""] * 3, f"{rate / 1e9:.4g}", *[""] * 5])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
