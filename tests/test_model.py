"""The Llama Cell on its own: loss definition, padding mask, causality, precision."""

import numpy as np
import pytest
import mindspore as ms

from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

PAD = 3


def tiny(**overrides):
    fields = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=96, seq_length=32, pad_token_id=PAD)
    fields.update(overrides)
    ms.set_seed(0)
    return LlamaForCausalLM(LlamaConfig(**fields))


@pytest.fixture(scope="module")
def net():
    """tiny() with its defaults, for the tests that only run it: each graph it compiles (per input shape) is reused."""
    return tiny()


def reference_loss(logits, labels):
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    labels = labels.reshape(-1)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -log_probs[np.arange(len(labels)), labels]
    mask = labels != PAD
    return (nll * mask).sum() / mask.sum()


def test_loss_is_masked_next_token_cross_entropy(net):
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 128, size=(2, 33)).astype(np.int32)
    ids[1, 20:] = PAD  # corpus-tail padding: these labels must not count
    loss = float(net(ms.Tensor(ids)).asnumpy())
    logits = net.logits(ms.Tensor(ids[:, :-1])).asnumpy()
    assert loss == pytest.approx(reference_loss(logits, ids[:, 1:]), rel=1e-5)
    assert loss == pytest.approx(np.log(128), abs=0.1)  # untrained: close to uniform


def test_attention_is_causal(net):
    ids = np.random.default_rng(1).integers(4, 128, size=(1, 32)).astype(np.int32)
    changed = ids.copy()
    changed[0, 20:] = 5
    # one batch of both rows: the (2, 32) logits graph, compiled once for the module
    a, b = net.logits(ms.Tensor(np.concatenate([ids, changed]))).asnumpy()
    np.testing.assert_allclose(a[:20], b[:20], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[20:], b[20:])


def test_parameter_names_follow_the_huggingface_checkpoint(net):
    names = [p.name for p in net.get_parameters()]
    assert names[:3] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.self_attn.q_proj.weight"]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert "model.layers.1.mlp.gate_proj.weight" in names


def test_float16_compute_tracks_float32(net):
    ids = ms.Tensor(np.random.default_rng(2).integers(4, 128, size=(2, 33)).astype(np.int32))
    loss32 = float(net(ids).asnumpy())  # the loss graph of this shape: compiled once for the module
    loss16 = float(tiny(compute_dtype="float16")(ids).asnumpy())
    assert loss16 == pytest.approx(loss32, abs=2e-2)


def test_document_attention_isolates_packed_documents(net):
    eod = 2
    doc_a = [10, 11, 12, 13, 14, eod]
    doc_b = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    packed = doc_a + doc_b + [30] * 16        # 32 tokens
    alone = doc_b + [30] * 22
    rows = ms.Tensor(np.array([packed, alone], dtype=np.int32))  # one batch, so one graph per net
    # one layer: a position or a token of document A reaching document B changes its logits in any layer
    packed_logits, alone_logits = tiny(document_attention=True, eos_token_id=eod, num_layers=1).logits(rows).asnumpy()
    # Document B sees neither document A nor its positions: same logits as when it starts the row.
    np.testing.assert_allclose(packed_logits[6:16], alone_logits[:10], rtol=1e-5, atol=1e-5)
    assert (net.config.document_attention, net.config.eos_token_id) == (False, eod)  # plain attention
    packed_logits, alone_logits = net.logits(rows).asnumpy()  # the module's (2, 32) logits graph
    assert not np.allclose(packed_logits[6:16], alone_logits[:10], atol=1e-4)


