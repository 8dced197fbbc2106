"""distributed_ext in the place of ``modelopt.torch.utils.distributed`` (the README's recipe:
``sys.modules["modelopt.torch.utils.distributed"] = distributed_ext`` before ModelOpt is
imported): ModelOpt's own calibration of an FSDP2 model on real gloo ranks, each rank
calibrating on its own data, reaches through our module and gives every amax a single
process computes on all the data."""

from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch
from harness import assert_all_ok, run_ranks

# (found, not imported: a rank imports this module, and ModelOpt must not be loaded before
# the test's own code decides how)
if importlib.util.find_spec("modelopt") is None:
    pytest.skip("needs nvidia-modelopt (the [test] extra)", allow_module_level=True)

import hf_models  # noqa: E402

# (family, format): a dense Llama in FP8 and NVFP4, Qwen3-MoE's fused experts in FP8.
CASES = [("llama", "FP8_DEFAULT_CFG"), ("llama", "NVFP4_DEFAULT_CFG"),
         ("qwen3-moe", "FP8_DEFAULT_CFG")]
DIMS = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=1)


def _batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s own calibration data."""
    return torch.randint(0, 130, (4, 32), generator=torch.Generator().manual_seed(100 + rank))


def _model(family: str):
    dims = {k: v for k, v in DIMS.items() if family != "llama" or k != "moe_intermediate_size"}
    return hf_models.build(family, 0, **dims)


def _amaxes(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()
            if k.endswith("._amax")}


def _one_process_on_all_data(world: int) -> dict:
    """The reference: one process, no group, calibrating on every rank's data."""
    warnings.filterwarnings("ignore")
    import modelopt.torch.quantization as mtq

    out = {}
    for family, fmt in CASES:
        model = _model(family)
        mtq.quantize(model, getattr(mtq, fmt), lambda m: [m(_batch(r)) for r in range(world)])
        out[family, fmt] = _amaxes(model)
    return out


def _ranks_each_on_their_own() -> dict:
    """Each rank: our module in ModelOpt's place, an FSDP2 model, its own batch."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import distributed_ext

    assert "modelopt" not in sys.modules, "ModelOpt was imported before the swap"
    sys.modules["modelopt.torch.utils.distributed"] = distributed_ext
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization import model_calib
    from modelopt.torch.utils import distributed as modelopt_distributed

    out = {"ours": modelopt_distributed is distributed_ext
           and model_calib.DistributedProcessGroup is distributed_ext.DistributedProcessGroup}
    for family, fmt in CASES:
        model = _model(family)
        distributed_ext.fsdp2_wrap(model)
        batch = _batch(dist.get_rank())
        mtq.quantize(model, getattr(mtq, fmt), lambda m, batch=batch: m(batch))
        out[family, fmt] = _amaxes(model)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_modelopt_calibrates_an_fsdp2_model_through_our_module_as_one_process_on_all_data(
        world):
    ref = assert_all_ok(run_ranks(_one_process_on_all_data, 1, world, init=False,
                                  timeout=300))[0]
    for got in assert_all_ok(run_ranks(_ranks_each_on_their_own, world, timeout=300)):
        assert got["ours"], "ModelOpt did not take distributed_ext in its module's place"
        for case in CASES:
            assert sorted(got[case]) == sorted(ref[case]) and ref[case], case
            differ = [k for k in ref[case] if not torch.equal(got[case][k], ref[case][k])]
            assert not differ, (case, differ)
