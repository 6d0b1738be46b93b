"""Import another framework's HSTU layer stack into layerflow's weights file (config in its metadata).

Formats, per layer l under a prefix P (layer l's tensors are named `P{l}.<name>`):
  gr-stu           generative-recommenders' STUStack (`P` = `_stu_layers.`), family `stu`:
                   _uvqk_weight [E, out], _uvqk_beta [out], _input_norm_weight/_bias [E],
                   _output_weight [3*H*dv, E], _output_norm_weight/_bias [H*dv] (layer norm) or [H] (group norm)
  recsys-examples  NVIDIA recsys-examples' HSTU inference layer, family `hstu`:
                   _linear_uvqk.weight [out, E] and _linear_proj.weight [E, H*dv] (torch Linear layout: transposed
                   here), _linear_uvqk.bias [out], _input_layernorm_weight/_bias [E] (absent when the model has no
                   learnable input norm: ones and zeros then), _output_layernorm_weight/_bias [H*dv]

E, dv, dqk, the layer count and the output norm come from the tensor shapes; the head count, the longest sequence and
the mask and attention options are not stored in a state dict and are given. Tensors outside the prefix are not
part of the stack and are ignored; under it, a missing, unexpected or mis-shaped tensor is an error naming it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from layerflow.model.config import DTYPES, N_RULES, OUTPUT_NORMS, HSTUConfig
from layerflow.model.family import LAYER_FAMILIES
from layerflow.model.layer import LayerWeights
from layerflow.model.weights import HSTUWeights


@dataclass(frozen=True)
class SourceTensor:
    """One framework tensor of a layer: its name, the LayerWeights field it fills, whether it is transposed."""

    name: str
    field: str
    transposed: bool = False
    fill: float | None = None      # value of an absent optional tensor; None: required


@dataclass(frozen=True)
class CheckpointFormat:
    family: str
    tensors: tuple[SourceTensor, ...]

    @property
    def anchor(self) -> str:
        """The tensor every layer has, used to find the layers and the prefix."""
        return self.tensors[0].name


FORMATS: dict[str, CheckpointFormat] = {
    "gr-stu": CheckpointFormat("stu", (
        SourceTensor("_uvqk_weight", "uvqk_weight"),
        SourceTensor("_uvqk_beta", "uvqk_bias"),
        SourceTensor("_input_norm_weight", "ln_in_weight"),
        SourceTensor("_input_norm_bias", "ln_in_bias"),
        SourceTensor("_output_weight", "out_weight"),
        SourceTensor("_output_norm_weight", "ln_attn_weight"),
        SourceTensor("_output_norm_bias", "ln_attn_bias"),
    )),
    "recsys-examples": CheckpointFormat("hstu", (
        SourceTensor("_linear_uvqk.weight", "uvqk_weight", transposed=True),
        SourceTensor("_linear_uvqk.bias", "uvqk_bias"),
        SourceTensor("_input_layernorm_weight", "ln_in_weight", fill=1.0),
        SourceTensor("_input_layernorm_bias", "ln_in_bias", fill=0.0),
        SourceTensor("_linear_proj.weight", "out_weight", transposed=True),
        SourceTensor("_output_layernorm_weight", "ln_attn_weight"),
        SourceTensor("_output_layernorm_bias", "ln_attn_bias"),
    )),
}


@dataclass(frozen=True)
class ModelOptions:
    """What a state dict does not say about the model: see HSTUConfig for each field."""

    num_heads: int
    max_seq_len: int
    contextual_len: int = 0
    max_attn_len: int = 0
    target_aware: bool = True
    attn_alpha: float | None = None
    attn_n_rule: str = "constant"
    output_norm: str | None = None     # None: inferred from the output norm's shape
    layer_norm_eps: float = 1e-6


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict from a `.safetensors` file or a torch `.pt` state dict (loaded weights-only)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a flat state dict of tensors")
    return state


def detect_prefix(fmt: CheckpointFormat, state: dict[str, torch.Tensor]) -> str:
    """The per-layer prefix P of the stack: the one string before `{l}.<anchor>` in the state dict's names."""
    pattern = re.compile(rf"^(.*?)(\d+)\.{re.escape(fmt.anchor)}$")
    prefixes = sorted({m.group(1) for m in map(pattern.match, state) if m})
    if not prefixes:
        raise ValueError(f"no tensor named '<prefix><layer>.{fmt.anchor}': not a {fmt.family} layer stack")
    if len(prefixes) > 1:
        raise ValueError(f"several layer stacks {prefixes}: pass the prefix")
    return prefixes[0]


