"""LoRA adapters the tests make themselves: PEFT on a Hugging Face Llama, random non-zero weights, saved in
PEFT's own format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, path: str | Path, targets: list[str], r: int = 4, alpha: float = 8.0,
                 seed: int = 1, std: float = 0.2, **lora_kwargs):
    """Wrap a copy of ``hf_model`` in a PEFT LoRA with seeded random A and B, save it to ``path`` and return
    the PEFT model (the reference)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model),
                                peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                init_lora_weights=False, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.eval()
    model.save_pretrained(str(path))
    return model


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()
