"""A sharded model's full state on one rank: as a Hugging Face checkpoint, or as a dict.

One module per concern; the plan of pieces (:mod:`.pieces`) is the contract between them:

- :mod:`.keys`: in-memory names <-> the hub's keys, each written tensor as blocks of
  in-memory tensors (transformers' own conversion machinery).
- :mod:`.entries`: what each rank holds, described as compact tables.
- :mod:`.blocks`: boxes of tensors and their byte runs (pure geometry).
- :mod:`.pieces`: the plan -- which rank sends which block of each written tensor.
- :mod:`.messages`: how pieces travel, and the row tables that say where bytes go.
- :mod:`.safetensors`: dtypes, file names, headers, the layout over files, size parsing.
- :mod:`.publish`: the stage directory and publishing it whole.
- :mod:`.sinks`: where dst puts the bytes (files, memory).
- :mod:`.stager` and :mod:`.transfer`: the data round.
- :mod:`.writers`: who writes the files (dst, or every rank its own bytes).
- :mod:`.api`: the rounds, and the public functions.
"""

from distributed_ext.export.api import export_hf_checkpoint, gather_full_state
from distributed_ext.export.blocks import Block, Runs, _tiles_exactly, block_runs
from distributed_ext.export.entries import describe_state
from distributed_ext.export.messages import plan_messages
from distributed_ext.export.pieces import Entry, Piece
from distributed_ext.export.safetensors import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    WEIGHTS_NAME,
    parse_shard_size,
    safetensors_header,
)
from distributed_ext.export.sinks import FileSink, MemorySink

__all__ = ["export_hf_checkpoint", "gather_full_state"]
# (The other names above are the package's tested internals, importable from here.)
_INTERNALS = (Block, Runs, block_runs, _tiles_exactly, describe_state, plan_messages, Entry,
              Piece, INDEX_NAME, SAFETENSORS_DTYPES, WEIGHTS_NAME, parse_shard_size,
              safetensors_header, FileSink, MemorySink)
