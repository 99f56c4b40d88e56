"""Write a real Megatron checkpoint (legacy and torch_dist) with megatron-core, plus its own logits.

    python tests/make_megatron_fixtures.py OUT_DIR [LAYOUT ...] [--processes N]

LAYOUT is tp1 (tied embeddings), tp2 (q/k/v bias), tp2pp2, moe (Mixture of Experts at TP1: megatron-core's
SequentialMLP, first layer dense, shared expert with gate, qk_layernorm, kv_channels != hidden / heads, an expert
capacity of 0.75 dropping the assignments of lowest probability) or moe_ep2
(the experts split over 2 expert-parallel ranks, sigmoid router with expert_bias, shared expert without gate) or
moe_tp2ep2 (TP2 x EP2, moe_router_pre_softmax, every other layer dense, no shared expert) (default: all six, in
one launch; ranks beyond TP x PP are data-parallel replicas), or tp2_large (hidden 512, 8 layers, vocabulary 32000;
`--processes 2`) to measure the converter. The N ranks (default 4) are forked from one
process after it has imported torch and megatron-core, which each rank would otherwise import again (8-12 CPU-s
apiece on 2 cores); under `torchrun --nproc-per-node N` the script runs as one of torchrun's ranks instead. Run by
tests/conftest.py's megatron_dir, always under a timeout (a failed torch_dist writer hangs its parent).
Builds megatron-core's GPTModel with the local layer spec on CPU under gloo from a Megatron-LM
style `args` namespace, fills every parameter with seeded noise (norms around 1), takes TRAIN_STEPS real
training steps with megatron-core's own optimizer (get_megatron_optimizer, Adam, use_distributed_optimizer
False, an OptimizerParamScheduler advanced to the iteration), and writes, as Megatron-LM's training loop
does, for each LAYOUT:

    OUT_DIR/LAYOUT/legacy/latest_checkpointed_iteration.txt, iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt
        (args, iteration, model, and, as megatron/training/checkpointing.py's generate_state_dict writes them
        for a non-distributed optimizer, optimizer = optimizer.state_dict() and opt_param_scheduler)
    OUT_DIR/LAYOUT/torch_dist/latest_checkpointed_iteration.txt, iter_NNNNNNN/ (*.distcp, metadata.json, common.pt)
    OUT_DIR/LAYOUT/tokens.npy, logits.npy  (megatron-core's forward, real vocabulary columns only)
    (MoE layouts: untrained, no optimizer state; legacy files mp_rank_TT[_EEE])
    OUT_DIR/MOE_LAYOUT/grouped/legacy, grouped/torch_dist  the same model with --moe-grouped-gemm (GroupedMLP's
        weight1/weight2), its weights loaded by megatron-core from the torch_dist save: the logits are its own
    OUT_DIR/LAYOUT/moments_TT_PPP.pt  {parameter name: (exp_avg, exp_avg_sq, step)} read from the live
        optimizer by parameter identity: the ground truth for the converter's index -> name mapping

megatron-core 0.16.1 on CPU needs a few workarounds, marked "CPU:" below.
"""

import argparse
import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
import zlib

import numpy as np
import torch
import torch.distributed as dist

ITERATION = 40
TRAIN_STEPS = 2  # optimizer steps actually taken: the optimizer restarted at iteration ITERATION - TRAIN_STEPS
# TP, PP, tied embeddings, q/k/v bias
LAYOUTS = {"tp1": (1, 1, True, False), "tp2": (2, 1, False, True), "tp2pp2": (2, 2, False, False)}
# Mixture of Experts (megatron-core's MoELayer with SequentialMLP and the allgather dispatcher): TP, EP, tied, and
# the MoE/attention arguments, under Megatron-LM's argument names.
MOE_LAYOUTS = {
    "moe": (1, 1, True, dict(moe_layer_freq=[0, 1, 1, 1], moe_shared_expert_intermediate_size=48,
                             moe_shared_expert_gate=True, qk_layernorm=True, kv_channels=24,
                             moe_expert_capacity_factor=0.75)),
    "moe_ep2": (1, 2, False, dict(moe_layer_freq=1, moe_shared_expert_intermediate_size=48,
                                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)),
    "moe_tp2ep2": (2, 2, False, dict(moe_layer_freq=2, moe_router_pre_softmax=True, qk_layernorm=True)),
}
LARGE = {"tp2_large": (2, 1, False, False)}  # on request only: the size of docs/benchmarks.md's figures
LARGE_SHAPE = dict(num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
                   kv_channels=64, vocab_size=32000)
