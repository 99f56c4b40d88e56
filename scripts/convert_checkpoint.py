"""Convert checkpoints between HuggingFace (transformers) and this repository's Llama model.

    python scripts/convert_checkpoint.py --from-hf HF_DIR --output OUT_DIR [--verify] [--seq-length N]
    python scripts/convert_checkpoint.py --to-hf OURS --output HF_DIR [--model-config YAML]
    python scripts/convert_checkpoint.py --from-torch consolidated.00.pth --model-config params.json --output OUT_DIR
    python scripts/convert_checkpoint.py --from-hf HF_DIR --output OUT_DIR --expert-layout stacked   # MoE on Ascend

--from-hf writes OUT_DIR/weights.safetensors, model_config.yaml (a recipe's model: section) and
conversion.json; train from it with that model section and the recipe keys
`load_checkpoint: OUT_DIR`, `load_ckpt_format: safetensors`. --verify compares logits with
transformers before anything is written.
--to-hf reads a converted directory, a run directory (its newest verified checkpoint step, as a
resume would take) or a .ckpt / .safetensors file, and writes config.json + model.safetensors
(plus the run's tokenizer when its dataset names one).
--from-megatron and --from-torch write the same converted directory as --from-hf; --to-megatron writes
Megatron-LM legacy files, mp_rank_TT[_PPP]/model_optim_rng.pt (models/conversion/megatron.py).
A Mixture-of-Experts model trains on Ascend with MindFormers' MoELayer, which holds each MoE layer's experts stacked
(mlp.router.weight, mlp.experts.weight1, mlp.experts.weight2): convert into our format with --expert-layout stacked
for such a recipe (the default, per-expert, is our CPU model's). --to-hf and --to-megatron read either layout.
Exit codes: 0 converted, 2 bad input (the message says what to fix), 1 internal error, 130 interrupted.
"""

import argparse
import sys
import traceback

from ascend_llm_recipes.models.conversion.hf import from_hf
from ascend_llm_recipes.models.conversion.ours import PER_EXPERT, STACKED
from ascend_llm_recipes.models.conversion.write import summary
from ascend_llm_recipes.training.tools.export import to_hf
from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.launcher.preflight import check_writable_dir
from ascend_llm_recipes.training.tools.relayout import export_source


def count(minimum: int):
    """An argparse type: an integer of at least `minimum`, refused by the argument's name otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is not a {'positive' if minimum else 'non-negative'} integer")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="HuggingFace model directory (config.json + weights)")
    direction.add_argument("--to-hf", metavar="OURS",
                           help="converted directory, run directory, or .ckpt/.safetensors file")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument("--verify", action="store_true",
                        help="--from-hf, --from-torch: compare logits with transformers (float32, CPU) before writing "
                             "(Meta's layout: with a forward after Meta's model.py; --from-megatron: Megatron's)")
    parser.add_argument("--seq-length", type=count(1),
                        help="--from-hf, --from-torch: model_config seq_length (default: max_position_embeddings, "
                             "at most 4096)")
    parser.add_argument("--model-config", metavar="YAML",
                        help="--to-hf: recipe or model_config.yaml, when not found beside the checkpoint; "
                             "--from-torch: config.json, Meta's params.json, model_config.yaml or recipe")
    parser.add_argument("--expert-layout", choices=(PER_EXPERT, STACKED),
                        help="--from-hf, --from-megatron, --from-torch, MoE models: per-expert (our CPU model's, "
                             "the default) or stacked (MindFormers' MoELayer's, for a recipe with "
                             "context.device_target Ascend)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # Megatron-LM and plain PyTorch files (models/conversion/megatron.py, torch_state.py; training/tools/export.py)
    direction.add_argument("--from-megatron", metavar="CKPT_DIR",
                           help="Megatron-LM save directory (latest_checkpointed_iteration.txt) or iter_NNNNNNN "
                                "directory, legacy or torch_dist, any TP/PP")
    direction.add_argument("--from-torch", metavar="FILE",
                           help="a torch.save'd state dict (.pt/.bin), or Meta's consolidated.00.pth (every "
                                "consolidated.NN.pth beside it is merged); needs --model-config")
    direction.add_argument("--to-megatron", metavar="OURS", help="converted or run directory -> Megatron-LM legacy "
                                                                 "files for --tp x --pp")
    parser.add_argument("--key-map", metavar="YAML", help="--from-torch: `their name: HF name` patterns ({n} = layer)")
    parser.add_argument("--tp", type=count(1), default=1, help="--to-megatron: tensor-parallel degree")
    parser.add_argument("--pp", type=count(1), default=1, help="--to-megatron: pipeline stages")
    parser.add_argument("--ep", type=count(1), default=1,
                        help="--to-megatron: expert-parallel degree (a MoE model's experts split over EP files)")
    parser.add_argument("--grouped-gemm", action="store_true",
                        help="--to-megatron: write the experts as megatron-core's GroupedMLP (weight1/weight2), for "
                             "Megatron-LM's --moe-grouped-gemm without TransformerEngine")
    parser.add_argument("--iteration", type=count(0),
                        help="--from-megatron: iteration to read (default: the latest); --to-megatron: iteration "
                             "to write")
    parser.add_argument("--vocab-size", type=count(1), help="--from-megatron: real vocabulary size when args lack it")
    parser.add_argument("--write-recipe", metavar="YAML", help="--from-megatron/--from-hf/--from-torch: also write a "
                                                               "recipe (base/ascend.yaml) continuing the run")
    parser.add_argument("--devices", type=count(1), help="--write-recipe: devices to lay the run out on")
    args = parser.parse_args(argv)
    megatron = args.from_megatron or args.from_torch or args.to_megatron or args.write_recipe
    if not megatron and args.from_hf and args.model_config:
        parser.error("--model-config applies to --to-hf")
    if args.to_hf and (args.verify or args.seq_length):
        parser.error("--verify and --seq-length do not apply to --to-hf")
    if args.grouped_gemm and not args.to_megatron:
        parser.error("--grouped-gemm applies to --to-megatron (GroupedMLP files are read as they are)")
    if args.expert_layout and (args.to_hf or args.to_megatron):
        parser.error("--expert-layout applies to conversions into our format (--from-hf, --from-megatron, "
                     "--from-torch); --to-hf and --to-megatron read either layout")
    args.expert_layout = args.expert_layout or PER_EXPERT
    try:
        if megatron:
            from ascend_llm_recipes.training.tools.export import run_cli

            return run_cli(parser, args)
        check_writable_dir(args.output, "--output")
        if args.from_hf:
            manifest = from_hf(args.from_hf, args.output, seq_length=args.seq_length, verify=args.verify,
                               show_progress=not args.quiet, expert_layout=args.expert_layout)
        else:
            # A semi-auto (TP/PP) run's shards are first merged into one unsliced checkpoint with the strategy
            # files the run saved, in RUN_DIR/merged_checkpoint/step_N/ (training/tools/relayout.py).
            source, model_config = export_source(args.to_hf, args.model_config)
            manifest = to_hf(source, args.output, model_config=model_config, show_progress=not args.quiet)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written (a conversion appears only when complete)", file=sys.stderr)
        return 130
    except Exception:  # bad input is a PretrainError; anything else is a bug to report
        traceback.print_exc()
        print("internal error in the converter (not a problem with your input); please report it with the "
              "traceback above. Nothing was written.", file=sys.stderr)
        return 1
    print(summary(manifest, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
