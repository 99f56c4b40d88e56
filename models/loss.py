"""The causal-LM loss: mean next-token cross-entropy over labels that are not padding, in float32.

Two cells compute the same numbers. Where every rank holds whole rows of logits (stand-alone, data
parallel) one fused kernel does it (WholeVocabularyCrossEntropy); in semi-auto parallel, where tensor
parallel may split the vocabulary, the loss is written with MindFormers' vocabulary-parallel operators
(CrossEntropy), each of which models/parallel.py can shard. loss_splits_vocabulary picks one;
models/llama.py's LlamaForCausalLM calls it. tests/test_model.py checks both against torch's cross_entropy.
"""

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops


def loss_splits_vocabulary(parallel_mode: str) -> bool:
    """Whether the loss is written with vocabulary-parallel operators (CrossEntropy) or the fused kernel.

    In semi-auto and auto parallel the logits may be split over the vocabulary by tensor parallel,
    and the loss uses the operators MindFormers shards for that. In stand-alone and data-parallel
    mode every rank holds whole rows of logits, and one fused kernel (WholeVocabularyCrossEntropy)
    computes the same loss in a fraction of the passes over the (tokens x vocabulary) logits.
    """
    return parallel_mode in ("semi_auto_parallel", "auto_parallel")


class CrossEntropy(nn.Cell):
    """Mean next-token cross-entropy over labels that are not padding, in float32.

    Written with the operators of MindFormers' vocabulary-parallel CrossEntropyLoss
    (mindformers/core/loss/loss.py:39-131, 282-319: max, subtract, exp, sum, log over the
    vocabulary, then one-hot, multiply, sum) so that each can be split over the vocabulary
    axis: the (B*S, vocab) logits are never gathered whole on one TP rank.
    """

    def __init__(self):
        super().__init__()
        self.pad = ops.Add()
        self.max = ops.ReduceMax(keep_dims=True)
        self.sub_max = ops.Sub()
        self.exp = ops.Exp()
        self.sum_exp = ops.ReduceSum(keep_dims=True)
        self.log = ops.Log()
        self.sub_log = ops.Sub()
        self.onehot = ops.OneHot()
        self.pick = ops.Mul()
        self.neg = ops.Neg()
        self.sum_vocab = ops.ReduceSum()
        self.not_pad = ops.NotEqual()
        self.mask_mul = ops.Mul()
        self.sum_tokens = ops.ReduceSum()
        self.count = ops.ReduceSum()
        self.at_least_one = ops.Maximum()
        self.div = ops.RealDiv()
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, logits, labels, vocab_padding, pad_token_id):
        logits = logits.astype(ms.float32)
        if vocab_padding is not None:
            logits = self.pad(logits, vocab_padding)
        shifted = self.sub_max(logits, self.max(logits, -1))                     # (N, vocab)
        log_probs = self.sub_log(shifted, self.log(self.sum_exp(self.exp(shifted), -1)))
        target = self.onehot(labels, logits.shape[-1], self.on, self.off)
        nll = self.sum_vocab(self.neg(self.pick(log_probs, target)), -1)         # (N,)
        mask = self.not_pad(labels, pad_token_id).astype(ms.float32)
        return self.div(self.sum_tokens(self.mask_mul(nll, mask)), self.at_least_one(self.count(mask), 1.0))


class WholeVocabularyCrossEntropy(nn.Cell):
    """The same loss as CrossEntropy on MindSpore's fused SparseSoftmaxCrossEntropyWithLogits kernel.

    For logits whose rows are whole (no vocabulary split): the kernel computes the mean of
    -log softmax(logits)[label] over all rows, and its gradient (softmax - one-hot) / rows, each in
    one pass (CPU, GPU and Ascend kernels; its gradient is the same kernel with is_grad=True,
    mindspore/ops/_grad_experimental/grad_nn_ops.py:146-161). CrossEntropy needs ~10 element-wise
    passes forward and ~12 backward over the (tokens x vocabulary) logits for the same numbers.

    The kernel has no ignore index (a label < 0 is an error), so padding labels become label 0
    and their logits a known constant row: the model zeroes their hidden states, the head
    (no bias) gives logits 0 (plus the vocabulary-padding row, -1e9 on padded ids), whose loss
    for label 0 is log(vocab_size) exactly. That constant is subtracted from the sum again:

        loss = kernel mean x rows / real rows - log(vocab_size) x padding rows / real rows

    (with no padding, rows / real rows is exactly 1 and the loss is the kernel's mean itself; a batch
    of padding only has loss 0, as in CrossEntropy). The subtraction cancels most of the kernel's sum
    when most rows are padding, so the loss value's float32 rounding grows by rows / real rows there.
    Gradients do not cancel: a zero hidden row passes nothing to the head's weight or the network below.
    """

    def __init__(self, vocab_size: int, pad_token_id: int):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.padding_row_loss = float(np.log(np.float32(vocab_size)))  # -log(1 / vocab_size), in float32
        self.kernel = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.not_pad = ops.NotEqual()
        self.pad = ops.Add()
        self.safe_labels = ops.Mul()
        self.count = ops.ReduceSum()
        self.at_least_one = ops.Maximum()
        self.at_most_one = ops.Minimum()

    def keep(self, labels):
        """1.0 for labels that count, 0.0 for padding, float32 (B * S,)."""
        return self.not_pad(labels, self.pad_token_id).astype(ms.float32)

    def construct(self, logits, labels, keep, vocab_padding):
        logits = logits.astype(ms.float32)
        if vocab_padding is not None:
            logits = self.pad(logits, vocab_padding)
        rows = logits.shape[0]
        real = self.count(keep)
        mean = self.kernel(logits, self.safe_labels(labels, keep.astype(labels.dtype)))
        padding, counted = rows - real, self.at_most_one(real, 1.0)   # counted: 0.0 when every label is padding
        real = self.at_least_one(real, 1.0)
        return (mean * (rows / real) - (padding / real) * self.padding_row_loss) * counted