def _layers(fmt: CheckpointFormat, state: dict[str, torch.Tensor], prefix: str) -> list[dict[str, torch.Tensor]]:
    """The state dict's tensors per layer, as {framework name: tensor}, checked for missing and extra names."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.+)$")
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if key.startswith(prefix) and (m := pattern.match(key)):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
    if not found:
        raise ValueError(f"no tensor under the prefix {prefix!r}")
    count = max(found) + 1
    known = {t.name for t in fmt.tensors}
    for layer in range(count):
        names = found.get(layer, {})
        extra = sorted(set(names) - known)
        if extra:
            raise ValueError(f"unexpected tensor {prefix}{layer}.{extra[0]}")
        missing = [t.name for t in fmt.tensors if t.fill is None and t.name not in names]
        if missing:
            raise ValueError(f"missing tensor {prefix}{layer}.{missing[0]}")
        optional = [t.name for t in fmt.tensors if t.fill is not None]
        if 0 < sum(name in names for name in optional) < len(optional):
            absent = next(name for name in optional if name not in names)
            raise ValueError(f"missing tensor {prefix}{layer}.{absent} (its pair is present)")
    leftover = sorted(key for key in state if key.startswith(prefix) and not pattern.match(key))
    if leftover:
        raise ValueError(f"unexpected tensor {leftover[0]} under the prefix {prefix!r}")
    return [found[layer] for layer in range(count)]


def _source_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> torch.dtype:
    """The one dtype of the stack's tensors (or `dtype`, which they are converted to)."""
    if dtype is not None:
        return dtype
    first_of: dict[torch.dtype, str] = {}
    for name, t in tensors.items():
        first_of.setdefault(t.dtype, name)
    if len(first_of) != 1:
        found = ", ".join(f"{d} (e.g. {name})" for d, name in first_of.items())
        raise ValueError(f"tensors of several dtypes: {found}; pass the dtype to convert them to")
    found = next(iter(first_of))
    if found not in DTYPES.values():
        raise ValueError(f"tensor dtype {found}: expected one of {sorted(DTYPES)} (or pass the dtype)")
    return found


def _infer_config(fmt: CheckpointFormat, first: dict[str, torch.Tensor], num_layers: int, options: ModelOptions,
                  dtype: torch.dtype) -> HSTUConfig:
    """The model config from layer 0's tensors (in LayerWeights layout) and the given options."""
    heads = options.num_heads
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"num_heads={heads!r}: must be a positive integer")
    embedding_dim, uvqk_width = first["uvqk_weight"].shape
    rows = first["out_weight"].shape[0]
    blocks = LAYER_FAMILIES[fmt.family].output_blocks
    if rows % (blocks * heads):
        raise ValueError(f"output projection rows {rows} are not {blocks} x num_heads={heads} x dv")
    dv = rows // (blocks * heads)
    qk_width = uvqk_width - 2 * heads * dv
    if qk_width <= 0 or qk_width % (2 * heads):
        raise ValueError(f"uvqk width {uvqk_width} does not split into 2 x {heads} x dv={dv} + 2 x {heads} x dqk")
    norm_size = first["ln_attn_weight"].shape[0]
    shape_norms = [kind for kind, size in (("layer", heads * dv), ("group", heads)) if size == norm_size]
    if not shape_norms:
        raise ValueError(f"output norm of {norm_size} weights: neither H*dv={heads * dv} (layer) nor H={heads} (group)")
    output_norm = options.output_norm or shape_norms[0]
    if output_norm not in shape_norms:
        raise ValueError(f"output_norm={output_norm!r} but the output norm has {norm_size} weights")
    return HSTUConfig(
        num_layers=num_layers, num_heads=heads, dqk=qk_width // (2 * heads), dv=dv, embedding_dim=embedding_dim,
        max_seq_len=options.max_seq_len, dtype=dtype, item_vocab_size=0, position_table_size=0,
        layer_norm_eps=options.layer_norm_eps, family=fmt.family, output_norm=output_norm,
        attn_alpha=options.attn_alpha, attn_n_rule=options.attn_n_rule, target_aware=options.target_aware,
        contextual_len=options.contextual_len, max_attn_len=options.max_attn_len,
    )


