"""Built-in models, from their published hyper-parameters: nothing is downloaded.

Every model is built on the meta device (no memory), with inputs on the meta device too, so
``modelsize estimate llama-3-70b`` costs what tracing it costs. ResNet-50 and the seed CNN are
written here in plain torch (torchvision cannot be relied on beside every torch version);
the transformers are built by ``transformers`` from a config object.

A local Hugging Face ``config.json`` (or the folder holding one) works the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelsize.errors import MissingDependencyError, PathNotFoundError, UsageError


class Kind(str, Enum):
    """What a model eats."""

    IMAGE = "image"
    TOKENS = "tokens"


@dataclass(frozen=True)
class ZooModel:
    """A built-in model: how to build it and what its inputs look like."""

    name: str
    description: str
    kind: Kind
    build: Callable[[], nn.Module]
    batch: int
    seq: int = 0
    image: int = 224
    channels: int = 3
    vocab: int = 0
    classes: int = 0
    repeated_block: str = ""


# -- plain-torch models ----------------------------------------------------------------------


class SeedCNN(nn.Module):
    """The classic MNIST example network (PyTorch examples/mnist)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 1x28x28 images."""
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.max_pool2d(x, 2)
        x = self.dropout(x)
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        return self.fc2(x)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (stride on the 3x3 convolution)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width = planes
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual bottleneck."""
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    """ResNet for ImageNet, torchvision's layout and parameter names."""

    def __init__(self, layers: tuple[int, int, int, int] = (3, 4, 6, 3),
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        stages = []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stride = 1 if i == 0 else 2
            seq = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * Bottleneck.expansion
            seq += [Bottleneck(inplanes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*seq))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 3x224x224 images."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


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


def _gpt2() -> nn.Module:
    tf = _transformers()
    return tf.GPT2LMHeadModel(tf.GPT2Config())


def _bert() -> nn.Module:
    tf = _transformers()
    return tf.BertForMaskedLM(tf.BertConfig())


def _vit() -> nn.Module:
    tf = _transformers()
    return tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000))


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
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
        ZooModel("seed-cnn", "MNIST example CNN, 1.2M parameters", Kind.IMAGE, SeedCNN,
                 batch=64, image=28, channels=1, classes=10),
        ZooModel("resnet50", "ResNet-50 v1.5, ImageNet, 25.6M parameters", Kind.IMAGE, ResNet,
                 batch=32, classes=1000, repeated_block="Bottleneck"),
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


def build(entry: ZooModel, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build ``entry`` on the meta device in ``dtype``."""
    with torch.device("meta"):
        model = entry.build()
    return model.to(dtype) if dtype != torch.float32 else model


def make_inputs(
    entry: ZooModel, batch: int, seq: int, train: bool, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor] | tuple[torch.Tensor]:
    """Meta-device inputs (with labels for training) in the shape ``entry`` expects."""
    meta = torch.device("meta")
    if entry.kind is Kind.TOKENS:
        ids = torch.empty(batch, seq, dtype=torch.long, device=meta)
        return {"input_ids": ids, "labels": ids} if train else {"input_ids": ids}
    pixels = torch.empty(batch, entry.channels, entry.image, entry.image, dtype=dtype, device=meta)
    if entry.name in ("seed-cnn", "resnet50"):
        return (pixels,)
    labels = torch.empty(batch, dtype=torch.long, device=meta)
    return {"pixel_values": pixels, "labels": labels} if train else {"pixel_values": pixels}


# -- Hugging Face config.json ----------------------------------------------------------------


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
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UsageError(f"{p}: a Hugging Face config.json needs a 'model_type' key")
    tf = _transformers()
    model_type = raw.pop("model_type")
    try:
        config = tf.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{p}: transformers cannot build a {model_type!r} config ({exc})") from exc
    arch = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(tf, arch, None) if arch else None

    def build_model() -> nn.Module:
        if cls is not None:
            return cls(config)
        return tf.AutoModel.from_config(config)

    image = getattr(config, "image_size", 0)
    kind = Kind.IMAGE if image and not getattr(config, "vocab_size", 0) else Kind.TOKENS
    return ZooModel(
        name=p.parent.name or p.name,
        description=f"{arch or model_type} from {p}",
        kind=kind,
        build=build_model,
        batch=1,
        seq=min(int(getattr(config, "max_position_embeddings", 0) or 512), 2048),
        image=int(image or 224),
        channels=int(getattr(config, "num_channels", 3) or 3),
        vocab=int(getattr(config, "vocab_size", 0) or 0),
    )
