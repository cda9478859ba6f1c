"""`tokenmill draft-vocab build`: a draft vocabulary from the deployment's own traffic.

`register(subparsers)` adds the `draft-vocab` command to tokenmill's top-level parser and sets
`handler` (and `func`) on the parsed namespace; the handler returns the exit status and raises
TokenmillError (ConfigError, ModelLoadError) for problems the user can fix.
"""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("tokenmill.draft_vocab")

DESCRIPTION = """\
Rank token ids by how often the deployment's own traffic uses them and write the top K as a
draft vocabulary (`draft_vocab` in --speculative-config): the draft model's output head is cut
to these rows, so its read shrinks by K/V while acceptance stays capped only by the target's
probability mass outside the set.

Sources: a directory of request logs written by `tokenmill serve --log-requests-dir DIR` (the
generated token ids are counted; prompt ids too with --include-prompts), or a JSONL file of
{"text": ...} lines tokenized with the model's tokenizer. The model's special ids (EOS, BOS,
...) are always kept."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the `draft-vocab` subcommand (with its `build` action)."""
    parser = subparsers.add_parser(
        "draft-vocab", help="build a draft vocabulary (token-id subset) for speculative decoding",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="draft_vocab_action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="rank token ids by frequency in request logs or texts and write the top K",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument("--from", dest="sources", action="append", required=True, metavar="PATH",
                       help="a directory of request logs (*.jsonl, *.jsonl.gz) or a .jsonl file of request-log "
                            "records or {\"text\": ...} lines; repeat the flag for several sources")
    build.add_argument("--size", type=int, required=True, metavar="K",
                       help="number of token ids to keep (e.g. 32768 or 131072)")
    build.add_argument("--out", required=True, metavar="FILE",
                       help="where to write the ids: .txt, .txt.gz or .npy (sorted ascending, one row of the "
                            "draft head each)")
    build.add_argument("--model", default=None,
                       help="the model whose tokenizer tokenizes texts and gives the special ids "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    build.add_argument("--include-prompts", action="store_true",
                       help="count the prompt token ids of request logs as well as the generated ones")
    build.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    build.set_defaults(handler=run_build, func=run_build)
    return parser


def run_build(args: argparse.Namespace) -> int:
    from tokenmill.errors import ConfigError
    from tokenmill.models.loader import load_tokenizer, resolve_model
    from tokenmill.speculative.draft_vocab import count_tokens, save_draft_vocab, select_top, source_files

    if args.size < 1:
        raise ConfigError(f"--size must be at least 1, got {args.size}")
    source_files(args.sources)  # a missing source fails before the tokenizer is loaded
    tokenizer = load_tokenizer(resolve_model(args.model, need_weights=False))
    if tokenizer is None:
        raise ConfigError(f"the model {args.model or '(default)'} ships no tokenizer; pass --model with one")
    special = sorted({int(i) for i in tokenizer.all_special_ids if i is not None}
                     | ({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()))
    counts = count_tokens(args.sources, tokenizer, include_prompts=args.include_prompts,
                          progress=not args.no_progress)
    if counts.total == 0:
        raise ConfigError(f"no tokens found in {', '.join(args.sources)} (nothing to rank)")
    vocab_size = len(tokenizer)
    if counts.counts.size > vocab_size:
        logger.warning("token id %d is outside this tokenizer's %d tokens: were the logs written by another model?",
                       counts.counts.size - 1, vocab_size)
    ids = select_top(counts.counts, args.size, special)
    path = save_draft_vocab(ids, args.out)
    short = f" (only {len(ids)} distinct ids were seen, fewer than --size {args.size})" if len(ids) < args.size else ""
    print(f"draft-vocab: counted {counts.total:,} tokens in {counts.num_records:,} records "
          f"({counts.num_skipped} lines skipped); wrote {len(ids):,} ids to {path}{short}; "
          f"coverage of the top {len(ids):,}: {100 * counts.coverage(ids):.2f}% of counted tokens", file=sys.stdout)
    return 0
