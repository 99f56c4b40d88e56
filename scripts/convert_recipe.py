"""Turn a MindFormers training config into a recipe, or a recipe into a MindFormers config.

    python scripts/convert_recipe.py --from-mindformers CONFIG.yaml --output recipes/NAME.yaml [--report R.md]
    python scripts/convert_recipe.py --from-mindformers TEMPLATE.yaml --pretrained-model-dir HF_DIR --output R.yaml
    python scripts/convert_recipe.py --to-mindformers RECIPE.yaml --output CONFIG.yaml [--report R.md]

--from-mindformers imports MindFormers' Llama-family configs (LlamaConfig / LlamaForCausalLM: Llama 2,
Llama 3, Qwen2-style q/k/v bias) and MindFormers 1.9's own format (use_legacy: False) for Qwen3,
Qwen3-MoE and DeepSeek-V3, and reports every key: carried over, translated, or dropped with the reason.
A 1.9 template without model_type takes the model from --pretrained-model-dir/config.json (else its own
pretrained_model_dir), as MindFormers does. Without --report the report is printed.

--to-mindformers writes the format of the MindFormers class that builds the recipe's model:
  - a Llama (no q/k norms, experts or latent attention): MindFormers' legacy LlamaForCausalLM (use_legacy: True);
  - q/k norms (qk_norm: True): MindFormers 1.9's own format (use_legacy: False), model_type qwen3, or qwen3_moe
    with experts (num_experts > 0);
  - multi-head latent attention (kv_lora_rank) with experts: MindFormers 1.9's own format, model_type deepseek_v3.
Options MindFormers' class would compute differently or has no key for (a router z-loss, dense layers in
Qwen3-MoE, groups scored otherwise than by their best two, experts without q/k norms, ...) are refused by name
with the MindFormers 1.9 file:line, from one table (training/recipe/mindformers_mcore_export.py REFUSALS); the
written file imports back into the same recipe with --from-mindformers.
"""

import argparse
import sys


from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.recipe.mindformers import from_mindformers, to_mindformers, write_output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-mindformers", metavar="CONFIG", help="a MindFormers training YAML")
    direction.add_argument("--to-mindformers", metavar="RECIPE",
                           help="one of our recipes: a Llama is written in MindFormers' legacy format (use_legacy: "
                                "True), a Qwen3 / Qwen3-MoE / DeepSeek-V3 model in MindFormers 1.9's own "
                                "(use_legacy: False)")
    parser.add_argument("--pretrained-model-dir", metavar="HF_DIR",
                        help="with --from-mindformers (use_legacy: False): the Hugging Face directory whose "
                             "config.json MindFormers merges under model_config")
    parser.add_argument("--output", required=True, help="file to write (a recipe, or a MindFormers config)")
    parser.add_argument("--report", help="write the per-key report (Markdown) here instead of printing it")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)
    try:
        if args.from_mindformers:
            text, report = from_mindformers(args.from_mindformers, args.output, args.pretrained_model_dir)
            title = f"Import of {args.from_mindformers} into {args.output}"
        else:
            text, report = to_mindformers(args.to_mindformers)
            title = f"Export of {args.to_mindformers} to {args.output}"
        write_output(args.output, text, args.force)
        if args.report:
            write_output(args.report, report.to_markdown(title), force=True)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.report:
        print(report.to_markdown(title))
    print(f"wrote {args.output} ({report.summary()})" + (f"; report: {args.report}" if args.report else ""))
    if args.from_mindformers:
        print(f"next: bash scripts/run_distributed.sh {args.output} --plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
