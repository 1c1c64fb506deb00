"""Load the adapter `peftx finetune` wrote into PyTorch PEFT and check it predicts what
peftx predicts (the second half of `make demo`).

    python examples/peft_check.py runs/lora_minilm_intents configs/lora_minilm_intents.toml

Both sides read the same files: the base checkpoint the job names, and `RUN/adapter` in
HF PEFT's format. The held-out texts go through transformers + PEFT in PyTorch and through
peftx in JAX; the script prints both accuracies and exits non-zero if a prediction or a
logit differs beyond float32 rounding.
"""

import json
import pathlib
import sys
import tomllib
import warnings

import jax
import numpy as np
from transformers import AutoTokenizer

import peftx
from peftx.cli import model_dir


def main(run: str, job: str) -> int:
    run_dir, job_file = pathlib.Path(run), pathlib.Path(job)
    try:
        import torch
        from peft import PeftModel as TorchPeftModel
        from transformers import AutoModelForSequenceClassification
    except ImportError:
        print("torch/peft not installed: `pip install torch==2.13.0 peft` to run the check")
        return 0
    config = tomllib.loads(job_file.read_text())
    base_dir = model_dir(config["model"].get("path"))
    labels = json.loads((run_dir / "labels.json").read_text())
    rows = [
        json.loads(x)
        for x in (job_file.parent / config["data"]["eval"]).read_text().split("\n")
        if x
    ]
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "adapter")
    enc = tokenizer([r["text"] for r in rows], padding=True, return_tensors="np")
    truth = np.array([labels.index(r["label"]) for r in rows])

    torch_base = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=len(labels)
    )
    torch_model = TorchPeftModel.from_pretrained(torch_base, run_dir / "adapter").eval()
    with torch.no_grad():
        ids, mask = torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])
        torch_logits = torch_model(input_ids=ids, attention_mask=mask).logits.numpy()

    with warnings.catch_warnings():  # the classifier is fresh here: the adapter holds it
        warnings.simplefilter("ignore")
        base = peftx.models.from_pretrained(
            base_dir, model_class="BertForSequenceClassification", num_labels=len(labels)
        )
    model = peftx.PeftModel.from_pretrained(base, run_dir / "adapter")
    jax_logits = np.asarray(
        jax.jit(lambda m, i, a: m(i, a).logits)(model, enc["input_ids"], enc["attention_mask"])
    )

    agree = np.mean(torch_logits.argmax(-1) == jax_logits.argmax(-1))
    gap = float(np.max(np.abs(torch_logits - jax_logits)))
    tol = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(torch_logits)))
    print(
        f"PyTorch PEFT accuracy {np.mean(torch_logits.argmax(-1) == truth):.2%}, "
        f"peftx accuracy {np.mean(jax_logits.argmax(-1) == truth):.2%}"
    )
    print(f"same prediction on {agree:.1%} of {len(rows)} texts; max logit difference {gap:.1e}")
    ok = agree == 1.0 and gap <= tol
    print("OK: PyTorch PEFT reads the adapter as peftx does" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
