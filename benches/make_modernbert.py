"""Makes a random-weight ModernBERT of all-MiniLM-L6-v2's width and depth for the speed
benchmark (`BENCH_MODEL=modernbert-mini benches/run.sh speed`, which runs this into
benches/out/modernbert-mini): there is no model hub here, and speed does not depend on
what the weights learned.

Shape: hidden 384, 6 layers, 6 heads of 64 (MiniLM has 12 of 32, so attention's shape
differs), a gated feed-forward of 2 x 768, local attention
128 (so the long corpus's 256-token texts use the sliding window), global attention on
every third layer, MiniLM's tokenizer (so both corpora tokenize as in the MiniLM rows),
mean pooling and Normalize, max_seq_length 256.

    .venv-bench/bin/python benches/make_modernbert.py --minilm DIR --out benches/out/modernbert-mini
"""

import argparse
import json
import os
import shutil

import torch
from transformers import ModernBertConfig, ModernBertModel


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minilm", required=True, help="all-MiniLM-L6-v2's directory (its tokenizer)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(os.path.join(args.out, "1_Pooling"))
    vocab = json.load(open(os.path.join(args.minilm, "tokenizer.json")))["model"]["vocab"]
    shutil.copy(os.path.join(args.minilm, "tokenizer.json"), args.out)
    cfg = json.load(open(os.path.join(args.minilm, "tokenizer_config.json")))
    # ModernBERT takes no token_type_ids.
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    write_json(os.path.join(args.out, "tokenizer_config.json"), cfg)

    torch.manual_seed(0)
    config = ModernBertConfig(
        vocab_size=len(vocab),
        hidden_size=384,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=6,
        max_position_embeddings=512,
        local_attention=128,
        global_attn_every_n_layers=3,
        pad_token_id=vocab["[PAD]"],
        bos_token_id=vocab["[CLS]"],
        cls_token_id=vocab["[CLS]"],
        eos_token_id=vocab["[SEP]"],
        sep_token_id=vocab["[SEP]"],
    )
    ModernBertModel(config).save_pretrained(args.out)
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
        {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True},
    )
    write_json(os.path.join(args.out, "sentence_bert_config.json"), {"max_seq_length": 256})


if __name__ == "__main__":
    main()
