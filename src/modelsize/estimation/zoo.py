"""Built-in models, from their published hyper-parameters: nothing is downloaded.

Every model is built on the meta device (no memory), with inputs on the meta device too, so
``modelsize estimate llama-3-70b`` costs what tracing it costs. ResNet-50 and the seed CNN are
written in plain torch (:mod:`modelsize.estimation.plain_models`); the transformers are built
by ``transformers`` from a config object. Importing this module imports neither, so the list
of built-in models needs no torch.

A local Hugging Face ``config.json`` (or the folder holding one) works the same way: the class
its ``architectures`` names, else the model type's causal-LM or conditional-generation head
(else its base model), in the config's ``dtype`` unless the caller gives one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelsize.errors import MissingDependencyError, PathNotFoundError, UsageError, printable

if TYPE_CHECKING:
    import torch
    from torch import nn


class Kind(str, Enum):
    """What a model eats."""

    IMAGE = "image"
    TOKENS = "tokens"
    AUDIO = "audio"
    """Log-mel features (Whisper's ``input_features``) and decoder tokens."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ZooModel:
    """A built-in model: how to build it and what its inputs look like.

    From a ``config.json``: ``dtype`` is the config's (``""``: none), ``model_class`` the
    class built and ``inferred`` whether it was chosen here (the config names no
    ``architectures``); ``encoder_decoder`` models take decoder tokens too.
    """

    name: str
    description: str
    kind: Kind
    build: Callable[[], Any]
    batch: int
    seq: int = 0
    image: int = 224
    channels: int = 3
    vocab: int = 0
    classes: int = 0
    repeated_block: str = ""
    dtype: str = ""
    model_class: str = ""
    inferred: bool = False
    encoder_decoder: bool = False
    features: tuple[int, ...] = ()
    """The shape of one sample's ``input_features`` (audio models)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``modelsize estimate --list --json``)."""
        return {"name": self.name, "description": self.description, "kind": str(self.kind),
                "batch": self.batch, "seq": self.seq or None,
                "image": self.image if self.kind is Kind.IMAGE else None,
                "repeated_block": self.repeated_block or None}


# -- plain-torch models ----------------------------------------------------------------------


def _plain(name: str) -> Callable[[], Any]:
    """A builder of the plain-torch model ``name`` (imports torch when called)."""

    def build() -> Any:
        from modelsize.estimation import plain_models

        return getattr(plain_models, name)()

    build.__name__ = name
    return build


def __getattr__(name: str) -> Any:
    """``zoo.SeedCNN``, ``zoo.ResNet``, ``zoo.Bottleneck``: the classes, imported on use."""
    if name in ("SeedCNN", "ResNet", "Bottleneck"):
        from modelsize.estimation import plain_models

        return getattr(plain_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- transformers models ---------------------------------------------------------------------


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "transformers", "this built-in model", extra="estimate"
        ) from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2() -> Any:
    tf = _transformers()
    return tf.GPT2LMHeadModel(tf.GPT2Config())


def _bert() -> Any:
    tf = _transformers()
    return tf.BertForMaskedLM(tf.BertConfig())


def _vit() -> Any:
    tf = _transformers()
    return tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000))


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> Callable[[], Any]:
    def build() -> Any:
        tf = _transformers()
        config = tf.LlamaConfig(
            vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
            max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
            bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
        )
        return tf.LlamaForCausalLM(config)

    return build


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("seed-cnn", "MNIST example CNN, 1.2M parameters", Kind.IMAGE,
                 _plain("SeedCNN"), batch=64, image=28, channels=1, classes=10),
        ZooModel("resnet50", "ResNet-50 v1.5, ImageNet, 25.6M parameters", Kind.IMAGE,
                 _plain("ResNet"), batch=32, classes=1000, repeated_block="Bottleneck"),
        ZooModel("vit-b-16", "ViT-B/16, ImageNet, 86.6M parameters", Kind.IMAGE, _vit,
                 batch=32, classes=1000, repeated_block="ViTLayer"),
        ZooModel("bert-base", "BERT-base uncased (masked LM head), 110M parameters",
                 Kind.TOKENS, _bert, batch=8, seq=512, vocab=30522, repeated_block="BertLayer"),
        ZooModel("gpt2", "GPT-2 small, 124M parameters", Kind.TOKENS, _gpt2, batch=8,
                 seq=1024, vocab=50257, repeated_block="GPT2Block"),
        ZooModel("llama-3-8b", "Llama 3 8B (published hyper-parameters)", Kind.TOKENS,
                 _llama(4096, 14336, 32, 32), batch=1, seq=2048, vocab=128256,
                 repeated_block="LlamaDecoderLayer"),
        ZooModel("llama-3-70b", "Llama 3 70B (published hyper-parameters)", Kind.TOKENS,
                 _llama(8192, 28672, 80, 64), batch=1, seq=2048, vocab=128256,
                 repeated_block="LlamaDecoderLayer"),
    )
}


def names() -> list[str]:
    """The built-in model names."""
    return list(MODELS)


def build(entry: ZooModel, dtype: torch.dtype | None = None) -> nn.Module:
    """Build ``entry`` on the meta device, its floating-point weights in ``dtype`` (default
    float32: a transformers config's own dtype applies only when the caller passes it)."""
    import torch

    with torch.device("meta"):
        model = entry.build()
    return model.to(dtype if dtype is not None else torch.float32)


