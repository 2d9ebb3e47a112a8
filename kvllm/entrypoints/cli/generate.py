"""`kvllm generate`: one prompt through `LLM.generate` (or `LLM.chat` with --chat), printed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvllm.entrypoints.cli.engine_args import engine_arg_parser, engine_kwargs_from_cli


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        parents=[engine_arg_parser(positional_model=False)],
        allow_abbrev=False,
        help="Generate a completion for one prompt.",
        description="Generate a completion for one prompt with the offline LLM API and print it. "
        "The model is chosen with --model (default: the embedded SmolLM2-135M-Instruct).",
    )
    sampling = parser.add_argument_group("sampling")
    parser.add_argument(
        "prompt_text", nargs="?", metavar="PROMPT", help="The prompt (or -p/--prompt, or stdin)."
    )
    sampling.add_argument("-p", "--prompt", help="The prompt; read from stdin when omitted.")
    sampling.add_argument("--chat", action="store_true", help="Send the prompt as a user chat message.")
    sampling.add_argument(
        "--max-tokens",
        "--max_tokens",
        dest="max_tokens",
        type=int,
        default=64,
        help="Maximum new tokens (default: 64).",
    )
    sampling.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy (default: 0)."
    )
    sampling.add_argument("--top-p", "--top_p", dest="top_p", type=float, help="Nucleus sampling threshold.")
    sampling.add_argument(
        "--top-k", "--top_k", dest="top_k", type=int, help="Sample from the k most likely tokens."
    )
    parser.set_defaults(dispatch=run)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keyword arguments from the parsed flags (unset optional ones left out).

    The engine's --seed, when given, also seeds this request's sampling, so a sampled run repeats.
    """
    kwargs: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for name in ("top_p", "top_k"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    return kwargs


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; prints the completion to stdout."""
    engine_kwargs = engine_kwargs_from_cli(args)
    if args.prompt is not None and args.prompt_text is not None:
        raise ValueError("prompt given twice (positional and --prompt); give it once")
    prompt = args.prompt if args.prompt is not None else args.prompt_text
    if prompt is None:
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ValueError('empty prompt: pass one as `kvllm generate "TEXT"`, with --prompt TEXT, or on stdin')
    from kvllm import LLM, SamplingParams

    params = SamplingParams(**sampling_kwargs(args))
    llm = LLM(**engine_kwargs)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": prompt}], params)
    else:
        outputs = llm.generate(prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0