VOCAB = 512          # the tiny dataset's vocabulary, so a converted fixture trains on it
TOKENS_SHAPE = (2, 16)


def megatron_args(tp: int, pp: int, tied: bool, qkv_bias: bool = False, large: bool = False) -> argparse.Namespace:
    """The subset of Megatron-LM's arguments (its own names) that describe this model and run."""
    args = argparse.Namespace(
        num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=16, seq_length=64, max_position_embeddings=64,
        position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not tied, num_experts=None, qk_layernorm=False,
        vocab_size=VOCAB, make_vocab_size_divisible_by=96, padded_vocab_size=_padded(VOCAB, 96 * tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=1,
        micro_batch_size=2, global_batch_size=16, lr=3e-4, min_lr=3e-5, lr_decay_style="cosine",
        lr_warmup_iters=10, lr_decay_iters=1000, train_iters=1000, weight_decay=0.05, adam_beta1=0.9,
        adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, optimizer="adam", use_distributed_optimizer=False,
        iteration=ITERATION, params_dtype=torch.float32, bf16=False, fp16=False,
    )
    if large:
        vars(args).update(LARGE_SHAPE, padded_vocab_size=_padded(LARGE_SHAPE["vocab_size"], 96 * tp))
    return args


def moe_args(tp: int, ep: int, tied: bool, options: dict) -> argparse.Namespace:
    """megatron_args plus the MoE arguments (Megatron-LM's names) of a MOE_LAYOUTS entry."""
    args = megatron_args(tp, 1, tied)
    vars(args).update({**dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=1,
                              moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                              moe_router_score_function="softmax", moe_router_pre_softmax=False,
                              moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
                              moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                              moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                              moe_expert_capacity_factor=None, moe_token_drop_policy="probs",
                              moe_pad_expert_input_to_capacity=False,
                              expert_model_parallel_size=ep, expert_tensor_parallel_size=tp), **options})
    return args


def _padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def cpu_workarounds() -> None:
    # CPU: rotary tables are moved to torch.cuda.current_device(); the torch_dist writer synchronizes CUDA.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # CPU: FP32Optimizer makes its loss-scale tensor, and the grad norm its buffers, with device='cuda'.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer
    mcore_optimizer.torch = clip_grads.torch = utils.torch = _CpuTensors()
    # Not for the CPU, for time: the torch_dist writer hands its results back through a Manager queue it starts
    # with the 'spawn' method, a new process re-importing this script (torch, numpy: ~4 CPU-s) on every rank.
    # dist_checkpointing.save runs the writer synchronously in this process: a plain queue carries the same results.
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._results_queue = queue.Queue()
    # CPU: without TransformerEngine, moe_utils leaves te_general_gemm undefined (its import fallback names only the
    # other TE functions) and the router's gating linear tests it for None.
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None


