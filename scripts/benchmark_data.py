"""Data preparation throughput and memory, side by side on the same corpus and tokenizer.

    python scripts/benchmark_data.py [--sizes 10 100] [--seq-length 2048] [--vocab-size 8192] [--workdir DIR]
                                     [--hf-tokenizer TOKENIZER_JSON_OR_HF_DIR]

Builds JSONL corpora of the given sizes (MB) from the Python standard library's source
(documents assembled from its paragraphs in seeded random order, so they are distinct and
deduplication keeps them), trains one sentencepiece BPE model on the smallest, then runs,
each in a fresh process:

  ours       data.prepare.prepare_dataset: input files -> cleaned, deduplicated, tokenized
             (worker processes), packed, MindRecord shards + manifest
  baseline   MindFormers' preprocessing pattern (tools/dataset_preprocess/llama/llama_preprocess.py):
             read the whole file, tokenize paragraph by paragraph through MindFormers'
             LlamaTokenizer wrapper, collect every id in one list, write one record at a time
  ceiling    sentencepiece batch encoding alone, all cores, documents already in memory
  ours_hf    as ours, with an HF tokenizer.json (default: transformers' fast conversion of the
             trained model, so the tokens are the same; --hf-tokenizer: e.g. a Llama 3 directory)
  ceiling_hf the `tokenizers` library's batch encoding alone (its own threads, all cores)

With --executors (and --tasks), it measures data/cluster/scale.py instead: the same corpus prepared by
N tasks on each executor (local: datatrove's per-task runner in data/cluster/tasks.py's watched processes, one
per task at once up to the cores; ray: a local Ray with all cores), against today's single-process run
(local, 1 task), with each stage's wall time, each task's CPU seconds and peak memory (from
OUTPUT.logs/<stage>/costs/), and a projection of 1 TB on 16 nodes x 64 cores from the measured
per-core rates:

    python scripts/benchmark_data.py --executors local ray --tasks 1 2 4 --sizes 20

Tokens are the documents' tokens (EOD separators not counted). Peak memory is the largest
resident memory of the process plus its children's private memory, sampled every 20 ms.
"ours" and "ceiling" run --repeat times, interleaved, and the fastest run of each is
reported, so that other work on a shared machine does not decide their ratio. CPU seconds
are user + system over the process tree, start-up and imports included: unlike wall time
they do not depend on other work sharing the machine (the load average is printed for
that reason).
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time


METHODS = ("ours", "baseline", "ceiling", "ours_hf", "ceiling_hf")
CEILING = {"ours": "ceiling", "baseline": "ceiling", "ceiling": "ceiling", "ours_hf": "ceiling_hf",
           "ceiling_hf": "ceiling_hf"}


def build_corpus(path: str, megabytes: int, seed: int = 0) -> None:
    """Distinct documents of 1-16 KB, each a seeded random run of stdlib paragraphs, as JSONL."""
    from ascend_llm_recipes.data.text.corpus import python_stdlib_files

    paragraphs = [p for f in python_stdlib_files() for p in f.read_text(encoding="utf-8").split("\n\n")
                  if len(p.strip()) > 40]
    rng = random.Random(seed)
    target, written = megabytes << 20, 0
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        while written < target:
            size, parts = rng.randint(1 << 10, 16 << 10), []
            while sum(map(len, parts)) < size:
                parts.append(rng.choice(paragraphs))
            line = json.dumps({"text": "\n\n".join(parts)}) + "\n"
            f.write(line)
            written += len(line.encode())
    os.replace(path + ".tmp", path)


def run_ours(corpus: str, tokenizer: str, out: str, seq_length: int) -> int:
    from ascend_llm_recipes.data.prepare import prepare_dataset

    manifest = prepare_dataset(out, seq_length, inputs=[corpus], tokenizer=tokenizer, show_progress=False,
                               samples_per_shard=max(256, (4 << 20) // (4 * (seq_length + 1))))
    return manifest["tokens"] - manifest["documents"]["train"]


def run_baseline(corpus: str, tokenizer: str, out: str, seq_length: int) -> int:
    """MindFormers' llama_preprocess.py pattern (its tokenize_wiki), on this JSONL corpus."""
    import numpy as np
    from mindformers.models.llama.llama_tokenizer import LlamaTokenizer
    from mindspore.mindrecord import FileWriter

    word_tokenizer = LlamaTokenizer(vocab_file=tokenizer)
    word_tokenizer.add_bos_token = True  # as the script sets them
    word_tokenizer.add_eos_token = True
    os.makedirs(out)
    writer = FileWriter(file_name=os.path.join(out, "baseline.mindrecord"), shard_num=1)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "wiki")
    content = []
    with open(corpus, "r", encoding="utf-8") as f:
        for line in f.read().splitlines():
            for para in json.loads(line)["text"].split("\n\n"):
                if para:
                    content += word_tokenizer(para)["input_ids"]
    tokens = len(content)
    for start in range(0, len(content), seq_length + 1):
        chunk = content[start:start + seq_length + 1]
        if len(chunk) == seq_length + 1:
            writer.write_raw_data([{"input_ids": np.array(chunk, dtype=np.int32)}])
    writer.commit()
    return tokens


