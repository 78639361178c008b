"""`postrain generate`: run the generator engine by hand on one prompt.

    postrain generate --model tiny --prompt "2+3=" --max-tokens 16
    postrain generate --model /models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \\
        --prompt "What is 2+3?" --temperature 0 --json
    postrain generate --model /ckpt/step100 --prompt "def f(" --n 4 --seed 1 --json
    postrain generate --model tiny --prompt "abcabcabc" --speculative ngram --json
    postrain generate --model tiny-vl --image chart.png --prompt "What was revenue in Q3?" --temperature 0
    postrain generate --model /models/big --prompt "..." --speculative draft_model --draft-model /models/small

--model takes a Hugging Face folder, a .gguf file or a built-in config name
(tiny, small: random weights). --json prints one object with the prompt's token
ids and, per sample, token_ids, logprobs (log_softmax(logits / T) of each sampled
token, T = the temperature, 1 when greedy), policy_versions, text and finish_reason.
--speculative METHOD drafts and verifies tokens (exact: the same distribution and
logprobs; see postrain.actors.generator.speculative); its acceptance figures are in "stats".
--image FILE (repeatable, a vision-language model) shows the images before the prompt, in one
user message rendered with the chat template (docs/vision.md).
"""
from __future__ import annotations

import argparse
import json
import sys

HELP = "generate text with the engine from a model folder, a .gguf file or a built-in config"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF folder, .gguf file or built-in name (tiny, small)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    # Sampling flags left out take SamplingParams' defaults (the one table, actors/records/generate.py).
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per sample "
                        "(default: SamplingParams.max_new_tokens, 64)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass (default 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k likeliest tokens (default 0 = off)")
    parser.add_argument("--n", type=int, default=None, help="samples of the prompt (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="an image shown before the prompt (repeatable; a vision-language model; implies --chat)")
    parser.add_argument("--speculative", choices=["ngram", "rollouts", "draft_model"], default=None,
                        help="speculative decoding: where drafts come from (default: off)")
    parser.add_argument("--num-draft-tokens", type=int, default=4,
                        help="with --speculative: drafted tokens per step at most (default 4)")
    parser.add_argument("--draft-model", default=None, help="with --speculative draft_model: the model that "
                        "drafts (HF folder, .gguf file or built-in name; the --model's tokenizer)")
    parser.add_argument("--json", action="store_true", help="print token ids, logprobs and text as JSON")


def main(args) -> int:
    from postrain.actors.models.loading import CheckpointError, load_model
    from postrain.actors.models.images import ImageInputError, render_prompt
    from postrain.actors.generator.engine import Engine, EngineError
    from postrain.actors.generator.sampling import SamplingParams, SamplingParamsError
    from postrain.actors.generator.speculative import SpeculativeOptions
    from pydantic import ValidationError

    try:
        given = {"n": args.n, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                 "seed": args.seed, "max_new_tokens": args.max_tokens}
        params = SamplingParams(stop=args.stop, **{k: v for k, v in given.items() if v is not None})
        speculative = None
        if args.speculative is not None:
            speculative = SpeculativeOptions(method=args.speculative, num_draft_tokens=args.num_draft_tokens,
                                             draft_model=args.draft_model)
        model, tokenizer = load_model(args.model)
        prompt: str | list[int] = args.prompt
        images: list[bytes] = []
        engine = Engine(model, tokenizer, max_num_seqs=max(64, params.n), speculative=speculative)
        if args.image:
            parts = [{"type": "image_url", "image_url": {"url": _data_url(path)}} for path in args.image]
            message = {"role": "user", "content": [*parts, {"type": "text", "text": args.prompt}]}
            layout = model.vision.layout if model.vision is not None else None
            prompt, images = render_prompt(tokenizer, layout, [message])
        elif args.chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        request_id = engine.add_request(prompt, params, images=images)
        out = next(o for o in _until_done(engine) if o.request_id == request_id)
    except (CheckpointError, EngineError, SamplingParamsError, ImageInputError, OSError) as exc:
        print(f"postrain generate: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        problems = "; ".join((f"--{str(e['loc'][-1]).replace('_', '-')}: " if e["loc"] else "") + e["msg"]
                             for e in exc.errors())
        print(f"postrain generate: {problems}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "model": args.model, "prompt": args.prompt if images else prompt, "images": args.image,
            "prompt_token_ids": out.prompt_token_ids,
            "samples": [{"token_ids": s.token_ids, "logprobs": [round(x, 6) for x in s.logprobs],
                         "policy_versions": s.policy_versions, "text": s.text,
                         "finish_reason": s.finish_reason} for s in out.outputs],
            "stats": {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))},
        }))
    else:
        for sample in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {sample.sample_index} ({sample.finish_reason})")
            print(sample.text)
    return 0


def _data_url(path: str) -> str:
    """The file at `path` as a base64 data URL (its bytes are checked when the prompt is rendered)."""
    import base64

    with open(path, "rb") as handle:
        return "data:image/png;base64," + base64.b64encode(handle.read()).decode()


def _until_done(engine):
    """Every output that finishes while the engine steps to the end."""
    while engine.has_unfinished():
        yield from engine.step()
