"""The best BLEU/ROUGE a model can reach when its tokenizer cannot write the references exactly.

Usage:
    python benchmarks/bleu_ceiling.py --data ../shared/data/ddtp_de_en/valid.jsonl.gz \
        --field en --tokenizer minilm --max-tokens 32

Each reference is tokenised as training tokenises a target (special tokens added), cut to
``--max-tokens`` target tokens as conditional sampling cuts it (max_length - max_input_length,
the EOS included) and decoded back as ``elflow sample`` decodes: the text a perfect model would
write. Scored against the original references with ``elflow score``'s own BLEU/ROUGE (spec §6). An
uncased WordPiece tokenizer (MiniLM) lower-cases and spaces punctuation ("c / c + +"), so even
this output falls short of 100.
"""

from __future__ import annotations

import argparse

from elflow.evaluation import read_jsonl, score_samples
from elflow.text.tokenizer import load_tokenizer
from elflow.text.tokens import detokenize, token_spec, tokenize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="JSONL(.gz) of references")
    p.add_argument("--field", default="text", help="the reference field")
    p.add_argument("--tokenizer", default="minilm", help="tokenizer name or folder")
    p.add_argument("--max-tokens", type=int, default=32, help="target tokens kept (with EOS)")
    args = p.parse_args()

    import torch

    refs = read_jsonl(args.data, args.field, field_flag="--field")
    texts = [r[args.field] for r in refs]
    tok = load_tokenizer(args.tokenizer)
    spec = token_spec(tok)
    rows = [ids[: args.max_tokens] for ids in tokenize(tok, texts)]  # as the target's row part
    width = max(len(r) for r in rows)
    padded = torch.tensor([r + [spec.pad_id] * (width - len(r)) for r in rows])
    written = detokenize(tok, padded, spec.eos_id, spec.pad_id)
    samples = [{"id": i, "text": t} for i, t in enumerate(written)]
    references = [{"id": i, "text": t} for i, t in enumerate(texts)]
    metrics = score_samples(samples, judge=None, refs=references, bootstrap=0)
    print(
        f"{len(texts)} references from {args.data} ({args.field}), {args.tokenizer}, "
        f"{args.max_tokens} target tokens"
    )
    for key in ("bleu", "bleu_cased", "rouge1", "rouge2", "rougeL"):
        print(f"{key:<11} {metrics[key]:.2f}")
    print(f"e.g. {written[0]!r} for {texts[0]!r}")


if __name__ == "__main__":
    main()
