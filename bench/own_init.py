"""The default policy ("own") on public models and at scale.

1. The zoo (tests/zoo.py: torchvision, timm and transformers models in small configs, and the held-out ones): each
   model built natively three times and once under meta_parameters(); its default plan materialized in process and
   every tensor compared with the native ones (fixed elements exactly, the rest by distribution). A model is ok (every
   tensor its own initialization), refused (the plan names why) or different (a defect: never silently).
2. Scale: a Llama-3-405B-sized transformers model built on meta (config only), its own-init plan made two ways: the
   constructor recorded under meta_parameters(), and replayed after the fact from torch.device("meta"). Seconds and
   the process's peak resident memory (each way in a fresh process: imports included). Target: under 10 s and 1 GiB.

    python bench/own_init.py [--zoo-only | --scale-only] [name prefixes...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import host_line

SCALE = """
import json, sys, time
t0 = time.perf_counter()
def peak_mib():  # this process's own high-water mark (ru_maxrss would carry the parent's across fork)
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024
import torch, transformers
from paraminit_client.torch import meta_parameters, plan_from_module
cfg = transformers.LlamaConfig(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
    intermediate_size=53248, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)
t1 = time.perf_counter()
if sys.argv[1] == "recorded":
    with meta_parameters():
        model = transformers.LlamaForCausalLM(cfg)
else:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
t2 = time.perf_counter()
plan = plan_from_module(model, seed=0)
t3 = time.perf_counter()
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "tensors": len(plan.params), "imports": t1 - t0,
    "build": t2 - t1, "plan": t3 - t2, "peak_mib": peak_mib()}))
"""


def zoo_table(prefixes: list[str]) -> int:
    import zoo

    models = [(n, b) for n, b in zoo.ZOO + zoo.HELD_OUT if not prefixes or any(n.startswith(p) for p in prefixes)]
    held = {n for n, _ in zoo.HELD_OUT}
    counts = {"ok": 0, "refused": 0, "different": 0, "error": 0}
    tensors = 0
    print(f"{'model':36s} {'outcome':10s} {'tensors':>7s} {'s':>6s}")
    for name, build in models:
        t = time.perf_counter()
        v = zoo.check(name, build)
        outcome = "ok" if v.ok else "refused" if v.refused else "error" if v.error else "different"
        counts[outcome] += 1
        tensors += v.tensors
        print(
            f"{name + (' (held out)' if name in held else ''):36s} {outcome:10s} {v.tensors:7d} {time.perf_counter() - t:6.1f}", flush=True
        )
        for line in (v.refused or v.error or "\n".join(v.differ[:5]) or "").splitlines()[:6]:
            if line:
                print(f"    {line[:200]}")
    share = counts["ok"] / max(1, len(models))
    print(
        f"\n{counts['ok']}/{len(models)} models ok ({share:.0%}, target >= 95%), {counts['refused']} refused, "
        f"{counts['different']} different (target 0), {counts['error']} errors; {tensors} tensors"
    )
    return 0 if share >= 0.95 and counts["different"] == 0 and counts["error"] == 0 else 1


def scale_table() -> int:
    ok = True
    print(f"{'Llama-3-405B on meta':28s} {'params':>8s} {'tensors':>7s} {'build s':>8s} {'plan s':>7s} {'peak MiB':>9s}")
    for way in ("recorded", "replayed"):
        out = subprocess.run([sys.executable, "-c", SCALE, way], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        ok &= r["build"] + r["plan"] < 10 and r["peak_mib"] < 1024
        print(f"{way:28s} {r['params'] / 1e9:7.1f}B {r['tensors']:7d} {r['build']:8.2f} {r['plan']:7.2f} {r['peak_mib']:9.0f}")
    print("target: build + plan under 10 s, peak under 1 GiB (the process's whole peak, PyTorch and transformers included)")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="*", help="only the zoo models whose names start so")
    parser.add_argument("--zoo-only", action="store_true")
    parser.add_argument("--scale-only", action="store_true")
    args = parser.parse_args()
    print(host_line())
    code = 0
    if not args.scale_only:
        code |= zoo_table(args.prefixes)
        print()
    if not args.zoo_only:
        code |= scale_table()
    return code


if __name__ == "__main__":
    sys.exit(main())
