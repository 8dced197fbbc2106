"""The pickle-free state format: encode a state to segments, decode a buffer to views.

A state is a tree of plain values (dict with str/int keys, OrderedDict, list, tuple, str, int,
float, bool, None, bytes, torch.dtype, torch.Size, torch.device) and dense tensors. Encoding
copies no tensor bytes: it returns a header and a list of *segments*, flat uint8 views of the
tensors' own memory, which the transport (or :func:`write_state`) copies straight to their
destination with the compiled core. Decoding copies no tensor bytes either: the tensors of a
decoded state are views of the buffer, which stays alive as long as any of them does.

The byte layout is specified in ``docs/format.md``. Decoding never runs pickle and checks every
length, offset, dtype, shape, stride and nesting depth against the buffer before use;
malformed input raises ValueError.

Tensors sharing a storage (tied weights, views of one buffer) travel once, as the byte span of
the storage they cover, and arrive sharing one storage with their strides, as ``torch.save``
keeps them. A tensor alone on its storage travels as its own bytes, contiguous. Parameters
arrive as plain tensors and CUDA tensors as CPU tensors (``requires_grad`` is not kept).

Two modules, one per job, over the format's shared constants (:mod:`.format`): the encoder
(:mod:`.encode`) and the decoder (:mod:`.decode`), which imports nothing of the encoder.
"""

from distributed_ext.serialization import decode, encode, format  # noqa: F401 - (its modules)
from distributed_ext.serialization.decode import (  # noqa: F401 - the names users and tests read
    DEFAULT_MAX_EXPANSION,
    decode_state,
    read_state,
    resolve_max_tensors,
)
from distributed_ext.serialization.encode import (  # noqa: F401 - the names users and tests read
    EncodedState,
    encode_state,
    pack_encoded,
    write_fully,
    write_state,
    write_state_into,
)
from distributed_ext.serialization.format import (  # noqa: F401 - the names users and tests read
    ALIGNMENT,
    CODE_DTYPES,
    DTYPE_CODES,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    VERSION,
)

__all__ = [
    "ALIGNMENT",
    "EncodedState",
    "decode_state",
    "encode_state",
    "read_state",
    "write_state",
    "write_state_into",
]
