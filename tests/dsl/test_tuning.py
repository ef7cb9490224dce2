"""Tuning: candidate configurations and the persistent result cache (timing itself needs a GPU)."""

import json

import torch

from ninefold.dsl import tuning

from .test_backends import add, mm


def test_candidates_respect_bounds_and_the_limit():
    a, b, c = torch.empty(4096, 4096), torch.empty(4096, 4096), torch.empty(4096, 4096)
    bound = mm.bind((a, b, c), {}, backend="triton")
    configs = tuning.candidates(mm, bound)
    assert 1 <= len(configs) <= tuning.DOT_MAX_CONFIGS  # a dot in a loop: matmul-style configurations
    for config in configs:
        assert set(config["meta"]) == {"BM", "BN", "BK"}
        assert all(16 <= v <= 64 for v in config["meta"].values())
        assert config["num_warps"] in (4, 8) and config["num_stages"] in (3, 4, 5)
        # operand tiles of one stage (float32 here) times the stages fit in shared memory
        stage = 4 * config["meta"]["BK"] * (config["meta"]["BM"] + config["meta"]["BN"])
        assert stage * config["num_stages"] <= tuning.SHARED_MEMORY
    assert configs[0]["meta"] == {"BM": 64, "BN": 64, "BK": 64}  # the largest tiles first
    assert len({str(c) for c in configs}) == len(configs)
    fixed = mm.bind((a, b, c), {"BM": 32, "BN": 32, "BK": 32}, backend="triton")
    assert all(config["meta"] == {} for config in tuning.candidates(mm, fixed))


def test_small_problems_prefer_more_programs():
    a, b, c = torch.empty(100, 64), torch.empty(64, 100), torch.empty(100, 100)
    configs = tuning.candidates(mm, mm.bind((a, b, c), {}, backend="triton"))
    assert configs[0]["meta"]["BM"] * configs[0]["meta"]["BN"] <= 32 * 64


def test_elementwise_tiles_near_the_target_size():
    x = torch.empty(1 << 20)
    configs = tuning.candidates(add, add.bind((x, x, x), {}, backend="triton"))
    assert 1 <= len(configs) <= tuning.DEFAULT_MAX_CONFIGS
    sizes = [c["meta"][next(iter(c["meta"]))] for c in configs]
    assert sizes[0] == min(tuning.TARGET_TILE, 1024)  # block_size()'s upper bound is 1024


def test_results_persist_across_processes_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    tuning._MEMO.clear()
    x = torch.empty(1000)
    bound = add.bind((x, x, x), {}, backend="triton")
    key = tuning.tuning_key(add, bound)
    assert "x:float32:1024c" in key and "device=cpu" in key and "triton=" in key
    path = tmp_path / "dsl" / "tuning" / f"{tuning.source_hash(add)}.json"
    path.parent.mkdir(parents=True)
    stored = {"meta": {"BLOCK": 256}, "num_warps": 8, "num_stages": 3}
    path.write_text(json.dumps({key: stored}))
    assert tuning.tune(add, bound) == stored  # read from disk, nothing timed
    other = add.bind((torch.empty(5000),) * 3, {}, backend="triton")
    assert tuning.tuning_key(add, other) != key


def test_generated_modules_are_cached_by_source_hash(tmp_path, monkeypatch):
    from ninefold.dsl.backends.triton_codegen import generate, specialize
    from ninefold.dsl.cache import load_module

    monkeypatch.setenv("NINEFOLD_CACHE_DIR", str(tmp_path))
    generated = generate(mm, specialize(mm, None))
    module = load_module(generated.source, generated.key)
    path = tmp_path / "dsl" / "generated" / f"{generated.key}.py"
    assert path.read_text() == generated.source
    assert hasattr(module, generated.function_name)
    assert generate(mm, specialize(mm, None)).key == generated.key


def test_tma_candidates_follow_the_pointer_ones_in_both_launch_orders(monkeypatch):
    import math

    import ninefold.dsl as nd
    from ninefold.dsl import tuning
    from ninefold.ops.kernels import attention

    kernel = nd.make(attention.arrangement, attention.application, attention.tensors())
    q = torch.empty(2, 4, 1024, 128, dtype=torch.float16)
    bound = kernel.bind((q, q, q, 1 / math.sqrt(128), True, q), {})
    monkeypatch.delenv("NINEFOLD_DSL_TUNE_TMA", raising=False)
    assert tuning.tma_tuning_enabled()
    assert not tuning.tma_candidates_apply(kernel, bound)  # a cpu call
    monkeypatch.setenv("NINEFOLD_DSL_TUNE_TMA", "0")
    assert not tuning.tma_tuning_enabled()
    plain = tuning.candidates(kernel, bound)
    assert all("tma" not in c for c in plain)
    monkeypatch.setattr(tuning, "tma_candidates_apply", lambda kernel, bound: True)
    both = tuning.candidates(kernel, bound)
    assert both[: len(plain)] == plain
    extra = both[len(plain) :]
    tiles = []
    for c in plain:
        if not c.get("persistent") and c["meta"] not in [t["meta"] for t in tiles]:
            tiles.append(c)
    tiles = tiles[: tuning.TMA_CONFIGS]
    assert len(tiles) >= 3  # the attention's 128x64, 128x128 and 64x64 tiles (H200 sweep: 128x128 gains most)
    assert len(extra) == 2 * len(tiles)
    assert all(c["tma"] == "rows" and c["hoist"] and not c.get("persistent") for c in extra)
    assert [c.get("grouped", True) for c in extra] == [True] * len(tiles) + [False] * len(tiles)
    strip = lambda c: {k: v for k, v in c.items() if k not in ("tma", "grouped", "hoist")}  # noqa: E731
    assert [strip(c) for c in extra] == tiles + tiles


def test_kernels_made_with_other_launch_options_or_switches_tune_apart():
    """Same source, different make(num_warps=...) or code-generation switch: a configuration tuned for one must
    not be read back for the other."""
    from ninefold.dsl import examples

    x = torch.empty(1000)
    plain, pinned = examples.add_kernel(), examples.add_kernel()
    pinned.num_warps = 4
    assert tuning.source_hash(plain) == tuning.source_hash(pinned)
    keys = {tuning.tuning_key(k, k.bind((x, x, x), {}, backend="triton")) for k in (plain, pinned)}
    hinted = examples.add_kernel()
    hinted.cache_hints = {"load": "evict_first"}
    keys.add(tuning.tuning_key(hinted, hinted.bind((x, x, x), {}, backend="triton")))
    assert len(keys) == 3
