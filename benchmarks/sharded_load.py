"""Peak host memory of loading a checkpoint onto 8 simulated CPU devices, side by side:
`peftx.from_pretrained(path)` (one device), `from_pretrained(path, mesh=..., rules=...)`
(each device's slices read into place) and loading whole, then `peftx.sharding.shard`.

Each load runs in a fresh process, after the imports and the mesh; its peak resident
memory during the load (Linux's `VmHWM`, reset just before) less the resident memory
before it is reported against the checkpoint's size. On simulated devices every device's
memory is this host's, so the sharded load holds the whole model too (once); what it
saves is the second copy that loading whole and then splitting makes. On several hosts,
each process reads only its devices' share.

    python benchmarks/sharded_load.py [--hidden 512] [--layers 8]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import peftx
from peftx.sharding import make_mesh, shard
how, path = sys.argv[1], sys.argv[2]
mesh = make_mesh()
jax.block_until_ready(jax.numpy.zeros(()))


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
if how == "one device":
    model = peftx.from_pretrained(path)
elif how == "sharded load":
    model = peftx.from_pretrained(path, mesh=mesh, rules=sys.argv[3])
elif how == "whole, then shard":
    model = shard(peftx.from_pretrained(path), mesh, sys.argv[3])
jax.block_until_ready(jax.tree.leaves(model))
print(status("VmHWM") - before)
"""


def peak(how: str, path: Path, rules: str = "fsdp") -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(path), rules],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp)
        size = (Path(tmp) / "model.safetensors").stat().st_size
        rows = [
            ("one device", "-", peak("one device", Path(tmp))),
            *(
                (how, rules, peak(how, Path(tmp), rules))
                for rules in ("fsdp", "tp")
                for how in ("sharded load", "whole, then shard")
            ),
        ]
    print(
        f"Llama-style checkpoint, hidden {args.hidden}, {args.layers} layers, vocab 8192: "
        f"{size / 2**20:.1f} MiB of float32 safetensors; 8 simulated CPU devices\n"
    )
    print("| load | rules | peak host memory of the load, MiB | x checkpoint |")
    print("| --- | --- | ---: | ---: |")
    for how, rules, rss in rows:
        print(f"| {how} | {rules} | {rss / 2**20:.1f} | {rss / size:.2f} |")


if __name__ == "__main__":
    main()
