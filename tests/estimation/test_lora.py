"""LoRA (peft), transformers' gradient checkpointing and bitsandbytes' 8-bit AdamW, exact.

The measured side is :mod:`tests.estimation.groundtruth`: the same program run for real on
CPU under the allocator's profiler, on a model adapted by peft's ``get_peft_model`` and
switched by transformers' ``activation_checkpointing_enable`` here, in the test, not by the
estimator. Every model is built from a tiny config in code.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelsize.errors import UsageError
from modelsize.estimation import LoraSpec, MemoryCategory, estimate
from modelsize.estimation.lora import apply_lora, parse_lora
from tests.estimation import models
from tests.estimation.groundtruth import measure

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _peft(model: nn.Module, **config: Any) -> nn.Module:
    """peft's own LoRA on a copy of ``model`` (the measured side)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notices (deprecated transformers names)
        return peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**config))


def _tiny_bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 256, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _tiny_vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers.logging.set_verbosity_error()
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3,
                                    hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, num_labels=5)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 3])}


#: model, ``--lora`` spec, the same as peft's LoraConfig arguments
ARCHITECTURES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], str, dict[str, Any]]] = {
    "llama": (models.tiny_llama, "r=8,alpha=16,targets=q_proj,v_proj",
              {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
    "bert": (_tiny_bert, "r=8,alpha=16,targets=query,value",
             {"r": 8, "lora_alpha": 16, "target_modules": ["query", "value"]}),
    "vit": (_tiny_vit, "r=4,alpha=8,targets=q_proj,v_proj,dropout=0.1",
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
             "lora_dropout": 0.1}),
}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], foreach=False)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_lora_training_step_is_exact(arch: str) -> None:
    """Decoder, encoder and vision model: frozen base, adapters trained with AdamW."""
    make, spec, config = ARCHITECTURES[arch]
    model, inputs = make()
    est = estimate(model, inputs, optimizer="adamw", implementation="for-loop",
                   device="cpu", lora=spec)
    adapted = _peft(model, **config)
    assert est.peak_bytes == measure(adapted, inputs, optimizer=_adamw)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert est.trainable_count == trainable
    assert sum(est.categories.values()) == est.peak_bytes
    assert any(f"{trainable:,} trainable parameters" in n for n in est.notes)


