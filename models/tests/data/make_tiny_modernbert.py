"""Generates the tiny random-weight ModernBERT fixtures in this folder and their
reference outputs, computed by sentence-transformers / transformers on CPU in float32.

tests/fixtures/ has no ModernBERT model, and there is no model hub here, so these are
made like the shared ones: random weights, a tokenizer trained on the fixture texts, the
reference from the pipeline users compare against. Run from the repository root:

    .venv-bench/bin/python models/tests/data/make_tiny_modernbert.py

Two models, to cover what real checkpoints differ in:
- tiny-modernbert-mean: config.json in the Hugging Face hub's format (answerdotai/
  ModernBERT-base, nomic-ai/modernbert-embed-base write `global_attn_every_n_layers`,
  `global_rope_theta`, `local_rope_theta`), no biases (as every published ModernBERT),
  mean pooling, prompts in config_sentence_transformers.json.
- tiny-modernbert-cls: config.json as transformers 5.x `save_pretrained` writes it
  (`layer_types`, `rope_parameters`), every bias on, CLS pooling.

- tiny-modernbert-reranker: `ModernBertForSequenceClassification` with one label (the
  gte-reranker-modernbert architecture), mean pooling before its head, hub config
  spelling, pairs truncated at `model_max_length` 128; its reference follows
  tests/fixtures/tiny-cross-encoder (same queries and documents, `raw_scores` the
  logits, `scores` their sigmoid), computed with transformers.

All use a small `local_attention` so that sliding-window layers truncate what a token
sees inside the fixture's longer texts, as 128 does in real models on long inputs.
"""

import json
import os
import shutil
import sys

import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TEXTS = json.load(open(os.path.join(ROOT, "tests/fixtures/tiny-xlmr-mean/reference.json")))[
    "texts"
]
SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]


