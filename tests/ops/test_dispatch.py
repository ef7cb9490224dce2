"""Dispatch: supports() filtering, pins (environment and ops.use), tuned choices, default order."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import UnsupportedError, dispatch, registry, tuning
from ninefold.ops.dispatch import device_model

x = torch.randn(3, 8)
w = torch.ones(8)


def _doubling(x, weight, eps):
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype) * 2


def _small_only(x, weight, eps):
    return None if x.shape[-1] <= 8 else f"last dimension {x.shape[-1]} > 8"


@pytest.fixture
def probe():
    """A second rms_norm implementation (doubles the output) that only takes rows of <= 8."""
    registry.register("rms_norm", "probe", devices=("cpu",), dtypes=(torch.float32,), supports=_small_only)(_doubling)
    yield "probe"
    registry.unregister("rms_norm", "probe")


def test_default_order_prefers_vendor_until_a_higher_priority_registers(probe):
    assert ops.choose("rms_norm", x, w) == "vendor"
    registry.register("rms_norm", "probe", devices=("cpu",), dtypes=(torch.float32,), supports=_small_only,
                      priority={"cpu": 5})(_doubling)
    assert ops.choose("rms_norm", x, w) == "probe"
    torch.testing.assert_close(ops.rms_norm(x, w), 2 * ops.run("rms_norm", "vendor", x, w))
    # The probe says no to wide rows and to float16: dispatch skips it there.
    assert ops.choose("rms_norm", torch.randn(2, 9), torch.ones(9)) == "vendor"
    assert ops.choose("rms_norm", x.half(), w) == "vendor"


def test_use_pins_inside_the_block_only_and_nests(probe):
    with ops.use(rms_norm="probe"):
        torch.testing.assert_close(ops.rms_norm(x, w), 2 * ops.run("rms_norm", "vendor", x, w))
        with ops.use(rms_norm="vendor"):
            assert ops.choose("rms_norm", x, w) == "vendor"
        assert ops.choose("rms_norm", x, w) == "probe"
    assert ops.choose("rms_norm", x, w) == "vendor"


def test_equal_pins_nested_around_another_unwind_in_order(probe):
    with ops.use(rms_norm="probe"):
        with ops.use(rms_norm="vendor"):
            with ops.use(rms_norm="probe"):
                assert ops.choose("rms_norm", x, w) == "probe"
            assert ops.choose("rms_norm", x, w) == "vendor"
        assert ops.choose("rms_norm", x, w) == "probe"


def test_pin_that_cannot_run_falls_back_with_a_warning_naming_the_reason(probe):
    wide, wide_w = torch.randn(2, 9), torch.ones(9)
    with ops.use(rms_norm="probe"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ops.rms_norm(wide, wide_w)
    assert "last dimension 9 > 8" in str(caught[0].message) and "using 'vendor'" in str(caught[0].message)
    torch.testing.assert_close(out, ops.run("rms_norm", "vendor", wide, wide_w))


def test_when_no_implementation_supports_the_inputs_every_reason_is_listed(probe):
    others = [i for i in registry.all_implementations("rms_norm") if i.name != "probe"]
    for impl in others:
        registry.unregister("rms_norm", impl.name)
    try:
        with pytest.raises(UnsupportedError, match=r"rms_norm: no implementation supports these inputs on cpu "
                                                   r"\(probe: last dimension 9 > 8\)"):
            ops.rms_norm(torch.randn(2, 9), torch.ones(9))
    finally:
        for impl in others:
            registry.add(impl)


def test_environment_pins_are_read_in_a_fresh_process(tmp_path):
    code = (
        "import torch, ninefold.ops as ops\n"
        "from ninefold.ops import registry\n"
        "registry.register('rms_norm', 'probe', devices=('cpu',))(lambda x, w, e: x * 0)\n"
        "print(ops.choose('rms_norm', torch.randn(2, 4), torch.ones(4)), ops.choose('softmax', torch.randn(2, 4)))\n"
    )
    env = {**os.environ, "NINEFOLD_OPS": "rms_norm=probe, softmax=vendor", "NINEFOLD_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["probe", "vendor"]



@pytest.mark.parametrize("value,message", [("rms_norm", "NINEFOLD_OPS: expected entries like 'rms_norm=dsl', got 'rms_norm'"),
                                           ("rms_norm=fast", "NINEFOLD_OPS: rms_norm has no implementation 'fast'"),
                                           ("rmsnorm=vendor", "unknown operator 'rmsnorm'")])
def test_bad_environment_pins_are_named(monkeypatch, value, message):
    monkeypatch.setenv("NINEFOLD_OPS", value)
    ops.reload_environment()
    try:
        with pytest.raises(ops.OpError, match=message):
            ops.rms_norm(x, w)
    finally:
        monkeypatch.delenv("NINEFOLD_OPS")
        ops.reload_environment()


def test_tuned_choice_wins_over_default_order_and_loses_to_a_pin(probe, tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    tuning.reload()
    try:
        entry = {"op": "rms_norm", "device": device_model(x.device), "dtype": "float32", "bucket": [4, 8],
                 "impl": "probe", "times_us": {"probe": 1.0, "vendor": 2.0}}
        path = tuning.record([entry])
        assert path.parent == tmp_path / "ops"
        assert ops.choose("rms_norm", x, w) == "probe"  # 3 rows -> bucket (4, 8)
        assert ops.choose("rms_norm", torch.randn(5, 8), w) == "vendor"  # bucket (8, 8): not tuned
        with ops.use(rms_norm="vendor"):
            assert ops.choose("rms_norm", x, w) == "vendor"
    finally:
        monkeypatch.delenv("NINEFOLD_CACHE_DIR")
        tuning.reload()


def test_a_tuned_choice_naming_no_implementation_warns_once(probe, tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    tuning.reload()
    try:
        entry = {"op": "rms_norm", "device": device_model(x.device), "dtype": "float32", "bucket": [4, 8],
                 "impl": "fastest", "times_us": {"fastest": 1.0}}
        tuning.record([entry])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = ops.choose("rms_norm", x, w)
            dispatch.clear_caches()  # resolve again: still one warning
            ops.choose("rms_norm", torch.randn(3, 8), w)
        assert first == registry.implementations("rms_norm")[0].name
        messages = [str(c.message) for c in caught if "tuning table" in str(c.message)]
        assert len(messages) == 1, messages
        assert "chooses 'fastest', which is not an implementation of rms_norm" in messages[0]
        assert "probe" in messages[0] and "vendor" in messages[0]
    finally:
        monkeypatch.delenv("NINEFOLD_CACHE_DIR")
        tuning.reload()


def test_tuning_cache_round_trip(tmp_path):
    entries = [{"op": "softmax", "device": "Card", "dtype": "bfloat16", "bucket": [16, 4096], "impl": "triton",
                "times_us": {"triton": 3.5, "vendor": 9.0}},
               {"op": "linear", "device": "Card", "dtype": "float16", "bucket": [1, 4096, 4096], "impl": "vendor",
                "times_us": {"vendor": 20.0}}]
    path = tmp_path / "t.json"
    tuning.record(entries[:1], path)
    tuning.record(entries[1:], path)
    table = tuning.read_table(path)
    assert {k: v["impl"] for k, v in table.items()} == {("softmax", "Card", "bfloat16", (16, 4096)): "triton",
                                                        ("linear", "Card", "float16", (1, 4096, 4096)): "vendor"}
    body = json.loads(path.read_text())
    assert body["format"] == tuning.FORMAT and body["versions"]["torch"] == torch.__version__


def test_shipped_tables_load():
    for path in tuning.TABLES_DIR.glob("*.json"):
        assert tuning.read_table(path) is not None


def test_cached_signatures_still_reject_bad_scalars_and_see_new_layouts(probe):
    from ninefold.ops import workloads

    ops.rms_norm(x, w, 1e-6)
    with pytest.raises(ops.OpError, match="eps must be > 0"):
        ops.rms_norm(x, w, 0.0)
    q, k, pos, cache = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.arange(3), workloads.cos_sin_cache(8, 16)
    ops.rope(q, k, pos, cache, True)
    with pytest.raises(TypeError, match="is_neox must be a bool, got int"):
        ops.rope(q, k, pos, cache, 1)
    # Same shape, new layout: the probe only takes contiguous rows of <= 8, so the choice must change.
    registry.register("rms_norm", "probe", devices=("cpu",), dtypes=(torch.float32,), priority={"cpu": 5},
                      supports=lambda x, w, e: None if x.is_contiguous() else "strided")(_doubling)
    assert ops.choose("rms_norm", x, w) == "probe"
    strided = torch.randn(8, 3).T
    torch.testing.assert_close(ops.rms_norm(strided, w), ops.run("rms_norm", "vendor", strided, w))


def _value_checked_calls() -> dict:
    """Per case: a call, then one with the same signature (shapes, dtypes, devices, layouts) but values the
    operator checks on CPUs, and the error that names them."""
    logits, ones, half = torch.randn(2, 10), torch.ones(2), torch.full((2,), 0.5)
    kc, vc, q = torch.randn(8, 4, 1, 16), torch.randn(8, 4, 1, 16), torch.randn(1, 2, 16)

    def decode(block_ids, length):
        return lambda: ops.attention_decode(q, kc, vc, torch.tensor([block_ids], dtype=torch.int32),
                                            torch.tensor([length], dtype=torch.int32))

    qp, kp, vp = torch.randn(4, 2, 16), torch.randn(4, 1, 16), torch.randn(4, 1, 16)

    def prefill(cu_q):
        cu_k = torch.tensor([0, 4], dtype=torch.int32)
        return lambda: ops.attention_prefill(qp, kp, vp, torch.tensor(cu_q, dtype=torch.int32), cu_k)

    qr, kr, cache = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(4, 8)
    kv_cache, slots = torch.zeros(2, 4, 1, 8), torch.arange(2)

    def rope_and_cache(positions):
        return lambda: ops.rope_and_cache(qr, kr, kr.clone(), torch.tensor(positions), cache, kv_cache,
                                          kv_cache.clone(), slots)

    return {
        "sample temperature": (lambda: ops.sample(logits, ones, top_p=half),
                               lambda: ops.sample(logits, torch.tensor([-1.0, 1.0]), top_p=half),
                               r"sample: temperature\[0\] is -1.0"),
        "sample top_p": (lambda: ops.sample(logits, ones, top_p=half),
                         lambda: ops.sample(logits, ones, top_p=torch.tensor([0.5, 7.0])),
                         r"sample: top_p\[1\] is 7.0"),
        "sample min_p": (lambda: ops.sample(logits, ones, min_p=half),
                         lambda: ops.sample(logits, ones, min_p=torch.tensor([-0.5, 0.5])), r"sample: min_p\[0\]"),
        "decode context_lens": (decode([0, 1], 5), decode([0, 1], 0), "context_lens must lie in 1..8"),
        "decode past the tables": (decode([0, 1], 5), decode([0, 1], 100), "context_lens must lie in 1..8"),
        "decode block ids": (decode([0, 1], 5), decode([0, 99], 6), r"block ids in \[0, 8\)"),
        "prefill cu_seqlens_q": (prefill([0, 4]), prefill([0, 2]), "cu_seqlens_q must run from 0 to q's 4 tokens"),
        "rope positions": (lambda: ops.rope(qr, kr, torch.tensor([0, 1]), cache),
                           lambda: ops.rope(qr, kr, torch.tensor([-1, 1]), cache),
                           r"rope: positions must lie in \[0, 4\)"),
        "rope_and_cache positions": (rope_and_cache([0, 1]), rope_and_cache([0, 4]),
                                     r"rope_and_cache: positions must lie in \[0, 4\)"),
    }


@pytest.mark.parametrize("case", list(_value_checked_calls()))
def test_cpu_value_checks_run_on_every_call_not_once_per_signature(case):
    """The signature cache skips the checks of shapes and types, never those of the values in CPU tensors
    (lengths, offsets, block ids, positions, sampling parameters): they change from call to call."""
    accepted, refused, message = _value_checked_calls()[case]
    accepted()
    accepted()  # (the signature is cached now)
    with pytest.raises(ops.OpError, match=message):
        refused()


def test_implementation_returns_the_chosen_function_for_direct_calls(probe):
    fn = ops.implementation("rms_norm", x, w)
    torch.testing.assert_close(fn(x, w, 1e-6), ops.rms_norm(x, w))
    with ops.use(rms_norm="probe"):
        probe_fn = ops.implementation("rms_norm", x, w, eps=1e-6)
        torch.testing.assert_close(probe_fn(x, w, 1e-6), 2 * fn(x, w, 1e-6))
    with pytest.raises(UnsupportedError, match="int32 is not supported"):
        ops.implementation("rms_norm", x.int(), w)


# ------------------------------------------------------------------ pins of implementations for another machine
_REGISTERED = """
import json, sys, torch
if sys.argv[1] == "cuda":
    torch.cuda.is_available = lambda: True  # registration as on a CUDA machine; nothing is launched
