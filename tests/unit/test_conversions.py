"""Weight conversions as ranged reads: the boxes `conversions.convert` derives from a
converter's operations put every element where transformers' own operations put it; a fused
expert parameter's shard is read by range alone; a transform that reorders elements within a
tensor is refused by name."""

import pytest
import torch

from rayzero.models.conversions import Part, UnsupportedConversion, convert
from tests.conftest import cli_in_process
from tests.models import save_hf_model


def numbered(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A tensor per key whose elements are numbered across all of them (each value names its
    key and place)."""
    out, at = {}, 0
    for key, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[key] = torch.arange(at, at + n, dtype=torch.float64).view(shape)
        at += n
    return out


def transformers_result(converter, collected: dict[str, list[torch.Tensor]], model=None):
    """What transformers' own operations make of the collected tensors (WeightConverter.convert's loop)."""
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns, full_layer_name="x", model=model, config=None)
    return {k: (v[0] if isinstance(v, list) else v) for k, v in collected.items()}


def from_parts(parts: list[Part], shape: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The parameter read back through the parts' runs, a third of it at a time (as a rank
    reads its shard)."""
    n = torch.Size(shape).numel()
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    for lo, hi in ((0, n // 3), (n // 3, 2 * n // 3 + 1), (2 * n // 3 + 1, n)):
        for part in parts:
            flat = tensors[part.key].reshape(-1)
            for first, k, at in part.runs(shape, lo, hi):
                out[lo + at : lo + at + k] = flat[first : first + k]
    return out.view(shape)


def test_merged_and_concatenated_experts_land_where_transformers_puts_them():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    _, gate_up, down = get_checkpoint_conversion_mapping("mixtral")
    experts, inner, hidden = 3, 5, 4
    shapes = {f"e.{e}.{w}": (inner, hidden) for w in ("w1", "w3") for e in range(experts)}
    shapes.update({f"e.{e}.w2": (hidden, inner) for e in range(experts)})
    tensors = numbered(shapes)
    for conv, pats in ((gate_up, {".experts.*.w1.weight": "w1", ".experts.*.w3.weight": "w3"}),
                       (down, {".experts.*.w2.weight": "w2"})):
        sources = {pat: [(f"e.{e}.{w}", shapes[f"e.{e}.{w}"]) for e in range(experts)] for pat, w in pats.items()}
        want = transformers_result(conv, {pat: [tensors[k] for k, _ in keys] for pat, keys in sources.items()})
        (target, expected), = want.items()
        parts = convert(conv, sources, {target: tuple(expected.shape)})[target]
        assert torch.equal(from_parts(parts, tuple(expected.shape), tensors), expected)
        # each expert's tensor is one contiguous run of the fused parameter
        assert all(len(list(p.blocks(tuple(expected.shape)))) == 1 for p in parts)


def test_a_fused_tensor_chunked_into_parameters():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    conv = next(t for t in get_checkpoint_conversion_mapping("hrm_text") if "attn.gqkv_proj.weight" in t.source_patterns)
    tensors = numbered({"gqkv": (8, 3)})
    want = transformers_result(conv, {"attn.gqkv_proj.weight": [tensors["gqkv"]]})
    targets = {k: tuple(v.shape) for k, v in want.items()}
    got = convert(conv, {"attn.gqkv_proj.weight": [("gqkv", (8, 3))]}, targets)
    assert got.keys() == want.keys() and len(want) == 4
    for target, expected in want.items():
        assert torch.equal(from_parts(got[target], targets[target], tensors), expected)


def test_split_by_the_model_sizes_and_a_column_cut():
    """`Split` takes each target's size from the model; a cut along dim 1 of a matrix makes one
    run per row."""
    from transformers.core_model_loading import Chunk, Split, WeightConverter

    tensors = numbered({"ab": (6, 4)})
    split = WeightConverter("ab", ["a", "b"], operations=[Split(dim=0)])
    got = convert(split, {"ab": [("ab", (6, 4))]}, {"a": (2, 4), "b": (4, 4)})
    assert torch.equal(from_parts(got["a"], (2, 4), tensors), tensors["ab"][:2])
    assert torch.equal(from_parts(got["b"], (4, 4), tensors), tensors["ab"][2:])
    cols = WeightConverter("ab", ["a", "b"], operations=[Chunk(dim=1)])
    got = convert(cols, {"ab": [("ab", (6, 4))]}, {"a": (6, 2), "b": (6, 2)})
    assert torch.equal(from_parts(got["b"], (6, 2), tensors), tensors["ab"][:, 2:])
    assert len(list(got["b"][0].blocks((6, 2)))) == 6


def test_a_transform_that_reorders_elements_is_refused_by_name():
    from transformers.core_model_loading import Interleave, WeightConverter

    conv = WeightConverter("w13", "gate_up", operations=[Interleave(dim=1)])
    with pytest.raises(UnsupportedConversion, match="the weight conversion Interleave .* reorders elements within a "
                                                    "tensor, which ranged reads cannot follow"):
        convert(conv, {"w13": [("w13", (2, 4))]}, {"gate_up": (2, 4)})


def test_a_rank_reads_only_its_shard_of_a_fused_expert_parameter(tmp_path):
    """Half of a layer's fused `gate_up_proj` (the shard of one of two ranks) costs half its
    bytes, read from the per-expert tensors that hold it; and comes out as transformers loads it."""
    import transformers as tf

    from rayzero.config import load_config
    from rayzero.models.weights import GAP_BYTES
    from rayzero.sharding.flat_buffer import Piece
    from rayzero.workers.assembly import make_spec

    d = save_hf_model("mixtral", tmp_path / "mixtral")
    spec = make_spec(load_config(None, ["model.kind=hf", f"model.path={d}"]))
    model = spec.build()
    source = spec.source(model)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    shape = tuple(model.get_parameter(name).shape)
    n = torch.Size(shape).numel()
    out = torch.empty(n // 2)
    before = source.bytes_read
    source.fill_pieces([Piece(name, n // 2, n, shape, out)])
    read = source.bytes_read - before
    assert n // 2 * 4 <= read <= n // 2 * 4 + GAP_BYTES, (read, n * 4)
    whole = tf.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).get_parameter(name)
    assert torch.equal(out, whole.detach().reshape(-1)[n // 2:])


def test_an_architecture_whose_conversion_cannot_be_read_by_range_is_one_message(tmp_path, capsys, monkeypatch):
    from transformers.core_model_loading import Interleave, WeightConverter

    from rayzero.models import conversions

    d = save_hf_model("mixtral", tmp_path / "mixtral")
    real = conversions.transforms_of

    def interleaved(model):
        """Mixtral's own transforms, its fused experts' interleaved as some checkpoints store them."""
        return [WeightConverter(t._original_source_patterns, t._original_target_patterns,
                                operations=[*t.operations, Interleave(dim=1)])
                if isinstance(t, WeightConverter) and "gate_up_proj" in t.target_patterns[0] else t
                for t in real(model)]

    monkeypatch.setattr(conversions, "transforms_of", interleaved)
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", "model.kind=hf",
                                  f"model.path={d}", "train.seq_len=32")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("rayzero: error: model.layers.0.mlp.experts.gate_up_proj: the weight conversion Interleave")
