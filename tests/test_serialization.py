"""The pickle-free state format: round trips, sharing, errors with key paths, hostile input."""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distributed_ext import serialization as S


def roundtrip(state):
    return S.decode_state(S.write_state(state))


def assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and type(b) is torch.Tensor), (
        type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _bitwise_equal(a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def _bitwise_equal(a, b):
    a = a.detach().cpu().contiguous()
    b = b.contiguous()
    return a.numel() == b.numel() and (
        a.numel() == 0 or bytes(a.view(-1).view(torch.uint8).tolist())
        == bytes(b.view(-1).view(torch.uint8).tolist()))


ALL_DTYPES = list(S.DTYPE_CODES)


def _random_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)])
def test_every_dtype_and_shape(dtype, shape):
    t = _random_tensor(dtype, shape, seed=len(shape))
    out = roundtrip({"t": t})["t"]
    assert out.dtype == dtype and out.shape == t.shape
    assert _bitwise_equal(t, out)


def test_values_round_trip():
    state = collections.OrderedDict(
        [("b", 1), ("a", [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**200, -(3**90)]),
         (7, (1.5, float("inf"), float("-inf"), -0.0, float("nan"))),
         (-2**70, {"nested": {"deep": ["x", "ünïcode", "", b"\x00\xff", bytearray(b"ba")]}}),
         ("meta", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.Size([3, 0, 2]),
                   torch.Size([]), torch.device("cpu"), torch.device("cuda", 3)])])
    out = roundtrip(state)
    assert type(out) is collections.OrderedDict and list(out) == list(state)
    assert out["a"] == state["a"] and out[-2**70]["nested"]["deep"][3:] == [b"\x00\xff", b"ba"]
    assert out[7][:4] == state[7][:4] and math.isnan(out[7][4])
    assert math.copysign(1, out[7][3]) == -1
    assert out["meta"] == state["meta"]
    plain = roundtrip({"x": 1, 2: "y"})
    assert type(plain) is dict and plain == {"x": 1, 2: "y"}


def test_tensors_view_the_buffer_without_copying():
    buf = S.write_state({"w": torch.arange(1024, dtype=torch.float32)})
    out = S.decode_state(buf)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert base <= out["w"].data_ptr() < base + len(buf)
    # Writing through the buffer shows in the tensor: it is a view.
    off = out["w"].data_ptr() - base
    buf[off : off + 4] = struct.pack("<f", 42.0)
    assert out["w"][0].item() == 42.0


def test_shared_storage_travels_once_and_stays_shared():
    emb = torch.randn(100, 64)
    state = {"embed.weight": emb, "lm_head.weight": emb, "emb_t": emb.t(), "row": emb[3],
             "slice": emb[10:20], "other": torch.randn(5)}
    encoded = S.encode_state(state)
    assert encoded.tensor_bytes == emb.numel() * 4 + 5 * 4  # emb once
    out = S.decode_state(S.write_state(state))
    assert out["embed.weight"] is out["lm_head.weight"]  # same object in, same object out
    ptr = out["embed.weight"].untyped_storage().data_ptr()
    for k in ("emb_t", "row", "slice"):
        assert out[k].untyped_storage().data_ptr() == ptr
        assert torch.equal(out[k], state[k])
    assert out["emb_t"].stride() == emb.t().stride()
    assert out["other"].untyped_storage().data_ptr() != ptr
    out["embed.weight"][3, 0] = 123.0
    assert out["row"][0].item() == 123.0


def test_views_of_one_buffer_with_different_dtypes():
    raw = torch.randint(0, 256, (64,), dtype=torch.uint8)
    state = {"bytes": raw[1:9], "floats": raw[8:24].view(torch.float32), "all": raw}
    out = roundtrip(state)
    for k in state:
        assert _bitwise_equal(state[k], out[k])


def test_non_contiguous_alone_arrives_contiguous():
    t = torch.randn(6, 8)[:, ::3]
    out = roundtrip({"t": t})["t"]
    assert out.is_contiguous() and torch.equal(out, t)


def test_parameters_and_special_bits_arrive_as_plain_tensors():
    p = torch.nn.Parameter(torch.randn(3, 3))
    c = torch.randn(4, dtype=torch.complex64)
    out = roundtrip({"p": p, "conj": c.conj(), "neg": torch._neg_view(torch.randn(2))})
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert torch.equal(out["p"], p.detach())
    assert torch.equal(out["conj"], c.conj().resolve_conj()) and not out["conj"].is_conj()