def import_state_dict(format_name: str, state: dict[str, torch.Tensor], options: ModelOptions, *,
                      prefix: str | None = None, dtype: torch.dtype | None = None) -> HSTUWeights:
    """layerflow weights (no embedding tables) from a framework state dict; dtype converts every tensor."""
    if format_name not in FORMATS:
        raise ValueError(f"format={format_name!r}: expected one of {sorted(FORMATS)}")
    fmt = FORMATS[format_name]
    prefix = detect_prefix(fmt, state) if prefix is None else prefix
    layers = _layers(fmt, state, prefix)
    dtype = _source_dtype({f"{prefix}{i}.{name}": t for i, names in enumerate(layers) for name, t in names.items()},
                          dtype)
    embedding_dim = layers[0][fmt.tensors[0].name].shape[1 if fmt.tensors[0].transposed else 0]

    def converted(names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for t in fmt.tensors:
            if t.name in names:
                value = names[t.name].t() if t.transposed and names[t.name].dim() == 2 else names[t.name]
            else:
                value = torch.full((embedding_dim,), t.fill)
            out[t.field] = value.to(dtype).contiguous()
        return out

    fields = [converted(names) for names in layers]
    config = _infer_config(fmt, fields[0], len(layers), options, dtype)
    shapes = LAYER_FAMILIES[fmt.family](config).layer_shapes()
    for i, layer in enumerate(fields):
        for t in fmt.tensors:
            got, want = tuple(layer[t.field].shape), shapes[t.field]
            if got != want:
                source = tuple(reversed(got)) if t.transposed else got
                expected = tuple(reversed(want)) if t.transposed else want
                raise ValueError(f"{prefix}{i}.{t.name} has shape {source}, expected {expected}")
    return HSTUWeights(config, None, None, [LayerWeights(**layer) for layer in fields])


def import_checkpoint(format_name: str, src: str | Path, out: str | Path, options: ModelOptions, *,
                      prefix: str | None = None, dtype: torch.dtype | None = None) -> HSTUWeights:
    """Read `src`, convert it and write layerflow's safetensors file `out` (HSTUWeights.load reads it back)."""
    weights = import_state_dict(format_name, read_state_dict(src), options, prefix=prefix, dtype=dtype)
    weights.save(out)
    return weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", required=True, choices=sorted(FORMATS), help="the checkpoint's framework")
    parser.add_argument("src", help="the framework's state dict: .pt (torch.save) or .safetensors")
    parser.add_argument("--out", required=True, help="layerflow weights file to write (.safetensors)")
    parser.add_argument("--prefix", help="per-layer prefix P of the tensors P{layer}.<name> (default: detected)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="convert every tensor to this dtype")
    parser.add_argument("--num-heads", type=int, required=True, help="attention heads (not in a state dict)")
    parser.add_argument("--max-seq-len", type=int, required=True,
                        help="longest history + candidates per user (and N of the constant 1/N rule)")
    parser.add_argument("--contextual-len", type=int, default=0, help="contextual prefix tokens per user")
    parser.add_argument("--max-attn-len", type=int, default=0, help="attention window (0: none)")
    parser.add_argument("--not-target-aware", action="store_true",
                        help="candidates attend causally to each other (default: target-aware)")
    parser.add_argument("--attn-alpha", type=float, help="q.k scale inside the SiLU (default 1/sqrt(dqk))")
    parser.add_argument("--attn-n-rule", choices=N_RULES, default="constant",
                        help="N of the 1/N: constant (max_seq_len) or batch (GR: longest cached + delta)")
    parser.add_argument("--output-norm", choices=OUTPUT_NORMS, help="output norm (default: from its shape)")
    parser.add_argument("--layer-norm-eps", type=float, default=1e-6, help="epsilon of every norm")


def main(args: argparse.Namespace) -> None:
    options = ModelOptions(
        num_heads=args.num_heads, max_seq_len=args.max_seq_len, contextual_len=args.contextual_len,
        max_attn_len=args.max_attn_len, target_aware=not args.not_target_aware, attn_alpha=args.attn_alpha,
        attn_n_rule=args.attn_n_rule, output_norm=args.output_norm, layer_norm_eps=args.layer_norm_eps,
    )
    weights = import_checkpoint(args.format, args.src, args.out, options, prefix=args.prefix,
                                dtype=DTYPES[args.dtype] if args.dtype else None)
    c = weights.config
    print(f"{args.out}: {c.family} model, {c.num_layers} layers, {c.num_heads} heads, dqk={c.dqk}, dv={c.dv}, "
          f"E={c.embedding_dim}, {c.output_norm} norm, {c.dtype}")