import ninefold.ops as ops
from ninefold.ops import registry
print(json.dumps(sorted([op, i.name] for op in registry.operators() for i in registry.all_implementations(op))))
"""


def _without_cuda() -> dict:
    """This environment with no CUDA device visible and Triton's interpreter off: a CPU-only machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


def test_the_cuda_only_table_lists_what_registers_only_where_cuda_is():
    pytest.importorskip("triton")

    def registered(machine):
        out = subprocess.run([sys.executable, "-c", _REGISTERED, machine], env=_without_cuda(), capture_output=True,
                             text=True, check=True, timeout=300)
        return {tuple(pair) for pair in json.loads(out.stdout)}

    extra = registered("cuda") - registered("cpu")
    assert extra == {(op, name) for op, names in registry.CUDA_ONLY.items() for name in names}


def test_a_pin_of_a_cuda_only_implementation_on_a_cpu_machine_warns_once_and_falls_back(tmp_path):
    """The pins were refused as unknown names, at every call: the Triton kernels and cuBLASLt register only
    where CUDA is. A name that no machine has is still refused, and the error lists the CUDA-only names."""
    code = """
        import warnings, torch, ninefold.ops as ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for rows in (2, 5, 40):  # three shape buckets: one warning per operator all the same
                x, w = torch.randn(rows, 8), torch.randn(6, 8)
                torch.testing.assert_close(ops.rms_norm(x, w[0]), ops.run("rms_norm", "vendor", x, w[0]))
                torch.testing.assert_close(ops.linear(x, w), ops.run("linear", "vendor", x, w))
        for warning in caught:
            print(warning.message)
        try:
            with ops.use(rms_norm="tritn"):
                pass
        except ops.OpError as error:
            print(error)
    """
    env = {**_without_cuda(), "NINEFOLD_OPS": "rms_norm=triton,linear=cublaslt", "NINEFOLD_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    no_cuda = "it runs only on cuda, and this process has no CUDA device"
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"rms_norm: pinned implementation 'triton' cannot run these inputs ({no_cuda}); "
                               "using '"), lines[0]
    assert lines[1] == f"linear: pinned implementation 'cublaslt' cannot run these inputs ({no_cuda}); using 'vendor' " \
                       "instead"
    assert lines[2].startswith("ops.use: rms_norm has no implementation 'tritn'; it has: ")
    assert lines[2].endswith("; where CUDA is, also: triton")