class _CpuTensors:
    """torch, with torch.tensor(..., device='cuda') made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def build_model(args):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
               moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_layer_freq=args.moe_layer_freq,
               moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
               moe_shared_expert_gate=args.moe_shared_expert_gate,
               moe_router_score_function=args.moe_router_score_function,
               moe_router_pre_softmax=args.moe_router_pre_softmax,
               moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
               moe_token_dispatcher_type=args.moe_token_dispatcher_type,
               moe_expert_capacity_factor=args.moe_expert_capacity_factor,
               moe_token_drop_policy=args.moe_token_drop_policy,
               moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
               moe_router_load_balancing_type="none", expert_model_parallel_size=args.expert_model_parallel_size,
               moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm) if args.num_experts else {}
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=args.add_qkv_bias, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        # CPU: no fused kernels
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False, **moe,
    )
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
            if args.num_experts else get_gpt_layer_local_spec(normalization=args.normalization))
    return GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
    )


def randomize(model, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> None:
    """Seeded noise in every parameter: TP shards differ per rank, replicated ones (norms) agree; each
    expert-parallel rank's local experts differ. Router weights are wide (std 1), so that each token's top k
    is clear of ties; expert_bias (a buffer) gets noise of a size that changes some choices."""
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                                         if n.endswith("expert_bias"))]:
            sharded = getattr(param, "tensor_model_parallel", False)
            key = f"{name}|{pp_rank}|{tp_rank if sharded else 'all'}" + (f"|{ep_rank}" if ".experts." in name else "")
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            scale = 1.0 if name.endswith("router.weight") else 0.5 if name.endswith("expert_bias") else 0.05
            noise = torch.randn(param.shape, generator=generator) * scale
            param.copy_(noise + (1.0 if "layernorm" in name or "norm" in name.split(".")[-2] else 0.0))


def forward(model, args, tokens: torch.Tensor):
    """Logits (batch, seq, padded vocab) on the last stage, None elsewhere; pipeline by send/recv."""
    from megatron.core import parallel_state

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # CPU: True = masked
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(seq, batch, args.hidden_size)
        dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens, positions, mask)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out


def train(model, args):
    """TRAIN_STEPS steps of megatron-core's optimizer on a DDP-wrapped model; returns (model, optimizer, scheduler).

    The pipeline is run by hand (activations forward, their gradients back by send/recv); the
    optimizer, its parameter groups, gradient sync and clipping are megatron-core's.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=0.0,  # CPU: clip_grads.py asserts torch.cuda.FloatTensor gradients
        use_distributed_optimizer=False, params_dtype=torch.float32), [ddp])
    batch = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * batch,
        lr_decay_steps=args.lr_decay_iters * batch, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * batch,
        wd_incr_style="constant")
    scheduler.step(increment=(ITERATION - TRAIN_STEPS) * batch)  # the iterations before the optimizer restarted
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    for step in range(TRAIN_STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.from_numpy(np.random.default_rng(100 + step).integers(0, args.vocab_size, size=(2, 17)))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        mask = torch.triu(torch.ones(1, 1, inputs.shape[1], inputs.shape[1], dtype=torch.bool), diagonal=1)
        hidden = None
        if not first:
            hidden = torch.empty(inputs.shape[1], inputs.shape[0], args.hidden_size)
            dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            hidden.requires_grad_(True)
            ddp.module.set_input_tensor(hidden)
        out = ddp(inputs, positions, mask)
        if last:  # (S, B)-major logits of the gathered vocabulary -> next-token loss
            logits = out[..., :args.vocab_size].float()
            torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab_size), labels.reshape(-1)).backward()
        else:
            dist.send(out.detach().contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(out)
            dist.recv(grad, parallel_state.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if not first:
            dist.send(hidden.grad.contiguous(), parallel_state.get_pipeline_model_parallel_prev_rank())
        ddp.finish_grad_sync()
        updated, _, _ = optimizer.step()
        assert updated, "megatron-core skipped the optimizer step"
        scheduler.step(increment=batch)
    return ddp.module, optimizer, scheduler


def save_legacy(model, args, out_dir: str, tp_rank: int, pp_rank: int, optimizer=None, scheduler=None,
                ep_rank: int = 0) -> None:
    """Megatron-LM's legacy layout: one torch.save per model-parallel rank (checkpointing.generate_state_dict),
    named as checkpointing.get_checkpoint_name does: mp_rank_TT[_PPP][_EEE]."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if args.pipeline_model_parallel_size > 1 else "")
    name += f"_{ep_rank:03d}" if getattr(args, "expert_model_parallel_size", 1) > 1 else ""
    path = os.path.join(out_dir, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.state_dict_for_save_checkpoint()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = scheduler.state_dict()
        # ground truth by parameter identity, independent of the integer indexes the state dict uses
        live = optimizer.optimizer.state
        truth = {n: (live[p]["exp_avg"].clone(), live[p]["exp_avg_sq"].clone(), float(live[p]["step"]))
                 for n, p in model.named_parameters()}
        torch.save(truth, os.path.join(os.path.dirname(out_dir), f"moments_{tp_rank:02d}_{pp_rank:03d}.pt"))
    torch.save(state, path)


def save_torch_dist(model, args, out_dir: str) -> None:
    """Megatron-LM's torch_dist layout: global tensors through megatron.core.dist_checkpointing."""
    from megatron.core import dist_checkpointing

    path = os.path.join(out_dir, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, path, sharded_strategy=("torch_dist", 1))


def make_layout(out_dir: str, tp: int, pp: int, tied: bool, qkv_bias: bool, large: bool = False) -> None:
    """Build, run and save one parallel layout on every rank of the world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, pp)
    # CPU: no CUDA RNG states to fork
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    args = megatron_args(tp, pp, tied, qkv_bias, large)
    model = build_model(args).eval()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first_replica = parallel_state.get_data_parallel_rank() == 0
    randomize(model, tp_rank, pp_rank)
    model, optimizer, scheduler = train(model, args)
    model.eval()

    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, args.vocab_size, size=TOKENS_SHAPE))
    logits = forward(model, args, tokens)
    save_formats(out_dir, model, args, (lambda save: save_legacy(model, args, save, tp_rank, pp_rank, optimizer,
                                                                 scheduler)) if first_replica else None)
    if logits is not None and tp_rank == 0 and first_replica:
        save_reference(out_dir, tokens, logits, args.vocab_size)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def save_formats(out_dir: str, model, args, write_legacy) -> None:
    """One layout in both formats: torch_dist by every rank, legacy files by the ranks given `write_legacy`
    (save directory -> None; None for the others), and the iteration file Megatron-LM reads next to each."""
    for fmt in ("legacy", "torch_dist"):
        save = os.path.join(out_dir, fmt)
        if fmt == "torch_dist":
            save_torch_dist(model, args, save)
        elif write_legacy is not None:
            write_legacy(save)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))


def save_reference(out_dir: str, tokens, logits, vocab_size: int) -> None:
    """The tokens and megatron-core's logits on them (vocabulary padding cut off): what --verify is checked against."""
    np.save(os.path.join(out_dir, "tokens.npy"), tokens.numpy())
    np.save(os.path.join(out_dir, "logits.npy"), logits[..., :vocab_size].double().numpy())


def make_moe_layout(out_dir: str, tp: int, ep: int, tied: bool, options: dict) -> None:
    """Build a MoE GPT, run it and save it as legacy files (expert-parallel ranks as Megatron-LM names them) and
    torch_dist.

    Not trained: megatron-core keeps expert parameters in their own optimizer groups, whose moments the
    converter does not carry yet; the forward and the files are the point.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    args = moe_args(tp, ep, tied, options)
    model = build_model(args).eval()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    randomize(model, tp_rank, 0, ep_rank)
    # every rank the same tokens: the allgather dispatcher gathers the expert-parallel group's tokens
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, args.vocab_size, size=TOKENS_SHAPE))
    logits = forward(model, args, tokens)
    writes_legacy = parallel_state.get_expert_data_parallel_rank() == 0  # as Megatron-LM: one file per TP x EP rank
    save_formats(out_dir, model, args,
                 (lambda save: save_legacy(model, args, save, tp_rank, 0, ep_rank=ep_rank)) if writes_legacy else None)
    if dist.get_rank() == 0:
        save_reference(out_dir, tokens, logits, args.vocab_size)
    save_grouped(os.path.join(out_dir, "grouped"), os.path.join(out_dir, "torch_dist", f"iter_{ITERATION:07d}"), args,
                 tp_rank, ep_rank, writes_legacy)
    dist.barrier()
    parallel_state.destroy_model_parallel()


def save_grouped(out_dir: str, sequential_dir: str, args, tp_rank: int, ep_rank: int, writes_legacy: bool) -> None:
    """The same model with --moe-grouped-gemm (megatron-core's GroupedMLP: weight1/weight2 per layer), its weights
    loaded by megatron-core from the SequentialMLP torch_dist save `sequential_dir` as Megatron-LM's load_checkpoint
    does (GroupedMLP.sharded_state_dict's merge functions build weight1/weight2), saved in both formats to out_dir.

    Its forward is not run (grouped_gemm's kernels are CUDA-only): the SequentialMLP's logits are its reference.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.moe.experts import SequentialMLP

    args = argparse.Namespace(**{**vars(args), "moe_grouped_gemm": True})
    # CPU: the grouped_gemm package is a CUDA extension (its setup.py asks the GPU for its capability) and is not
    # installed. GroupedMLP.__init__ asserts that it imports and calls it only in forward (gg.ops.gmm), which is not
    # run: the check is skipped while the model is built; gg.ops stays None, so a forward would fail.
    check = grouped_gemm_util.assert_grouped_gemm_is_available
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    try:
        model = build_model(args).eval()
    finally:
        grouped_gemm_util.assert_grouped_gemm_is_available = check
    assert not any(isinstance(m, SequentialMLP) for m in model.modules()), "the spec did not pick GroupedMLP"
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, sequential_dir,
                                     sharded_strategy=("torch_dist", 1))
    model.load_state_dict(loaded["model"])
    save_formats(out_dir, model, args,
                 (lambda save: save_legacy(model, args, save, tp_rank, 0, ep_rank=ep_rank)) if writes_legacy else None)


def run_rank(out_dir: str, layouts: list) -> None:
    """One rank of the world (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment): every layout in turn."""
    cpu_workarounds()
    dist.init_process_group("gloo")
    for name in layouts:
        if name in MOE_LAYOUTS:
            make_moe_layout(os.path.join(out_dir, name), *MOE_LAYOUTS[name])
            continue
        make_layout(os.path.join(out_dir, name), *{**LAYOUTS, **LARGE}[name], large=name in LARGE)
    dist.destroy_process_group()


def _forked_rank(rank: int, world: int, port: int, out_dir: str, layouts: list) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_rank(out_dir, layouts)


def fork_ranks(world: int, out_dir: str, layouts: list) -> int:
    """Run `world` ranks forked from this process; the first that fails stops the others. Returns an exit code."""
    # imported once here, before the fork, instead of once in every rank
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_forked_rank, args=(rank, world, port, out_dir, layouts)) for rank in range(world)]
    for process in ranks:
        process.start()
    running = {process.sentinel: process for process in ranks}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            process = running.pop(sentinel)
            process.join()
            if process.exitcode:  # the others would wait for it in a collective forever
                for other in running.values():
                    other.kill()
                return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("layouts", nargs="*", help=f"of {', '.join([*LAYOUTS, *MOE_LAYOUTS])} (default: all)")
    parser.add_argument("--processes", type=int, default=4, help="ranks to fork (ignored under torchrun)")
    options = parser.parse_args()
    unknown = set(options.layouts) - set(LAYOUTS) - set(MOE_LAYOUTS) - set(LARGE)
    if unknown:
        parser.error(f"unknown layout(s) {sorted(unknown)}")
    layouts = options.layouts or [*LAYOUTS, *MOE_LAYOUTS]
    if "RANK" in os.environ:  # started by torchrun
        run_rank(options.out_dir, layouts)
        return 0
    return fork_ranks(options.processes, options.out_dir, layouts)


if __name__ == "__main__":
    raise SystemExit(main())
