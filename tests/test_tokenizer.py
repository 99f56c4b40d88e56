"""Users' own tokenizers: a real Llama-2-layout sentencepiece model (no pad id) and the HF tokenizer.json
transformers converts from it, through data preparation, the dataset-vs-recipe check and the loss."""

import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from conftest import LLAMA2_LAYOUT_SP_MODEL
from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.clean import clean_document
from ascend_llm_recipes.data.mindrecord_io import read_manifest, read_samples
from ascend_llm_recipes.data.text.pipeline import PrepareOptions
from ascend_llm_recipes.data.prepare import check_dataset, prepare_dataset
from ascend_llm_recipes.data.tokenizer import HF, NO_PAD, SENTENCEPIECE, load_tokenizer

SP_MODEL = LLAMA2_LAYOUT_SP_MODEL

ENGLISH = ["The quick brown fox jumps over the lazy dog. It was 3.14 degrees at 12:30 in New York.",
           "def mean(values):\n    return sum(values) / len(values)\n",
           " A leading space, two  spaces, a blank line\n\nand a trailing space ",
           "Tokenizers split text into pieces; rare words like antidisestablishmentarianism become several.",
           "Markup that names special tokens, <s> and </s> and <unk>, is text: no document ends here."]
CHINESE = ["今天天气很好，我们去公园散步吧。北京是中华人民共和国的首都。",
           "机器学习模型需要大量的训练数据，数据质量比数量更重要。",
           "混合文本：Python 3.11 的性能提升了百分之二十五。"]


@pytest.fixture
def hf_dir(llama2_hf_tokenizer):
    return llama2_hf_tokenizer


def corpus(tmp_path, texts):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def stream_of(dataset_dir):
    """The token stream of a stream-packed dataset (rows overlap by one)."""
    samples = list(read_samples(dataset_dir, read_manifest(dataset_dir)))
    return [int(t) for t in samples[0]] + [int(t) for s in samples[1:] for t in s[1:]]


def test_llama2_layout_and_hf_tokenizers_load_with_their_own_special_ids(hf_dir):
    sp = load_tokenizer(SP_MODEL)
    hf = load_tokenizer(hf_dir)  # the HF model directory: its tokenizer.json
    assert hf.path == os.path.join(hf_dir, "tokenizer.json")
    for tok, kind in ((sp, SENTENCEPIECE), (hf, HF)):
        assert (tok.kind, tok.vocab_size, tok.unk_id, tok.bos_id, tok.eod_id, tok.pad_id, tok.eod_token) == \
            (kind, 32000, 0, 1, 2, NO_PAD, "</s>")


def test_sentencepiece_and_its_hf_conversion_give_the_same_ids(hf_dir):
    """English, code, whitespace runs and Chinese give identical ids through both. (transformers documents
    that its non-legacy conversion, legacy=False, tokenizes differently after special tokens; not used here.)"""
    sp, hf = load_tokenizer(SP_MODEL), load_tokenizer(hf_dir)
    texts = ENGLISH + CHINESE
    assert hf.encode_batch(texts) == sp.encode_batch(texts)
    assert any(i > 20000 for ids in hf.encode_batch(CHINESE) for i in ids)  # CJK pieces, not only byte fallback
    assert [sp.decode(ids) for ids in sp.encode_batch(texts)] == texts


@pytest.mark.parametrize("which", ["sentencepiece", "hf"])
def test_a_users_tokenizer_without_pad_prepares_data_padded_with_minus_one(tmp_path, hf_dir, which):
    """Documents end with </s> (2), the tail pads with -1 (never a real id), the manifest records it all."""
    source = SP_MODEL if which == "sentencepiece" else hf_dir
    texts = ENGLISH + CHINESE
    out = str(tmp_path / "ds")
    manifest = prepare_dataset(out, 64, inputs=[corpus(tmp_path, texts)], tokenizer=source, show_progress=False,
                               min_chars=1, workers=0)
    tok = manifest["tokenizer"]
    expected_file = "tokenizer.model" if which == "sentencepiece" else "tokenizer.json"
    assert (tok["file"], tok["kind"], tok["vocab_size"], tok["eod_id"], tok["eod_token"], tok["pad_id"]) == \
        (expected_file, which, 32000, 2, "</s>", -1)
    assert len(tok["sha256"]) == 64 and os.path.isfile(os.path.join(out, expected_file))
    stream = stream_of(out)
    real, tail = stream[:stream.index(-1)], stream[stream.index(-1):]
    assert set(tail) == {-1}  # padding only at the tail
    cleaned = [clean_document(t, PrepareOptions(min_chars=1).clean())[1] for t in texts]
    expected = [i for ids in load_tokenizer(SP_MODEL).encode_batch(cleaned) for i in ids + [2]]
    assert real == expected
    # The dataset-vs-recipe check compares the padding id: a recipe masking id 3 (<0x00>) is refused.
    with pytest.raises(DataError, match=r"pad_id -1 \(model\.model_config\.pad_token_id is 3; the tokenizer has no "
                                        r"pad token: set pad_token_id to -1"):
        check_dataset(out, 64, 32000, 3, 2)
    check_dataset(out, 64, 32000, -1, 2)