def test_a_pin_for_another_device_warns_once_for_every_shape():
    """The warning came again for every new shape bucket."""
    registry.register("rms_norm", "gpuonly", devices=("cuda",))(lambda *a: None)
    try:
        with ops.use(rms_norm="gpuonly"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for rows in (1, 3, 9, 100):
                ops.rms_norm(torch.randn(rows, 7), torch.ones(7))
        messages = {str(c.message) for c in caught}
        assert {m.split("; using ")[0] for m in messages} == {
            "rms_norm: pinned implementation 'gpuonly' cannot run these inputs (it runs on cuda, not cpu)"}
        assert len(caught) == len(messages)  # one per fallback: one row takes cpu_row, more rows vendor
    finally:
        registry.unregister("rms_norm", "gpuonly")


def test_each_pin_block_warns_about_its_fallback_again():
    """Warned once per message and process, a second ``ops.use`` block (another test, say) stayed silent."""
    registry.register("rms_norm", "gpuonly", devices=("cuda",))(lambda *a: None)
    try:
        counts = []
        for _ in range(2):
            with ops.use(rms_norm="gpuonly"), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ops.rms_norm(torch.randn(5, 7), torch.ones(7))
                ops.rms_norm(torch.randn(5, 7), torch.ones(7))
            counts.append(sum("pinned implementation 'gpuonly'" in str(c.message) for c in caught))
        assert counts == [1, 1]
    finally:
        registry.unregister("rms_norm", "gpuonly")
