"""The long corpus's passages at other lengths before truncation, for the question of why
the speed ratio depends on the corpus (RESULTS.md, issue 14 item 3): each passage run on
into the next ones to 400 words, and each cut to its first 230 words (still at least ~256
MiniLM tokens, so truncation leaves the same 256).

    python benches/corpus_variants.py benches/out/corpus-long.txt benches/out/

writes corpus-400w.txt and corpus-230w.txt beside the others; then run `gpulane bench`
and benches/st_speed.py on each as benches/run.sh's speed part does."""

import pathlib
import sys


def main() -> None:
    source, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    words = [line.split() for line in source.read_text().splitlines() if line.strip()]
    longer = []
    for i, w in enumerate(words):
        run, j = list(w), i + 1
        while len(run) < 400:
            run += words[j % len(words)]
            j += 1
        longer.append(" ".join(run[:400]))
    cut = [" ".join(w[:230]) for w in words]
    (out / "corpus-400w.txt").write_text("\n".join(longer) + "\n")
    (out / "corpus-230w.txt").write_text("\n".join(cut) + "\n")


if __name__ == "__main__":
    main()
