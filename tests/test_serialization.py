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
from harness import read_rss
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


def test_tensor_subclass_is_refused():
    # (A real DTensor is refused on real ranks: tests/test_state_dicts.py.)
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
    idx = tree_tail.rfind(bytes([S.format.T_BYTES]))
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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", sorted(S.DTYPE_CODES, key=str), ids=str)
def test_cuda_state_of_every_dtype_non_contiguous_and_shared(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; torch.cuda.is_available() is False here")
    dev = torch.device("cuda", 0)
    raw = torch.randint(0, 120, (64, 48), dtype=torch.uint8, device=dev)
    base = raw.view(dtype) if dtype.itemsize <= 48 else raw.view(torch.uint8)
    if base.dtype != dtype:
        pytest.skip(f"{dtype} is wider than the test row")
    state = {"base": base, "t": base.t(), "rows": base[::2], "alias": base, "one": base[3]}
    out = roundtrip(state)
    for k, v in state.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k].view(torch.uint8) if dtype.itemsize == 1 else out[k].contiguous()
                           .view(torch.uint8), v.cpu().contiguous().view(torch.uint8)), k
    assert out["alias"] is out["base"]
    assert out["t"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()


# -- issue 10, items 5-11: every contract of the format holds -------------------------------


class _Trickle(io.RawIOBase):
    """A raw stream that takes at most ``limit`` bytes per write (as a socket or pipe may)."""

    def __init__(self, limit):
        self.limit, self.data = limit, bytearray()

    def writable(self):
        return True

    def write(self, b):
        n = min(len(b), self.limit)
        self.data += bytes(memoryview(b)[:n])
        return n


def test_short_writes_are_continued_until_every_byte_is_written():
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    sink = _Trickle(4096)
    S.write_state(state, sink)
    assert len(sink.data) == len(S.write_state(state)) == 400_128
    assert torch.equal(S.decode_state(sink.data)["w"], state["w"])


def test_short_writes_over_a_socket():
    import socket
    import threading

    state = {"w": torch.arange(4_000_000, dtype=torch.float32)}  # 16 MB
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    received = bytearray()

    def drain():
        while chunk := b.recv(1 << 20):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with a.makefile("wb", buffering=0) as raw:  # SocketIO: write() may take part of a buffer
        S.write_state(state, raw)
    a.close()
    reader.join(30)
    assert len(received) == 16_000_128
    assert torch.equal(S.decode_state(received)["w"], state["w"])


class _Stuck(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        return None  # a non-blocking stream that would block


def test_a_stream_that_takes_nothing_raises():
    with pytest.raises(OSError, match="took no bytes after 0 of"):
        S.write_state({"w": torch.ones(10)}, _Stuck())


def test_two_writers_of_one_path_never_mix(tmp_path, monkeypatch):
    import threading
    import time

    path = tmp_path / "state.dxst"
    states = [{"who": torch.full((2_000_000,), float(k))} for k in range(2)]
    barrier = threading.Barrier(2)
    # Both writers in one process: the same pid, as two containers' processes may have.
    real = S.encode._write_chunks

    class Interleaved:  # each write yields to the other writer, so the two always interleave
        def __init__(self, f):
            self.f = f

        def write(self, b):
            n = self.f.write(b)
            time.sleep(0.0005)
            return n

    def slow_write(encoded, f, chunk_bytes):
        barrier.wait(10)
        real(encoded, Interleaved(f), 2**16)

    monkeypatch.setattr(S.encode, "_write_chunks", slow_write)
    threads = [threading.Thread(target=S.write_state, args=(s, path)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out = S.read_state(path)["who"]
    assert torch.equal(out, states[0]["who"]) or torch.equal(out, states[1]["who"])
    assert os.listdir(tmp_path) == ["state.dxst"]  # no temp file left behind


def test_written_file_mode_follows_the_umask(tmp_path):
    path = tmp_path / "s.dxst"
    S.write_state({"a": 1}, path)
    umask = os.umask(0)
    os.umask(umask)
    assert (os.stat(path).st_mode & 0o777) == (0o666 & ~umask)


_rss = read_rss


def _many_scalar_records(n):
    """A hostile-shaped but well-formed buffer: a list of n 0-dim float32 tensors, every one
    a view of the same 4-byte storage (built directly: encoding n tensors would be slow)."""
    import array as _array

    storage_table = struct.pack("<I", 1) + struct.pack("<QQ", 0, 4)
    tensor_table = struct.pack("<I", n) + S.format._TENSOR.pack(1, 0, 0, 0) * n
    refs = _array.array("I", range(n)).tobytes()
    tree = bytearray(struct.pack("<BI", S.format.T_LIST, n))
    tags = bytearray(5 * n)
    tags[0::5] = bytes([S.format.T_TENSOR]) * n
    for k in range(4):
        tags[1 + k :: 5] = refs[k::4]
    blob = storage_table + tensor_table + bytes(tree) + bytes(tags)
    data_off = (S.format._PREAMBLE.size + len(blob) + 63) // 64 * 64
    pre = S.format._PREAMBLE.pack(S.MAGIC, S.VERSION, 0, len(blob), data_off, 4)
    return (pre + blob).ljust(data_off, b"\0") + bytes(4)


def test_decoding_memory_is_bounded_for_many_tensor_records():
    import gc

    n = 1_000_000  # ~19 MB of header: 0-dim views of one 4-byte storage
    buf = bytearray(_many_scalar_records(n))
    gc.collect()
    before = _rss()
    with pytest.raises(ValueError, match="tensor records exceed the cap"):
        S.decode_state(buf)
    assert _rss() - before < 64 * 2**20
    # Under the default cap the decode is allowed, and its memory stays within 16x the buffer:
    # 100,000 scalar views beside 8 MB of data (the cap is one tensor per 64 buffer bytes).
    base = torch.zeros(1)
    state = {"views": [base[0] for _ in range(100_000)], "data": torch.ones(2 * 2**20)}
    allowed = bytearray(S.write_state(state))
    assert 100_001 <= S.resolve_max_tensors(len(allowed), None)
    gc.collect()
    before = _rss()
    out = S.decode_state(allowed)
    grown = _rss() - before
    assert len(out["views"]) == 100_000 and grown < 16 * len(allowed) + 2**20, (
        grown, len(allowed))
    del out
    # A trusted caller raises the cap.
    assert len(S.decode_state(_many_scalar_records(50_000), max_tensors=50_000)) == 50_000


def _storage_table_bomb(n_storages):
    """A buffer whose storage table holds n_storages records over a tiny data region."""
    storage_table = struct.pack("<I", n_storages) + struct.pack("<QQ", 0, 1) * n_storages
    blob = storage_table + struct.pack("<I", 0) + bytes([S.format.T_NONE])
    data_off = (S.format._PREAMBLE.size + len(blob) + 63) // 64 * 64
    pre = S.format._PREAMBLE.pack(S.MAGIC, S.VERSION, 0, len(blob), data_off, 64)
    return (pre + blob).ljust(data_off, b"\0") + bytes(64)


def test_a_storage_table_bomb_is_refused_without_allocating():
    buf = _storage_table_bomb(1_000_000)  # 16 MB of records, each overlapping the last
    before = _rss()
    with pytest.raises(ValueError, match="storages cannot fit"):
        S.decode_state(buf)
    assert _rss() - before < 32 * 2**20


def test_overlapping_storages_are_refused():
    # Two storages at the same offset: a writer never does this.
    storage_table = struct.pack("<I", 2) + struct.pack("<QQ", 0, 64) * 2
    blob = storage_table + struct.pack("<I", 0) + bytes([S.format.T_NONE])
    data_off = (S.format._PREAMBLE.size + len(blob) + 63) // 64 * 64
    buf = (S.format._PREAMBLE.pack(S.MAGIC, S.VERSION, 0, len(blob), data_off, 128)
           + blob).ljust(data_off, b"\0") + bytes(128)
    with pytest.raises(ValueError, match="overlap or are out of order"):
        S.decode_state(buf)


class _Pipe(io.RawIOBase):
    """A non-seekable stream (as a FIFO is) that counts what was read from it."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), len(self.data) - self.pos)
        memoryview(b)[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_read_state_checks_the_preamble_before_reading_on():
    zeros = _Pipe(memoryview(bytes(64 * 2**20)))
    with pytest.raises(ValueError, match="bad magic"):
        S.read_state(zeros)
    assert zeros.pos == 32  # the preamble only


def test_read_state_reads_exactly_the_declared_length(tmp_path):
    a, b = {"a": torch.arange(10)}, {"b": torch.ones(3)}
    stream = _Pipe(memoryview(bytes(S.write_state(a)) + bytes(S.write_state(b)) + b"tail"))
    assert torch.equal(S.read_state(stream)["a"], a["a"])
    assert torch.equal(S.read_state(stream)["b"], b["b"])  # the next state, in turn
    assert stream.read() == b"tail"


def test_a_lying_preamble_does_not_allocate_what_it_claims(tmp_path):
    buf = bytearray(S.write_state({"a": torch.ones(4)}))
    _m, v, fl, hl, off, _n = S.format._PREAMBLE.unpack_from(buf)
    S.format._PREAMBLE.pack_into(buf, 0, S.MAGIC, v, fl, hl, off, 2**40)  # claims a terabyte
    before = _rss()
    with pytest.raises(ValueError, match="ended after"):
        S.read_state(_Pipe(memoryview(bytes(buf))))
    assert _rss() - before < 256 * 2**20
    path = tmp_path / "liar.dxst"
    path.write_bytes(buf)
    with pytest.raises(ValueError, match="only .* bytes are left in the file"):
        S.read_state(path)


def test_read_state_honours_the_stream_position(tmp_path):
    blob = bytes(S.write_state({"x": torch.arange(5)}))
    stream = io.BytesIO(b"JUNK" + blob)
    stream.seek(4)
    assert torch.equal(S.read_state(stream)["x"], torch.arange(5))
    path = tmp_path / "f"
    path.write_bytes(b"JUNK" + blob)
    with open(path, "rb") as f:
        f.seek(4)
        assert torch.equal(S.read_state(f)["x"], torch.arange(5))


@pytest.mark.parametrize("first", ["head", "all"])
def test_tensors_whose_memory_overlaps_encode_in_any_order(first):
    np = pytest.importorskip("numpy")
    a = np.arange(1000, dtype=np.float32)
    head, whole = torch.from_numpy(a[:10]), torch.from_numpy(a)
    mid = torch.from_numpy(a[400:700])
    state = {"head": head, "all": whole, "mid": mid} if first == "head" else {
        "all": whole, "mid": mid, "head": head}
    out = roundtrip(state)
    for k in state:
        assert torch.equal(out[k], state[k])
    # One storage: they overlapped in memory, so they still share it.
    ptrs = {out[k].untyped_storage().data_ptr() for k in out}
    assert len(ptrs) == 1
    assert len(S.write_state(state)) < 4000 + 1000  # travelled once


def test_partially_overlapping_views_from_different_storages():
    np = pytest.importorskip("numpy")
    a = np.arange(1000, dtype=np.float64)
    state = {"x": torch.from_numpy(a[0:600]), "y": torch.from_numpy(a[500:1000])}
    out = roundtrip(state)
    assert torch.equal(out["x"], state["x"]) and torch.equal(out["y"], state["y"])
    out["x"][550] = -1.0  # still one memory, as at the writer
    assert out["y"][50].item() == -1.0


def _expanded_bomb():
    """The 192-byte buffer of the issue: one float of data, 2**62 elements by stride 0."""
    base = torch.zeros(1)
    buf = bytearray(S.write_state([base, base.expand(4)]))  # shared: the view keeps stride 0
    pos = buf.index(struct.pack("<qq", 4, 0))  # shape (4,), stride (0,)
    buf[pos : pos + 8] = struct.pack("<q", 2**62)
    return buf


def test_tensors_larger_than_the_buffer_allows_are_refused():
    buf = _expanded_bomb()
    assert len(buf) < 256  # a couple of hundred bytes
    with pytest.raises(ValueError, match="max_expansion=1024"):
        S.decode_state(buf)


def test_legitimate_expanded_views_round_trip_and_the_limit_can_be_raised():
    one, row = torch.ones(1), torch.arange(8.0)
    state = {"one": one, "mask": one.expand(4096), "row": row, "bias": row.expand(64, 8)}
    out = roundtrip(state)
    assert torch.equal(out["mask"], state["mask"]) and out["mask"].stride() == (0,)
    assert torch.equal(out["bias"], state["bias"]) and out["bias"].stride() == (0, 1)
    big = {"one": one, "b": one.expand(10_000_000)}  # 40 MB logical from a few hundred bytes
    blob = S.write_state(big)
    with pytest.raises(ValueError, match="logical size"):
        S.decode_state(blob)
    assert S.decode_state(blob, max_expansion=10**6)["b"].shape == (10_000_000,)


@pytest.mark.parametrize("index", [128, 300, -2, 2**40])
def test_device_indices_outside_torch_range_are_refused(index):
    buf = bytearray(S.write_state({"d": torch.device("cpu", 3)}))
    pos = buf.index(b"cpu" + struct.pack("<q", 3)) + 3
    buf[pos : pos + 8] = struct.pack("<q", index)
    with pytest.raises(ValueError, match="device index"):
        S.decode_state(buf)


def test_device_indices_in_range_round_trip():
    for d in (torch.device("cpu"), torch.device("cpu", 0), torch.device("cuda", 127)):
        assert roundtrip({"d": d})["d"] == d


def test_encoded_surrogates_are_refused_and_lone_surrogates_never_written():
    buf = bytearray(S.write_state({"k": "ab"}))
    pos = buf.index(b"ab")
    buf[pos - 4 : pos + 2] = struct.pack("<I", 3) + b"\xed\xa0"  # \ud800 in surrogatepass
    buf.insert(pos + 2, 0x80)
    # Fix the header length for the inserted byte.
    _m, v, fl, hl, off, n = S.format._PREAMBLE.unpack_from(buf)
    del buf[off : off + 1]  # keep the total length: drop one padding byte before data
    S.format._PREAMBLE.pack_into(buf, 0, S.MAGIC, v, fl, hl + 1, off, n)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        S.decode_state(buf)
    with pytest.raises(TypeError, match=r"state\['k'\] is a str that is not valid Unicode"):
        S.write_state({"k": "a\ud800b"})
    with pytest.raises(TypeError, match="not valid Unicode"):
        S.write_state({"a\udc80": 1})


def _tree_bomb(item, n):
    """A list of n copies of one encoded value (item: its bytes), built directly."""
    blob = struct.pack("<I", 0) + struct.pack("<I", 0) + struct.pack("<BI", S.format.T_LIST, n) + item * n
    data_off = (S.format._PREAMBLE.size + len(blob) + 63) // 64 * 64
    pre = S.format._PREAMBLE.pack(S.MAGIC, S.VERSION, 0, len(blob), data_off, 0)
    return (pre + blob).ljust(data_off, b"\0")


@pytest.mark.parametrize("item", [
    bytes([S.format.T_NONE]),  # an 8-byte list slot per byte
    struct.pack("<BI", S.format.T_LIST, 0),  # an empty list object per 5 bytes
    struct.pack("<BI", S.format.T_DICT, 0),  # an empty dict per 5 bytes
    struct.pack("<BI", S.format.T_STR, 1) + b"a",  # a one-character str per 6 bytes
    struct.pack("<Bd", S.format.T_FLOAT, 0.5),
], ids=["none", "list", "dict", "str", "float"])
def test_value_tree_memory_stays_within_16x_the_buffer(item):
    import gc

    buf = _tree_bomb(item, 2_000_000)
    gc.collect()
    before = _rss()
    out = S.decode_state(buf)
    grown = _rss() - before
    assert len(out) == 2_000_000
    assert grown < 16 * len(buf) + 2**20, (grown / len(buf))
