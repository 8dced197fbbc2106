"""A sharded model's full state on one rank: as a Hugging Face checkpoint, or as a dict.

One module per concern; the plan of pieces (:mod:`.pieces`) is the contract between them:

- :mod:`.keys`: in-memory names <-> the hub's keys, each written tensor as blocks of
  in-memory tensors (transformers' own conversion machinery).
- :mod:`.entries`: what each rank holds, described as compact tables.
- :mod:`.holdings`: those descriptions merged: who holds which in-memory tensor, and which
  block of it (checked against the distribution plan the models record).
- :mod:`.blocks`: boxes of tensors and their byte runs (pure geometry).
- :mod:`.pieces`: the plan -- which rank sends which block of each written tensor.
- :mod:`.messages`: how pieces travel, and the row tables that say where bytes go.
- :mod:`.safetensors`: dtypes, file names, headers, the layout over files, size parsing.
- :mod:`.publish`: the stage directory and publishing it whole.
- :mod:`.sinks`: where dst puts the bytes (files, memory); :mod:`.regions`: short runs
  assembled into aligned regions of a file, each written whole.
- :mod:`.prepare`, :mod:`.stager` and :mod:`.transfer`: the data round (its messages and
  buffers planned and allocated up front; the bytes staged and moved).
- :mod:`.writers`: who writes the files (dst, or every rank its own bytes); :mod:`.stop`:
  the flag that stops every rank's own writes once one rank failed.
- :mod:`.owners` and :mod:`.edges`: with every rank writing, who writes each block that two
  ranks' runs share (the holder of most of its bytes), and how its bytes get there.
- :mod:`.zones`: with every rank writing, who writes each region of a TP layout's short
  rows (the holder of most of its bytes), planned alike at both ends from the plan.
- :mod:`.rounds`: the agreed rounds of an export; :mod:`.api`: the public functions.
"""

# The public calls, and (``X as X``: re-exported) the internals the tests reach from here.
from distributed_ext.export.api import export_hf_checkpoint, gather_full_state
from distributed_ext.export.blocks import Block as Block
from distributed_ext.export.blocks import Runs as Runs
from distributed_ext.export.blocks import _tiles_exactly as _tiles_exactly
from distributed_ext.export.blocks import block_runs as block_runs
from distributed_ext.export.entries import describe_state as describe_state
from distributed_ext.export.messages import plan_messages as plan_messages
from distributed_ext.export.pieces import Entry as Entry
from distributed_ext.export.pieces import Piece as Piece
from distributed_ext.export.safetensors import INDEX_NAME as INDEX_NAME
from distributed_ext.export.safetensors import SAFETENSORS_DTYPES as SAFETENSORS_DTYPES
from distributed_ext.export.safetensors import WEIGHTS_NAME as WEIGHTS_NAME
from distributed_ext.export.safetensors import parse_shard_size as parse_shard_size
from distributed_ext.export.safetensors import safetensors_header as safetensors_header
from distributed_ext.export.sinks import FileSink as FileSink
from distributed_ext.export.sinks import MemorySink as MemorySink

__all__ = ["export_hf_checkpoint", "gather_full_state"]