def run_ceiling(corpus: str, tokenizer: str, out: str, seq_length: int) -> tuple:
    """(tokens, seconds of encoding alone): the documents are read before the clock starts."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    ids = sp.encode(docs, num_threads=os.cpu_count() or 1)
    return sum(map(len, ids)), time.perf_counter() - start


def run_ceiling_hf(corpus: str, tokenizer: str, out: str, seq_length: int) -> tuple:
    """(tokens, seconds of encoding alone) with `tokenizers`' batch encoding, documents read before the clock."""
    from tokenizers import Tokenizer

    from ascend_llm_recipes.data.tokenizer import resolve_tokenizer

    hf = Tokenizer.from_file(resolve_tokenizer(tokenizer))
    hf.encode_special_tokens = True  # as data/text/workers.py: special tokens written in the text are text
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    encodings = hf.encode_batch(docs, add_special_tokens=False)
    return sum(len(e.ids) for e in encodings), time.perf_counter() - start


def hf_conversion(sp_model: str, out_dir: str) -> str:
    """transformers' slow-to-fast conversion of a sentencepiece model (legacy layout, as Llama 2 ships it)."""
    from transformers import LlamaTokenizerFast

    if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        LlamaTokenizerFast(vocab_file=sp_model, legacy=True, add_prefix_space=True, from_slow=True).save_pretrained(
            out_dir)
    return out_dir


def run_scale(corpus: str, tokenizer: str, out: str, seq_length: int, executor: str, tasks: int) -> int:
    from ascend_llm_recipes.data.prepare import prepare_dataset

    if executor == "ray":
        import ray
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    manifest = prepare_dataset(out, seq_length, inputs=[corpus], tokenizer=tokenizer, show_progress=False,
                               samples_per_shard=max(256, (4 << 20) // (4 * (seq_length + 1))),
                               executor=executor, tasks=tasks)
    return manifest["tokens"] - manifest["documents"]["train"]


def stage_costs(out: str) -> dict:
    """{stage: (wall seconds of its slowest task, CPU seconds of all tasks, largest peak RSS MB)} from the logs."""
    costs = {}
    for stage in ("signatures", "decide", "pack", "merge"):
        folder = os.path.join(out + ".logs", stage, "costs")
        records = [json.load(open(os.path.join(folder, name))) for name in sorted(os.listdir(folder))] \
            if os.path.isdir(folder) else []
        if records:
            costs[stage] = (max(r["seconds"] for r in records), sum(r["cpu_seconds"] for r in records),
                            max(r["max_rss_mb"] for r in records))
    return costs


def child(method: str, corpus: str, tokenizer: str, out: str, seq_length: int) -> None:
    """Runs in the measured process; prints one JSON line."""
    if method.startswith("scale:"):  # scale:EXECUTOR:TASKS
        import ascend_llm_recipes.data.cluster.scale  # noqa: F401  (MindSpore before the clock, as for ours)
        _, executor, tasks = method.split(":")
        start = time.perf_counter()
        tokens = run_scale(corpus, tokenizer, out, seq_length, executor, int(tasks))
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}), flush=True)
        return
    if method in ("ours", "ours_hf"):  # import MindSpore before the clock, as the others do
        import ascend_llm_recipes.data.prepare  # noqa: F401
    elif method == "baseline":
        import mindformers.models.llama.llama_tokenizer  # noqa: F401
    start = time.perf_counter()
    run = {"ours": run_ours, "baseline": run_baseline, "ceiling": run_ceiling, "ours_hf": run_ours,
           "ceiling_hf": run_ceiling_hf}[method]
    result = run(corpus, tokenizer, out, seq_length)
    tokens, seconds = result if isinstance(result, tuple) else (result, time.perf_counter() - start)
    print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


