"""Copy weights from ``torch.nn.Transformer`` / ``torch.nn.TransformerEncoder`` into aiayn.

The layouts match one for one: ``nn.MultiheadAttention.in_proj_weight`` is our
``MultiHeadAttention.in_proj.weight`` ([W^Q; W^K; W^V]); ``linear1``/``linear2`` are the
feed-forward network; ``norm1``/``norm2``/``norm3`` are the LayerNorms after (post-norm) or
before (pre-norm) self-attention, encoder-decoder attention and the feed-forward network.
``torch.nn.Transformer`` always ends each stack with a LayerNorm, so the aiayn config needs
``final_norm=True`` to match it.

Only the stacks are copied: torch's modules have no embeddings or output projection.

``from_marian`` reads a Hugging Face ``MarianMTModel`` (OPUS-MT), whose architecture is the
paper's base Transformer (post-norm, sinusoidal positions, embeddings scaled by √d_model and tied
to the output), into an aiayn ``Transformer`` that computes the same function, with the same
token ids. What Marian does differently, and how it is expressed:
- its sinusoidal encodings are laid out as [sin | cos] halves, not interleaved (§3.5). The
  model dimension is permuted once, at conversion: aiayn's dimension 2i is Marian's i and 2i + 1
  is Marian's d_model/2 + i, in every weight that reads or writes the residual stream (the
  embeddings, every projection's d_model side, the layer norms). Layer norm, dot products and
  the tied output projection do not see a permutation, so the function is unchanged and the
  paper's code needs no Marian-shaped option; the heads' dimensions are not permuted, so the
  attention weights are Marian's, head by head;
- ``final_logits_bias`` becomes ``Transformer.output_bias`` (``ModelConfig.output_bias``);
- its decoder starts from the padding token: ``bos_id = pad_id``, never masked at position 0;
- its activation "swish" is ``activation="silu"``;
- separate source and target embeddings (``share_encoder_decoder_embeddings: false``) and an
  untied output projection load as ``share_embeddings`` / ``tie_output`` false.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import EncoderOnly, ModelConfig, Transformer
from .model.attention import MultiHeadAttention
from .model.layers import ResidualNorm
from .model.transformer import Decoder, Encoder

__all__ = [
    "load_torch_transformer", "from_marian", "from_marian_state", "marian_config", "convert_marian",
    "to_marian_state", "export_marian",
]  # fmt: skip


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: shape {tuple(src.shape)} in torch, {tuple(dst.shape)} in aiayn; configs differ")
    dst.copy_(src)


def _attention(dst: MultiHeadAttention, src: nn.MultiheadAttention, name: str) -> None:
    if not src._qkv_same_embed_dim or src.in_proj_bias is None:
        raise ValueError(f"{name}: only nn.MultiheadAttention with one in_proj and biases is supported")
    if not src.batch_first:
        raise ValueError(f"{name}: the torch module must be built with batch_first=True")
    _copy(dst.in_proj.weight, src.in_proj_weight, f"{name}.in_proj_weight")
    _copy(dst.in_proj.bias, src.in_proj_bias, f"{name}.in_proj_bias")
    _copy(dst.out_proj.weight, src.out_proj.weight, f"{name}.out_proj.weight")
    _copy(dst.out_proj.bias, src.out_proj.bias, f"{name}.out_proj.bias")


def _linear(dst: nn.Linear, src: nn.Linear, name: str) -> None:
    _copy(dst.weight, src.weight, f"{name}.weight")
    _copy(dst.bias, src.bias, f"{name}.bias")


def _norm(dst: nn.LayerNorm | ResidualNorm | None, src: nn.LayerNorm | None, name: str) -> None:
    dst = dst.norm if isinstance(dst, ResidualNorm) else dst
    if (dst is None) != (src is None):
        raise ValueError(
            f"{name}: {'missing in aiayn' if dst is None else 'missing in torch'}; set final_norm to match"
        )
    if dst is not None:
        if dst.eps != src.eps:
            raise ValueError(f"{name}: eps {src.eps} in torch, {dst.eps} in aiayn")
        _copy(dst.weight, src.weight, f"{name}.weight")
        _copy(dst.bias, src.bias, f"{name}.bias")


def _check_layer(layer: nn.Module, config: ModelConfig, name: str) -> None:
    if layer.norm_first != config.norm_first:
        raise ValueError(f"{name}: norm_first={layer.norm_first} in torch, {config.norm_first} in aiayn")
    activation = {F.relu: "relu", F.gelu: "gelu"}.get(layer.activation)
    if activation != config.activation:
        raise ValueError(f"{name}: activation {layer.activation} in torch, {config.activation!r} in aiayn")


def _stack(
    dst: Encoder | Decoder, src: nn.TransformerEncoder | nn.TransformerDecoder, config: ModelConfig, name: str
) -> None:
    """Copy every layer of a torch encoder or decoder stack, then its final norm."""
    if len(dst.layers) != len(src.layers):
        raise ValueError(f"{name}: {len(src.layers)} layers in torch, {len(dst.layers)} in aiayn")
    for i, (ours, theirs) in enumerate(zip(dst.layers, src.layers, strict=True)):
        prefix = f"{name}.layers.{i}"
        _check_layer(theirs, config, prefix)
        _attention(ours.self_attn, theirs.self_attn, f"{prefix}.self_attn")
        norms = [ours.self_attn_norm, ours.feed_forward_norm]  # torch: norm1, norm2 (encoder)
        if isinstance(theirs, nn.TransformerDecoderLayer):
            _attention(ours.cross_attn, theirs.multihead_attn, f"{prefix}.multihead_attn")
            norms.insert(1, ours.cross_attn_norm)  # torch: norm1, norm2, norm3 (decoder)
        _linear(ours.feed_forward.linear1, theirs.linear1, f"{prefix}.linear1")
        _linear(ours.feed_forward.linear2, theirs.linear2, f"{prefix}.linear2")
        for j, norm in enumerate(norms, start=1):
            _norm(norm, getattr(theirs, f"norm{j}"), f"{prefix}.norm{j}")
    _norm(dst.norm, src.norm, f"{name}.norm")


@torch.no_grad()
def load_torch_transformer(model: Transformer | EncoderOnly, module: nn.Transformer | nn.TransformerEncoder) -> None:
    """Copy the encoder and decoder stacks of a ``torch.nn.Transformer`` (``batch_first=True``,
    either norm order) into ``model``, an aiayn ``Transformer`` built with the matching config
    (``d_model``, ``h``, ``d_ff``, ``N``, ``norm_first``, ``activation``, ``layer_norm_eps``,
    ``final_norm=True``). For an ``EncoderOnly`` model, ``module`` is a
    ``torch.nn.TransformerEncoder``. Raises ``ValueError`` naming the first mismatch."""
    config = model.config
    if config.norm != "layer":
        raise ValueError("torch.nn.Transformer has LayerNorms only: build the aiayn model with norm='layer'")
    if isinstance(model, EncoderOnly):
        if not isinstance(module, nn.TransformerEncoder):
            raise TypeError("an EncoderOnly model loads from a torch.nn.TransformerEncoder")
        _stack(model.encoder, module, config, "encoder")
        return
    if not isinstance(module, nn.Transformer):
        raise TypeError("a Transformer loads from a torch.nn.Transformer")
    _stack(model.encoder, module.encoder, config, "encoder")
    _stack(model.decoder, module.decoder, config, "decoder")


# Hugging Face Marian (OPUS-MT) ------------------------------------------------------------------

_MARIAN_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
# transformers' MarianConfig defaults, for a config.json that leaves a field out (as transformers reads it)
_MARIAN_DEFAULTS = {
    "vocab_size": 58101, "decoder_vocab_size": None, "max_position_embeddings": 1024, "encoder_layers": 12,
    "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12, "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16, "activation_function": "gelu", "d_model": 1024, "dropout": 0.1,
    "attention_dropout": 0.0, "activation_dropout": 0.0, "decoder_start_token_id": 58100, "scale_embedding": False,
    "pad_token_id": 58100, "eos_token_id": 0, "share_encoder_decoder_embeddings": True,
}  # fmt: skip
# options of older Marian configs that describe models aiayn (and transformers' MarianMTModel) do
# not compute: the value each must have
_MARIAN_FIXED = {
    "normalize_before": False, "add_final_layer_norm": False, "normalize_embedding": False,
    "static_position_embeddings": True, "add_bias_logits": False,
}  # fmt: skip


def marian_config(config: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """The aiayn ``ModelConfig`` of a Marian ``config.json`` (a dict). Raises ``ValueError``
    naming ``source`` and the problem for a model that is not Marian, or a Marian variant aiayn
    cannot express."""

    def fail(msg: str) -> None:
        raise ValueError(f"{source}: {msg}")

    model_type = config.get("model_type")
    if model_type != "marian":
        fail(f"model_type {model_type!r}, not 'marian': not a Marian (OPUS-MT) model")
    config = {**_MARIAN_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in _MARIAN_DEFAULTS}}
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        if not isinstance(config[name], int) or isinstance(config[name], bool):
            fail(f"{name}={config[name]!r}: aiayn takes one token id")
    for name, value in _MARIAN_FIXED.items():
        if name in config and bool(config[name]) != value:
            fail(f"{name}={config[name]!r}: aiayn converts Marian models with {name}={value} only")
    if not config["scale_embedding"]:  # false by MarianConfig's default; OPUS-MT models scale (§3.4)
        fail("scale_embedding is false: aiayn scales the embeddings by √d_model (§3.4), as OPUS-MT models do")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config[a] != config[b]:
            fail(f"{a}={config[a]} and {b}={config[b]} differ; aiayn's encoder and decoder share h and d_ff")
    activation = _MARIAN_ACTIVATIONS.get(config["activation_function"])
    if activation is None:
        known = ", ".join(_MARIAN_ACTIVATIONS)
        fail(f"activation_function {config['activation_function']!r} is not one of {known}")
    if config["d_model"] % 2:
        fail(f"d_model={config['d_model']} is odd; the sinusoidal encodings need an even d_model")
    share = bool(config["share_encoder_decoder_embeddings"])
    vocab_size = config["vocab_size"]
    tgt_vocab_size = vocab_size if share else config["decoder_vocab_size"] or vocab_size
    return ModelConfig(
        vocab_size=vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        N=config["encoder_layers"],
        N_dec=config["decoder_layers"],
        d_model=config["d_model"],
        d_ff=config["encoder_ffn_dim"],
        h=config["encoder_attention_heads"],
        P_drop=float(config["dropout"]),
        attention_dropout=float(config["attention_dropout"]),
        activation_dropout=float(config["activation_dropout"]),
        activation=activation,
        max_len=config["max_position_embeddings"],
        share_embeddings=share,  # from_marian_state checks the weights: untied matrices load as such
        output_bias=True,
        pad_id=config["pad_token_id"],
        bos_id=config["decoder_start_token_id"],
        eos_id=config["eos_token_id"],
    )


def _marian_sinusoid(length: int, d_model: int) -> Tensor:
    """Marian's positional table: sin(pos / 10000^(2i/d_model)) in dimension i < d_model/2, the
    cosine in d_model/2 + i (§3.5's encodings, in halves): ``(length, d_model)``."""
    from .model.embedding import sinusoidal_encoding

    return sinusoidal_encoding(length, d_model)[:, torch.argsort(_halves_to_interleaved(d_model))]


def _marian_layers(config: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """The layers' tensors, aiayn's name against Marian's (three for the fused W^Q, W^K, W^V),
    with the side that meets the residual stream and so the permutation (``_permute``): ``reads``
    (its input columns), ``writes`` (its output rows, or a layer norm's entries), or ``neither``
    (the heads' and the FFN's inner dimensions)."""
    layers = []

    def attention(ours: str, theirs: str) -> None:
        layers.append((f"{ours}.in_proj.weight", tuple(f"{theirs}.{x}_proj.weight" for x in "qkv"), "reads"))
        layers.append((f"{ours}.in_proj.bias", tuple(f"{theirs}.{x}_proj.bias" for x in "qkv"), "neither"))
        layers.append((f"{ours}.out_proj.weight", (f"{theirs}.out_proj.weight",), "writes"))
        layers.append((f"{ours}.out_proj.bias", (f"{theirs}.out_proj.bias",), "writes"))

    def norm(ours: str, theirs: str) -> None:
        layers.append((f"{ours}.norm.weight", (f"{theirs}.weight",), "writes"))
        layers.append((f"{ours}.norm.bias", (f"{theirs}.bias",), "writes"))

    def feed_forward(ours: str, theirs: str) -> None:
        layers.append((f"{ours}.feed_forward.linear1.weight", (f"{theirs}.fc1.weight",), "reads"))
        layers.append((f"{ours}.feed_forward.linear1.bias", (f"{theirs}.fc1.bias",), "neither"))
        layers.append((f"{ours}.feed_forward.linear2.weight", (f"{theirs}.fc2.weight",), "writes"))
        layers.append((f"{ours}.feed_forward.linear2.bias", (f"{theirs}.fc2.bias",), "writes"))

    for stack, count in (("encoder", config.N), ("decoder", config.N_dec)):
        for i in range(count):
            layer = f"{stack}.layers.{i}"  # the same path in both
            attention(f"{layer}.self_attn", f"{layer}.self_attn")
            norm(f"{layer}.self_attn_norm", f"{layer}.self_attn_layer_norm")
            if stack == "decoder":
                attention(f"{layer}.cross_attn", f"{layer}.encoder_attn")
                norm(f"{layer}.cross_attn_norm", f"{layer}.encoder_attn_layer_norm")
            feed_forward(layer, layer)
            norm(f"{layer}.feed_forward_norm", f"{layer}.final_layer_norm")
    return layers


def _permute(tensor: Tensor, side: str, order: Tensor) -> Tensor:
    """``tensor``'s model dimension in ``order``, on its ``side`` (``_marian_layers``)."""
    return tensor[:, order] if side == "reads" else tensor[order] if side == "writes" else tensor


def _halves_to_interleaved(d_model: int) -> Tensor:
    """The permutation of the model dimension: aiayn's dimension a is Marian's ``perm[a]``
    (2i -> i, the sines; 2i + 1 -> d_model/2 + i, the cosines)."""
    i = torch.arange(d_model // 2)
    return torch.stack([i, i + d_model // 2], dim=1).reshape(-1)  # (d_model,)


def from_marian_state(
    config: Mapping[str, Any], state: Mapping[str, Tensor], source: str = "the Marian model"
) -> Transformer:
    """An aiayn ``Transformer`` computing what the Marian model of ``config`` (its config.json as
    a dict) with the weights ``state`` (its state dict, tensor names as transformers saves them,
    with or without the ``model.`` prefix) computes. Errors name ``source``, and the tensor at fault."""
    model_config = marian_config(config, f"{source} (config)")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    used: set[str] = set()

    def get(*names: str) -> Tensor:
        for name in names:
            if name in state:
                used.add(name)
                return state[name].detach().float()
        raise ValueError(f"{source}: no tensor {names[0]!r} in the weights")

    perm = _halves_to_interleaved(model_config.d_model)
    ours: dict[str, Tensor] = {}
    # Which matrices are one: the values say (a file stores a tied matrix once, under one of its
    # names; transformers unties them all where tie_word_embeddings is false)
    src_embedding = get("encoder.embed_tokens.weight", "shared.weight")
    if model_config.share_embeddings:
        tgt_embedding = get("decoder.embed_tokens.weight", "shared.weight")
    else:
        tgt_embedding = get("decoder.embed_tokens.weight")
    output = get("lm_head.weight", "decoder.embed_tokens.weight", "shared.weight")
    share = model_config.share_embeddings and torch.equal(src_embedding, tgt_embedding)
    model_config = model_config.replace(share_embeddings=share, tie_output=torch.equal(output, tgt_embedding))
    ours["src_embedding.weight"] = src_embedding[:, perm]
    ours["tgt_embedding.weight"] = ours["src_embedding.weight"] if share else tgt_embedding[:, perm]
    if not model_config.tie_output:
        ours["output_projection.weight"] = output[:, perm]
    bias = state.get("final_logits_bias")
    used.add("final_logits_bias")
    ours["output_bias"] = torch.zeros(model_config.tgt_vocab_size) if bias is None else bias.detach().float().view(-1)

    for ours_name, theirs, side in _marian_layers(model_config):
        ours[ours_name] = _permute(torch.cat([get(name) for name in theirs]), side, perm)  # W^Q, W^K, W^V: in_proj

    positions = {"encoder.embed_positions.weight", "decoder.embed_positions.weight"}
    for name in positions & set(state):  # transformers uses a stored table: it must be the sinusoid
        table = state[name].detach().float()
        expected = _marian_sinusoid(table.size(0), model_config.d_model)
        if table.shape != expected.shape or not torch.allclose(table, expected, atol=1e-5):
            raise ValueError(f"{source}: {name} is not Marian's sinusoidal table; aiayn cannot load learned positions")
    unknown = sorted(set(state) - used - positions - {"shared.weight"})  # shared: unused where untied
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"{source}: tensors aiayn does not know: {', '.join(unknown[:3])}{more}")
    model = Transformer(model_config)
    try:
        model.load_state_dict(ours, strict=True)
    except RuntimeError as e:  # a shape that does not match the config
        raise ValueError(f"{source}: the weights do not match the config: {str(e).splitlines()[-1].strip()}") from None
    return model.eval()


def from_marian(module: nn.Module) -> Transformer:
    """The aiayn ``Transformer`` of a transformers ``MarianMTModel`` (module docstring): for a
    ``tgt`` starting with Marian's ``decoder_start_token_id``, ``from_marian(m)(src, tgt)`` equals
    ``m(input_ids=src, decoder_input_ids=tgt).logits``, and the searches of ``aiayn.decode`` give
    what ``m.generate`` gives."""
    config = module.config.to_dict()
    return from_marian_state(config, module.state_dict(), type(module).__name__)


def _read_marian_weights(directory: Path) -> dict[str, Tensor]:
    """The weights of a Hugging Face model directory: ``model.safetensors``, else
    ``pytorch_model.bin`` (read with ``weights_only=True``: nothing is unpickled)."""
    import safetensors.torch

    path = directory / "model.safetensors"
    if path.is_file():
        try:
            return safetensors.torch.load_file(path)
        except Exception as e:  # safetensors raises its own error types for bad files
            raise ValueError(f"{path}: not a readable safetensors file: {e}") from None
    path = directory / "pytorch_model.bin"
    if path.is_file():
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle errors, or a pickled object that is not tensors
            lines = str(e).splitlines()
            why = next((x for x in lines if "Unsupported global" in x), lines[0] if lines else type(e).__name__)
            raise ValueError(f"{path}: not a readable weights file (loaded with weights_only=True): {why}") from None
    raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin")


def convert_marian(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a Hugging Face Marian model directory (config.json, the weights, source.spm,
    target.spm and vocab.json, as OPUS-MT models are published) into an aiayn model directory
    (config.json, model.safetensors and the SentencePiece tokenizer) that ``aiayn translate``,
    ``evaluate``, ``attention`` and ``train --train.init`` read. Downloads nothing."""
    from .data.sentencepiece import SentencePieceTokenizer

    src = Path(src_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a directory")
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a Hugging Face model directory has one)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a valid JSON config: {e}") from None
    marian_config(config, str(path))  # not Marian, or a variant aiayn cannot express: say so first
    model = from_marian_state(config, _read_marian_weights(src), str(src))
    tokenizer = SentencePieceTokenizer.load(src, model.config.vocab_size, model.config.tgt_vocab_size)
    out = Path(out_dir)
    model.save_pretrained(out, converted_from=f"marian: {src.resolve()}")
    tokenizer.save(out)
    return out


# The other way: an aiayn Transformer as a Marian model ------------------------------------------


def to_marian_state(model: Transformer) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The Marian ``config.json`` (a dict) and state dict (transformers' ``MarianMTModel`` names)
    of ``model``: ``from_marian_state``'s inverse, the permutation of the model dimension undone.
    Raises ``ValueError`` naming the setting for a model Marian cannot express (pre-norm, a final
    layer norm, learned positions, restricted attention, d_k · h != d_model, other layer-norm ε, ScaleNorm,
    FixNorm)."""
    c = model.config
    problems = [
        (c.norm_first, "norm_first=True (Marian is post-norm)"),
        (c.final_norm, "final_norm=True (Marian has no layer norm after its stacks)"),
        (c.positional != "sinusoidal", f"positional={c.positional!r} (Marian's are sinusoidal)"),
        (c.attention_window is not None, "attention_window (Marian attends to every position)"),
        (c.d_k * c.h != c.d_model or c.d_v != c.d_k, f"d_k={c.d_k}, d_v={c.d_v}, h={c.h} (Marian's: d_model / h)"),
        (c.layer_norm_eps != 1e-5, f"layer_norm_eps={c.layer_norm_eps} (Marian's is 1e-5)"),
        (c.norm != "layer", f"norm={c.norm!r} (Marian's are LayerNorms)"),
        (c.fix_norm, "fix_norm=True (Marian's embeddings are used as they are)"),
        (c.d_model % 2 == 1, f"d_model={c.d_model} is odd"),
    ]
    named = [why for bad, why in problems if bad]
    if named:
        raise ValueError("Marian cannot express this model: " + "; ".join(named))
    inverse = torch.argsort(_halves_to_interleaved(c.d_model))
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    state: dict[str, Tensor] = {}
    for ours_name, theirs, side in _marian_layers(c):
        tensor = _permute(ours[ours_name], side, inverse)
        for name, part in zip(theirs, tensor.chunk(len(theirs)), strict=True):  # W^Q, W^K, W^V: equal sizes
            state[f"model.{name}"] = part.contiguous()
    src, tgt = ours["src_embedding.weight"][:, inverse], ours["tgt_embedding.weight"][:, inverse]
    state["model.encoder.embed_tokens.weight"], state["model.decoder.embed_tokens.weight"] = src, tgt.clone()
    if c.share_embeddings:
        state["model.shared.weight"] = src.clone()
    state["lm_head.weight"] = tgt.clone() if c.tie_output else ours["output_projection.weight"][:, inverse]
    bias = ours.get("output_bias", torch.zeros(c.tgt_vocab_size))
    state["final_logits_bias"] = bias.view(1, -1).clone()
    activation = {"relu": "relu", "gelu": "gelu", "silu": "swish"}[c.activation]
    config = {
        "model_type": "marian", "architectures": ["MarianMTModel"], "vocab_size": c.vocab_size,
        "decoder_vocab_size": c.tgt_vocab_size, "share_encoder_decoder_embeddings": c.share_embeddings,
        "tie_word_embeddings": c.tie_output,  # false: transformers unties every matrix (each is written)
        "d_model": c.d_model, "encoder_layers": c.N, "decoder_layers": c.N_dec, "encoder_attention_heads": c.h,
        "decoder_attention_heads": c.h, "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff,
        "activation_function": activation, "dropout": c.P_drop, "attention_dropout": c.attention_dropout,
        "activation_dropout": c.activation_dropout, "max_position_embeddings": c.max_len, "scale_embedding": True,
        "pad_token_id": c.pad_id, "eos_token_id": c.eos_id, "decoder_start_token_id": c.bos_id,
        "forced_eos_token_id": c.eos_id, "bad_words_ids": [[c.pad_id], *([i] for i in c.suppress_ids)],
    }  # fmt: skip
    return config, state


def export_marian(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the aiayn model directory ``model_dir`` as a Hugging Face Marian directory that
    transformers' ``MarianMTModel.from_pretrained`` reads (config.json, model.safetensors), with
    the tokenizer's files: a converted OPUS-MT model's SentencePiece ones, which
    ``MarianTokenizer`` reads, or aiayn's ``tokenizer.json`` (the ``tokenizers`` library's file)."""
    import safetensors.torch

    from .data.tokenizer import load_tokenizer, save_tokenizer

    model = Transformer.from_pretrained(model_dir)
    config, state = to_marian_state(model)
    tokenizer = load_tokenizer(model_dir, model.config.vocab_size, model.config.tgt_vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tokenizer, out)
    return out