def test_alignment_of_tensor_data():
    state = {f"t{i}": torch.randn(i + 1) for i in range(20)}
    buf = S.write_state(state)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    out = S.decode_state(buf)
    for t in out.values():
        assert (t.data_ptr() - base) % S.ALIGNMENT == 0


@pytest.mark.parametrize(
    "state, path, fix",
    [
        ({"a": {"b": object()}}, "state['a']['b']", "convert it"),
        ({"m": [1, torch.randn(3, 3).to_sparse()]}, "state['m'][1]", ".to_dense()"),
        ({"x": torch.empty(3, device="meta")}, "state['x']", "materialize"),
        ({"n": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])}, "state['n']",
         "unbind"),
        ({"f": lambda: 0}, "state['f']", "convert it"),
        ({(1, 2): 3}, "state", "keys must be str or int"),
        ({"q": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)}, "state['q']",
         ".dequantize()"),
    ],
)
def test_unsupported_values_name_the_key_path_and_fix(state, path, fix):
    with pytest.raises(TypeError) as info:
        S.encode_state(state)
    assert path in str(info.value) and fix in str(info.value)


def test_dtensor_is_refused(tmp_path):
    from torch.distributed.tensor import DTensor  # noqa: F401  (import path exists)

    class Fake(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="tensor subclass"):
        S.encode_state({"x": torch.randn(2).as_subclass(Fake)})


def test_self_containing_state_is_a_type_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nests deeper"):
        S.encode_state({"loop": loop})


def test_write_and_read_file(tmp_path):
    state = {"w": torch.randn(300, 300), "meta": {"step": 7}}
    path = tmp_path / "state.dxst"
    S.write_state(state, path, chunk_bytes=4096)  # many chunks
    out = S.read_state(path)
    assert torch.equal(out["w"], state["w"]) and out["meta"] == {"step": 7}
    assert os.listdir(tmp_path) == ["state.dxst"]  # no temp file left
    bio = io.BytesIO()
    S.write_state(state, bio)
    assert torch.equal(S.read_state(io.BytesIO(bio.getvalue()))["w"], state["w"])


def test_write_into_a_reused_buffer():
    buffer = bytearray(1 << 16)
    for seed in range(3):
        state = {"w": torch.randn(100, 50, generator=torch.Generator().manual_seed(seed))}
        n = S.write_state_into(state, buffer)
        assert n == len(S.write_state(state))
        out = S.decode_state(memoryview(buffer)[:n])
        assert torch.equal(out["w"], state["w"])
        del out
    with pytest.raises(ValueError, match="buffer has 100"):
        S.write_state_into({"w": torch.randn(100)}, bytearray(100))
    with pytest.raises(TypeError, match="writable"):
        S.write_state_into({"w": torch.randn(1)}, bytes(1000))


def test_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "bad.dxst"
    with pytest.raises(TypeError):
        S.write_state({"x": object()}, path)
    assert not path.exists() and os.listdir(tmp_path) == []


# -- property tests --------------------------------------------------------------------------

_dtypes = st.sampled_from(ALL_DTYPES)
_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
_tensors = st.builds(lambda d, s, seed: _random_tensor(d, s, seed), _dtypes, _shapes,
                     st.integers(0, 2**16))
_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
            | st.text(max_size=20) | st.binary(max_size=20) | _dtypes
            | _shapes.map(torch.Size) | _tensors)
_keys = st.text(max_size=8) | st.integers()
_trees = st.recursive(
    _scalars,
    lambda children: (st.lists(children, max_size=4)
                      | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(_keys, children, max_size=4)
                      | st.dictionaries(_keys, children, max_size=4).map(collections.OrderedDict)),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _trees, max_size=5))
def test_property_round_trip(state):
    assert_same(state, roundtrip(state))


# -- hostile input -----------------------------------------------------------------------------


def _sample_buffer() -> bytearray:
    state = collections.OrderedDict(
        w=torch.randn(16, 8), tied=None, b=torch.arange(10, dtype=torch.int64),
        meta={"name": "layer", "shape": torch.Size([16, 8]), "n": 2**70, "f": 1.5,
              "dtypes": [torch.bfloat16], "raw": b"abc", "t": (1, None)},
        e=torch.empty(0, 4, dtype=torch.float16), h=torch.randn(3).to(torch.bfloat16))
    state["tied"] = state["w"][2:]
    return S.write_state(state)


def _decode_or_value_error(buf) -> None:
    try:
        out = S.decode_state(buf)
    except ValueError:
        return
    # A mutation may still decode: then every tensor must lie inside the buffer.
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr() if len(buf) else 0

    def walk(v):
        if isinstance(v, torch.Tensor) and v.numel():
            lo = v.data_ptr()
            hi = lo + (1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride()))) * v.element_size()
            assert base <= lo and hi <= base + len(buf)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(out)