def test_all_linear_with_dropout_on_gpt2() -> None:
    """``targets=all-linear`` (every Conv1D but the head, peft's fan_in_fan_out) and a
    dropout layer in front of each adapter (its mask kept for the backward)."""
    model, inputs = models.tiny_gpt2()
    est = estimate(model, inputs, optimizer="adamw", implementation="for-loop", device="cpu",
                   lora="r=4,targets=all-linear,dropout=0.1")
    adapted = _peft(model, r=4, target_modules="all-linear", lora_dropout=0.1)
    torch.manual_seed(0)
    assert est.peak_bytes == measure(adapted, inputs, optimizer=_adamw)
    assert sum(1 for m in adapted.modules() if isinstance(m, nn.Dropout)) > 8


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_with_transformers_gradient_checkpointing(reentrant: bool) -> None:
    """``activation_checkpointing_enable({"use_reentrant": ...})`` as transformers does it,
    on the model peft wraps: each decoder layer checkpointed (the CPU RNG state it keeps
    counted), the embeddings' output made to require grad."""
    model, inputs = models.tiny_llama()
    kwargs = {"use_reentrant": reentrant}
    est = estimate(model, inputs, optimizer="adamw", implementation="for-loop", device="cpu",
                   lora="r=8,alpha=16,targets=q_proj,v_proj", gradient_checkpointing=kwargs)
    adapted = _peft(model, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    adapted.base_model.model.activation_checkpointing_enable(kwargs)
    assert est.peak_bytes == measure(adapted, inputs, optimizer=_adamw)
    plain = estimate(model, inputs, optimizer="adamw", implementation="for-loop", device="cpu",
                     lora="r=8,alpha=16,targets=q_proj,v_proj")
    assert est.peak_bytes < plain.peak_bytes
    # the caller's model is left as it was: no adapters, no checkpointing, no hooks
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert not model.is_activation_checkpointing
    assert not getattr(model, "_require_grads_hooks", None)


def test_gradient_checkpointing_of_a_model_already_switched_on() -> None:
    """A model the caller switched on is traced as it is (the switch is not needed)."""
    model, inputs = models.tiny_llama()
    model.activation_checkpointing_enable({"use_reentrant": False})
    est = estimate(model, inputs, optimizer="adamw", implementation="for-loop", device="cpu")
    assert est.peak_bytes == measure(model, inputs,
                                     optimizer=functools.partial(torch.optim.AdamW,
                                                                 foreach=False))


class _OwnCheckpoints(nn.Module):
    """A model that checkpoints its own blocks (reentrant or not), after a trainable stem."""

    def __init__(self, reentrant: bool, n: int = 3, d: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(models.Block(d) for _ in range(n))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_own_checkpointing_counts_the_rng_state_of_each_block(reentrant: bool) -> None:
    """Each checkpointed block keeps ``torch.get_rng_state()`` (5,056 bytes for PyTorch's
    Mersenne Twister) until its backward: three blocks, three states at the forward's end."""
    torch.manual_seed(0)
    model, x = _OwnCheckpoints(reentrant), torch.randn(4, 16, 32)
    est = estimate(model, (x,), optimizer="adamw", implementation="for-loop", device="cpu")
    assert est.peak_bytes == measure(model, (x,), optimizer=functools.partial(
        torch.optim.AdamW, foreach=False))
    assert torch.get_rng_state().nbytes == 5056
    if not reentrant:  # (a reentrant checkpoint under no_grad warns that nothing has a grad)
        infer = estimate(model, (x,), mode="infer", device="cpu")
        assert infer.peak_bytes == measure(model, (x,), mode="infer")


# -- bitsandbytes' 8-bit AdamW ------------------------------------------------------------------


def _bnb_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages in a real optimizer's state."""
    seen: dict[int, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


class _Mixed(nn.Module):
    """Parameters on both sides of bitsandbytes' min_8bit_size (4,096 elements), one of them
    not a multiple of the 256-element block."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 300)    # 19,200 elements: 8-bit, 75 blocks
        self.odd = nn.Linear(300, 17)    # 5,100 elements: 8-bit, 20 blocks (the last partial)
        self.small = nn.Linear(17, 10)   # 170 elements: 32-bit states

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.odd(torch.relu(self.big(x)))))


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_adamw8bit_state_and_peak_match_bitsandbytes(name: str) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    cls = bnb.optim.PagedAdamW8bit if name.startswith("paged") else bnb.optim.AdamW8bit
    torch.manual_seed(0)
    model, x = _Mixed(), torch.randn(4, 64)

    def real_opt(params: Any) -> torch.optim.Optimizer:
        opt = cls(params, lr=1e-3)
        opt._cpu_paged_warned = True  # its CPU fallback's warning
        return opt

    est = estimate(model, (x,), optimizer=name, device="cpu")
    assert est.peak_bytes == measure(model, (x,), optimizer=real_opt)
    work = copy.deepcopy(model)
    opt = real_opt(work.parameters())
    work(x).sum().backward()
    opt.step()
    real_state = _bnb_state_bytes(opt)
    # bitsandbytes' layout, written out: uint8 m and v plus a float32 absmax per 256-element
    # block for the big ones, float32 m and v for the rest, two shared 256-entry qmaps
    blocks = [-(-n // 256) for n in (19_200, 5_100)]
    layout = sum(2 * n for n in (19_200, 5_100)) + sum(2 * 4 * b for b in blocks)
    layout += 2 * 4 * (300 + 17 + 170 + 10) + 2 * 256 * 4
    assert real_state == layout
    # the estimate's optimizer state after the step, at the peak of the optimizer phase
    assert est.phase.name == "optimizer"
    assert est.categories[MemoryCategory.OPTIMIZER_STATE] == layout


def test_paged_adamw8bit_for_cuda_says_which_bytes_are_paged() -> None:
    pytest.importorskip("bitsandbytes")
    model, x = nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 4)), torch.randn(2, 512)
    est = estimate(model, (x,), optimizer="paged_adamw8bit", device="cuda")
    note = next(n for n in est.notes if n.startswith("paged_adamw8bit"))
    assert f"{2 * 512 * 256:,} bytes" in note  # only the 131,072-element weight is paged
    same = estimate(model, (x,), optimizer="adamw8bit", device="cuda")
    assert same.peak_bytes == est.peak_bytes


# -- the spec, the API and the CLI ---------------------------------------------------------------


def test_parse_lora() -> None:
    assert parse_lora("r=16,alpha=32,targets=q_proj,v_proj") == LoraSpec(
        16, ("q_proj", "v_proj"), 32.0, 0.0)
    assert parse_lora("targets=all-linear,r=4,dropout=0.05") == LoraSpec(
        4, ("all-linear",), None, 0.05)
    assert str(parse_lora("r=16,alpha=32,targets=q_proj,v_proj")) == (
        "r=16,alpha=32,targets=q_proj,v_proj")


@pytest.mark.parametrize("text", [
    "r=16", "targets=q_proj", "r=x,targets=q", "r=0,targets=q", "r=8,targets=q,dropout=1.5",
    "r=8,alpa=16,targets=q", "q_proj,r=8,targets=q", "r=8,r=9,targets=q", "r=8,alpha=2,q",
    "r=8,targets=",
])
def test_bad_lora_strings_are_one_usage_line(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_lora(text)
    assert "\n" not in str(info.value)


def test_unmatched_targets_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not found"):
        apply_lora(models.Stack(), "r=4,targets=nothing_here")


def test_gradient_checkpointing_needs_a_transformers_model() -> None:
    with pytest.raises(UsageError, match="--checkpoint MODULES"):
        estimate(models.Stack(), (torch.randn(2, 4, 32),), device="cpu",
                 gradient_checkpointing=True)


def test_lora_on_any_module_and_the_callers_model_untouched() -> None:
    """A plain module (peft's custom-model path); the caller's parameters stay real and
    trainable."""
    torch.manual_seed(0)
    model, x = models.Stack(), torch.randn(2, 8, 32)
    est = estimate(model, (x,), optimizer="adamw", implementation="for-loop", device="cpu",
                   lora=LoraSpec(r=4, targets=("up", "down")))
    adapted = _peft(model, r=4, target_modules=["up", "down"])
    assert est.peak_bytes == measure(adapted, (x,), optimizer=_adamw)
    assert all(p.requires_grad and not p.is_meta for p in model.parameters())
    assert type(model) is models.Stack


def test_lora_on_bitsandbytes_4bit_linears() -> None:
    """QLoRA's second step: peft adapts bitsandbytes' Linear4bit (its own LoRA layer class)."""
    bnb = pytest.importorskip("bitsandbytes")
    model = nn.Sequential(bnb.nn.Linear4bit(64, 64, quant_type="nf4"), nn.ReLU(),
                          bnb.nn.Linear4bit(64, 8, quant_type="nf4"))
    adapted = apply_lora(model, "r=4,targets=0,2")
    layers = [m for m in adapted.modules()
              if type(m).__module__ == "peft.tuners.lora.bnb" and type(m).__name__ == "Linear4bit"]
    assert len(layers) == 2
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_qlora_of_a_meta_model_equals_that_of_a_real_one() -> None:
    """``estimate(meta_model, quantize="nf4", lora=...)`` and a model quantized on the meta
    device: bitsandbytes' ``Params4bit.__deepcopy__`` fails on meta (it sets meta data on a
    CPU tensor), which made both a traceback; each now equals the CPU-quantized model's."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from modelsize.estimation.quantized import quantize_model

    def build(device: str) -> nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            return models.Stack().to(torch.bfloat16)

    x = torch.zeros(2, 8, 32, dtype=torch.bfloat16, device="meta")
    spec = "r=4,alpha=8,targets=up,down"
    kwargs: dict[str, Any] = {"optimizer": "adamw", "device": "cpu", "lora": spec}
    real = estimate(quantize_model(build("cpu"), "nf4"), (x,), **kwargs)
    on_meta = quantize_model(build("meta"), "nf4")
    weights = [(n, type(p), p.is_meta) for n, p in on_meta.named_parameters()]
    assert estimate(on_meta, (x,), **kwargs).peak_bytes == real.peak_bytes
    assert estimate(build("meta"), (x,), quantize="nf4", **kwargs).peak_bytes == real.peak_bytes
    assert [(n, type(p), p.is_meta) for n, p in on_meta.named_parameters()] == weights
    assert any(kind.__name__ == "Params4bit" for _, kind, _ in weights)


def test_cli_lora_and_gradient_checkpointing(capsys: Any, tmp_path: Any) -> None:
    import json

    from modelsize.cli import main

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=176, vocab_size=512,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    args = ["estimate", str(tmp_path / "config.json"), "--device", "cpu", "--batch", "1",
            "--seq", "16", "--json", "--lora", "r=8,alpha=16,targets=q_proj,v_proj"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--gradient-checkpointing", "reentrant", "--optimizer",
                 "adamw8bit"]) == 0
    ckpt = json.loads(capsys.readouterr().out)
    assert any("LoRA r=8,alpha=16" in n for n in plain["notes"])
    assert any("use_reentrant=True" in n for n in ckpt["notes"])
    assert ckpt["peak_bytes"] < plain["peak_bytes"]
    assert main(["estimate", str(tmp_path / "config.json"), "--lora", "r=8"]) == 2
    assert "targets= is required" in capsys.readouterr().err
