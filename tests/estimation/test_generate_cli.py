"""``modelsize estimate MODEL --generate N``: the report, JSON, --verify and --fit.

The model is a tiny Llama ``config.json`` written in ``tmp_path``; the measured side runs
the real ``generate()`` of the same config (random weights) under the CPU profiler, and the
``--fit`` answers are checked by tracing the answer and the value above it through the API.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from modelsize.cli import main
from modelsize.estimation import estimate
from modelsize.estimation.generate import generation_inputs
from tests.estimation.generators import BASE, measure

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
          **{k: v for k, v in BASE.items() if k != "max_position_embeddings"},
          "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def cli(capsys: Any, *args: str) -> subprocess.CompletedProcess[str]:
    code = main(["estimate", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["modelsize", "estimate", *args], code, out, err)


def data(capsys: Any, *args: str) -> dict[str, Any]:
    proc = cli(capsys, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _real_model() -> Any:
    import transformers as tf

    torch.manual_seed(0)
    raw = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    return tf.LlamaForCausalLM(tf.LlamaConfig(**raw)).eval()


def _meta_model() -> Any:
    import transformers as tf

    raw = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        return tf.LlamaForCausalLM(tf.LlamaConfig(**raw))


def test_generate_json_equals_the_real_generate(config: Path, capsys: Any) -> None:
    got = data(capsys, str(config), "--generate", "6", "--batch", "2", "--seq", "20",
               "--device", "cpu")
    model = _real_model()
    inputs = generation_inputs(model, 2, 20)
    assert got["peak_bytes"] == measure(model, inputs, 6)
    assert got["setup"]["mode"] == "generate"
    assert got["generation"]["new_tokens"] == 6 and got["generation"]["prompt_tokens"] == 20
    assert got["categories"]["kv_cache"] > 0
    assert got["generation"]["groups"][0]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_generate_options_reach_generate(config: Path, capsys: Any) -> None:
    got = data(capsys, str(config), "--generate", "4", "--batch", "2", "--seq", "12",
               "--device", "cpu", "--cache", "static", "--beams", "2", "--prefill-chunk", "5",
               "--left-pad", "3")
    model = _real_model()
    inputs = generation_inputs(model, 2, 12, left_pad=3)
    assert inputs["attention_mask"][1, :3].sum() == 0 and inputs["attention_mask"][0].all()
    options = {"cache_implementation": "static", "num_beams": 2, "prefill_chunk_size": 5}
    assert got["peak_bytes"] == measure(model, inputs, 4, **options)
    assert got["generation"]["cache_class"] == "StaticCache"
    assert got["generation"]["rows"] == 4 and got["generation"]["prefill_chunks"] == 3
    fp8 = data(capsys, str(config), "--generate", "4", "--batch", "2", "--seq", "12",
               "--device", "cpu", "--kv-dtype", "fp8")
    assert fp8["generation"]["cache_class"] == "QuantizedCache"
    assert fp8["generation"]["groups"][0]["bytes_per_token"] == 2 * 2 * 2 * 16  # 1 byte each


def test_generate_text_report_and_verify(config: Path, capsys: Any, tmp_path: Path) -> None:
    page = tmp_path / "gen.html"
    proc = cli(capsys, str(config), "--generate", "5", "--batch", "2", "--seq", "16",
               "--device", "cpu", "--verify", "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "generate() of 5 new tokens (greedy; DynamicCache)" in out
    assert "kv_cache" in out and "full attention" in out and "in the prefill" in out
    assert "verified on CPU: measured" in out and "difference 0 bytes" in out
    assert "gradients" not in out and "optimizer_state" not in out
    assert "kv_cache" in page.read_text() and "Cache (DynamicCache, 2 rows" in page.read_text()


@pytest.mark.parametrize("dimension", ["context", "batch"])
def test_fit_answer_fits_and_the_next_does_not(config: Path, capsys: Any,
                                               dimension: str) -> None:
    budget = 3 * 2**20
    got = data(capsys, str(config), "--generate", "8", "--batch", "2", "--seq", "16",
               "--device", "cpu", "--fit", str(budget), "--fit-dim", dimension)
    fit, plan = got["fit"]["fit"], got["fit"]["plan"]
    best = fit["best"]
    assert best > 0 and len(fit["probes"]) <= 8
    model = _meta_model()

    def peak(batch: int, prompt: int) -> int:
        inputs = generation_inputs(model, batch, prompt)
        return estimate(model, inputs, mode="generate", new_tokens=8).peak_bytes

    if dimension == "context":
        assert plan["context_tokens"] == best and plan["prompt_tokens"] == best - 8
        here, above = peak(2, best - 8), peak(2, best - 7)
    else:
        assert plan["batch"] == best and plan["prompt_tokens"] == 16
        here, above = peak(best, 16), peak(best + 1, 16)
    assert here == plan["peak_bytes"] <= budget < above
    assert got["fit"]["above"]["bytes"] == above


def test_fit_text(config: Path, capsys: Any) -> None:
    proc = cli(capsys, str(config), "--generate", "8", "--batch", "1", "--seq", "16",
               "--device", "cpu", "--fit", "2MiB", "--fit-dim", "context")
    assert proc.returncode == 0, proc.stderr
    assert "largest context that fits 2 MiB" in proc.stdout
    assert "plan at the answer:" in proc.stdout and "prompt +" in proc.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["--optimizer", "sgd"], "--optimizer"),
    (["--fit", "1GiB", "--fit-dim", "seq"], "--fit-dim context"),
    (["--left-pad", "16"], "--left-pad"),
    (["--cache", "static", "--kv-dtype", "fp8"], "--kv-dtype fp8 needs the quantized cache"),
    (["--cache", "offloaded", "--device", "cpu"], "device='cuda'"),
])
def test_usage_errors_are_one_line(config: Path, capsys: Any, args: list[str],
                                   words: str) -> None:
    proc = cli(capsys, str(config), "--generate", "4", "--batch", "1", "--seq", "16", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr
