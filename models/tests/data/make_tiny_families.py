"""Generates tiny random-weight fixtures for the model families beyond BERT / XLM-R /
ModernBERT, and their reference outputs, computed by sentence-transformers 6.2 /
transformers 5.24 / torch 2.15 on CPU in float32.

There is no model hub here, so these are made like make_tiny_modernbert.py's: random
weights, tokenizers built from the fixture texts (tests/fixtures/tiny-xlmr-mean's 24), and
the reference from the pipeline users compare against (`SentenceTransformer(...).encode`,
the model's full pipeline: `embeddings` are normalized exactly when modules.json has a
Normalize module). Run from the repository root (~15 s on 2 cores; the output is
byte-for-byte the same on every run):

    .venv-bench/bin/python models/tests/data/make_tiny_families.py

Every folder is a complete sentence-transformers directory. All use `max_seq_length` 64,
so the fixture's long texts are truncated (`token_counts` are after truncation, special
tokens included). Each reference is checked to be padding-independent (batches of 8 vs
one text at a time, max abs diff < 1e-5) and attention-kernel-independent (SDPA vs
eager), and sentence-transformers' input ids are checked to be exactly tokenizer.json's
on its own (`tokenizers.Tokenizer.from_file`, truncation at 64). That matters because
transformers 5 builds MPNetTokenizer / DistilBertTokenizer / Qwen2Tokenizer from the
class's own normalizer and pre-tokenizer, taking only the vocabulary, merges and
post-processor from tokenizer.json; these tokenizer.json files agree with the classes.
`prompted_embeddings` (where a prompt applies) are for `texts[:4]` with `prompt_name`,
encoded as `prompt + text` (plain concatenation, no separator), as make_tiny_modernbert.py.

- tiny-mpnet-mean: `MPNetModel` (all-mpnet-base-v2's architecture: relative position
  buckets, 32 of them, so distances >= 8 fall in the log-spaced buckets), RoBERTa-style
  position ids (padding_idx 1), a lowercasing WordPiece with `<s>`=0 `<pad>`=1 `</s>`=2
  `<unk>`=3 `<mask>`=4 and all-mpnet's `RobertaProcessing` post-processor
  (`<s> $A </s>`, pair `<s> $A </s> </s> $B </s>`), mean pooling, Normalize. Prompt
  `query` = "query: " with `"include_prompt": false` in 1_Pooling/config.json, so
  `prompted_embeddings` leave the prompt's tokens out of the mean. What sentence-
  transformers 6.2 does (base/modules/transformer.py `_get_prompt_length`, l. 2189-2214):

      tokenized_prompt = self.preprocess([prompt], **kwargs)   # the prompt alone
      prompt_length = tokenized_prompt["input_ids"].shape[-1]  # special tokens included
      last_token = tokenized_prompt["input_ids"][..., -1].item()
      if tokenizer is not None and hasattr(tokenizer, "all_special_ids") and last_token in tokenizer.all_special_ids:
          prompt_length -= 1

  i.e. `<s> query : </s>` is 4 ids, minus the trailing `</s>`: `prompt_length` 3, which
  COUNTS the leading `<s>`. encode() puts it in the features only for text prompts
  (l. 1386-1423); sentence_transformer/modules/pooling.py uses it only when
  `include_prompt` is false (l. 127-132), and `_exclude_prompt_from_mask` (l. 154-168):

      pad_lengths = attention_mask.argmax(dim=1)   # leading pads per row
      if pad_lengths.sum() == 0: attention_mask[:, :prompt_length] = 0
      else: attention_mask[positions < pad_lengths + prompt_length] = 0

  on a copy of the mask, for pooling only: the transformer ran on the whole prompted text
  with the full mask. The mean is then over the remaining real tokens (`</s>` included).
  reference.json has `include_prompt` false and `prompt_length` 3.
- tiny-distilbert-cls: `DistilBertModel`, BERT-style lowercasing WordPiece
  (`[CLS] $A [SEP]`, `[PAD]`=0), no token_type_ids (`model_input_names` input_ids,
  attention_mask), CLS pooling, NO Normalize: `embeddings` are the raw CLS vectors.
- tiny-bert-dense: `BertModel` (cased WordPiece, token_type_ids) + mean Pooling + a
  `Dense(32 -> 16, bias, Tanh)` + Normalize, built as `SentenceTransformer(modules=...)`
  and written by its own `save()`, so in sentence-transformers 6.2's own save format:
  1_Pooling/config.json is the new `{"embedding_dimension", "pooling_mode",
  "include_prompt"}` spelling, not the `pooling_mode_*_tokens` booleans; modules.json names
  the modules by their 6.x paths (`sentence_transformers.base.modules.transformer.
  Transformer`, `sentence_transformers.sentence_transformer.modules.pooling.Pooling`,
  `sentence_transformers.base.modules.dense.Dense`, `sentence_transformers.base.modules.
  normalize.Normalize`); 2_Dense/ holds config.json and model.safetensors (`linear.weight`
  [16, 32], `linear.bias`); 3_Normalize/config.json exists; sentence_bert_config.json has
  NO `max_seq_length`: 6.2 saves it as tokenizer_config.json's `model_max_length` (64).
  On load, a `max_seq_length` in sentence_bert_config.json wins; without one, the
  tokenizer's `model_max_length` is it. reference.json's `dense` is informational.
- tiny-qwen3-last: `Qwen3Model` (hidden 64, 4 query heads of head_dim 32 so the query
  width 128 != hidden, 2 KV heads, q/k RMSNorm, rope theta 1e6, untied), config.json in
  the hub's spelling (`rope_theta`, `torch_dtype`, as Qwen3-Embedding-0.6B publishes), a
  Qwen2-style byte-level BPE (NFC, the Qwen2 split regex, ByteLevel) with `<|endoftext|>`
  `<|im_start|>` `<|im_end|>` after the vocabulary and a post-processor that appends
  `<|endoftext|>` to every text (also after truncation) as Qwen3-Embedding's tokenizer.json
  does, padding on the LEFT (tokenizer_config.json `padding_side`; pad = `<|endoftext|>`),
  last-token pooling, Normalize, Qwen3-Embedding's `query` instruction prompt (18 tokens
  here; kept in the sequence, and the pooled token is still the final `<|endoftext|>`).
  Its weights make it the one folder over 500 KB (~550 KB).
- tiny-qwen3-sharded: another random Qwen3 of the same shape, config.json as transformers
  5 `save_pretrained` writes it (`rope_parameters`, `layer_types`, `dtype`), weights STORED
  in bfloat16 in 3 shards with model.safetensors.index.json (no model.safetensors). The
  reference is float32 compute on the bf16 values upcast (loaded with
  `model_kwargs={"dtype": torch.float32}`; transformers 5 would otherwise keep bfloat16),
  no prompts. reference.json's `stored_dtype` is informational.

Compare with cosine >= 0.9999 and max abs diff <= 1e-4, as for tests/fixtures.
"""

