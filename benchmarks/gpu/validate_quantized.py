"""GPU check of ``estimate(..., device="cuda", quantize=...)`` against
``torch.cuda.max_memory_allocated()`` for quantized layers on their CUDA kernels.

Run on a lent H100 on 2026-11-27 (results in benchmarks/RESULTS.md, "Quantized layers on
CUDA"; this machine's bitsandbytes and torchao carried as wheels). It found the one-token nf4
row 3.3% over (bitsandbytes' CUDA ``gemm_4bit`` takes its fused kernel there, the trace had
run the dequantizing default kernel; now followed, ``quant_kernels._gemm_4bit_cuda``). Run
it where a GPU is (no network: the model is built from a config, random weights):

    PYTHONPATH=src python benchmarks/gpu/validate_quantized.py           # about 3 minutes
    PYTHONPATH=src python benchmarks/gpu/validate_quantized.py --dry-run # estimates only

Each row: a small Llama (bfloat16) quantized by ``modelsize.estimation.quantized.
quantize_model`` (nf4: bitsandbytes ``Linear4bit``; int8, fp8: torchao weight-only), then
either one forward under ``no_grad`` or, for nf4, two training steps: ``train`` (only the
norms train, AdamW) or ``qlora`` (peft LoRA adapters on ``q_proj``/``v_proj``, AdamW or
bitsandbytes' ``AdamW8bit``). The real run is a fresh process (``--measure``): the model
quantized on CPU and moved to the GPU, the allocator emptied and its peak reset, then the
program; its ``max_memory_allocated`` is compared with the estimate's ``allocated_bytes``
(the trace replayed through the caching allocator's rules), made on a meta-device copy in
this process.
Prints a table and writes ``validate_quantized.json`` to ``$OUT`` (default ``./gpu_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

LORA = "r=16,alpha=32,targets=q_proj,v_proj"

CASES = [  # (scheme, mode, batch, seq, optimizer): "qlora" trains peft LoRA adapters (LORA)
    ("nf4", "infer", 4, 256, "adamw"),
    ("nf4", "infer", 1, 1, "adamw"),  # one token: bitsandbytes' gemv_4bit path
    ("nf4", "train", 4, 256, "adamw"),
    ("nf4", "qlora", 4, 256, "adamw"),
    ("nf4", "qlora", 4, 256, "adamw8bit"),  # bitsandbytes' 8-bit AdamW on its CUDA kernels
    ("int8", "infer", 4, 256, "adamw"),
    ("fp8", "infer", 4, 256, "adamw"),
]


def build(device: str) -> nn.Module:
    """The model: a 4-layer Llama, hidden 512, bfloat16, random weights (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def prepare(model: nn.Module, mode: str) -> nn.Module:
    """``train``: only the norms train (the quantized weights never do); ``qlora``: the
    model as is (the estimate adds the adapters itself, the real run with the same call)."""
    if mode == "qlora":
        return model
    for name, p in model.named_parameters():
        p.requires_grad_(mode == "train" and "norm" in name)
    return model


def optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The real optimizer of a case, as modelsize builds it."""
    if name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params)
    return torch.optim.AdamW(params)


def measure(scheme: str, mode: str, batch: int, seq: int, opt_name: str) -> dict[str, Any]:
    """The real run on the GPU (called in a fresh process)."""
    from modelsize.estimation.lora import apply_lora
    from modelsize.estimation.quantized import quantize_model
    from modelsize.estimation.trace import default_loss

    model = prepare(quantize_model(build("cpu"), scheme), mode)
    if mode == "qlora":
        model = apply_lora(model, LORA)
    model = model.to("cuda")
    ids = torch.randint(0, 4096, (batch, seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if mode == "infer":
        model.eval()
        with torch.no_grad():
            out = model(ids)
        del out
    else:
        model.train()
        opt = optimizer(opt_name, [p for p in model.parameters() if p.requires_grad])
        for _ in range(2):
            default_loss(model(ids)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"before": before, "max_memory_allocated": torch.cuda.max_memory_allocated()}


def estimated(scheme: str, mode: str, batch: int, seq: int, opt_name: str) -> dict[str, Any]:
    """The estimate on a meta copy of the same model."""
    from modelsize.estimation import estimate
    from modelsize.estimation.quantized import quantize_model

    model = prepare(quantize_model(build("meta"), scheme), mode)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    est = estimate(model, (ids,), mode="train" if mode == "qlora" else mode, device="cuda",
                   optimizer=opt_name, lora=LORA if mode == "qlora" else None)
    return {"peak_bytes": est.peak_bytes,
            "allocated_bytes": est.device_estimate.allocated_bytes,
            "quantization": est.setup.quantization, "notes": list(est.notes)}


def main() -> int:
    """Run every case; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs=5,
                        metavar=("SCHEME", "MODE", "BATCH", "SEQ", "OPTIMIZER"))
    parser.add_argument("--dry-run", action="store_true", help="estimates only (no GPU)")
    args = parser.parse_args()
    if args.measure:
        s, m, b, q, o = args.measure
        print(json.dumps(measure(s, m, int(b), int(q), o)))
        return 0
    rows = []
    for scheme, mode, batch, seq, opt_name in CASES:
        row: dict[str, Any] = {"scheme": scheme, "mode": mode, "batch": batch, "seq": seq,
                               "optimizer": opt_name,
                               **estimated(scheme, mode, batch, seq, opt_name)}
        if not args.dry_run:
            proc = subprocess.run([sys.executable, __file__, "--measure", scheme, mode,
                                   str(batch), str(seq), opt_name], capture_output=True,
                                  text=True, check=False, timeout=90)
            if proc.returncode:
                row["error"] = proc.stderr.strip().splitlines()[-1:]
            else:
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                real = row["max_memory_allocated"]
                row["gap_pct"] = round(100 * (row["allocated_bytes"] - real) / real, 3)
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("scheme", "mode", "batch", "seq", "optimizer",
                                                   "allocated_bytes", "max_memory_allocated",
                                                   "gap_pct", "error")}), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"{device}, torch {torch.__version__}")
    print(f"{'case':<34}{'estimate':>16}{'max_memory_allocated':>22}{'gap':>9}")
    for r in rows:
        case = f"{r['scheme']} {r['mode']} {r['batch']}x{r['seq']}"
        if r["mode"] != "infer":
            case += f" {r['optimizer']}"
        real = r.get("max_memory_allocated")
        gap = f"{r['gap_pct']:+.2f}%" if "gap_pct" in r else r.get("error", "-")
        print(f"{case:<34}{r['allocated_bytes']:>16,}{real or 0:>22,}  {gap}")
    out = Path(os.environ.get("OUT", "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate_quantized.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