def test_fuzz_truncated_buffers():
    buf = _sample_buffer()
    for n in range(len(buf)):
        with pytest.raises(ValueError):
            S.decode_state(bytearray(buf[:n]))
    with pytest.raises(ValueError):
        S.decode_state(buf + b"\x00")


FUZZ_CASES = 5000


def test_fuzz_mutated_buffers():
    buf = _sample_buffer()
    header_end = struct.unpack_from("<Q", buf, 16)[0]  # data offset: mutate the header mostly
    rng = random.Random(1234)
    for _ in range(FUZZ_CASES):
        mutated = bytearray(buf)
        for _ in range(rng.choice([1, 1, 2, 4, 16])):
            pos = rng.randrange(header_end if rng.random() < 0.9 else len(buf))
            mutated[pos] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        _decode_or_value_error(mutated)


def test_fuzz_random_garbage():
    rng = random.Random(99)
    for _ in range(2000):
        n = rng.randrange(0, 200)
        garbage = bytearray(rng.randbytes(n))
        if n >= 4 and rng.random() < 0.7:
            garbage[:4] = b"DXST"
        if n >= 8 and rng.random() < 0.7:
            garbage[4:8] = struct.pack("<HH", 1, 0)
        with pytest.raises(ValueError):
            S.decode_state(garbage)


def test_huge_counts_do_not_allocate():
    # A header claiming 2**32-1 list items (or a 2**63-byte bytes value) fails at once.
    buf = _sample_buffer()
    blob = bytearray(buf)
    data_off = struct.unpack_from("<Q", blob, 16)[0]
    header_len = struct.unpack_from("<Q", blob, 8)[0]
    tree_tail = blob[32:32 + header_len]
    idx = tree_tail.rfind(bytes([S.T_BYTES]))
    assert idx > 0
    blob[32 + idx + 1 : 32 + idx + 9] = struct.pack("<Q", 2**63 - 1)
    with pytest.raises(ValueError, match="truncated"):
        S.decode_state(blob)
    assert data_off > 0


class Planted:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ.get("PLANT_PATH", "/tmp/x"),))


def test_planted_pickle_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("PLANT_PATH", str(marker))
    evil = pickle.dumps(Planted())
    buf = _sample_buffer()
    data_off = struct.unpack_from("<Q", buf, 16)[0]
    # 1. In place of the tensor data: it is just bytes of a tensor.
    planted = bytearray(buf)
    planted[data_off : data_off + len(evil)] = evil
    out = S.decode_state(planted)
    assert out["w"].view(-1).view(torch.uint8)[: len(evil)].tolist() == list(evil)
    # 2. In place of the header / a value: rejected as malformed.
    for where in (0, 32, 40, data_off - len(evil)):
        bad = bytearray(buf)
        bad[where : where + len(evil)] = evil
        try:
            S.decode_state(bad)
        except ValueError:
            pass
    # 3. A whole pickle as the buffer.
    with pytest.raises(ValueError, match="magic"):
        S.decode_state(evil)
    assert not marker.exists(), "a pickle ran"


def test_decode_rejects_non_buffers():
    with pytest.raises(TypeError, match="got str"):
        S.decode_state("not bytes")  # type: ignore[arg-type]


# -- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_state_arrives_on_cpu_packed_on_device():
    dev = torch.device("cuda", 0)
    emb = torch.randn(1000, 64, device=dev)
    state = {f"small.{i}": torch.randn(i + 1, device=dev).to(torch.bfloat16) for i in range(300)}
    state.update({"emb": emb, "head": emb, "row": emb[7], "big": torch.randn(2**24 + 3, device=dev),
                  "cpu": torch.arange(5)})
    out = roundtrip(state)
    for k, v in state.items():
        assert out[k].device.type == "cpu" and torch.equal(out[k], v.cpu()), k
    assert out["emb"] is out["head"]
    assert out["row"].untyped_storage().data_ptr() == out["emb"].untyped_storage().data_ptr()


def test_cuda_sources_compile_with_nvcc(tmp_path):
    # A syntax/type check of csrc/cuda/*.cu where nvcc exists, also on machines without a GPU.
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA sources can only be checked where a toolkit is")
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cuda_dir = os.path.join(root, "csrc", "cuda")
    sources = sorted(f for f in os.listdir(cuda_dir) if f.endswith(".cu"))
    assert sources
    for name in sources:
        proc = subprocess.run(
            [nvcc, "-c", "-std=c++17", f"-I{include}", os.path.join(cuda_dir, name),
             "-o", str(tmp_path / (name + ".o"))],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
