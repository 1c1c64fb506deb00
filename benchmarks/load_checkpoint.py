"""Loading a ~100M-parameter Llama-style checkpoint: time and peak memory.

Builds a checkpoint locally (random weights written with `safetensors` under
transformers' names, a transformers `LlamaConfig`), stored in float32 and in bfloat16,
then loads it in a fresh subprocess per case:

- `peftx.from_pretrained(dir, dtype=..., layout=...)`, into float32 and bfloat16, stacked
  and unrolled, from the float32 and the bfloat16 file (casting on the way where they
  differ), from a sharded copy (transformers' writer, 100MB shards) and from a
  `pytorch_model.bin` (`torch.load(weights_only=True)`, which reads the whole pickle
  first; the state dict lets go of each tensor once it is copied);
- as a reference, transformers' own `AutoModelForCausalLM.from_pretrained(dir, dtype=...)`
  in torch, on the same files.

Each child imports its libraries, runs one tiny op so the backend is up, resets the
kernel's peak-RSS counter (`/proc/self/clear_refs`; where that is refused, the peak so
far is the baseline instead), loads, waits for every array, and reports the load time
and `VmHWM` (peak RSS) above that baseline. "model" is the loaded parameters' bytes in
the target dtype; "peak/model" is the figure to keep near 1: 1.0 means the load never
held more than the model itself. "read MB" is the resident memory above the baseline
after every parameter has then been read once: transformers keeps parameters whose
dtype matches the file as views of the memory-mapped file, which count as resident only
once touched, so its "peak" undercounts what using the model costs. The page cache is
warm (the files were just written), so the times measure the loader, not the disk.

Run: `python benchmarks/load_checkpoint.py [--dir DIR] [--repeat 1]`. About a minute on
2 busy CPU cores. The checkpoint is written to a temporary directory unless `--dir`
names one (reused if it is already there).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def build(root: Path) -> None:
    """`root/fp32` and `root/bf16`: config.json and model.safetensors; `root/fp32-sharded`:
    the float32 weights in 100MB shards."""
    import ml_dtypes
    import numpy as np
    import transformers
    from safetensors.numpy import save_file

    if (root / "fp32-sharded" / "model.safetensors.index.json").is_file():
        return
    config = transformers.LlamaConfig(**CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    c = config
    hd = c.hidden_size // c.num_attention_heads
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (c.num_attention_heads * hd, c.hidden_size),
                p + "self_attn.k_proj.weight": (c.num_key_value_heads * hd, c.hidden_size),
                p + "self_attn.v_proj.weight": (c.num_key_value_heads * hd, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, c.num_attention_heads * hd),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                p + "input_layernorm.weight": (c.hidden_size,),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
            }
        )
    rng = np.random.default_rng(0)
    fp32 = {
        k: (
            np.ones(s, np.float32)
            if len(s) == 1
            else (0.02 * rng.standard_normal(s, dtype=np.float32))
        )
        for k, s in shapes.items()
    }
    for name, tensors in [
        ("fp32", fp32),
        ("bf16", {k: v.astype(ml_dtypes.bfloat16) for k, v in fp32.items()}),
    ]:
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        config.dtype = "float32" if name == "fp32" else "bfloat16"
        config.save_pretrained(d)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    # a torch pickle of the same float32 weights, as older transformers wrote it
    import torch

    (root / "fp32-bin").mkdir(exist_ok=True)
    config.dtype = "float32"
    config.save_pretrained(root / "fp32-bin")
    torch.save(
        {k: torch.from_numpy(v) for k, v in fp32.items()}, root / "fp32-bin" / "pytorch_model.bin"
    )
    del fp32
    # the sharded copy: transformers' own writer, from the fp32 directory
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "fp32")
    model.save_pretrained(root / "fp32-sharded", max_shard_size="100MB")


def _child(case: dict) -> dict:
    """One measurement, in this (fresh) process."""

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    if case["loader"] == "peftx":
        import jax
        import jax.numpy as jnp

        import peftx

        if case["dir"].endswith("-bin"):
            import torch  # noqa: F401 - its ~200MB of libraries are no part of the load

        jnp.zeros(4).block_until_ready()
    else:
        import torch
        import transformers

        torch.zeros(4) + 1
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        reset = True
    except OSError:
        reset = False
    base = status("VmHWM")
    start = time.perf_counter()
    if case["loader"] == "peftx":
        model = peftx.from_pretrained(case["dir"], dtype=case["dtype"], layout=case["layout"])
        arrays = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
        jax.block_until_ready(arrays)
        nbytes = sum(x.nbytes for x in arrays)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            case["dir"], dtype=getattr(torch, case["dtype"])
        )
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.perf_counter() - start
    peak = status("VmHWM") - base
    # read every parameter once: memory-mapped parameters become resident only now
    if case["loader"] == "peftx":
        jax.block_until_ready([jnp.sum(x) for x in arrays])
    else:
        with torch.no_grad():
            [p.sum() for p in model.parameters()]
    touched = status("VmRSS") - base
    return {"seconds": seconds, "peak": peak, "model": nbytes, "touched": touched, "reset": reset}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (best time)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return

    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="peftx-load-")
        args.dir = Path(tmp.name)
    root = args.dir
    print(f"building the checkpoint in {root} ...", flush=True)
    build(root)
    cases = [
        ("peftx", "fp32", "float32", "stacked"),
        ("peftx", "fp32", "float32", "unrolled"),
        ("peftx", "fp32", "bfloat16", "stacked"),
        ("peftx", "bf16", "bfloat16", "stacked"),
        ("peftx", "bf16", "float32", "stacked"),
        ("peftx", "fp32-sharded", "float32", "stacked"),
        ("peftx", "fp32-bin", "float32", "stacked"),
        ("transformers", "fp32", "float32", "-"),
        ("transformers", "fp32", "bfloat16", "-"),
        ("transformers", "bf16", "bfloat16", "-"),
    ]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    header = (
        f"{'loader':<13}{'file':<14}{'target':<10}{'layout':<10}"
        f"{'time s':>8}{'peak MB':>10}{'model MB':>10}{'peak/model':>12}{'read MB':>10}"
    )
    print(header)
    print("-" * len(header))
    for loader, stored, dtype, layout in cases:
        case = dict(loader=loader, dir=str(root / stored), dtype=dtype, layout=layout)
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(case)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if out.returncode != 0:
                raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = min(r["seconds"] for r in runs)
        peak = max(r["peak"] for r in runs)
        model = runs[0]["model"]
        touched = max(r["touched"] for r in runs)
        flag = "" if all(r["reset"] for r in runs) else "  (peak since import)"
        print(
            f"{loader:<13}{stored:<14}{dtype:<10}{layout:<10}{best:>8.2f}"
            f"{peak / 1e6:>10.0f}{model / 1e6:>10.0f}{peak / model:>12.2f}"
            f"{touched / 1e6:>10.0f}{flag}",
            flush=True,
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
