"""``bucketserve generate``: run the engine in-process (no Ray) on one prompt."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser("generate", help="generate a completion in-process (no Ray)")
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
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
    from engine.config import ConfigError
    from engine.model_loader import ModelNotFoundError

    try:
        engine = LLMEngine(config_from_args(args))
    except (ModelNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = engine.tokenizer(args.prompt, add_special_tokens=True).input_ids
    if not ids:
        print("error: the prompt is empty after tokenization", file=sys.stderr)
        return 2
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
