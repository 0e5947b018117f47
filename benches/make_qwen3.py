"""Makes a random-weight decoder embedder of Qwen3-Embedding-0.6B's shape for the speed
benchmark (`BENCH_MODEL=qwen3-0.6b benches/run.sh speed`, which runs this into
benches/out/qwen3-0.6b): there is no model hub here, and speed does not depend on what
the weights learned.

Shape, as Qwen3-Embedding-0.6B's config.json: hidden 1024, 28 layers, 16 query heads and
8 key/value heads of head_dim 128 (so the query width 2048 is twice hidden), q/k
RMSNorm, SwiGLU feed-forward 2 x 3072, rms_norm_eps 1e-6, rope_theta 1e6,
max_position_embeddings 32768, no attention bias, no sliding window: ~440M parameters
outside the embedding table, ~1.8 GB in float32 (stored as float32 safetensors, one file).

The vocabulary is not Qwen's (151,669 rows; its tokenizer is not reachable here either):
a byte-level BPE in Qwen2/3's layout (NFC, Qwen2's split regex, ByteLevel; `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` after the trained vocabulary; a post-processor that appends
`<|endoftext|>` to every text, also after truncation; padding on the LEFT), trained on text
from benches/corpus.py's grammar and its words alone, with a cap of 8,192 tokens; it
saturates at 1,544 (the grammar has 232 words), so every word is one token, with or without
the space before it (real text splits rare words; the corpora are sized in this tokenizer's
tokens, so lengths match the other rows': short ~23 tokens a sentence). Embedding rows do not
affect forward speed (a lookup of one row per token); the corpora are measured with this
tokenizer (benches/corpus.py), so their token counts are what the benchmark reports either
way. The tokenizer layout is models/tests/data/make_tiny_families.py's `qwen_bpe`.

sentence-transformers directory: last-token pooling (`pooling_mode_lasttoken`, the
`<|endoftext|>` appended), Normalize, max_seq_length 256 (so the long corpus's passages are
truncated to 256 tokens as in the other rows), Qwen3-Embedding's `query` prompt (unused by
the benchmark). Weights: every parameter from one seeded generator, 0.02 x N(0, 1), RMSNorm
weights 1 + 0.1 x N(0, 1); the same files on every run.

    .venv-bench/bin/python benches/make_qwen3.py --out benches/out/qwen3-0.6b

About a minute and ~5 GB of memory on 2 cores.
"""

import argparse
import json
import os
import random
import shutil
import sys

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import Qwen3Config, Qwen3Model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402  (benches/corpus.py: the grammar the corpora are made from)

SEED = 20261130
MAX_SEQ = 256
VOCAB_CAP = 8192
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
}
QWEN_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# Qwen2Tokenizer's pre-tokenization regex (transformers' tokenization_qwen2.py, the hub's
# Qwen3 tokenizer.json), as in models/tests/data/make_tiny_families.py.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


class WordCounter:
    """corpus.sentence's counter, one token a word: the training text needs no tokenizer."""

    def word(self, w):
        return 1


def training_text(n=20000):
    """Sentences and passages from benches/corpus.py's grammar, seeded, and every word of
    its word lists alone (lower case and capitalized): corpus.py sizes sentences by the
    tokens of each word alone, which must be the word's count inside a sentence too (one
    token, with or without the space before it), or the short corpus would come out at
    about 10 tokens a sentence instead of about 25."""
    rng = random.Random(SEED)
    counter = WordCounter()
    sentences = [corpus.sentence(rng, counter, rng.randint(8, 30)) for _ in range(n)]
    passages = [" ".join(sentences[i:i + 12]) for i in range(0, n, 12)]
    words = sorted(
        set(corpus.DETERMINERS + corpus.ADJECTIVES + corpus.NOUNS + corpus.VERBS
            + corpus.PREPOSITIONS + corpus.ADVERBS + corpus.CONJUNCTIONS + corpus.NAMES)
    )
    alone = [w for w in words for _ in range(50)] + [w.capitalize() for w in words for _ in range(50)]
    return sentences + passages + alone


def qwen_bpe() -> Tokenizer:
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
        vocab_size=VOCAB_CAP, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0",
        pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)],
    )
    return tok


def randomize(model: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(os.path.join(args.out, "1_Pooling"))
    tok = qwen_bpe()
    tok.save(os.path.join(args.out, "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")
    write_json(
        os.path.join(args.out, "tokenizer_config.json"),
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

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"],
        num_hidden_layers=SHAPE["num_hidden_layers"],
        num_attention_heads=SHAPE["num_attention_heads"],
        num_key_value_heads=SHAPE["num_key_value_heads"],
        head_dim=SHAPE["head_dim"],
        hidden_act="silu",
        max_position_embeddings=SHAPE["max_position_embeddings"],
        rms_norm_eps=SHAPE["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": float(SHAPE["rope_theta"])},
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    config.architectures = ["Qwen3Model"]
    model = Qwen3Model(config)
    randomize(model, SEED)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    model.save_pretrained(args.out, max_shard_size="20GB")
    assert os.path.isfile(os.path.join(args.out, "model.safetensors")), os.listdir(args.out)
    # config.json as Qwen3-Embedding-0.6B publishes it (transformers 4.5x spelling), but
    # float32 and this vocabulary.
    write_json(
        os.path.join(args.out, "config.json"),
        {
            "architectures": ["Qwen3Model"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": eot,
            "eos_token_id": eot,
            "head_dim": SHAPE["head_dim"],
            "hidden_act": "silu",
            "hidden_size": SHAPE["hidden_size"],
            "initializer_range": 0.02,
            "intermediate_size": SHAPE["intermediate_size"],
            "max_position_embeddings": SHAPE["max_position_embeddings"],
            "max_window_layers": SHAPE["num_hidden_layers"],
            "model_type": "qwen3",
            "num_attention_heads": SHAPE["num_attention_heads"],
            "num_hidden_layers": SHAPE["num_hidden_layers"],
            "num_key_value_heads": SHAPE["num_key_value_heads"],
            "rms_norm_eps": SHAPE["rms_norm_eps"],
            "rope_scaling": None,
            "rope_theta": SHAPE["rope_theta"],
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab_size,
        },
    )
    write_json(
        os.path.join(args.out, "modules.json"),
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    write_json(
        os.path.join(args.out, "1_Pooling/config.json"),
        {
            "word_embedding_dimension": SHAPE["hidden_size"],
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": True,
            "include_prompt": True,
        },
    )
    write_json(os.path.join(args.out, "sentence_bert_config.json"),
               {"max_seq_length": MAX_SEQ, "do_lower_case": False})
    write_json(
        os.path.join(args.out, "config_sentence_transformers.json"),
        {"prompts": {"query": QWEN_QUERY, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"},
    )
    print(json.dumps({"out": args.out, "vocab": vocab_size, "non_embedding_params": params}))


if __name__ == "__main__":
    main()
