"""The traced program matches the program users run: frozen parameters, values read from tensors.

Measured side: :mod:`tests.estimation.groundtruth` (the real CPU peak under the profiler).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

from modelsize.errors import EstimateError
from modelsize.estimation import estimate
from modelsize.report.estimate_text import render_estimate
from tests.estimation.groundtruth import measure


def frozen_backbone() -> nn.Module:
    """A backbone of 2 frozen linears and a trainable head, as in fine-tuning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    for p in model[:4].parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("name, cls", [("adagrad", torch.optim.Adagrad),
                                       ("adam", torch.optim.Adam)])
def test_frozen_parameters_get_no_optimizer_state(name: str, cls: Any) -> None:
    model, x = frozen_backbone(), torch.randn(4, 64)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # the fine-tuning idiom: the optimizer over the trainable parameters only
    est = estimate(model, (x,), optimizer=name)
    real = measure(model, (x,), optimizer=lambda _: cls(trainable, foreach=False))
    assert est.peak_bytes == real
    assert not est.setup.optimize_frozen
    # the other idiom: cls(model.parameters())
    every = estimate(model, (x,), optimizer=name, optimize_frozen=True)
    real_every = measure(model, (x,), optimizer=functools.partial(cls, foreach=False))
    assert every.peak_bytes == real_every
    assert every.setup.optimize_frozen
    if name == "adagrad":  # state made in __init__: a sum and a 0-d fp32 step per parameter
        frozen = sum(p.numel() * 4 + 4 for p in model.parameters() if not p.requires_grad)
        assert every.categories["optimizer_state"] - est.categories["optimizer_state"] == frozen


def test_the_report_says_what_the_optimizer_covers() -> None:
    model, x = frozen_backbone(), torch.randn(4, 64)
    frozen, head = 64 * 256 + 256 + 256 * 256 + 256, 256 * 10 + 10
    text = render_estimate(estimate(model, (x,), optimizer="adagrad"))
    assert (f"adagrad (given) over the {head:,} trainable parameters (the {frozen:,} frozen "
            "ones get no optimizer state)") in text
    text = render_estimate(estimate(model, (x,), optimizer="adagrad", optimize_frozen=True))
    assert f"over all {frozen + head:,} parameters, the {frozen:,} frozen ones included" in text


class Branchy(nn.Module):
    """Reads a value of its input: the wide branch runs only for positive inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(32, 8)
        self.wide = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.max() > 0:  # the line the error names
            return self.wide(x)
        return self.narrow(x)


BRANCH_LINE = "if x.max() > 0:  # the line the error names"


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_value_read_from_the_inputs_takes_the_branch_the_data_takes(mode: str) -> None:
    torch.manual_seed(0)
    model = Branchy()
    positive, negative = torch.rand(16, 32) + 0.1, -torch.rand(16, 32) - 0.1
    adam = functools.partial(torch.optim.AdamW, foreach=False)
    peaks = []
    for x in (positive, negative):
        rng = torch.get_rng_state()
        est = estimate(model, (x,), mode=mode)
        assert torch.equal(torch.get_rng_state(), rng)
        assert est.peak_bytes == measure(model, (x,), mode=mode, optimizer=adam)
        peaks.append(est.peak_bytes)
    assert peaks[0] > peaks[1]


class Masked(nn.Module):
    """Selects rows with a mask made from the input: the output's size depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[keep > 0].sum(0) + torch.nonzero(keep).numel()


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_mask_from_the_inputs_sizes_what_it_selects(mode: str) -> None:
    torch.manual_seed(0)
    model = Masked()
    x = torch.randn(32, 16)
    keep = (torch.arange(32) % 3 == 0).long()
    est = estimate(model, (x, keep), mode=mode)
    adam = functools.partial(torch.optim.AdamW, foreach=False)
    assert est.peak_bytes == measure(model, (x, keep), mode=mode, optimizer=adam)


def test_a_value_of_meta_inputs_is_one_error_naming_the_line() -> None:
    x = torch.empty(16, 32, device="meta")
    with pytest.raises(EstimateError) as info:
        estimate(Branchy(), (x,))
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"test_program\.py:\d+ \(`" + re.escape(BRANCH_LINE) + r"`\)", message)
    assert "pass real input tensors" in message


class ReadsItsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if bool(y.sum() > 0) else -y


def test_a_value_of_the_weights_is_one_error_naming_the_line() -> None:
    with pytest.raises(EstimateError) as info:
        estimate(ReadsItsWeights(), (torch.randn(2, 4),))
    message = str(info.value)
    assert message.startswith("tracing ReadsItsWeights failed: the model reads a tensor's value")
    assert "return y if bool(y.sum() > 0) else -y" in message
    assert "depends on the weights or activations" in message


def tiny_wav2vec2(layerdrop: float) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Wav2Vec2ForCTC from a config (no download): 2 conv, 2 transformer layers, CTC loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        vocab_size=12, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        layerdrop=layerdrop, mask_time_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config)
    labels = torch.randint(1, 12, (2, 10))
    labels[1, 7:] = -100  # padding: the CTC loss selects the real labels with a mask
    return model, {"input_values": torch.randn(2, 2000), "labels": labels}


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_wav2vec2_ctc_reads_its_labels(mode: str) -> None:
    model, inputs = tiny_wav2vec2(layerdrop=0.0)
    est = estimate(model, inputs, mode=mode)
    adam = functools.partial(torch.optim.AdamW, foreach=False)
    assert est.peak_bytes == measure(model, inputs, mode=mode, optimizer=adam)


def test_a_random_branch_is_named_as_such() -> None:
    model, inputs = tiny_wav2vec2(layerdrop=0.1)  # LayerDrop: a random draw skips a layer
    with pytest.raises(EstimateError) as info:
        estimate(model, inputs)
    message = str(info.value)
    assert re.search(r"modeling_wav2vec2\.py:\d+ \(`if not skip_the_layer", message)
    assert "random" in message


class DrawsFromNumpy(nn.Module):
    """Model code that draws from NumPy's and Python's generators (as masking code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        return self.lin(x) * float(np.random.rand() + random.random())


def test_the_callers_random_states_are_left_alone() -> None:
    import random

    import numpy as np

    np.random.seed(0)
    random.seed(0)
    expected = (np.random.rand(), random.random())
    np.random.seed(0)
    random.seed(0)
    estimate(DrawsFromNumpy(), (torch.randn(2, 8),), verify=True)
    assert (np.random.rand(), random.random()) == expected
