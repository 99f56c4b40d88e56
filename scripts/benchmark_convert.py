"""Wall time and peak memory of HF -> MindSpore conversion: ours (tensor by tensor) vs load-everything.

    python scripts/benchmark_convert.py [--hidden 1024 --layers 12 --vocab 32000 --dtype bfloat16]

Creates a random Llama checkpoint with transformers (sharded safetensors in a temporary
directory), then runs, each in its own process:
  - ours:        scripts/convert_checkpoint.py --from-hf (one tensor in memory at a time)
  - MindFormers: mindformers.models.llama.convert_weight.convert_pt_to_ms, which loads the whole
                 model with transformers' from_pretrained, builds every MindSpore tensor, then calls
                 mindspore.save_checkpoint on the full list
  - ours:        scripts/convert_checkpoint.py --to-hf of our output (the way back)
Peak RSS is each process's own (os.wait4 rusage ru_maxrss), imports included.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERTER = os.path.join(REPO_ROOT, "scripts", "convert_checkpoint.py")

MAKE_MODEL = """
import sys, torch, transformers
hidden, layers, vocab, ffn, heads, kv, dtype, shard, out = sys.argv[1:]
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=int(hidden), num_hidden_layers=int(layers), vocab_size=int(vocab),
                                  intermediate_size=int(ffn), num_attention_heads=int(heads),
                                  num_key_value_heads=int(kv), max_position_embeddings=2048)
model = transformers.AutoModelForCausalLM.from_config(config)
model.to(getattr(torch, dtype)).save_pretrained(out, max_shard_size=shard)
"""

MINDFORMERS_CONVERT = """
import sys
import mindspore as ms
from mindformers.models.llama.convert_weight import convert_pt_to_ms
convert_pt_to_ms(sys.argv[1], sys.argv[2], dtype=ms.float32)
"""


def run_measured(command: list, env: dict) -> tuple:
    """(wall seconds, peak RSS in MB) of one child process; raises if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"benchmark step failed ({process.returncode}): {' '.join(command)}\n"
                         f"{process.stderr.read().decode(errors='replace')[-3000:]}")
    return wall, usage.ru_maxrss / 1024  # Linux reports kB


def size_mb(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--shard-size", default="100MB", help="save_pretrained max_shard_size")
    parser.add_argument("--workdir", help="keep files here instead of a temporary directory")
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="benchmark-convert-")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, LOCAL_DEFAULT_PATH=os.path.join(work, "mindformers-log"))
    hf_dir = os.path.join(work, "hf")
    try:
        print(f"[benchmark] creating a random Llama ({args.hidden} hidden, {args.layers} layers, vocab {args.vocab}, "
              f"{args.dtype}) in {hf_dir}", flush=True)
        subprocess.run([sys.executable, "-c", MAKE_MODEL, str(args.hidden), str(args.layers), str(args.vocab),
                        str(args.intermediate), str(args.heads), str(args.kv_heads), args.dtype, args.shard_size,
                        hf_dir], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shards = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
        print(f"[benchmark] source: {size_mb(hf_dir):,.0f} MB in {len(shards)} safetensors shards", flush=True)

        ours, back, theirs = (os.path.join(work, n) for n in ("ours", "back", "mindformers"))
        os.makedirs(theirs)
        rows = [
            ("ours --from-hf (tensor by tensor)",
             [sys.executable, CONVERTER, "--from-hf", hf_dir, "--output", ours, "--quiet"], ours),
            ("MindFormers convert_pt_to_ms (load everything)",
             [sys.executable, "-c", MINDFORMERS_CONVERT, hf_dir, os.path.join(theirs, "llama.ckpt")], theirs),
            ("ours --to-hf (the way back)",
             [sys.executable, CONVERTER, "--to-hf", ours, "--output", back, "--quiet"], back),
        ]
        results = []
        for name, command, output in rows:
            print(f"[benchmark] running: {name}", flush=True)
            wall, rss = run_measured(command, env)
            results.append((name, wall, rss, size_mb(output)))
        width = max(len(r[0]) for r in results)
        print(f"\n{'approach':<{width}}  {'wall s':>7}  {'peak RSS MB':>11}  {'output MB':>9}")
        for name, wall, rss, out in results:
            print(f"{name:<{width}}  {wall:7.1f}  {rss:11,.0f}  {out:9,.0f}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
