"""A sharded model's full state on one rank: as a Hugging Face checkpoint, or as a dict.

Four layers, each importing only those below it (``tests/test_architecture.py`` holds them
to it; the picture: ``docs/architecture.md``). The plan (:class:`plan.types.Entry`: each
written tensor and the pieces it is assembled from) is the one contract between them:

- :mod:`.plan` -- pure planning, the same on every rank from the metadata round, testable
  in one process (no process group, no files): :mod:`plan.types` (the shared types),
  :mod:`plan.placements` (where a DTensor's shard lies), :mod:`plan.blocks` (boxes and byte
  runs), :mod:`plan.keys` (the hub's keys, from transformers' own conversions),
  :mod:`plan.wrappers` (the model inside torch.compile/DDP), :mod:`plan.entries` (what a
  rank holds, as compact tables), :mod:`plan.holdings` (those merged), :mod:`plan.pieces`
  (which rank sends which block), :mod:`plan.messages` (how pieces travel, row tables),
  :mod:`plan.safetensors` (the format), :mod:`plan.block_owners` (who writes each 4 KiB
  block that two ranks' runs share), :mod:`plan.tp_regions` (who writes each region of a
  TP layout's short rows).
- :mod:`.files` -- the filesystem: :mod:`files.sinks` (where bytes land: files or
  memory), :mod:`files.regions` (short runs assembled into aligned regions),
  :mod:`files.publish` (the stage and its atomic publication), :mod:`files.writers` (who
  writes: dst, or every rank that sees the directory).
- :mod:`.transport` -- moving bytes between ranks: :mod:`transport.prepare` (messages
  planned, buffers allocated up front), :mod:`transport.stager` (bytes staged on the
  link's device), :mod:`transport.transfer` (the data round), :mod:`transport.shared_blocks`
  (the shared blocks' fragments to their owners), :mod:`transport.stop` (the flag that
  stops every rank's writes once one failed).
- :mod:`.rounds` (the agreed rounds of an export) and :mod:`.api` (the public calls);
  :mod:`.convert` (a DCP checkpoint on disk through the same rounds: its saved chunks are
  the holdings, :mod:`plan.saved`, read from their files, :mod:`files.saved`).
"""

# The public calls, and (``X as X``: re-exported) the internals the tests reach from here.
from distributed_ext.export.api import export_hf_checkpoint, gather_full_state
from distributed_ext.export.convert import convert_dcp_to_hf
from distributed_ext.export.files.sinks import FileSink as FileSink
from distributed_ext.export.files.sinks import MemorySink as MemorySink
from distributed_ext.export.plan.blocks import Block as Block
from distributed_ext.export.plan.blocks import Runs as Runs
from distributed_ext.export.plan.blocks import _tiles_exactly as _tiles_exactly
from distributed_ext.export.plan.blocks import block_runs as block_runs
from distributed_ext.export.plan.entries import describe_state as describe_state
from distributed_ext.export.plan.messages import plan_messages as plan_messages
from distributed_ext.export.plan.safetensors import INDEX_NAME as INDEX_NAME
from distributed_ext.export.plan.safetensors import SAFETENSORS_DTYPES as SAFETENSORS_DTYPES
from distributed_ext.export.plan.safetensors import WEIGHTS_NAME as WEIGHTS_NAME
from distributed_ext.export.plan.safetensors import parse_shard_size as parse_shard_size
from distributed_ext.export.plan.safetensors import safetensors_header as safetensors_header
from distributed_ext.export.plan.types import Entry as Entry
from distributed_ext.export.plan.types import Piece as Piece

__all__ = ["convert_dcp_to_hf", "export_hf_checkpoint", "gather_full_state"]