import glob
import json
import os
import shutil
import sys
from collections import Counter

import numpy as np
import torch
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    MPNetConfig,
    MPNetModel,
    Qwen3Config,
    Qwen3Model,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TEXTS = json.load(open(os.path.join(ROOT, "tests/fixtures/tiny-xlmr-mean/reference.json")))[
    "texts"
]
MAX_SEQ = 64
# Batched vs one-at-a-time: the reference must not depend on how rows were padded.
PAD_TOL = 1e-5
QWEN_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# Qwen2Tokenizer's pre-tokenization regex (transformers' tokenization_qwen2.py, the hub's
# Qwen3 tokenizer.json).
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


def randomize(model: torch.nn.Module, seed: int):
    """Every parameter random, (Layer/RMS)Norm gammas around 1, so no weight is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def wordpiece(specials: list, unk: str, lowercase: bool, vocab_size: int = 400, extra=()) -> Tokenizer:
    """A BERT-style WordPiece (BertNormalizer, BertPreTokenizer) with a vocabulary built from
    the texts: the specials, every character seen (alone and as `##c`), then the whole
    words, word prefixes and `##` suffixes seen at least twice, by count x (length - 1),
    then alphabetically. Built here
    rather than with `trainers.WordPieceTrainer`, whose vocabulary changes from run to run
    (it adds the `##` alphabet in hash-map order, which breaks merge ties differently)."""
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    pre = pre_tokenizers.BertPreTokenizer()
    words = Counter(
        w for text in TEXTS + list(extra) for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(text))
    )
    base = sorted({w[0] for w in words}) + sorted({"##" + c for w in words for c in w[1:]})
    seen = Counter()
    for w, n in words.items():
        for piece in [w[:j] for j in range(2, len(w) + 1)] + ["##" + w[i:] for i in range(1, len(w) - 1)]:
            seen[piece] += n
    score = {p: n * (len(p.removeprefix("##")) - 1) for p, n in seen.items() if n >= 2}
    ranked = sorted((p for p in score if p not in base), key=lambda p: (-score[p], p))
    vocab = {}
    for t in specials + base + ranked:
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(specials)
    return tok


def qwen_bpe() -> Tokenizer:
    """Qwen2/3's byte-level BPE layout; the three specials come after the trained vocab, as
    in the real one (there 151643..151645), and `<|endoftext|>` is appended to every text."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    # The instruction weighted so that it takes ~20 tokens (the real tokenizer: 18), not 49,
    # leaving room for the text in `max_seq_length` 64.
    tok.train_from_iterator(TEXTS * 3 + [QWEN_QUERY] * 20, trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0",
        pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)],
    )
    return tok


