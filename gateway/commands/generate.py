"""``bucketserve generate``: run the engine in-process (no Ray) on one prompt."""

from __future__ import annotations

import argparse
import json
import sys

EXAMPLES = """examples:
  bucketserve generate --prompt "def main():" --max-tokens 16
  bucketserve generate --model /path/to/checkpoint --prompt "Hello" --json
"""


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser(
        "generate",
        help="generate a completion in-process (no Ray)",
        description="Load the model in this process and complete one prompt (no Ray, no server).",
        epilog=EXAMPLES,
    )
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object: prompt_token_ids, token_ids, text"
    )
    p.set_defaults(func=run, skip_warmup=True)


def run(args: argparse.Namespace) -> int:
    from engine.config import config_from_args
    from engine.llm_engine import LLMEngine, RequestRejected
    from engine.request import Request, SamplingParams

    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from engine.args import add_engine_args
    from engine.config import ConfigError, fit_to_model
    from engine.model_loader import ModelNotFoundError, load_tokenizer, read_model_facts
    from gateway.flags import in_flag_terms

    # Everything that can be checked without loading weights is checked first: a mistake costs a second.
    try:
        facts = read_model_facts(args.model)
        config = fit_to_model(config_from_args(args), facts.max_position_embeddings, facts.dtype)
    except (ModelNotFoundError, ConfigError) as e:
        flags = argparse.ArgumentParser()
        add_engine_args(flags)
        print(f"error: {in_flag_terms(flags, str(e))}", file=sys.stderr)
        return 2
    ids = load_tokenizer(config.model)(args.prompt, add_special_tokens=True).input_ids
    if not ids:
        print("error: the prompt is empty after tokenization", file=sys.stderr)
        return 2
    limit = config.scheduler.max_model_len
    if len(ids) + args.max_tokens > limit:
        print(
            f"error: --max-tokens {args.max_tokens}: the prompt's {len(ids)} tokens + {args.max_tokens} exceed "
            f"--max-model-len {limit}",
            file=sys.stderr,
        )
        return 2
    engine = LLMEngine(config)
    req = Request("generate-0", ids, sampling)
    try:
        engine.generate([req])
    except RequestRejected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = engine.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"prompt_token_ids": ids, "token_ids": req.output_token_ids, "text": text}))
    else:
        print(text)
    return 0