def make_inputs(
    entry: ZooModel, batch: int, seq: int, train: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | tuple[torch.Tensor]:
    """Meta-device inputs (with labels for training) in the shape ``entry`` expects.

    An encoder-decoder takes ``seq`` tokens on each side: its decoder tokens are the labels
    in training (the model shifts them right) and ``decoder_input_ids`` in inference.
    """
    import torch

    meta = torch.device("meta")
    floats = dtype if dtype is not None else torch.float32
    if entry.kind is Kind.TOKENS or entry.kind is Kind.AUDIO:
        tokens = torch.empty(batch, seq, dtype=torch.long, device=meta)
        inputs: dict[str, torch.Tensor] = (
            {"input_features": torch.empty(batch, *entry.features, dtype=floats, device=meta)}
            if entry.kind is Kind.AUDIO else {"input_ids": tokens})
        if train:
            inputs["labels"] = tokens
        elif entry.encoder_decoder:
            inputs["decoder_input_ids"] = tokens
        return inputs
    pixels = torch.empty(batch, entry.channels, entry.image, entry.image, dtype=floats,
                         device=meta)
    if entry.name in ("seed-cnn", "resnet50"):
        return (pixels,)
    labels = torch.empty(batch, dtype=torch.long, device=meta)
    return {"pixel_values": pixels, "labels": labels} if train else {"pixel_values": pixels}


# -- Hugging Face config.json ----------------------------------------------------------------

#: The auto-mappings whose class is the model a ``config.json`` without ``architectures``
#: most likely describes: the generation heads, encoder-decoders' first.
_HEADS = (("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "conditional-generation head"),
          ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "conditional-generation head"),
          ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-LM head"),
          ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "conditional-generation head"))


def _head_for(tf: Any, config: Any) -> tuple[Any, str]:
    """The class to build for ``config`` when it names no ``architectures``, and what it is."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", "")
    order = _HEADS if getattr(config, "is_encoder_decoder", False) else (_HEADS[2], *_HEADS)
    for table, what in order:
        name = getattr(modeling_auto, table, {}).get(model_type)
        cls = getattr(tf, name, None) if isinstance(name, str) else None
        if cls is not None:
            return cls, what
    name = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    cls = getattr(tf, name, None) if isinstance(name, str) else None
    return cls, "base model, no head"


def config_dtype(raw: dict[str, Any]) -> str:
    """The floating-point dtype a ``config.json`` names (``dtype``, or the older
    ``torch_dtype``), or ``""`` (none, ``"auto"``, or not a floating-point dtype)."""
    import torch

    value = raw.get("dtype") or raw.get("torch_dtype")
    if not isinstance(value, str):
        return ""
    name = value.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return str(dtype).removeprefix("torch.")
    return ""


def from_config_json(path: str | Path) -> ZooModel:
    """A :class:`ZooModel` for a local Hugging Face ``config.json`` (or its folder)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise PathNotFoundError(p)
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{p}: not a readable JSON config ({exc})") from exc
    return from_config_dict(raw, p.parent.name or p.name, str(p))


def from_config_dict(raw: Any, name: str, origin: str) -> ZooModel:
    """A :class:`ZooModel` named ``name`` for a config.json's contents, read from
    ``origin`` (a path or URL, for messages and the description)."""
    p = origin
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UsageError(f"{p}: a Hugging Face config.json needs a 'model_type' key")
    raw = dict(raw)
    tf = _transformers()
    dtype = config_dtype(raw)
    model_type = raw.pop("model_type")
    try:
        config = tf.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{p}: transformers cannot build a {model_type!r} config ({exc})") from exc
    arch = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(tf, arch, None) if arch else None
    inferred, what = cls is None, ""
    if cls is None:
        cls, what = _head_for(tf, config)
    if cls is None:
        raise UsageError(f"{p}: transformers has no model class for model_type "
                         f"{printable(str(model_type))!r}")
    model_class = cls.__name__

    def build_model() -> Any:
        try:
            return cls(config)
        except (ValueError, KeyError, TypeError, AssertionError, AttributeError,
                RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"{p}: transformers cannot build {model_class} from it: "
                             f"{printable(first, 200)}") from exc

    main_input = getattr(cls, "main_input_name", "input_ids")
    image = getattr(config, "image_size", 0)
    if main_input == "input_features":
        kind = Kind.AUDIO
    elif main_input == "pixel_values" or (image and not getattr(config, "vocab_size", 0)):
        kind = Kind.IMAGE
    else:
        kind = Kind.TOKENS
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    features: tuple[int, ...] = ()
    if kind is Kind.AUDIO:
        # Whisper: num_mel_bins x 2 * max_source_positions frames; decoder tokens up to
        # max_target_positions
        features = (int(getattr(config, "num_mel_bins", 80)),
                    2 * int(getattr(config, "max_source_positions", 1500)))
        seq = min(int(getattr(config, "max_target_positions", 0) or 448), 2048)
    else:
        seq = min(int(getattr(config, "max_position_embeddings", 0) or 512), 2048)
    how = f" (inferred, the {what}: the config names no architectures)" if inferred else ""
    return ZooModel(
        name=name,
        description=f"{model_class}{how} from {p}",
        kind=kind,
        build=build_model,
        batch=1,
        seq=0 if kind is Kind.IMAGE else seq,
        image=int(image or 224),
        channels=int(getattr(config, "num_channels", 3) or 3),
        vocab=int(getattr(config, "vocab_size", 0) or 0),
        dtype=dtype,
        model_class=model_class,
        inferred=inferred,
        encoder_decoder=encoder_decoder,
        features=features,
    )
