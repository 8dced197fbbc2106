"""The fusing of layers that read one input (export/plan/shared_inputs.py) for models with
pre-quant scales (INT4 AWQ, INT8 SmoothQuant), done from each rank's rows: on real gloo
ranks, an FSDP2 model's weights (``full_tensor()``), quantizer buffers and layernorms after
the export's fusing round equal those ModelOpt's own ``requantize_resmooth_fused_llm_layers``
leaves on the same model in one process, and no FSDP2 unshard ran (ModelOpt's own does one
per group: the positive control); a failure on one rank leaves every rank's model as it was.
(The exported files are compared with ModelOpt's own export in test_quantized.py.)"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings

import pytest
import torch
from harness import assert_all_ok, run_ranks

if importlib.util.find_spec("modelopt") is None:
    pytest.skip("needs nvidia-modelopt (the [test] extra)", allow_module_level=True)

import hf_models  # noqa: E402

# INT4 AWQ groups 128 columns (every linear's input a multiple of 128); at world 3 the odd
# intermediate size shards gate/up unevenly (299, 299, 298 rows: the export would refuse
# it for AWQ's packed pairs of rows, the fusing is by row).
DIMS = dict(hidden_size=384, intermediate_size=768, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
ODD = {**DIMS, "intermediate_size": 896}


def _quantized(fmt: str, dims: dict):
    """A tiny Llama in bf16 quantized by ModelOpt's ``mtq.quantize`` (the same weights and
    calibration batch in every process)."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq

    model = hf_models.build("llama", 0, dtype=torch.bfloat16, **dims).to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    batch = torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, getattr(mtq, fmt), lambda m: m(batch))
    return model


def _count_unshards() -> list[int]:
    """Counts FSDP2's all-gathers of a parameter group (what an unshard does)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    count = [0]
    unshard = FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        count[0] += 1
        return unshard(self, *args, **kwargs)

    FSDPParamGroup.unshard = counted
    return count


def _state(model) -> dict[str, tuple]:
    """Every parameter whole (``full_tensor()``: every rank calls it in the same order) and
    every buffer, as bytes; which linears ModelOpt marked fused with their layernorm."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in sorted(model.named_parameters()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = (t.dtype, tuple(t.shape), t.detach().contiguous().view(-1).view(torch.uint8))
    for name, b in sorted(model.named_buffers()):
        out[name] = (b.dtype, tuple(b.shape), b.detach().contiguous().view(-1).view(torch.uint8))
    out["fused"] = sorted(n for n, m in model.named_modules()
                          if getattr(m, "fused_with_prequant", False))
    return out


def _differences(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or (
        a[k] != b[k] if k == "fused" else
        a[k][:2] != b[k][:2] or not torch.equal(a[k][2], b[k][2]))]


def _fuse_and_compare(cases: list[tuple[str, dict]]) -> dict:
    """Per case: the differences between ModelOpt's one-process fusing and ours (the
    export's round) of an FSDP2 model, the unshards ours ran, and how many entries the
    fusing changed; then ModelOpt's own on the FSDP2 model (the control's unshards)."""
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    import distributed_ext as dx
    from distributed_ext.export import rounds

    count = _count_unshards()
    out = {}
    for fmt, dims in cases:
        ref = _quantized(fmt, dims)
        before = _state(ref)
        requantize_resmooth_fused_llm_layers(ref)
        expected = _state(ref)
        model = _quantized(fmt, dims)
        dx.fsdp2_wrap(model)
        count[0] = 0
        rounds._fuse_quantized(model, None, "test")
        out[fmt] = (_differences(expected, _state(model)), count[0],
                    len(_differences(before, expected)))
    model = _quantized(*cases[0])
    dx.fsdp2_wrap(model)
    count[0] = 0
    requantize_resmooth_fused_llm_layers(model)
    out["control"] = count[0]
    return out


def test_pre_quant_scales_fused_from_the_rows_as_modelopt_fuses_them():
    # World 3, shards uneven (world 2 and even shards: through the export, in
    # test_quantized.py, whose files equal ModelOpt's).
    cases = [("INT4_AWQ_CFG", ODD), ("INT8_SMOOTHQUANT_CFG", ODD)]
    results = assert_all_ok(run_ranks(_fuse_and_compare, 3, cases, timeout=300))
    for rank, result in enumerate(results):
        for fmt, _dims in cases:
            differ, unshards, changed = result[fmt]
            assert not differ, (rank, fmt, differ)
            assert unshards == 0, (rank, fmt, unshards)
            # AWQ's fusing changes weights, amax, scales and layernorms; SmoothQuant's
            # scales are alike in a group already (ModelOpt's then changes nothing).
            assert changed > 0 if fmt == "INT4_AWQ_CFG" else changed == 0, (rank, fmt, changed)
        assert result["control"] > 0, rank  # (ModelOpt's own does gather)