def test_hf_tokenizer_in_worker_processes_writes_the_same_shards(tmp_path, hf_dir):
    texts = [f"{t} ({i})" for i in range(40) for t in ENGLISH + CHINESE]
    path = corpus(tmp_path, texts)
    one = prepare_dataset(str(tmp_path / "one"), 64, inputs=[path], tokenizer=hf_dir, show_progress=False, workers=0)
    two = prepare_dataset(str(tmp_path / "two"), 64, inputs=[path], tokenizer=hf_dir, show_progress=False, workers=2)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]


def test_a_users_vocabulary_not_a_multiple_of_16_is_accepted_and_reported(tmp_path):
    """Only tokenizers we train are forced to a multiple of 16; the model pads its tables for the rest."""
    model = tmp_path / "odd"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(ENGLISH * 20 + CHINESE * 20), model_prefix=str(model),
                                   vocab_size=401, model_type="bpe", byte_fallback=True, minloglevel=2)
    manifest = prepare_dataset(str(tmp_path / "ds"), 64, inputs=[corpus(tmp_path, ENGLISH)],
                               tokenizer=str(model) + ".model", show_progress=False, min_chars=1, workers=0)
    assert manifest["tokenizer"]["vocab_size"] == 401
    assert "401 is not a multiple of 16" in manifest["tokenizer"]["vocab_note"]
    with pytest.raises(DataError, match="vocab_size 401 is not a multiple of 16; use 416"):
        prepare_dataset(str(tmp_path / "trained"), 64, 401, inputs=[corpus(tmp_path, ENGLISH)], show_progress=False)


def test_a_directory_without_a_tokenizer_is_refused_with_what_to_pass(tmp_path):
    with pytest.raises(DataError, match="holds neither tokenizer.json nor tokenizer.model"):
        prepare_dataset(str(tmp_path / "ds"), 64, inputs=[corpus(tmp_path, ENGLISH)], tokenizer=str(tmp_path),
                        show_progress=False)
    assert not os.path.exists(tmp_path / "ds")


def test_minus_one_padding_keeps_the_loss_of_the_real_tokens_exact():
    """A row padded with -1 has the loss of its real tokens alone (no id is borrowed for padding)."""
    import mindspore as ms
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                       intermediate_size=96, seq_length=32, pad_token_id=-1))
    ids = np.random.default_rng(0).integers(0, 128, size=(1, 33)).astype(np.int32)
    padded = ids.copy()
    padded[0, 20:] = -1
    logits = net.logits(ms.Tensor(ids[:, :-1])).asnumpy()[0, :19].astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = -log_probs[np.arange(19), ids[0, 1:20]].mean()
    assert float(net(ms.Tensor(padded)).asnumpy()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name, message", [("notes.model", "cannot be loaded as a sentencepiece model"),
                                           ("tokenizer.json", "cannot be loaded as an HF tokenizer.json")])
def test_a_file_that_is_no_tokenizer_is_refused_by_kind(tmp_path, name, message):
    (tmp_path / name).write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=message):
        prepare_dataset(str(tmp_path / "ds"), 64, inputs=[corpus(tmp_path, ENGLISH)], tokenizer=str(tmp_path / name),
                        show_progress=False)
    assert not os.path.exists(tmp_path / "ds")


def test_a_pad_id_that_is_a_text_piece_is_not_used_for_padding(tmp_path, tiny_dataset):
    """Padding never borrows a piece that text can produce: its labels would be dropped from the loss."""
    from sentencepiece import sentencepiece_model_pb2

    ours = os.path.join(tiny_dataset, "tokenizer.model")
    assert load_tokenizer(ours).pad_id == 3  # our trained models: a dedicated control piece
    proto = sentencepiece_model_pb2.ModelProto()
    with open(ours, "rb") as f:
        proto.ParseFromString(f.read())
    proto.pieces[3].type = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    (tmp_path / "edited.model").write_bytes(proto.SerializeToString())
    assert load_tokenizer(str(tmp_path / "edited.model")).pad_id == NO_PAD
