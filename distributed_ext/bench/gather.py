"""The bytes and state-dict workloads: their inputs, and the targets the table judges
(first call >= 0.9x raw gloo's, >= 3x gather_object's; warm >= 10x; ...)."""

from __future__ import annotations

from distributed_ext.bench.methods import Result


def make_state(nbytes: int, seed: int = 0) -> dict:
    """An LLM-shaped state of about ``nbytes``: 4096x4096 bf16 matrices (or smaller ones for a
    small size) plus up to 200 small norm/bias tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state: dict = {}
    small = min(200, max(1, nbytes // 2**16))
    for i in range(small):
        state[f"model.layers.{i // 2}.norm{i % 2}.weight"] = torch.randn(1024, generator=g)
    remaining = max(0, nbytes - small * 4096)
    side, i = 4096, 0
    while remaining >= 2 * side:  # whole 4096-wide matrices, then one of the rows left
        rows = min(side, remaining // (2 * side))
        w = torch.empty(rows, side, dtype=torch.bfloat16)
        w.view(torch.int16).random_(generator=g)
        state[f"model.layers.{i}.mlp.up_proj.weight"] = w
        remaining -= w.numel() * 2
        i += 1
    return state


def _payload(size: int, rank: int) -> bytearray:
    import torch

    data = bytearray(size)
    torch.frombuffer(data, dtype=torch.uint8).random_(
        0, 256, generator=torch.Generator().manual_seed(rank))
    return data


def _targets_at(results: list[Result], label: str) -> list[str]:
    by = {(r.workload, r.method): r.timing() for r in results}
    out = []

    def line(name: str, value: float, target: float, higher: bool = True) -> None:
        ok = value >= target if higher else value <= target
        out.append(f"{'met ' if ok else 'MISSED'} [{label}/rank] {name}: {value:.2f}x (target "
                   f"{'>=' if higher else '<='} {target}x)")

    ours = by.get(("bytes", "distributed_ext"))
    if ours is None:
        return out
    raw = by.get(("bytes", "raw gloo send/recv"))
    obj = by.get(("bytes", "torch gather_object"))
    floor = by.get(("bytes", "first-touch floor"))
    if raw is not None:
        line("first call vs raw gloo's first call", raw.first / ours.first, 0.9)
    if obj is not None:
        line("first call vs gather_object's first call", obj.first / ours.first, 3.0)
        line("warm vs gather_object warm", obj.median / ours.median, 10.0)
    if ours.warm:
        line("warm max/min over the warm calls", ours.spread, 1.5, higher=False)
    if floor is not None:
        line("warm vs the first-touch floor of dst's outputs (ours / floor)",
             ours.median / floor.median, 1.3, higher=False)
    return out
