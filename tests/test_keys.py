"""distributed_ext.export.plan.keys in one process: the hub's layout traced through transformers' own
revert_weight_conversion, checked against that function run on the real tensors."""

from __future__ import annotations

import pytest
import torch

from distributed_ext.export.plan import keys as _keys

pytest.importorskip("transformers", reason="the key mapping is transformers' own")

from hf_models import FAMILIES, build  # noqa: E402 - after the importorskip


def _assemble(written: _keys.Written, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A written tensor rebuilt from its parts' boxes of the in-memory tensors."""
    out = torch.full(written.shape, float("nan"), dtype=written.dtype)
    for p in written.parts:
        src = state[p.source]
        box = src[tuple(slice(p.src_start[d], p.src_stop(d)) for d in range(src.dim()))]
        order = [d for d in p.src_dims if d >= 0]
        box = box.permute(order + [d for d in range(src.dim()) if d not in order])
        out[tuple(slice(a, a + n) for a, n in zip(p.at, p.shape))] = box.reshape(p.shape)
    return out


def _held(state):
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_written_tensor_is_the_boxes_revert_weight_conversion_takes(family):
    from transformers.core_model_loading import revert_weight_conversion

    model = build(family)
    state = model.state_dict()
    reference = revert_weight_conversion(model, dict(state))
    written = _keys.resolve_written(model, _held(state))
    assert [w.key for w in written] == list(reference)  # (its order too)
    for w in written:
        assert w.unstreamable is None, (w.key, w.unstreamable)
        assert w.shape == tuple(reference[w.key].shape) and w.dtype == reference[w.key].dtype
        assert torch.equal(_assemble(w, state), reference[w.key]), w.key
    if family in ("llama", "qwen2-tied"):  # no conversion: every key as it is
        assert all(len(w.parts) == 1 and w.parts[0].source == w.key for w in written)


def _with_scales(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with keys as a ModelOpt-quantized model's export adds them: scales beside
    each 2-D weight, per-expert scales under the hub's names, quantizer buffers."""
    out = dict(state)
    for key, value in state.items():
        prefix = key.removesuffix("weight")
        if value.dim() == 2 and key.endswith("weight"):
            out[prefix + "weight_scale"] = torch.ones(())
            out[prefix + "input_scale"] = torch.ones(())
            out[prefix + "weight_quantizer._amax"] = torch.ones(())
        if value.dim() == 3:  # fused experts
            for e in range(value.shape[0]):
                out[f"{key}_weight_quantizers.{e}._amax"] = torch.ones(())
                out[f"{key.rpartition('.')[0]}.{e}.gate_proj.weight_scale"] = torch.ones(())
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keys_only_renamed_are_resolved_as_the_whole_function_does(family):
    # Transformers' function is run only on the keys its converters take (every other key
    # through the renamings): the same tensors, boxes and order as running it on every key.
    from transformers.core_model_loading import revert_weight_conversion

    model = build(family)
    state = _with_scales(model.state_dict())
    held = _held(state)
    whole = _keys._traced_revert(model, held)
    assert _keys.resolve_written(model, held) == whole
    assert [w.key for w in whole] == list(revert_weight_conversion(model, dict(state)))
    if _keys.has_conversions(model):
        assert _keys._converted_apart(model, held) == whole  # (not the fallback: None)


def _with_conversions(model, conversions):
    model._weight_conversions = conversions  # what from_pretrained records on a model
    return model


def test_a_transpose_is_a_box_with_its_dims_swapped():
    from transformers.core_model_loading import (
        Transpose,
        WeightConverter,
        revert_weight_conversion,
    )

    model = _with_conversions(build("qwen3-moe"), [WeightConverter(
        "mlp.experts.down_proj", "mlp.experts.down_proj", operations=[Transpose(1, 2)])])
    state = model.state_dict()
    reference = revert_weight_conversion(model, dict(state))
    written = {w.key: w for w in _keys.resolve_written(model, _held(state))}
    w = written["model.layers.0.mlp.experts.down_proj"]
    assert w.shape == tuple(reference[w.key].shape) == (4, 32, 64)
    assert w.parts[0].src_dims == (0, 2, 1) and w.parts[0].is_permuted
    for key, ref in reference.items():
        assert torch.equal(_assemble(written[key], state), ref), key


def test_an_operation_that_is_not_a_view_is_recorded_on_its_key():
    from transformers.core_model_loading import Interleave, WeightConverter

    model = _with_conversions(build("mixtral"), [WeightConverter(
        "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", operations=[Interleave(dim=1)])])
    written = {w.key: w for w in _keys.resolve_written(model, _held(model.state_dict()))}
    bad = written["model.layers.1.mlp.experts.gate_up_proj"]
    assert bad.unstreamable is not None and "reshape" in bad.unstreamable
    assert written["model.layers.1.mlp.experts.down_proj"].unstreamable is None


@pytest.mark.parametrize("make, expected", [
    (lambda t: t[1], ((1, 0, 0), (1, 2))),
    (lambda t: t[:, 2:5], ((0, 2, 0), (0, 1, 2))),
    (lambda t: t.transpose(1, 2)[3], ((3, 0, 0), (2, 1))),
    (lambda t: torch.chunk(t, 2, dim=1)[1].squeeze(0)[0], ((0, 3, 0), (1, 2))),
    (lambda t: t.reshape(4, 30), None),  # a dim spanning two in-memory dims
    (lambda t: t.reshape(-1)[5:9], ((0, 1, 0), (2,))),
])
def test_box_of_reads_a_view_as_a_box(make, expected):
    base = torch.empty((4, 6, 5), device="meta")
    assert _keys.box_of(make(base), (4, 6, 5)) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whether_a_model_converts_is_transformers_own_answer(family, monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import PrefixChange

    model = build(family)
    own = any(not isinstance(c, PrefixChange)
              for c in conversion_mapping.get_model_conversion_mapping(model, add_legacy=False))
    assert _keys.has_conversions(model) == own
    if not own:  # answered without building transformers' table (0.07-0.2 s a process)
        def refused(*args, **kwargs):
            raise AssertionError("the table was built")

        monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", refused)
        assert _keys.has_conversions(model) is False


def test_every_key_of_transformers_conversion_table_is_quoted_in_its_source():
    # What the quick answer rests on: a name the source never quotes is no key of the table.
    from transformers import conversion_mapping

    source = _keys._conversion_source(conversion_mapping.__file__)
    assert source is not None
    table = conversion_mapping._build_checkpoint_conversion_mapping()
    assert len(table) > 50
    missing = [k for k in table if f'"{k}"' not in source and f"'{k}'" not in source]
    assert not missing, missing


def test_a_user_registered_name_takes_transformers_table(monkeypatch):
    from transformers import conversion_mapping

    model = build("llama")
    monkeypatch.setattr(conversion_mapping, "USER_REGISTERED_MAPPINGS",
                        set(conversion_mapping.USER_REGISTERED_MAPPINGS) | {"llama"})
    assert _keys._may_convert(model) is True