@pytest.mark.parametrize("fields", [dict(), dict(vocab_size=100), dict(vocab_size=100, tie_word_embeddings=True)])
def test_fused_loss_equals_the_vocabulary_parallel_operators_and_torch(fields):
    """Stand-alone and data-parallel runs take the fused kernel (WholeVocabularyCrossEntropy), semi-auto parallel
    the vocabulary-parallel operators (CrossEntropy): same loss and gradients, and PyTorch's cross_entropy with
    ignore_index on the same logits; padding labels count nowhere, a batch of padding only has loss 0.

    A vocabulary of 100 is padded to tables of 112 rows: the logits have 100 columns (no probability on a
    padded row) and neither loss gives a padded row a gradient. One decoder layer: the losses take the head's
    logits, whatever computed the hidden states (and each of the three graphs compiles in half the time).
    """
    import torch

    net = tiny(num_layers=1, **fields)
    assert net.whole_vocabulary_loss  # built stand-alone
    head = net.model.embed_tokens.weight if net.tie_word_embeddings else net.lm_head.weight
    padded = net.vocab_size != 128
    if padded:
        assert net.model.embed_tokens.weight.shape == (112, 32) and head.shape == (112, 32)
    rng = np.random.default_rng(1)
    ids = rng.integers(4, net.vocab_size, size=(3, 33)).astype(np.int32)
    ids[1, 12:] = PAD
    ids[2, 32] = PAD
    results, grad_fns = {}, {}
    for fused in (True, False):
        net.whole_vocabulary_loss = fused
        # A new function per setting: a graph compiled once is reused whatever the attribute says afterwards.
        grad_fns[fused] = ms.value_and_grad(net, None, net.trainable_params())
        loss, grads = grad_fns[fused](ms.Tensor(ids))
        results[fused] = (float(loss.asnumpy()), [g.asnumpy() for g in grads])
    (fused_loss, fused_grads), (ops_loss, ops_grads) = results[True], results[False]
    assert fused_loss == pytest.approx(ops_loss, rel=2e-6)
    for a, b in zip(fused_grads, ops_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    if padded:
        names = [p.name for p in net.trainable_params()]
        for grads in (fused_grads, ops_grads):
            head_grad = grads[names.index(head.name)]
            assert np.abs(head_grad[100:]).max() == 0 and np.abs(head_grad[:100]).max() > 0
    logits = net.logits(ms.Tensor(ids[:, :-1])).asnumpy()
    assert logits.shape == (3, 32, net.vocab_size)
    logits = torch.tensor(logits).reshape(-1, net.vocab_size)
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[:, 1:]).reshape(-1).long(),
                                                 ignore_index=PAD)
    assert fused_loss == pytest.approx(float(expected), rel=2e-6)
    net.whole_vocabulary_loss = True  # the fused graph (compiled above for this shape) on a batch of padding only
    loss, grads = grad_fns[True](ms.Tensor(np.full(ids.shape, PAD, np.int32)))
    assert float(loss.asnumpy()) == 0.0 and not any(np.any(g.asnumpy()) for g in grads)


@pytest.mark.parametrize("fields", [dict(tie_word_embeddings=True), dict(qkv_bias=True), dict(num_kv_heads=1)])
def test_family_options_build_and_train(fields):
    net = tiny(num_layers=1, **fields)  # each option lives in every layer (or the head): one is enough
    ids = ms.Tensor(np.random.default_rng(4).integers(4, 128, size=(2, 33)).astype(np.int32))
    loss = float(net(ids).asnumpy())
    assert loss == pytest.approx(np.log(128), abs=0.15)


def test_config_defaults_are_the_recipe_model_sections():
    """LlamaConfig and the recipe's model.model_config are one definition (models/config.py): same fields, defaults."""
    import dataclasses

    from ascend_llm_recipes.models.config import ModelConfig

    sizes = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=96, seq_length=32)
    recipe_section, model_config = ModelConfig(**sizes), LlamaConfig(**sizes)
    for f in dataclasses.fields(ModelConfig):
        if f.name != "type":
            assert getattr(model_config, f.name) == getattr(recipe_section, f.name) or \
                f.name == "num_kv_heads" and model_config.num_kv_heads == recipe_section.kv_heads, f.name
    assert model_config.pad_token_id == recipe_section.pad_token_id == 3
    assert LlamaConfig(**sizes, num_kv_heads=None).num_kv_heads == recipe_section.kv_heads == 4
    assert LlamaConfig().to_dict()["hidden_size"] == 4096  # MindFormers builds a default instance to diff against


def test_config_prints_its_architecture_with_mindformers_parallel_config_attached():
    """lazy_inline keys compiled cells by str() of the constructor's arguments (mindspore/graph/lazy_inline.py:228),
    and MindFormers attaches its dict-like parallel config to the model config before building it."""
    from mindformers import MindFormerConfig

    fields = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=96, seq_length=32)
    config = LlamaConfig(**fields)
    config.parallel_config = MindFormerConfig(data_parallel=2, model_parallel=2, pipeline_stage=2)
    assert "hidden_size=32" in str(config) and "num_layers=2" in str(config)
    assert str(config) != str(LlamaConfig(**{**fields, "num_layers": 4}))
