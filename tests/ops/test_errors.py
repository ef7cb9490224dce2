"""Bad calls raise TypeError/ValueError naming the argument, what was given and what is accepted."""

import pytest
import torch

import ninefold.ops as ops
from ninefold.ops import OpError, UnsupportedError

x = torch.randn(4, 8)
w = torch.randn(8)


def test_unsupported_dtype_lists_what_the_device_supports():
    with pytest.raises(UnsupportedError) as err:
        ops.rms_norm(x.to(torch.int32), w)
    assert str(err.value) == "rms_norm: int32 is not supported on cpu; supported: float16, bfloat16, float32"
    assert isinstance(err.value, ValueError)


def test_device_without_implementations_is_named():
    with pytest.raises(UnsupportedError, match="rms_norm: no implementation runs on meta"):
        ops.rms_norm(x.to("meta"), w.to("meta"))


@pytest.mark.parametrize("call,error,words", [
    (lambda: ops.rms_norm(x.tolist(), w), TypeError, ["rms_norm", "x", "torch.Tensor", "list"]),
    (lambda: ops.rms_norm(x, torch.randn(7)), OpError, ["weight", "(8,)", "(7,)"]),
    (lambda: ops.rms_norm(x, w, eps=0), OpError, ["eps", "> 0"]),
    (lambda: ops.rms_norm(x, w.to("meta")), OpError, ["weight", "meta", "cpu"]),
    (lambda: ops.add(x, torch.randn(3)), OpError, ["add", "(4, 8)", "(3,)", "broadcast"]),
    (lambda: ops.mul(x, x.half()), TypeError, ["mul", "b", "float16", "float32"]),
    (lambda: ops.linear(x, torch.randn(5, 7)), OpError, ["linear", "weight", "[N, 8]"]),
    (lambda: ops.linear(x, torch.randn(5, 8), torch.randn(4)), OpError, ["bias", "(5,)", "(4,)"]),
    (lambda: ops.embedding(x, torch.randn(3, 4)), TypeError, ["embedding", "ids", "int32 or int64", "float32"]),
    (lambda: ops.silu_and_mul(torch.randn(3, 5)), OpError, ["silu_and_mul", "even", "(3, 5)"]),
    (lambda: ops.gelu_and_mul(x, "fast"), OpError, ["approximate", "'fast'"]),
    (lambda: ops.softmax(x, 2), OpError, ["softmax", "dim", "[-2, 1]"]),
    (lambda: ops.argmax(x, dim=5), OpError, ["argmax", "dim"]),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.zeros(3, dtype=torch.int64),
                      torch.randn(10, 10)), OpError, ["cos_sin_cache", "R even", "8"]),
    (lambda: ops.rope(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.zeros(3), torch.randn(10, 8)),
     TypeError, ["positions", "int32 or int64", "float32"]),
    (lambda: ops.attention_decode(torch.randn(2, 6, 8), torch.randn(4, 2, 4, 8), torch.randn(4, 2, 4, 8),
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)),
     OpError, ["attention_decode", "query heads (6)", "KV heads (4)"]),
    (lambda: ops.attention_decode(torch.randn(2, 4, 8), torch.randn(4, 2, 4, 8), torch.randn(4, 2, 4, 8),
                                  torch.zeros(3, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)),
     OpError, ["block_tables", "(2, *)", "(3, 2)"]),
    (lambda: ops.attention_prefill(torch.randn(3, 2, 8), None, None, torch.tensor([0, 3]), torch.tensor([0, 3])),
     TypeError, ["attention_prefill", "k", "NoneType"]),
    (lambda: ops.attention_prefill(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
                                   torch.tensor([0, 3]), torch.tensor([0, 2])), OpError, ["3 queries but 2 keys"]),
    (lambda: ops.reshape_and_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(4, 4, 2, 8),
                                   torch.randn(4, 4, 2, 8), torch.tensor([0, 1, 2])), OpError, ["slot_mapping", "(2,)"]),
    (lambda: ops.sample(x, torch.ones(3)), OpError, ["sample", "temperature", "(4,)", "(3,)"]),
    (lambda: ops.embedding(torch.tensor([0, 5]), torch.randn(5, 2)), OpError, ["ids", "[0, 5)", "from 0 to 5"]),
    (lambda: ops.rope(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.tensor([0, 9]), torch.randn(9, 8)),
     OpError, ["positions", "[0, 9)", "to 9"]),
    (lambda: ops.reshape_and_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(4, 4, 2, 8),
                                   torch.randn(4, 4, 2, 8), torch.tensor([16])), OpError, ["slot_mapping", "16", "16 slots"]),
    (lambda: ops.sample(x, torch.ones(4), top_k=torch.ones(4)), TypeError, ["top_k", "int32 or int64"]),
    (lambda: ops.sample(x, torch.ones(4), generators=[None]), OpError, ["generators", "list of 4"]),
    (lambda: ops.sample(x, torch.ones(4), generators=[1, None, None, None]), TypeError, ["generators[0]", "int"]),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error) as err:
        call()
    for word in words:
        assert word in str(err.value), f"{word!r} missing from {err.value!s}"


def test_unknown_pin_is_rejected_with_the_known_names():
    with pytest.raises(OpError, match="rms_norm has no implementation 'fast'; it has: .*vendor"):
        with ops.use(rms_norm="fast"):
            pass
    with pytest.raises(OpError, match="unknown operator 'rmsnorm'"):
        with ops.use(rmsnorm="vendor"):
            pass