def fresh(name: str) -> str:
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


def st_files(out, *, dim, pooling, normalize, prompts=None, include_prompt=True, do_lower_case=False):
    """modules.json, 1_Pooling, sentence_bert_config.json, config_sentence_transformers.json
    in the format the hub's models have (legacy `pooling_mode_*` booleans)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    write_json(os.path.join(out, "modules.json"), modules)
    os.makedirs(os.path.join(out, "1_Pooling"))
    write_json(
        os.path.join(out, "1_Pooling/config.json"),
        {
            "word_embedding_dimension": dim,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken",
            "include_prompt": include_prompt,
        },
    )
    write_json(
        os.path.join(out, "sentence_bert_config.json"),
        {"max_seq_length": MAX_SEQ, "do_lower_case": do_lower_case},
    )
    write_json(
        os.path.join(out, "config_sentence_transformers.json"),
        {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )


def check_tokenization(out: str, st: SentenceTransformer, texts: list) -> list:
    """sentence-transformers' input ids must be exactly tokenizer.json's, truncated at
    max_seq_length; returns the token counts (special tokens included)."""
    raw = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    raw.enable_truncation(MAX_SEQ)
    feats = st.preprocess(texts)
    counts = []
    for text, ids, mask in zip(texts, feats["input_ids"], feats["attention_mask"]):
        mine = [int(i) for i, m in zip(ids, mask) if m]
        assert mine == raw.encode(text).ids, (text, mine, raw.encode(text).ids)
        counts.append(len(mine))
    return counts


def encode_checked(st, texts, what, **kw):
    """Batched (8, rows of mixed lengths padded together) and one by one must agree."""
    emb = st.encode(texts, batch_size=8, convert_to_numpy=True, **kw)
    alone = np.stack([st.encode([t], batch_size=1, convert_to_numpy=True, **kw)[0] for t in texts])
    diff = float(abs(emb - alone).max())
    print(f"  {what}: batched vs alone max abs diff {diff:.2e}", file=sys.stderr)
    assert diff < PAD_TOL, (what, diff)
    return emb


def reference(out, st, *, pooling, normalize, min_count, model_kwargs=None, extra=None):
    """Checks and writes reference.json (keys as in make_tiny_modernbert.py, plus `extra`)."""
    assert st.max_seq_length == MAX_SEQ, st.max_seq_length
    emb = encode_checked(st, TEXTS, "texts")
    # The eager attention path must agree with the SDPA one sentence-transformers ran:
    # the reference is the model, not one attention kernel.
    eager = SentenceTransformer(
        out, device="cpu", model_kwargs={**(model_kwargs or {}), "attn_implementation": "eager"}
    )
    assert eager[0].auto_model.config._attn_implementation == "eager"
    emb_eager = eager.encode(TEXTS, batch_size=3, convert_to_numpy=True)
    assert abs(emb - emb_eager).max() < 1e-5, abs(emb - emb_eager).max()
    counts = check_tokenization(out, st, TEXTS)
    assert max(counts) == MAX_SEQ and min(counts) == min_count, counts
    assert sum(c == MAX_SEQ for c in counts) >= 3, "the long texts must be truncated"
    assert len(set(counts)) >= 12, "a mix of lengths"
    ref = {
        "pooling": pooling,
        "normalize": normalize,
        "max_seq_length": MAX_SEQ,
        "texts": TEXTS,
        "token_counts": counts,
        "embeddings": emb.tolist(),
    }
    norms = np.linalg.norm(emb, axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize, norms
    if any(st.prompts.values()):
        name0, prefix = next((k, v) for k, v in st.prompts.items() if v)
        ref["prompt_name"] = name0
        ref["prompted_embeddings"] = encode_checked(
            st, TEXTS[:4], f"prompt {name0!r}", prompt_name=name0
        ).tolist()
    ref.update(extra or {})
    write_json(os.path.join(out, "reference.json"), ref)
    for path in glob.glob(os.path.join(out, "**/*"), recursive=True):
        if os.path.isfile(path):
            os.chmod(path, 0o644)  # safetensors files come out 0600
    print(os.path.basename(out), "written; token counts", counts, file=sys.stderr)
    return ref


def make_mpnet(name: str, seed: int):
    out = fresh(name)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = wordpiece(specials, "<unk>", lowercase=True, extra=["query: "])
    assert [tok.token_to_id(t) for t in specials] == [0, 1, 2, 3, 4]
    # all-mpnet-base-v2's tokenizer.json post-processor.
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "MPNetTokenizer",
            "do_lower_case": True,
            "model_max_length": 512,
            "model_input_names": ["input_ids", "attention_mask"],
            "bos_token": "<s>",
            "eos_token": "</s>",
            "cls_token": "<s>",
            "sep_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "mask_token": "<mask>",
        },
    )
    config = MPNetConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_act="gelu",
        max_position_embeddings=514,
        relative_attention_num_buckets=32,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    config.architectures = ["MPNetModel"]
    model = MPNetModel(config)
    randomize(model, seed)
    model.save_pretrained(out)
    prompts = {"query": "query: "}
    st_files(out, dim=32, pooling="mean", normalize=True, prompts=prompts, include_prompt=False,
             do_lower_case=False)

    st = SentenceTransformer(out, device="cpu")
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Normalize"], st
    assert st[0].auto_model.__class__.__name__ == "MPNetModel"
    assert st[1].pooling_mode == "mean" and st[1].include_prompt is False
    # ST 6.2 also lists its default prompt names ("query", "document"), empty when unset.
    assert {k: v for k, v in st.prompts.items() if v} == {k: v for k, v in prompts.items() if v}, st.prompts
    # What sentence-transformers excludes from pooling for the prompt, re-derived here.
    prompt_length = st[0]._get_prompt_length(prompts["query"])
    raw = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    prompt_ids = raw.encode(prompts["query"]).ids
    assert prompt_ids == [0, tok.token_to_id("query"), tok.token_to_id(":"), 2], prompt_ids
    assert prompt_length == len(prompt_ids) - 1 == 3, prompt_length
    ref = reference(
        out, st, pooling="mean", normalize=True, min_count=2,
        extra={"include_prompt": False, "prompt_length": prompt_length},
    )
    # Recompute the prompted embeddings by hand: transformer over the whole prompted text,
    # mean over the positions from prompt_length on, normalize.
    feats = st.preprocess([prompts["query"] + t for t in TEXTS[:4]])
    with torch.no_grad():
        hidden = st[0].auto_model(
            input_ids=feats["input_ids"], attention_mask=feats["attention_mask"]
        ).last_hidden_state
    mask = feats["attention_mask"].clone().float()
    mask[:, :prompt_length] = 0
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    mine = torch.nn.functional.normalize(mean, dim=-1).numpy()
    assert abs(mine - np.array(ref["prompted_embeddings"])).max() < 1e-6
    # Relative distances >= 8 (the log-spaced buckets) occur: long texts are 64 tokens.
    assert sum(c > 16 for c in ref["token_counts"]) >= 8


def make_distilbert(name: str, seed: int):
    out = fresh(name)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = wordpiece(specials, "[UNK]", lowercase=True)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "DistilBertTokenizer",
            "do_lower_case": True,
            "model_max_length": 512,
            "model_input_names": ["input_ids", "attention_mask"],
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
        },
    )
    config = DistilBertConfig(
        vocab_size=tok.get_vocab_size(),
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        activation="gelu",
        max_position_embeddings=512,
        sinusoidal_pos_embds=False,
        pad_token_id=0,
    )
    config.architectures = ["DistilBertModel"]
    model = DistilBertModel(config)
    randomize(model, seed)
    model.save_pretrained(out)
    st_files(out, dim=32, pooling="cls", normalize=False, do_lower_case=False)

    st = SentenceTransformer(out, device="cpu")
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling"], st
    assert st[0].auto_model.__class__.__name__ == "DistilBertModel"
    assert st[1].pooling_mode == "cls"
    assert "token_type_ids" not in st.preprocess(["a b"]), "DistilBERT takes no token_type_ids"
    reference(out, st, pooling="cls", normalize=False, min_count=2)


def make_bert_dense(name: str, seed: int):
    out = fresh(name)
    tmp = os.path.join(HERE, f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = wordpiece(specials, "[UNK]", lowercase=False, vocab_size=420)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.save(os.path.join(tmp, "tokenizer.json"))
    write_json(
        os.path.join(tmp, "tokenizer_config.json"),
        {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": False,
            "model_max_length": 512,
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
        },
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=0,
    )
    config.architectures = ["BertModel"]
    BertModel(config).save_pretrained(tmp)

    dense = st_models.Dense(32, 16, activation_function=torch.nn.Tanh())
    built = SentenceTransformer(
        modules=[
            st_models.Transformer(tmp, max_seq_length=MAX_SEQ),
            st_models.Pooling(32, pooling_mode="mean"),
            dense,
            st_models.Normalize(),
        ],
        device="cpu",
    )
    randomize(built, seed)
    built.save(out, create_model_card=False, safe_serialization=True)
    shutil.rmtree(tmp)
    assert "max_seq_length" not in json.load(open(os.path.join(out, "sentence_bert_config.json")))
    assert json.load(open(os.path.join(out, "tokenizer_config.json")))["model_max_length"] == MAX_SEQ
    assert not glob.glob(os.path.join(out, "**/*.bin"), recursive=True)
    assert os.path.isfile(os.path.join(out, "2_Dense/model.safetensors"))

    st = SentenceTransformer(out, device="cpu")
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Dense", "Normalize"], st
    assert st[0].auto_model.__class__.__name__ == "BertModel"
    assert isinstance(st[2].activation_function, torch.nn.Tanh)
    assert torch.equal(st[2].linear.weight, dense.linear.weight)
    assert "token_type_ids" in st.preprocess(["a b"])
    dense_config = json.load(open(os.path.join(out, "2_Dense/config.json")))
    reference(
        out, st, pooling="mean", normalize=True, min_count=2,
        extra={
            "dense": {
                "in_features": dense_config["in_features"],
                "out_features": dense_config["out_features"],
                "bias": dense_config["bias"],
                "activation": dense_config["activation_function"],
            }
        },
    )


def qwen3_config(vocab_size: int, eot: int) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    config.architectures = ["Qwen3Model"]
    return config


def qwen3_tokenizer_files(out: str) -> Tokenizer:
    tok = qwen_bpe()
    tok.save(os.path.join(out, "tokenizer.json"))
    write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "model_max_length": 32768,
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,
            "add_prefix_space": False,
            "errors": "replace",
            "model_input_names": ["input_ids", "attention_mask"],
            "bos_token": None,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
    return tok


def check_qwen3_st(st: SentenceTransformer, eot: int):
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Normalize"], st
    assert st[0].auto_model.__class__.__name__ == "Qwen3Model"
    assert st[1].pooling_mode == "lasttoken" and st[1].include_prompt
    cfg = st[0].auto_model.config
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 4, 2)
    assert cfg.rope_parameters["rope_theta"] == 1e6, cfg.rope_parameters
    feats = st.preprocess(TEXTS)
    ids, mask = feats["input_ids"], feats["attention_mask"]
    # Left padding: every row ends with a real token, the short ones start with padding,
    # and the last real token is the <|endoftext|> the post-processor appended.
    assert bool(mask[:, -1].all()) and not bool(mask[:, 0].all()), mask
    assert bool((ids[:, -1] == eot).all()), ids[:, -1]
    for row_ids, row_mask in zip(ids, mask):
        first = int(row_mask.argmax())
        assert bool(row_mask[first:].all()) and not bool(row_mask[:first].any())
        assert bool((row_ids[:first] == eot).all())


def make_qwen3_last(name: str, seed: int):
    out = fresh(name)
    tok = qwen3_tokenizer_files(out)
    eot = tok.token_to_id("<|endoftext|>")
    config = qwen3_config(tok.get_vocab_size(), eot)
    model = Qwen3Model(config)
    randomize(model, seed)
    model.save_pretrained(out)
    # config.json as the hub's Qwen3 checkpoints spell it (transformers 4.5x era).
    write_json(
        os.path.join(out, "config.json"),
        {
            "architectures": ["Qwen3Model"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": eot,
            "eos_token_id": eot,
            "head_dim": 32,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 96,
            "max_position_embeddings": 512,
            "max_window_layers": 2,
            "model_type": "qwen3",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": tok.get_vocab_size(),
        },
    )
    prompts = {"query": QWEN_QUERY, "document": ""}
    st_files(out, dim=64, pooling="lasttoken", normalize=True, prompts=prompts)

    st = SentenceTransformer(out, device="cpu")
    check_qwen3_st(st, eot)
    # ST 6.2 also lists its default prompt names ("query", "document"), empty when unset.
    assert {k: v for k, v in st.prompts.items() if v} == {k: v for k, v in prompts.items() if v}, st.prompts
    reference(out, st, pooling="lasttoken", normalize=True, min_count=1,
              extra={"padding_side": "left"})


def make_qwen3_sharded(name: str, seed: int):
    out = fresh(name)
    tok = qwen3_tokenizer_files(out)
    eot = tok.token_to_id("<|endoftext|>")
    model = Qwen3Model(qwen3_config(tok.get_vocab_size(), eot))
    randomize(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="100KB")
    shards = sorted(glob.glob(os.path.join(out, "model-*-of-*.safetensors")))
    assert 2 <= len(shards) <= 3 and not os.path.exists(os.path.join(out, "model.safetensors")), shards
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["dtype"] == "bfloat16", config
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys()), shard
    st_files(out, dim=64, pooling="lasttoken", normalize=True)

    kwargs = {"dtype": torch.float32}
    st = SentenceTransformer(out, device="cpu", model_kwargs=kwargs)
    check_qwen3_st(st, eot)
    loaded = dict(st[0].auto_model.named_parameters())
    assert set(loaded) == set(dict(model.named_parameters())), set(loaded) ^ set(dict(model.named_parameters()))
    for n, p in model.named_parameters():
        assert loaded[n].dtype == torch.float32 and torch.equal(loaded[n], p.float()), n
    reference(out, st, pooling="lasttoken", normalize=True, min_count=1, model_kwargs=kwargs,
              extra={"stored_dtype": "bfloat16"})


if __name__ == "__main__":
    torch.manual_seed(0)
    make_mpnet("tiny-mpnet-mean", seed=11)
    make_distilbert("tiny-distilbert-cls", seed=12)
    make_bert_dense("tiny-bert-dense", seed=13)
    make_qwen3_last("tiny-qwen3-last", seed=14)
    make_qwen3_sharded("tiny-qwen3-sharded", seed=15)
