"""Shard a Hugging Face causal LM with FSDP2, train a step, and export ONE checkpoint.

Every rank builds the (tiny, config-built) model, ``fsdp2_wrap`` shards it, one optimizer
step changes the shards, and ``export_hf_checkpoint`` writes a Hugging Face checkpoint from
rank 0 -- ``model.safetensors`` (or shards + index), ``config.json`` -- that
``AutoModelForCausalLM.from_pretrained`` loads. Rank 0 never holds the whole model: bytes are
written to their place in the files as they arrive.

    python examples/export_fsdp2_hf.py --world 2 --out ckpt/               # local ranks
    torchrun --nproc-per-node 2 examples/export_fsdp2_hf.py --out ckpt/    # a launch
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Importing torch takes a while: a Ctrl-C meanwhile is a message, not a traceback. The
# handler notes it as well as raising it, because some import on the way catches every
# exception (KeyboardInterrupt included) and goes on: seen as an export that ran to the end
# after a Ctrl-C.
_interrupted = False


def _note_interrupt(signum: int, frame: object) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, _note_interrupt)
try:
    import torch
    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext._spawn import run_local
except KeyboardInterrupt:
    _interrupted = True
except BaseException:
    # An import the interrupt cut short can fail later in the same import as something
    # else (numpy's C module, loaded again after a half-done first load: "ImportError:
    # cannot load module more than once per process"): after a Ctrl-C, that is the Ctrl-C.
    if not _interrupted:
        raise
signal.signal(signal.SIGINT, signal.default_int_handler)
if _interrupted:
    print("export_fsdp2_hf: interrupted while starting; nothing ran", file=sys.stderr, flush=True)
    # At once: the interpreter's shutdown with half-imported extension modules can end the
    # process by SIGINT after all, hiding this exit code.
    os._exit(130)


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def sample_input() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def train_and_export(out: str, max_shard_size: str) -> list[float]:
    """Collective: shard, one step, export; returns the sharded model's logits (first row)."""
    model = build_model()
    dx.fsdp2_wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(sample_input(), labels=sample_input()).loss.backward()
    optimizer.step()
    dx.export_hf_checkpoint(model, out, max_shard_size=max_shard_size)
    with torch.no_grad():
        return model(sample_input()).logits[0, 0].tolist()


def _local_rank(out: str, max_shard_size: str) -> list[float]:
    logits = train_and_export(out, max_shard_size)
    dist.barrier()
    return logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the checkpoint directory")
    ap.add_argument("--world", type=int, default=2, help="local ranks without a launcher")
    ap.add_argument("--max-shard-size", default="5GB")
    args = ap.parse_args(argv)
    import importlib.util

    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"needs {' and '.join(missing)}: pip install --no-build-isolation -e "
                 f"'.[export]' in the distributed_ext checkout (or pip install "
                 f"{' '.join(missing)})")
    if dx.is_distributed_launch():
        with dx.distributed_run() as state:
            logits = train_and_export(args.out, args.max_shard_size)
            if state.is_main:
                print(f"exported to {args.out}; logits[0, 0, :3] = {logits[:3]}", flush=True)
            dist.barrier()
        return 0
    # Ctrl-C stops every local rank (the export then leaves the earlier checkpoint, or none).
    outcomes = run_local(_local_rank, args.world, args.out, args.max_shard_size, timeout=600,
                         stop_on_sigint=True)
    if any(o.interrupted for o in outcomes):
        print("export_fsdp2_hf: interrupted; every rank stopped, nothing was published",
              file=sys.stderr)
        return 130
    failed = [o.describe() for o in outcomes if not o.ok]
    if failed:
        print(f"export_fsdp2_hf: {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"exported to {args.out}; logits[0, 0, :3] = {outcomes[0].value[:3]}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the ranks started, or under a launch
        print("export_fsdp2_hf: interrupted", file=sys.stderr)
        sys.exit(130)