def tokenizer() -> Tokenizer:
    """A byte-level BPE with ModernBERT's special tokens and `[CLS] $A [SEP]` template."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


def tokenizer_files(out: str, **tokenizer_config) -> dict:
    """Writes tokenizer.json and tokenizer_config.json to `out`; returns the config
    sizes every fixture shares (4 layers: global, local, local, global)."""
    tok = tokenizer()
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokenizer_config,
            "model_input_names": ["input_ids", "attention_mask"],
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
        },
    )
    return dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_activation="gelu",
        max_position_embeddings=512,
        norm_eps=1e-5,
        local_attention=16,
        pad_token_id=ids["[PAD]"],
        bos_token_id=ids["[CLS]"],
        cls_token_id=ids["[CLS]"],
        eos_token_id=ids["[SEP]"],
        sep_token_id=ids["[SEP]"],
    )


def randomize(model: torch.nn.Module, seed: int):
    """Every parameter random, LayerNorm gammas around 1, so no weight is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def make(name: str, *, hub_format: bool, bias: bool, pooling: str, prompts: dict, seed: int):
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "1_Pooling"))
    sizes = tokenizer_files(out, model_max_length=8192, clean_up_tokenization_spaces=True)
    sizes.update(norm_bias=bias, attention_bias=bias, mlp_bias=bias, classifier_pooling=pooling)
    rope = dict(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    config = ModernBertConfig(**sizes, **rope)
    # Layers 0 and 3 global, 1 and 2 sliding: both kinds, and a global one after locals.
    assert config.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ], config.layer_types
    model = ModernBertModel(config)
    randomize(model, seed)
    model.save_pretrained(out)
    if hub_format:
        # The hub's published configs predate `layer_types` / `rope_parameters`.
        cfg = {
            "architectures": ["ModernBertModel"],
            "model_type": "modernbert",
            **sizes,
            **rope,
            "torch_dtype": "float32",
        }
        write_json(os.path.join(out, "config.json"), cfg)
    write_json(
        os.path.join(out, "modules.json"),
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    write_json(
        os.path.join(out, "1_Pooling/config.json"),
        {
            "word_embedding_dimension": 32,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "include_prompt": True,
        },
    )
    write_json(
        os.path.join(out, "sentence_bert_config.json"),
        {"max_seq_length": 128, "do_lower_case": False},
    )
    write_json(
        os.path.join(out, "config_sentence_transformers.json"),
        {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )

    st = SentenceTransformer(out, device="cpu")
    assert st.max_seq_length == 128
    emb = st.encode(TEXTS, batch_size=8, convert_to_numpy=True, normalize_embeddings=False)
    # The eager attention path must agree with the SDPA one sentence-transformers ran:
    # the reference is the model, not one attention kernel.
    eager = SentenceTransformer(out, device="cpu", model_kwargs={"attn_implementation": "eager"})
    emb_eager = eager.encode(TEXTS, batch_size=3, convert_to_numpy=True)
    assert abs(emb - emb_eager).max() < 1e-5, abs(emb - emb_eager).max()
    # What sentence-transformers fed the model: texts as given (not stripped), truncated.
    counts = [int(m.sum()) for m in st.tokenize(TEXTS)["attention_mask"]]
    assert max(counts) == 128 and min(counts) == 2, counts
    assert sum(c > 16 for c in counts) >= 5, "the sliding window must matter for some texts"
    reference = {
        "pooling": pooling,
        "normalize": True,
        "max_seq_length": 128,
        "texts": TEXTS,
        "token_counts": counts,
        "embeddings": emb.tolist(),
    }
    if prompts:
        name0, prefix = next(iter(prompts.items()))
        reference["prompt_name"] = name0
        reference["prompted_embeddings"] = st.encode(
            TEXTS[:4], prompt_name=name0, convert_to_numpy=True
        ).tolist()
        assert prefix
    write_json(os.path.join(out, "reference.json"), reference)
    print(name, "written; token counts", counts, file=sys.stderr)


def make_reranker(name: str, seed: int):
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sizes = tokenizer_files(out, model_max_length=128)
    sizes.update(
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        classifier_pooling="mean",
        classifier_activation="gelu",
        classifier_bias=False,
        num_labels=1,
    )
    rope = dict(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    model = ModernBertForSequenceClassification(ModernBertConfig(**sizes, **rope))
    randomize(model, seed)
    model.save_pretrained(out)
    cfg = {
        "architectures": ["ModernBertForSequenceClassification"],
        "model_type": "modernbert",
        **{k: v for k, v in sizes.items() if k != "num_labels"},
        **rope,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "torch_dtype": "float32",
    }
    write_json(os.path.join(out, "config.json"), cfg)

    shared = json.load(open(os.path.join(ROOT, "tests/fixtures/tiny-cross-encoder/reference.json")))
    tokz = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    cases = []
    for case in shared["cases"]:
        q, docs = case["query"], case["documents"]
        enc = tokz([q] * len(docs), docs, padding=True, truncation=True, return_tensors="pt")
        assert enc["input_ids"].shape[1] == 128, "the long document must be truncated"
        with torch.no_grad():
            logits = model(**enc).logits[:, 0]
        cases.append(
            {
                "query": q,
                "documents": docs,
                "raw_scores": logits.tolist(),
                "scores": torch.sigmoid(logits).tolist(),
            }
        )
    write_json(os.path.join(out, "reference.json"), {"max_length": 128, "score": "sigmoid", "cases": cases})
    print(name, "written", file=sys.stderr)


if __name__ == "__main__":
    torch.manual_seed(0)
    make(
        "tiny-modernbert-mean",
        hub_format=True,
        bias=False,
        pooling="mean",
        prompts={"query": "search_query: ", "document": "search_document: "},
        seed=1,
    )
    make("tiny-modernbert-cls", hub_format=False, bias=True, pooling="cls", prompts={}, seed=2)
    make_reranker("tiny-modernbert-reranker", seed=3)
