"""Deterministic benchmark corpora, one text per line, measured with the model's tokenizer.

- `short`: 2,000 English-like sentences of 15 to 35 tokens (mean ~25), special tokens
  ([CLS], [SEP]) included, as all-MiniLM-L6-v2's tokenizer counts them: the size of a
  search query or a chat message, where per-call and padding overheads dominate.
- `long`: 200 passages of at least 280 tokens, which the model truncates to its
  max_seq_length of 256: the size of a document chunk, where the matrix multiplies and
  attention dominate.

Sentences come from a small grammar over a fixed word list and a seeded `random.Random`,
so the files are the same on every machine for the same tokenizer (the token counts are
what the benchmarks are about, so lengths are measured, not guessed). Some words are rare
enough to split into several word pieces, as real text does.

Usage: corpus.py --tokenizer MODEL_DIR/tokenizer.json --out-dir benches/out
writes corpus-short.txt, corpus-long.txt and corpus-stats.json there.
"""

import argparse
import json
import pathlib
import random
import statistics

SEED = 20261130

DETERMINERS = ["the", "a", "every", "each", "this", "that", "one", "some", "our", "their", "no"]
ADJECTIVES = """
quick quiet small large early late bright dark cold warm heavy light simple careful strange
ordinary ancient modern local distant narrow wide young old busy empty public private
northern southern gentle sudden steady rapid rural urban seasonal digital fragile durable
reliable noisy patient curious hidden familiar remarkable reluctant meticulous ambitious
transparent intermittent hydraulic volcanic botanical municipal maritime medieval
""".split()
NOUNS = """
river city teacher engineer garden window market village bridge station library doctor
student farmer report meeting company market budget kitchen harbor island mountain forest
valley letter message problem question answer system network server database request
committee museum painting concert festival weather season morning evening winter summer
harvest recipe journey traveler passenger ticket schedule factory machine signal battery
archive manuscript telescope glacier orchard lighthouse cathedral pharmacist hydrologist
algorithm spreadsheet thermostat microscope cartographer anthology vineyard observatory
""".split()
VERBS = """
found built opened closed carried moved watched followed visited described measured
repaired delivered collected painted studied reviewed approved ignored answered crossed
protected replaced organized photographed calibrated catalogued translated negotiated
renovated illuminated surveyed transported postponed summarized
""".split()
PREPOSITIONS = ["near", "behind", "beyond", "across", "under", "after", "before", "during",
                "without", "beside", "inside", "toward"]
ADVERBS = """
quickly slowly carefully quietly finally nearly rarely usually suddenly gradually
eventually reluctantly meticulously
""".split()
CONJUNCTIONS = ["and", "but", "while", "because", "although", "so", "until", "since"]
NAMES = """
Maria Jonas Aiko Tomasz Fatima Lucas Ingrid Ravi Olga Mateo Chen Amara Dmitri Sofia
Helsinki Lisbon Nairobi Osaka Montreal Valparaiso Tbilisi Reykjavik
""".split()


def clause(rng: random.Random):
    """Words of one clause: subject, verb, object, sometimes an adverb and a place."""
    words = []

    def noun_phrase():
        if rng.random() < 0.15:
            return [rng.choice(NAMES)]
        out = [rng.choice(DETERMINERS)]
        if rng.random() < 0.6:
            out.append(rng.choice(ADJECTIVES))
        out.append(rng.choice(NOUNS))
        return out

    words += noun_phrase()
    if rng.random() < 0.25:
        words.append(rng.choice(ADVERBS))
    words.append(rng.choice(VERBS))
    words += noun_phrase()
    if rng.random() < 0.5:
        words.append(rng.choice(PREPOSITIONS))
        words += noun_phrase()
    return words


def word_stream(rng: random.Random):
    """An endless run of clauses joined by conjunctions and commas."""
    yield from clause(rng)
    while True:
        yield "," if rng.random() < 0.3 else rng.choice(CONJUNCTIONS)
        if rng.random() < 0.3:
            yield rng.choice(CONJUNCTIONS)
        yield from clause(rng)


class Counter:
    """Token counts of words, by the model's tokenizer (cached; BERT's pre-tokenizer splits
    on whitespace and punctuation, so a sentence's count is the sum of its words')."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        self.tok.no_truncation()
        self.tok.no_padding()
        self.cache = {}

    def word(self, w: str) -> int:
        if w not in self.cache:
            self.cache[w] = len(self.tok.encode(w, add_special_tokens=False).ids)
        return self.cache[w]

    def text(self, t: str) -> int:
        """Tokens of a whole text with [CLS] and [SEP], untruncated."""
        return len(self.tok.encode(t).ids)


def sentence(rng: random.Random, counter: Counter, target: int) -> str:
    """A sentence of about `target` tokens including [CLS], [SEP] and the final period."""
    budget = target - 3  # [CLS], [SEP], "."
    words, used = [], 0
    for w in word_stream(rng):
        n = counter.word(w)
        if used + n > budget:
            break
        words.append(w)
        used += n
    # End on a content word, not "the." or "because.".
    dangling = set(CONJUNCTIONS) | set(DETERMINERS) | set(PREPOSITIONS) | {","}
    while words and words[-1] in dangling:
        words.pop()
    text = " ".join(words).replace(" ,", ",") + "."
    return text[0].upper() + text[1:]


def short_corpus(counter: Counter, n: int = 2000):
    rng = random.Random(SEED)
    return [sentence(rng, counter, rng.randint(15, 35)) for _ in range(n)]


def long_corpus(counter: Counter, n: int = 200):
    rng = random.Random(SEED + 1)
    out = []
    for _ in range(n):
        target = rng.randint(280, 420)
        parts, used = [], 2  # [CLS], [SEP]
        while used < target:
            s = sentence(rng, counter, rng.randint(12, 32))
            parts.append(s)
            used += counter.text(s) - 2
        out.append(" ".join(parts))
    return out


def stats(counter: Counter, texts, max_len: int = 256):
    lengths = [counter.text(t) for t in texts]
    kept = [min(n, max_len) for n in lengths]
    return {
        "texts": len(texts),
        "tokens_untruncated": sum(lengths),
        "tokens": sum(kept),
        "tokens_mean": round(statistics.mean(kept), 2),
        "tokens_min": min(kept),
        "tokens_max": max(kept),
        "untruncated_min": min(lengths),
        "untruncated_max": max(lengths),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    ap.add_argument("--out-dir", default="benches/out")
    args = ap.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counter = Counter(args.tokenizer)
    all_stats = {}
    for name, texts in [("short", short_corpus(counter)), ("long", long_corpus(counter))]:
        assert all("\n" not in t for t in texts), "one text per line; this is a bug"
        (out / f"corpus-{name}.txt").write_text("\n".join(texts) + "\n")
        all_stats[name] = stats(counter, texts)
    (out / "corpus-stats.json").write_text(json.dumps(all_stats, indent=1) + "\n")
    print(json.dumps(all_stats))


if __name__ == "__main__":
    main()
