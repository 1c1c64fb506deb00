"""Saving and loading a LoRA adapter in HF PEFT's format on a ~110M-parameter Llama.

For each adapter (r=8 on q/v; r=16 on all seven projections) and each peftx layout
(stacked for `scan`, unrolled), measured side by side in one run, medians over repeats:

- `peft_model.save_pretrained(dir)`: gathers the factors from device, splits stacks into
  one key per layer, writes `adapter_config.json` and `adapter_model.safetensors` under
  temporary names and renames them;
- `PeftModel.from_pretrained(model, dir)`: reads and checks the config and every key and
  shape, places the adapter, and waits for the arrays;
- PyTorch PEFT on the same machine, same adapter file: `save_pretrained` and
  `PeftModel.from_pretrained` onto a transformers model of the same config (when torch is
  installed). Its load includes wrapping the target modules, as ours includes placing.

The base model is random (built in memory, no checkpoint on disk), the page cache warm.

Run: `python benchmarks/adapter_io.py [--repeat 5]`.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import peftx
import peftx.models as pm

CONFIG = dict(
    vocab_size=16384,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
ADAPTERS = {
    "r=8, q/v": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "r=16, all-linear": dict(r=16, lora_alpha=32, target_modules="all-linear"),
}


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    config = pm.LlamaConfig.from_hf_config({"model_type": "llama", **CONFIG})
    try:
        import peft
        import transformers

        torch_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    except ImportError:
        torch_model = None

    rows = []
    for layout in ("stacked", "unrolled"):
        model = pm.LlamaForCausalLM(config, key=jax.random.key(0), layout=layout)
        for label, kwargs in ADAPTERS.items():
            lora = peftx.LoraConfig(init_lora_weights=False, **kwargs)
            adapted = peftx.get_peft_model(model, lora, key=jax.random.key(1))
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "adapter"
                save = median_time(lambda: adapted.save_pretrained(out), args.repeat)
                size = (out / "adapter_model.safetensors").stat().st_size

                def load():
                    jax.block_until_ready(peftx.PeftModel.from_pretrained(model, out))

                peftx_load = median_time(load, args.repeat)
                torch_save = torch_load = float("nan")
                if torch_model is not None and layout == "stacked":
                    loads = []
                    for _ in range(args.repeat):
                        fresh = fresh_copy(torch_model)  # PEFT wraps modules in place
                        start = time.perf_counter()
                        theirs = peft.PeftModel.from_pretrained(fresh, out)
                        loads.append(time.perf_counter() - start)
                    torch_load = statistics.median(loads)
                    torch_save = median_time(
                        lambda: theirs.save_pretrained(Path(tmp) / "torch"), args.repeat
                    )
            rows.append((layout, label, size, save, peftx_load, torch_save, torch_load))

    print(f"\n{jax.devices()[0].device_kind}, {args.repeat} repeats, medians")
    print("| layout | adapter | file MB | save ms | load ms | PEFT save ms | PEFT load ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for layout, label, size, save, load, tsave, tload in rows:
        torch_cells = f"{1e3 * tsave:.0f} | {1e3 * tload:.0f}" if not np.isnan(tsave) else "- | -"
        print(
            f"| {layout} | {label} | {size / 1e6:.1f} | {1e3 * save:.0f} | "
            f"{1e3 * load:.0f} | {torch_cells} |"
        )


def fresh_copy(torch_model):
    """A new transformers model holding `torch_model`'s weights."""
    import transformers

    fresh = transformers.LlamaForCausalLM(torch_model.config)
    fresh.load_state_dict(torch_model.state_dict(), assign=True)
    return fresh.eval()


if __name__ == "__main__":
    main()
