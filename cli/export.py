"""`postrain export CHECKPOINT OUT`: a learner checkpoint's policy as a Hugging Face folder.

    postrain export runs/default/checkpoints/40 policy-40/

CHECKPOINT is a folder a run's learner saved (RUN_FOLDER/checkpoints/STEP), whole or sharded
(`strategy = "fsdp"`: one shard per rank, in any number of ranks). The folder written holds
config.json, the tokenizer and the weights (LoRA merged) as safetensors, in files of at most
--max-shard-gb each with transformers' index past that. It is read and written one decoder layer
at a time, so the model never has to fit this machine's memory whole.
"""
from __future__ import annotations

HELP = "write a learner checkpoint's policy as a Hugging Face folder (`postrain export CHECKPOINT OUT`)"


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a learner checkpoint folder (RUN_FOLDER/checkpoints/STEP)")
    parser.add_argument("out", help="the Hugging Face folder to write (replaced atomically if it exists)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="largest safetensors file, in GiB (default 5, transformers' default)")


def main(args) -> int:
    from postrain.actors.learner.streamed_export import export_checkpoint
    from postrain.core.errors import PostrainError

    if not args.max_shard_gb > 0:
        raise SystemExit(f"postrain export: --max-shard-gb must be > 0, got {args.max_shard_gb}")
    try:
        folder = export_checkpoint(args.checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except PostrainError as exc:
        raise SystemExit(f"postrain export: {exc}") from None
    print(f"wrote {folder} (load it with transformers' from_pretrained, `postrain eval {folder}`, "
          "or `postrain generate`)")
    return 0