def tree_memory(pid: int) -> int:
    """Resident bytes of a process plus the private bytes of all its descendants (Linux /proc).

    Children count only their private pages: what they share with the parent (libraries, or
    everything between fork and exec) is already in the parent's RSS. PSS would not do:
    it also splits library pages with unrelated processes that happen to map them.
    """
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
            total += 1024 * (fields["Rss"] if p == pid else fields["Private_Clean"] + fields["Private_Dirty"])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, KeyError):
            continue
    return total


def measure(method: str, corpus: str, tokenizer: str, out: str, seq_length: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", method, "--corpus", corpus,
                             "--tokenizer", tokenizer, "--out", out, "--seq-length", str(seq_length)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, LOCAL_DEFAULT_PATH=os.path.join(out + ".logs")))
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_memory(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**result, "tokens_per_s": result["tokens"] / result["seconds"], "peak_rss": peak[0], "cpu_s": cpu}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100], help="corpus sizes in MB")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--hf-tokenizer", help="tokenizer.json or HF model directory for ours_hf and ceiling_hf "
                                               "(default: the trained model converted by transformers)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of ours and ceiling (best kept)")
    parser.add_argument("--workdir", default="/tmp/benchmark_data")
    parser.add_argument("--executors", nargs="+", choices=["local", "ray"],
                        help="measure data/cluster/scale.py on these executors (with --tasks) instead of the methods")
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4], help="with --executors: task counts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.corpus, args.tokenizer, args.out, args.seq_length)
        return 0

    import shutil

    from ascend_llm_recipes.data.tokenizer import train_tokenizer

    os.makedirs(args.workdir, exist_ok=True)
    corpora = {}
    for size in args.sizes:
        corpora[size] = os.path.join(args.workdir, f"corpus-{size}MB.jsonl")
        if not os.path.isfile(corpora[size]):
            print(f"building {corpora[size]} ...", flush=True)
            build_corpus(corpora[size], size)
    tokenizer = os.path.join(args.workdir, f"bpe{args.vocab_size}.model")
    if not os.path.isfile(tokenizer):
        print(f"training a {args.vocab_size}-piece BPE tokenizer on {corpora[min(args.sizes)]} ...", flush=True)
        with open(corpora[min(args.sizes)], encoding="utf-8") as f:
            train_tokenizer([json.loads(line)["text"] for line in f], args.vocab_size, tokenizer[:-len(".model")])
    hf_tokenizer = args.hf_tokenizer
    if not hf_tokenizer and {"ours_hf", "ceiling_hf"} & set(args.methods):
        hf_tokenizer = hf_conversion(tokenizer, os.path.join(args.workdir, f"hf-bpe{args.vocab_size}"))
    if args.executors:
        return scale_benchmark(args, corpora, tokenizer)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before; seq_length {args.seq_length}, "
          f"BPE {args.vocab_size}" + (f", HF tokenizer {hf_tokenizer}" if hf_tokenizer else ""), flush=True)
    rows = []
    for size in args.sizes:
        best = {}
        runs = [m for _ in range(args.repeat) for m in args.methods if m != "baseline"]
        for method in runs + [m for m in args.methods if m == "baseline"]:
            out = os.path.join(args.workdir, f"out-{method}-{size}MB")
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out + ".logs", ignore_errors=True)
            r = measure(method, corpora[size], hf_tokenizer if method.endswith("_hf") else tokenizer, out,
                        args.seq_length)
            print(f"  {size:>4} MB {method:<9} {r['tokens']:>12,} tokens {r['seconds']:>8.2f} s "
                  f"{r['tokens_per_s']:>12,.0f} tok/s  peak {r['peak_rss'] / 2**20:>7,.0f} MB  cpu {r['cpu_s']:.1f} s  "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
            if method not in best or r["seconds"] < best[method]["seconds"]:
                best[method] = r
            shutil.rmtree(out, ignore_errors=True)
        rows += [(size, method, best[method]) for method in args.methods]
    print(f"load average {os.getloadavg()[0]:.2f} after\n")
    print(table(rows))
    return 0


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


def scale_benchmark(args, corpora: dict, tokenizer: str) -> int:
    """Today's single-process run vs N tasks on each executor (each corpus size), then the 1 TB projection.

    With two sizes it also prints the marginal CPU cost per million tokens (the difference between the
    sizes), which leaves out the fixed start-up that a small corpus cannot amortise.
    """
    import shutil

    print(f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before; seq_length "
          f"{args.seq_length}, BPE {args.vocab_size}", flush=True)
    configs = [("local", 1)] + [(e, t) for e in args.executors for t in args.tasks if (e, t) != ("local", 1)]
    # CPU s / M tokens counts every process (start-ups included: each task process imports MindSpore);
    # "in tasks" only the stages' own work, which is what grows with the corpus.
    lines = ["| corpus | executor | tasks | tokens | seconds | tokens/s | CPU s / M tokens | vs 1 process | in tasks "
             "| peak RSS (largest task) | stage seconds: signatures / decide / pack / merge |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    measured, widest = {}, None
    for size, corpus in sorted(corpora.items()):
        base = None
        for executor, tasks in configs:
            single = (executor, tasks) == ("local", 1)
            out = os.path.join(args.workdir, f"out-{executor}-{tasks}-{size}MB")
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out + ".logs", ignore_errors=True)
            r = measure("ours" if single else f"scale:{executor}:{tasks}", corpus, tokenizer, out, args.seq_length)
            costs = stage_costs(out)
            cpu_per_m = r["cpu_s"] / r["tokens"] * 1e6
            base = base or cpu_per_m
            peak = max(c[2] for c in costs.values()) if costs else r["peak_rss"] / 2**20
            stages = " / ".join(f"{costs[st][0]:.1f}" for st in costs) if costs else "(today's single process)"
            in_tasks = f"{sum(c[1] for c in costs.values()) / r['tokens'] * 1e6:.2f}" if costs else "-"
            lines.append(f"| {size} MB | {executor} | {tasks} | {r['tokens']:,} | {r['seconds']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {cpu_per_m:.2f} | {cpu_per_m / base:.0%} | {in_tasks} | "
                         f"{peak:,.0f} MB | {stages} |")
            print(lines[-1], flush=True)
            measured.setdefault((executor, tasks), []).append((r["tokens"], r["cpu_s"]))
            if costs and executor == "local":
                widest = (os.path.getsize(corpus), r, costs)
            shutil.rmtree(out, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.2f} after\n")
    print("\n".join(lines))
    if len(corpora) > 1:
        small, large = min(corpora), max(corpora)
        print(f"\nmarginal CPU s per M tokens ({small} MB -> {large} MB: start-up cancels out):")
        first = None
        for config, points in measured.items():
            (t0, c0), (t1, c1) = points[0], points[-1]
            marginal = (c1 - c0) / (t1 - t0) * 1e6
            first = first or marginal
            print(f"  {config[0]:<5} {config[1]} task(s): {marginal:.2f} ({marginal / first:.0%} of one process)")
    if widest:
        print("\n" + projection(*widest))
    return 0


def projection(corpus_bytes: int, run: dict, costs: dict) -> str:
    """PROJECTION (arithmetic, not a measurement) of 1 TB on 16 nodes x 64 cores from this run's CPU costs."""
    scale, cores = (1 << 40) / corpus_bytes, 16 * 64
    spread = (costs["signatures"][1] + costs["pack"][1]) * scale / cores  # per-range stages: every core busy
    once = (costs["decide"][1] + costs["merge"][1]) * scale               # one task each, linear in the corpus
    return (f"PROJECTION, not a measurement: 1 TB is {scale:,.0f} x this corpus ({run['tokens'] / corpus_bytes:.2f} "
            f"tokens per byte, about {run['tokens'] * scale / 1e9:,.0f}B tokens). Signatures + pack "
            f"({costs['signatures'][1] + costs['pack'][1]:.1f} CPU s here) spread over {cores} cores: "
            f"{spread / 3600:,.1f} h, assuming shared storage keeps up and per-core speed as measured here; "
            f"decide + merge run as one task ({costs['decide'][1] + costs['merge'][1]:.2f} CPU s here, linear in the "
            f"corpus): {once / 3600:,.1f} h. Total about {(spread + once) / 3600:,.1f} h.")


def table(rows: list) -> str:
    by = {(size, method): r for size, method, r in rows}
    lines = ["| corpus | method | tokens | seconds | tokens/s | vs ceiling | peak memory | CPU s / M tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size, method, r in rows:
        ceiling = by.get((size, CEILING[method]))
        ratio = f"{r['tokens_per_s'] / ceiling['tokens_per_s']:.0%}" if ceiling else "n/a"
        lines.append(f"| {size} MB | {method} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {r['peak_rss'] / 2**20:,.0f} MB | {r['cpu_s'] / r['tokens'] * 1e6:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