def _fail_on_rank_1(base: str) -> tuple:
    """The export of an AWQ model whose fusing fails on rank 1: every rank's outcome, and
    whether every rank's model was left as it was."""
    import torch.distributed as dist

    import distributed_ext as dx
    from distributed_ext.export.plan import shared_inputs

    model = _quantized("INT4_AWQ_CFG", DIMS)
    dx.fsdp2_wrap(model)
    before = _state(model)
    if dist.get_rank() == 1:
        def fail(self):
            raise MemoryError("rank 1 out of memory in the fusing")
        shared_inputs.Resmooth.pieces = fail
    try:
        dx.export_hf_checkpoint(model, os.path.join(base, "out"))
        outcome: tuple = ("ok",)
    except BaseException as exc:  # noqa: BLE001 - asserted by the test
        outcome = (type(exc).__name__, str(exc))
    return outcome, _differences(before, _state(model)), os.path.exists(os.path.join(base,
                                                                                      "out"))


def test_a_failed_fusing_is_raised_on_every_rank_and_changes_no_model(tmp_path):
    results = assert_all_ok(run_ranks(_fail_on_rank_1, 2, str(tmp_path), timeout=300))
    for rank, (outcome, changed, written) in enumerate(results):
        assert outcome[0] == ("MemoryError" if rank == 1 else "RuntimeError"), outcome
        assert "out of memory in the fusing" in outcome[1], outcome
        assert not changed, (rank, changed)
        assert not written, rank


class _TwoHeads(torch.nn.Module):
    """Two linears on different inputs, sharing one weight object (undeclared: no tie map),
    with a third of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32, bias=False)
        self.b = torch.nn.Linear(32, 32, bias=False)
        self.b.weight = self.a.weight
        self.c = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(4 * x) + self.c(x)


def _input_amax(model) -> dict[str, float]:
    return {n: float(getattr(model, n).input_quantizer.amax) for n in ("a", "b", "c")}


@pytest.mark.parametrize("shared", [True, False])
def test_tied_input_amax_merged_as_modelopt_merges_it(shared, monkeypatch):
    # ModelOpt's export merges the input amax of modules that share a weight; ours calls
    # its function where some parameter is registered twice (or a tie is declared), and
    # skips its walk where none is: the amax then as ModelOpt's leaves them either way.
    warnings.filterwarnings("ignore")
    import modelopt.torch.export.quant_utils as qu
    import modelopt.torch.quantization as mtq

    from distributed_ext.export.plan import shared_inputs

    torch.manual_seed(0)
    model = _TwoHeads()
    if not shared:
        model.b.weight = torch.nn.Parameter(model.a.weight.detach().clone())
    batch = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(batch))
    before = _input_amax(model)
    assert before["b"] > 3 * before["a"], before  # (b's input is 4x a's)
    theirs = [0]
    real = qu.sync_tied_input_amax

    def counted(*args, **kwargs):
        theirs[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(qu, "sync_tied_input_amax", counted)
    reference = copy.deepcopy(model)
    real(reference)  # ModelOpt's own, always
    expected = _input_amax(reference)
    shared_inputs.sync_amax(model, torch.float32)
    assert _input_amax(model) == expected
    assert theirs[0] == (1 if shared else 0)
    if shared:
        assert expected["a"] == expected["b"] == before["b"] and expected["c"] == before["c"]
    else:
        assert expected == before


class Qwen3MoeSparseMoeBlock(torch.nn.Module):
    """A MoE block of iterable experts (gate, up and down projections) under the name
    ModelOpt knows such a block by; every token goes to expert 0: expert 1 is never
    calibrated."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.ModuleDict({
            n: torch.nn.Linear(32, 32, bias=False) for n in ("gate_proj", "up_proj", "down_proj")
        }) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts[0]
        return e["down_proj"](e["gate_proj"](x) * e["up_proj"](x))


class _WithMoe(torch.nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, 32, bias=False)
        self.mlp = Qwen3MoeSparseMoeBlock() if moe else torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.inp(x))


def _quantizer_amax(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_amax")}


@pytest.mark.parametrize("moe", [True, False])
def test_moe_steps_run_as_modelopt_runs_them_and_only_on_a_moe(moe, monkeypatch):
    # ModelOpt's export fills the input amax of experts no token reached and shares each
    # expert's gate/up weight amax; ours calls its two functions where a module is a MoE
    # block with experts (its `is_moe`), and skips their walks of every module where none
    # is: the amax then as ModelOpt's leaves them either way.
    warnings.filterwarnings("ignore")
    import modelopt.torch.export.layer_utils as lu
    import modelopt.torch.export.unified_export_hf as ue
    import modelopt.torch.quantization as mtq

    from distributed_ext.export.plan import shared_inputs

    torch.manual_seed(0)
    model = _WithMoe(moe)
    batch = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(batch))
    before = _quantizer_amax(model)
    reference = copy.deepcopy(model)
    ue._prepare_moe_inputs(reference, torch.float32, False)  # ModelOpt's own, always
    lu.sync_moe_gate_up_amax(reference)
    expected = _quantizer_amax(reference)
    calls: list[str] = []
    for mod, name in ((ue, "_prepare_moe_inputs"), (lu, "sync_moe_gate_up_amax")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name:
                            calls.append(_name) or _real(*a))
    shared_inputs.sync_amax(model, torch.float32)
    got = _quantizer_amax(model)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert calls == (["_prepare_moe_inputs", "sync_moe_gate_up_amax"] if moe else [])
    if moe:  # (ModelOpt's steps changed something here: expert 1's input amax, gate/up's)
        assert sorted(expected) != sorted(before) or any(
            not torch.equal(before[k], expected[k]) for k in before)
